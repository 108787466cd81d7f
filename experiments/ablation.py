"""Which of DGC's techniques help SparDL reach dense accuracy: each alone and together, several
seeds, one table. Every run is the training CLI on local workers (loopback: accuracy per step
does not depend on the network).

    python -m experiments.ablation --dnn mnistcnn --train-samples 30000 --max-epochs 1
    python -m experiments.ablation --dnn resnet20 --configs dense,spardl,spardl+warmup \\
        --train-samples 20000 --max-epochs 3 --out experiments/results/ablation_resnet20

--parallel N runs N runs at a time (on a GPU, `--extra "--device cuda"`; each run is --workers
processes). Writes OUT/NAME-seedS/ (each run's logs, packed into OUT/NAME-seedS.tar.xz once the
run has finished: see testbed.records), OUT/results.json and OUT/summary.md: per config, the
mean and spread (min..max) over seeds of the final test accuracy, the final training loss, the
bytes per step over the whole run, against dense's. (After a warm-up, SparDL's bytes per step are
those of the same density without one: its messages have fixed sizes.) Run again, the same
command skips the finished runs and continues a run cut off after an epoch from its checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from testbed.configs import TECHNIQUES, config_options
from testbed.records import Run, pack, read_log, runs_under

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = "dense,spardl,spardl+warmup,spardl+mc,spardl+clip,spardl+warmup+mc,spardl+warmup+mc+clip"


def total_steps(args: argparse.Namespace) -> int:
    """Training steps of each run: whole batches of every worker per epoch, times the epochs."""
    return args.max_epochs * (args.train_samples // (args.workers * args.batch_size))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated ALGORITHM[@DENSITY][+TECHNIQUE...]; ALGORITHM: dense, a "
                        "sparse all-reduce, auto (no density: the library's choice), fp16, "
                        "powersgdR or postlocalH (PyTorch's); "
                        "techniques: " + ", ".join(f"{k} ({' '.join(v)})" for k, v in TECHNIQUES.items())
                        + ", adamfreeze[PCT] (--adam-freeze-step at PCT%% of the steps, 10 by "
                        "default), everyN (--exchange-period N)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--dnn", default="mnistcnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--train-samples", type=int, default=30000)
    p.add_argument("--test-samples", type=int, default=10000)
    p.add_argument("--extra", default="", help="more training-CLI options for every run")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at a time (each is --workers processes; one GPU can hold several)")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--report", action="store_true",
                   help="run nothing: tabulate the finished runs in OUT (any configs and "
                        "seeds; a run also tabulates every finished run in OUT)")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error("--parallel must be >= 1")
    args.configs = [c for c in args.configs.split(",") if c]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for c in args.configs:
        try:
            config_options(c, total_steps(args))
        except ValueError as exc:
            p.error(f"--configs {c}: {exc}")
    return args


def run(args: argparse.Namespace, config: str, seed: int) -> dict:
    out = Path(args.out) / f"{config}-seed{seed}"
    run_record = out / "run.json"
    recorded = Run(out)
    if recorded.has("run.json"):
        return json.loads(recorded.read_text("run.json"))  # finished runs are not repeated
    print(f"{config} seed {seed} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    # A run cut off after an epoch's checkpoint continues from it instead of starting over.
    resume = ["--resume"] if (out / "ckpt-rank0.pt").exists() else []
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", args.dnn,
           "--dataset", args.dataset, "--nworkers", str(args.workers),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--density", str(args.density), "--max-epochs", str(args.max_epochs),
           "--train-samples", str(args.train_samples), "--test-samples", str(args.test_samples),
           "--seed", str(seed), "--out", str(out), *config_options(config, total_steps(args)),
           *args.extra.split(),
           *resume]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(out / "output.log", "a" if resume else "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{config} seed {seed} failed; see {out / 'output.log'}")
    log = read_log(out)
    final = log["run"][-1]
    bytes_run, train_s, steps = whole_run(log)
    result = {"config": config, "seed": seed, "test_accuracy": final["test_accuracy"],
              "test_loss": final["test_loss"],
              "train_loss": final["train_loss"], "bytes_run": bytes_run,
              "dense_bytes": final["dense_bytes_per_step"], "train_s": train_s, "steps": steps}
    run_record.write_text(json.dumps(result))
    pack(out)
    return result


def whole_run(log: dict[str, list[dict]]) -> tuple[float, float, int]:
    """(bytes per step, training seconds, steps) over every epoch of a run, resumed or not. A
    resumed trainer's own run summary covers only its process (its clock and byte count start
    again), and steps cut off by the interruption are trained again, so the last record of
    each epoch and of each step is the one that counts: bytes from the epochs' records
    weighted by their steps, seconds as the sum of the steps' own times."""
    epochs = {e["epoch"]: e for e in log["epoch"]}
    sent, previous = 0.0, 0
    for epoch in sorted(epochs):
        sent += epochs[epoch]["bytes_sent_per_step"] * (epochs[epoch]["step"] - previous)
        previous = epochs[epoch]["step"]
    step_s = {s["step"]: s["step_s"] for s in log["step"] if s["step"] < previous}
    return sent / max(previous, 1), sum(step_s.values()), previous


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(results: list[dict], configs: list[str]) -> list[dict]:
    rows = []
    for config in configs:
        runs = [r for r in results if r["config"] == config]
        # runs recorded before test_loss was kept have none
        keys = ("test_accuracy", "train_loss", "bytes_run", "train_s",
                *(("test_loss",) if all("test_loss" in r for r in runs) else ()))
        rows.append({"config": config, "seeds": len(runs),
                     **{k: spread([r[k] for r in runs]) for k in keys},
                     "dense_bytes": runs[0]["dense_bytes"]})
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    dense = next((r for r in rows if r["config"] == "dense"), None)
    lines = [f"{args.dnn} on {args.dataset}, {args.workers} workers, density {args.density}, "
             f"{args.max_epochs} epoch(s) of {args.train_samples} images, batch {args.batch_size}"
             f"/worker, lr {args.lr} {args.extra}; seeds {', '.join(map(str, args.seeds))}; mean "
             f"(min..max) over the seeds each config ran; tested on {args.test_samples} images.",
             "",
             "| config | test acc | vs dense (points) | train loss | bytes/step whole run | vs dense |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        acc = r["test_accuracy"]
        gap = f"{100 * (acc['mean'] - dense['test_accuracy']['mean']):+.2f}" if dense else "-"
        lines.append(
            f"| {r['config']} ({r['seeds']} seeds) | {acc['mean']:.4f} ({acc['min']:.4f}..{acc['max']:.4f}) | {gap} "
            f"| {r['train_loss']['mean']:.3f} | {r['bytes_run']['mean']:,.0f} "
            f"| {r['bytes_run']['mean'] / r['dense_bytes']:.4f} |")
    if all("test_loss" in r for r in rows):
        lines += ["", "| config | test loss | vs dense | perplexity |", "|---|---|---|---|"]
        for r in rows:
            loss = r["test_loss"]
            gap = f"{loss['mean'] - dense['test_loss']['mean']:+.4f}" if dense else "-"
            lines.append(f"| {r['config']} | {loss['mean']:.4f} ({loss['min']:.4f}..{loss['max']:.4f})"
                         f" | {gap} | {math.exp(loss['mean']):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.report:
        jobs = [(config, seed) for seed in args.seeds for config in args.configs]
        with ThreadPoolExecutor(args.parallel) as pool:  # each run is its own processes
            list(pool.map(lambda job: run(args, *job), jobs))
    # The folder's summary covers every finished run in it, this command's and earlier ones',
    # so that adding a config or a seed to a recorded folder keeps the rest of its table.
    results = [json.loads(r.read_text("run.json")) for r in runs_under(args.out, "run.json")]
    configs = list(dict.fromkeys(r["config"] for r in results))
    args.configs = sorted(configs, key=lambda c: (c != "dense", c.count("+"), c))
    args.seeds = sorted({r["seed"] for r in results})
    rows = summarise(results, args.configs)
    text = markdown(rows, args)
    (Path(args.out) / "summary.md").write_text(text)
    (Path(args.out) / "results.json").write_text(json.dumps(
        {"config": vars(args), "runs": results, "summary": rows}, indent=1))
    print(text)
    return rows


if __name__ == "__main__":
    main()
