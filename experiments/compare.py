"""The README's main job: time to accuracy on an emulated slow network. 4 workers train MnistCNN
(Keras's MNIST CNN, 1.2M parameters) on Fashion-MNIST with PyTorch's DDP (fp32, and with its
fp16 compression hook, the dense baseline users run on slow links), PyTorch's own PowerSGD hook,
SparDL, and the library's own choice ('communicator': 'auto', whose pick each run reports) on
links shaped to 100 Mbit/s, --repeats times each (seeds --seed, --seed + 1, ...; the algorithms
take turns, so that a machine's drift falls on all alike). A run stops at the evaluation that
reaches --target-accuracy, or after --time-budget seconds of training. The verdict names the
algorithm with the lowest mean time to the target faster than the next only when the 95% Welch
interval of the difference of their means excludes zero; otherwise it says they are level.

    python -m experiments.compare                    # about 18 minutes on 2 CPU cores
    python -m experiments.compare --quick            # a reduced run (CI)
    python -m experiments.compare --algorithms ddp,spardl,powersgd1,powersgd4,topka
    python -m experiments.compare --dnn lstmimdb --dataset tweets --target-accuracy 0.65  # text

Every run is one `python -m experiments.main_trainer` (the training CLI) with the same recipe;
only the synchronisation differs. Evaluation (every --eval-every steps, 2,000 test images) is
not counted as training time. Without root (no network namespaces) it runs on loopback and
says so. Writes OUT/results.json, OUT/accuracy_vs_time.png (every run thin, each algorithm's
median curve with its min-max band) and each run's logs in OUT/NAME/seedS.tar.xz (the run's
folder packed once summarised; testbed.records reads it, `tar xJf` unpacks it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from testbed.configs import ALGORITHMS, LABELS, algorithm_options
from testbed.records import Run, pack, read_log

ROOT = Path(__file__).resolve().parent.parent
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from testbed.datasets import DATASETS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default="ddp,fp16,powersgd4,spardl,auto",
                   help=f"comma-separated of {', '.join(ALGORITHMS)}")
    p.add_argument("--dnn", default="mnistcnn")
    p.add_argument("--dataset", default="fashion-mnist", choices=sorted(DATASETS),
                   help="e.g. tweets with --dnn lstmimdb")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default="100mbit", help="emulated link rate; 'none' for loopback")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--time-budget", type=float, default=60.0, help="training seconds per run at most")
    p.add_argument("--repeats", type=int, default=3, help="runs of each algorithm (seeds from --seed)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target-accuracy", type=float, default=0.80)
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--test-samples", type=int, default=2000)
    p.add_argument("--max-epochs", type=int, default=100, help="the time budget ends runs first")
    p.add_argument("--max-steps", type=int, default=None, help="per epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/main_job")
    p.add_argument("--quick", action="store_true",
                   help="FashionCNN, 2,000 images, 12 steps per algorithm (CI)")
    args = p.parse_args(argv)
    if args.quick:
        args.dnn, args.dataset = "fashioncnn", "fashion-mnist"
        args.train_samples, args.test_samples = 2000, 500
        args.max_epochs, args.max_steps = 1, 12
        args.eval_every, args.time_budget, args.target_accuracy = 6, None, 0.3
        args.repeats = 2
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        p.error(f"unknown algorithm(s) {unknown}; valid: {', '.join(ALGORITHMS)}")
    if args.bandwidth == "none":
        args.bandwidth = None
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def network(args: argparse.Namespace) -> tuple[str | None, str]:
    """(rate to emulate or None, a line saying which network the runs use)."""
    if args.bandwidth is None:
        return None, "network: loopback (--bandwidth none)"
    from testbed.netem import available, rate_bits_per_s
    rate_bits_per_s(args.bandwidth)
    why = available()
    if why:
        return None, (f"network: loopback. Cannot emulate {args.bandwidth} here ({why}); the "
                      "times below are those of an unshaped local network")
    return args.bandwidth, f"network: emulated, every worker's link shaped to {args.bandwidth}"


def trainer_command(args: argparse.Namespace, name: str, out: Path, rate: str | None,
                    seed: int | None = None) -> list[str]:
    """The training CLI's command for one run of `name` (seed --seed unless given)."""
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", args.dnn,
           "--dataset", args.dataset, "--nworkers", str(args.workers),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--density", str(args.density), "--max-epochs", str(args.max_epochs),
           "--seed", str(args.seed if seed is None else seed),
           "--eval-every", str(args.eval_every), "--test-samples", str(args.test_samples),
           "--target-accuracy", str(args.target_accuracy), "--stop-at-target", "--out", str(out),
           *algorithm_options(name)]
    for option, value in (("--time-budget", args.time_budget), ("--bandwidth", rate),
                          ("--train-samples", args.train_samples), ("--max-steps", args.max_steps)):
        if value is not None:
            cmd += [option, str(value)]
    return cmd


def run_one(args: argparse.Namespace, name: str, out: Path, rate: str | None, seed: int) -> None:
    """Train one run into the folder `out`; it replaces an earlier run's there, packed or not."""
    Run(out).archive.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(out / "output.log", "w") as log:
        done = subprocess.run(trainer_command(args, name, out, rate, seed), cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{name} seed {seed} failed (exit {done.returncode}); its output:\n"
                         + (out / "output.log").read_text()[-4000:])


def summarise(name: str, out: Path, workers: int, seed: int) -> dict[str, Any]:
    """One run's figures: accuracies, time and steps to the target, step time, bytes, whether
    every worker ended with the same parameters, and its accuracy curve."""
    log = read_log(out)
    evals, run = log["eval"], log["run"][0]
    choice = log["step"][-1].get("auto_choice") if log["step"] else None
    finals = [torch.load(out / f"final-rank{r}.pt", weights_only=True)["params"]
              for r in range(workers)]
    return {"algorithm": name, "label": LABELS[name], "seed": seed,
            "final_test_accuracy": evals[-1]["test_accuracy"],
            "best_test_accuracy": max(e["test_accuracy"] for e in evals),
            "time_to_target_s": run["time_to_target_s"], "steps_to_target": run["steps_to_target"],
            "train_s": evals[-1]["train_s"], "steps": run["steps_run"],
            "s_per_step": evals[-1]["train_s"] / max(run["steps_run"], 1),
            "bytes_per_step_final": evals[-1]["bytes_sent_per_step"],
            "bytes_per_step_run": run["bytes_sent_per_step_run"],
            "wire_bytes_per_step_run": run.get("wire_bytes_per_step_run"),
            "dense_bytes_per_step": run["dense_bytes_per_step"], "parameters": run["parameters"],
            "identical_replicas": all(torch.equal(f, finals[0]) for f in finals),
            "auto_chose": None if choice is None else auto_choice_name(int(choice)),
            "curve": [[e["train_s"], e["test_accuracy"]] for e in evals]}


def auto_choice_name(index: int) -> str:
    """The candidate 'auto' chose, from last_stats' auto_choice (-1: still measuring)."""
    from spardl_grace.planner import DEFAULT_CANDIDATES
    return DEFAULT_CANDIDATES[index] if index >= 0 else "none yet (measuring)"


def group(runs: list[dict]) -> list[dict]:
    """Per algorithm, in the order first run: its runs, how many reached the target, and the
    median, fastest and slowest time to it over those that did."""
    names = list(dict.fromkeys(r["algorithm"] for r in runs))
    out = []
    for name in names:
        mine = [r for r in runs if r["algorithm"] == name]
        times = sorted(r["time_to_target_s"] for r in mine if r["time_to_target_s"] is not None)
        out.append({"algorithm": name, "label": mine[0]["label"], "runs": mine,
                    "reached": len(times),
                    "median_s": statistics.median(times) if times else None,
                    "min_s": times[0] if times else None, "max_s": times[-1] if times else None,
                    "s_per_step": statistics.median(r["s_per_step"] for r in mine)})
    return out


def verdict(groups: list[dict], target: float) -> str:
    """Who reaches the target first, in plain words, by the project's rule: the algorithm with
    the lowest mean time to the target is named faster than the next only when the 95% Welch
    interval of the difference of their means excludes zero, else the two are level.
    Algorithms that missed the target in some run rank after those that never did; 'auto'
    says what it chose."""
    from testbed.stats import welch
    ranked = sorted((g for g in groups if g["reached"]),
                    key=lambda g: (g["reached"] < len(g["runs"]), statistics.fmean(_times(g))))
    if not ranked:
        return f"No run reached test accuracy {target:.2f} within its budget."

    def spread(g: dict) -> str:
        return (f"mean {statistics.fmean(_times(g)):.1f} s, {g['min_s']:.1f}-{g['max_s']:.1f} "
                f"over {g['reached']} of {len(g['runs'])} runs")

    best = ranked[0]
    if len(ranked) == 1:
        line = f"Only {best['label']} reached {target:.2f} ({spread(best)})"
    else:
        nxt = ranked[1]
        interval = welch(_times(nxt), _times(best))
        if interval is not None and interval.low > 0 and best["reached"] == len(best["runs"]):
            line = (f"{best['label']} reached {target:.2f} first ({spread(best)}); "
                    f"{nxt['label']} took {interval.difference:.1f} s longer on average (95% "
                    f"Welch interval {interval.low:.1f} to {interval.high:.1f} s; {spread(nxt)})")
        else:
            what = ("too few runs reached it for an interval" if interval is None else
                    f"the 95% Welch interval of the difference, {interval.low:.1f} to "
                    f"{interval.high:.1f} s, includes zero")
            line = (f"{best['label']} and {nxt['label']} are level in reaching {target:.2f} "
                    f"({what}): {best['label']} {spread(best)}, {nxt['label']} {spread(nxt)}")
    for g in ranked[2:]:
        line += f"; {g['label']} {spread(g)}"
    missed = [g["label"] for g in groups if not g["reached"]]
    if missed:
        line += f"; {', '.join(missed)} did not reach it within the budget"
    chose = sorted({r["auto_chose"] for g in groups for r in g["runs"] if r.get("auto_chose")})
    if chose:
        line += f". The library's auto chose {', '.join(chose)}"
    return line + "."


def _times(g: dict) -> list[float]:
    return [r["time_to_target_s"] for r in g["runs"] if r["time_to_target_s"] is not None]


def plot(groups: list[dict], path: Path, title: str, target: float) -> None:
    """Every run's accuracy against training seconds (thin), and per algorithm the median of
    its runs with their min-max band, up to the earliest end of its runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for g, color in zip(groups, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        curves = [np.array(r["curve"]) for r in g["runs"]]
        for c in curves:
            ax.plot(c[:, 0], c[:, 1], color=color, alpha=0.3, linewidth=0.8)
        end = min(c[-1, 0] for c in curves)
        grid = np.linspace(0.0, end, 100)
        ys = np.array([np.interp(grid, c[:, 0], c[:, 1]) for c in curves])
        ax.plot(grid, np.median(ys, axis=0), color=color,
                label=f"{g['label']} (median of {len(curves)})")
        ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.2f}")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(groups: list[dict]) -> str:
    """One row per algorithm: time to the target (median and range), runs that reached it,
    median step time, bytes per step at the end and against DDP's, and the replicas check."""
    lines = [f"{'algorithm':<22}{'to target s':>12}{'range s':>13}{'reached':>9}{'s/step':>8}"
             f"{'MB/step':>9}{'vs DDP':>8}{'best acc':>10}{'replicas':>10}"]
    for g in groups:
        runs = g["runs"]
        median = f"{g['median_s']:.1f}" if g["reached"] else "-"
        span = f"{g['min_s']:.1f}-{g['max_s']:.1f}" if g["reached"] else "-"
        sent = statistics.median(r["bytes_per_step_final"] for r in runs)
        best = statistics.median(r["best_test_accuracy"] for r in runs)
        same = all(r["identical_replicas"] for r in runs)
        lines.append(f"{g['label']:<22}{median:>12}{span:>13}{g['reached']:>4} of {len(runs):<2}"
                     f"{g['s_per_step']:>8.3f}{sent / 1e6:>9.3f}"
                     f"{sent / runs[0]['dense_bytes_per_step']:>8.4f}{best:>10.4f}"
                     f"{'identical' if same else 'DIFFER':>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rate, net_line = network(args)
    print(net_line, flush=True)
    runs = []
    for seed in range(args.seed, args.seed + args.repeats):
        for name in args.algorithms:  # in turns, so that drift falls on every algorithm alike
            print(f"training with {LABELS[name]}, seed {seed} ...", flush=True)
            run_one(args, name, out / name / f"seed{seed}", rate, seed)
            runs.append(summarise(name, out / name / f"seed{seed}", args.workers, seed))
            pack(out / name / f"seed{seed}")
    groups = group(runs)
    title = (f"{args.dnn}, {args.dataset}, {args.workers} workers, "
             f"{'links ' + rate if rate else 'loopback'}, batch {args.batch_size}/worker, "
             f"{args.repeats} runs each")
    plot(groups, out / "accuracy_vs_time.png", title, args.target_accuracy)
    said = verdict(groups, args.target_accuracy)
    (out / "results.json").write_text(json.dumps(
        {"config": {**vars(args), "network": rate or "loopback"}, "verdict": said,
         "results": runs,
         "summary": [{k: v for k, v in g.items() if k != "runs"} for g in groups]}, indent=1))
    print(f"\n{title}; runs stop at the target; MB/step: payload per worker at the end of a run "
          "(after any warm-up), median over runs\n")
    print(table(groups))
    print(f"\n{said}\n\nresults: {out / 'results.json'}  plot: {out / 'accuracy_vs_time.png'}")
    return runs


if __name__ == "__main__":
    main()
