"""Training steps side by side: what a PyTorch user runs (DDP, its fp16 and PowerSGD hooks)
against this library's algorithms, on emulated networks, with the compute-only time beside.

    python -m benchmarks.train_step --dnn vgg16 --batch-size 8 --bandwidths 100mbit,1gbit
    python -m benchmarks.train_step --dnn mnistcnn --batch-size 32 --algorithms ddp,powersgd4,spardl

Every run is the training CLI (experiments.main_trainer) on --workers local workers, each in
its own network namespace behind a link shaped to the rate (root; loopback otherwise, and the
table says so). A step is forward, backward, synchronisation and the optimizer step, timed on
rank 0 (the ranks leave each step together); the median is taken after --skip steps (PowerSGD
starts compressing at step 2, SparDL runs without density warm-up: steady state). Compute only:
--workers independent single-worker trainers at once, so they share the cores as the real
workers do, with nothing to synchronise (each still runs this library's optimizer path with
P = 1, whose flatten and copy-back of the gradient are included). Beside each step: the payload
bytes per worker after the skipped steps, the time they take on the link at its rate, and the
bound issue 15 sets a step: compute only + that wire time + 3 copies of the gradient, a copy
timed with --workers processes copying at once (the cores shared as in the run). With
--device cuda (the default where a GPU is visible) the trainers compute on the GPU, rank r on
GPU r mod the GPUs here, and the copy is timed there.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import twonode
from benchmarks.comm import machine, write_json
from benchmarks.comm_worker import synchronize
from benchmarks.launch import launch_env, launcher_command
from testbed.load import load_burst
from testbed.netem import EmulatedNetwork, available, rate_bits_per_s, rate_change, run_all
from benchmarks.netns_ssh import on_node
from testbed import configs
from testbed.configs import DEVICES, OPTIMIZERS, resolve_device
from testbed.models import MODEL_TASKS
from testbed.records import read_log

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ("spawn", "horovodrun")
DDP_ONLY = ("ddp", "fp16", "powersgd1", "powersgd4")
LM_DATASET = "wikipedia-chars"  # the transformer front's corpus, on every machine the set-up made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dnn", default="vgg16")
    p.add_argument("--dataset", default=None,
                   help="the training CLI's --dataset; default fashion-mnist, or "
                        f"{LM_DATASET} for a language model")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--algorithms", default="ddp,fp16,powersgd1,powersgd4,dense,spardl",
                   help=f"comma-separated of {', '.join(configs.ALGORITHMS)}, or the "
                        "ablation's configs (experiments.ablation: 'spardl@0.003+compact', "
                        "'powersgd2', 'postlocal16'; warm-ups are left out: steady state)")
    p.add_argument("--bandwidths", default="100mbit,1gbit",
                   help="comma-separated link rates; 'loopback' for the link unshaped")
    p.add_argument("--bandwidth-change", default=None, metavar="STEP:RATE",
                   help="every run's link reshaped to RATE at STEP (the training CLI's option): "
                        "a link that changes mid-run, for 'auto' to re-plan")
    p.add_argument("--load-burst", default=None, metavar="STEP:STEPS",
                   help="every run's rank 0 starts a busy process per core at STEP for STEPS "
                        "steps (the training CLI's option): other work passing through, for "
                        "'auto' to measure through and recover from")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every algorithm this many times, interleaved and in reverse "
                        "order on every other repeat (A B C C B A A B C ...), so that a drift "
                        "of the machine over the run falls on every arm alike (exactly so for "
                        "a steady drift over an even number of repeats); each row keeps its "
                        "repeats' steps (benchmarks.auto_check compares their means)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the trainers compute and the copy is timed: cuda (the workers "
                        "share this machine's GPUs as the training CLI places them), cpu, or "
                        "auto (cuda when a GPU is visible)")
    p.add_argument("--launcher", default="spawn", choices=LAUNCHERS,
                   help="spawn: the training CLI starts its workers (torch.distributed, gloo); "
                        "horovodrun: Horovod starts them (this library's algorithms only)")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS,
                   help="the training CLI's --optimizer: adamw for the transformer front's "
                        "configs (its frozen-variance ones refuse sgd)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="the training CLI's --clip-norm (the transformer front clips at 1)")
    p.add_argument("--json", default=None,
                   help="write the results here; while running, each finished run is kept in "
                        "JSON + '.partial', and the same command run again (after a stop or a "
                        "session's end) continues from it, skipping the finished runs")
    args = p.parse_args(argv)
    if args.dataset is None:
        args.dataset = LM_DATASET if MODEL_TASKS.get(args.dnn) == "lm" else "fashion-mnist"
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    for name in args.algorithms:
        try:
            algorithm_options(name)
        except ValueError as exc:
            p.error(f"{exc}; valid: {', '.join(configs.ALGORITHMS)}, or an ablation config")
    ddp = [a for a in args.algorithms if a in DDP_ONLY or _ablation_baseline(a)]
    if args.launcher == "horovodrun" and ddp:
        p.error(f"--launcher horovodrun cannot run {', '.join(ddp)}: DDP's own, which needs "
                "torch.distributed; run it with --launcher spawn")
    # "loopback": the namespaces' links left unshaped, beside the shaped rates in one run.
    args.bandwidths = [None if b == "loopback" else b for b in args.bandwidths.split(",") if b]
    for rate in filter(None, args.bandwidths):
        try:
            rate_bits_per_s(rate)
        except ValueError as exc:
            p.error(f"{exc}, or 'loopback' for the link unshaped")
    if args.bandwidth_change is not None:
        if None in args.bandwidths or args.launcher != "spawn":
            p.error("--bandwidth-change reshapes an emulated link: give shaped --bandwidths "
                    "(no 'loopback') and the spawn launcher")
        try:
            if not 0 < rate_change(args.bandwidth_change)[0] < args.steps:
                raise ValueError(f"STEP must lie within the run's {args.steps} steps")
        except ValueError as exc:
            p.error(f"--bandwidth-change STEP:RATE, e.g. 40:100mbit: {exc}")
    if args.load_burst is not None:
        try:
            if load_burst(args.load_burst)[0] >= args.steps:
                raise ValueError(f"STEP must lie within the run's {args.steps} steps")
        except ValueError as exc:
            p.error(f"--load-burst: {exc}")
    if args.steps <= args.skip:
        p.error("--steps must be larger than --skip")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.device = resolve_device(args.device, p)
    return args


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _trainer(args: argparse.Namespace, out: Path, workers: int, options: list[str],
             eval_every: int | None = None) -> list[str]:
    return [sys.executable, "-m", "experiments.main_trainer", "--dnn", args.dnn,
            "--dataset", args.dataset, "--nworkers", str(workers),
            "--batch-size", str(args.batch_size), "--density", str(args.density),
            "--max-epochs", "1", "--max-steps", str(args.steps), "--test-samples", "100",
            "--eval-every", str(eval_every or args.skip),
            "--powersgd-start-iter", "2", "--device", args.device, "--out", str(out),
            "--optimizer", args.optimizer,
            *(["--clip-norm", str(args.clip_norm)] if args.clip_norm else []), *options]


def _ablation_baseline(name: str) -> bool:
    """Whether `name` is one of PyTorch's own answers in the ablation's naming (DDP's)."""
    return name not in configs.ALGORITHMS and name.split("+")[0].startswith(tuple(configs.TORCH_BASELINES))


def algorithm_options(name: str) -> list[str]:
    """The training CLI's options for `name`: one of configs.ALGORITHMS without its warm-up,
    or an ablation config (testbed.configs.config_options) with its density warm-up left
    out and PyTorch's baselines compressing from step 2 (post-local SGD averaging from its
    first period): the steady state. ValueError naming the problem otherwise."""
    if name in configs.ALGORITHMS:
        return configs.algorithm_options(name, warmup=False)
    from testbed.configs import config_options
    head, *techniques = name.split("+")
    steady = "+".join([head, *(t for t in techniques if not t.startswith("warmup"))])
    if "@" not in head and not _ablation_baseline(head) and head != "dense":
        raise ValueError(f"unknown algorithm {name!r}")
    return config_options(steady, total_steps=0)


def step_times(out: Path, skip: int) -> list[float]:
    """Rank 0's step times after the first `skip` steps."""
    return [r["step_s"] for r in read_log(out)["step"]][skip:]


def run_algorithm(args: argparse.Namespace, name: str, rate: str | None, out: Path) -> dict[str, Any]:
    options = algorithm_options(name)
    # Post-local SGD starts after period - 1 dense steps and then averages once a period, and
    # DiLoCo's outer step comes every period: the step is the mean over whole periods after
    # the start, and the bytes those of an evaluation window of one period (every such window
    # holds exactly one averaging).
    period = _period(options)
    cmd = _trainer(args, out, args.workers, options, eval_every=period or None)
    cmd += ["--load-burst", args.load_burst] if args.load_burst else []
    if args.launcher == "horovodrun":
        under_horovodrun(cmd[1:], args.workers, rate)
    else:
        change = ["--bandwidth-change", args.bandwidth_change] if args.bandwidth_change else []
        run_all([cmd + (["--bandwidth", rate, *change] if rate else [])], [_env()], ROOT)
    times = step_times(out, max(args.skip, period - 1))
    if period:
        whole = len(times) // period * period
        if whole == 0:
            raise ValueError(f"{name}: --steps must reach {max(args.skip, period) + period} "
                             f"(the skipped steps or its start, {period - 1}, then a whole "
                             f"period timed and counted)")
        times = [statistics.fmean(times[-whole:])]
    log = read_log(out)
    payload = _payload(log["eval"], period)
    plan = {k: v for k, v in log["step"][-1].items() if k.startswith("auto_")}
    # Each step's choice and re-plan count: when auto re-planned after a change of the link.
    auto_steps = [{"step": r["step"], "choice": r["auto_choice"], "replans": r["auto_replans"]}
                  for r in log["step"] if "auto_choice" in r]
    wire_s = payload * 8 / rate_bits_per_s(rate) if rate else None
    return {"step_s": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "step_times": times, "bytes_per_step": payload, "wire_s_of_bytes": wire_s,
            **({"auto_plan": plan, "auto_steps": auto_steps,
                "auto_plans": log.get("plan", [])} if plan else {})}


def merge_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from an algorithm's repeats: a single run as it is; several with their timed
    steps pooled (median, min, max, step_times over all of them), the last run's bytes and
    plan, and each run kept under 'repeats' (its step_times, median, auto's steps and plans)."""
    if len(runs) == 1:
        return runs[0]
    pooled = [t for r in runs for t in r["step_times"]]
    kept = ("step_s", "step_times", "auto_plan", "auto_steps", "auto_plans")
    return {**runs[-1], "step_s": statistics.median(pooled), "step_s_min": min(pooled),
            "step_s_max": max(pooled), "step_times": pooled,
            "repeats": [{k: r[k] for k in kept if k in r} for r in runs]}


def _period(options: list[str]) -> int:
    """The steps between averagings of post-local SGD or DiLoCo's outer steps; 0 for the
    algorithms that synchronise every step."""
    for flag in ("--postlocal-period", "--diloco-period"):
        if flag in options:
            return int(options[options.index(flag) + 1])
    return 0


def _payload(evals: list[dict[str, Any]], period: int) -> float:
    """Bytes per step of the last evaluation window, which lies after the skipped steps
    (PowerSGD's dense start); with post-local SGD's or DiLoCo's `period`, of the last window
    of one whole period after the start (the run's last window may be shorter and hold no
    averaging)."""
    if not period:
        return evals[-1]["bytes_sent_per_step"]
    whole = [e for before, e in zip(evals, evals[1:])
             if e["step"] - before["step"] == period and before["step"] >= period - 1]
    if not whole:
        raise ValueError(f"averaging every {period} steps: --steps must reach "
                         f"{2 * period} for a whole period's window after its start")
    return whole[-1]["bytes_sent_per_step"]


def under_horovodrun(script: list[str], workers: int, rate: str | None) -> None:
    """`python SCRIPT` on `workers` ranks under horovodrun (gloo): on loopback, or with each
    rank in its own namespace behind a link shaped to `rate`, horovodrun started on the
    first and reaching the others through the ssh stand-in."""
    if rate is None:
        run_all([launcher_command("horovod", workers, script)], [launch_env()], ROOT)
        return
    with EmulatedNetwork(workers, rate, interface_name=twonode.INTERFACE) as net, \
            twonode.ssh_to_nodes(net, launch_env()) as env:
        command = twonode.commands("horovodrun", net, 1, script)[0]
        run_all([on_node(net.namespace(0), command)], [env], ROOT)


def compute_only(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """--workers single-worker trainers at once: the cores shared as in a real run, no
    synchronisation."""
    outs = [tmp / f"compute{r}" for r in range(args.workers)]
    run_all([_trainer(args, out, 1, []) for out in outs], [_env()] * args.workers, ROOT)
    times = [t for out in outs for t in step_times(out, args.skip)]
    return {"step_s": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times)}


COPIES_IN_BOUND = 3


def _copy_worker(numel: int, repeat: int, barrier: Any, times: Any, device: str) -> None:
    torch.set_num_threads(1)
    source = torch.randn(numel, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch of the pages, not timed
    mine = []
    for _ in range(repeat):
        synchronize(source.device)
        barrier.wait()
        start = time.perf_counter()
        target.copy_(source)
        synchronize(source.device)
        mine.append(time.perf_counter() - start)
    times.put(mine)


def copy_seconds(numel: int, workers: int, repeat: int = 10, device: str = "cpu") -> float:
    """Median over `repeat` rounds of the slowest of `workers` processes copying a
    `numel`-entry float32 tensor on `device` at the same moment."""
    context = multiprocessing.get_context("spawn")
    barrier, times = context.Barrier(workers), context.Queue()
    procs = [context.Process(target=_copy_worker, args=(numel, repeat, barrier, times, device))
             for _ in range(workers)]
    for proc in procs:
        proc.start()
    per_worker = [times.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return statistics.median(max(round_) for round_ in zip(*per_worker))


def gradient_numel(dnn: str, dataset: str) -> int:
    from testbed.datasets import DATASETS
    from testbed.models import build_model
    _, channels, classes = DATASETS[dataset]
    return sum(p.numel() for p in build_model(dnn, channels, classes).parameters())


def add_bounds(result: dict[str, Any]) -> None:
    """Each row's bound (compute only + wire time of its bytes + COPIES_IN_BOUND copies) and
    its step's ratio to it, where the network has a rate."""
    fixed = result["compute_only"]["step_s"] + COPIES_IN_BOUND * result["copy_s"]
    for rows in result["networks"].values():
        for r in rows.values():
            if r["wire_s_of_bytes"] is not None:
                r["bound_s"] = fixed + r["wire_s_of_bytes"]
                r["vs_bound"] = r["step_s"] / r["bound_s"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = available()
    networks = args.bandwidths if why is None else [None]
    config = {k: v for k, v in vars(args).items() if k != "json"}
    partial = Path(f"{args.json}.partial") if args.json else None
    # What a continued run must share with the runs it continues: the command, the machine,
    # whether links are emulated, and the code (compared arms run on one commit).
    identity = {"config": config, "machine": machine(), "emulated": why is None,
                "commit": _commit()}
    done = _finished_runs(partial, identity)
    result: dict[str, Any] = {"machine": identity["machine"], "config": config,
                              "emulated": why is None, "why_not_emulated": why, "networks": {},
                              "continued_runs": len(done["runs"])}
    with tempfile.TemporaryDirectory() as tmp:
        if "compute_only" in done:
            result["compute_only"], result["copy_s"] = done["compute_only"], done["copy_s"]
        else:
            result["compute_only"] = compute_only(args, Path(tmp))
            result["copy_s"] = copy_seconds(gradient_numel(args.dnn, args.dataset),
                                            args.workers, device=args.device)
            done.update(identity, compute_only=result["compute_only"],
                        copy_s=result["copy_s"], runs={})
            _write_partial(partial, done)
        for rate in networks:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.algorithms}
            for repeat in range(args.repeats):
                which = f" (repeat {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                for name in repeat_order(args.algorithms, repeat):
                    key = f"{rate or 'loopback'}|{name}|{repeat}"
                    if key not in done["runs"]:
                        print(f"{rate or 'loopback'}: {name}{which} ...", flush=True)
                        done["runs"][key] = run_algorithm(args, name, rate,
                                                          Path(tmp) / f"{rate}-{name}-{repeat}")
                        _write_partial(partial, done)
                    runs[name].append(done["runs"][key])
            result["networks"][rate or "loopback"] = {name: merge_repeats(r)
                                                      for name, r in runs.items()}
    add_bounds(result)
    return result


def _finished_runs(partial: Path | None, identity: dict[str, Any]) -> dict[str, Any]:
    """What an earlier run of the same command finished ('compute_only', 'copy_s' and 'runs'
    by 'RATE|ALGORITHM|REPEAT', beside `identity`'s keys), from its partial file; no runs when
    there is none. A partial file of another command, machine, emulation or commit is refused
    rather than mixed in."""
    if partial is None or not partial.exists():
        return {"runs": {}}
    try:
        done = json.loads(partial.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{partial} is not a partial result ({exc}); remove it") from exc
    differ = [k for k, v in json.loads(json.dumps(identity)).items() if done.get(k) != v]
    if differ:
        raise SystemExit(f"{partial} holds the runs of another {', '.join(differ)} "
                         f"({', '.join(f'{k}: {done.get(k)}' for k in differ)}); remove it, or "
                         "run the command it was made by on that machine and commit")
    print(f"continuing from {partial}: {len(done['runs'])} runs finished", flush=True)
    return dict(done)


def _write_partial(partial: Path | None, done: dict[str, Any]) -> None:
    """Write the partial file whole or not at all (a stop mid-write keeps the last one)."""
    if partial is not None:
        staged = partial.with_name(partial.name + ".tmp")
        write_json(staged, done)
        os.replace(staged, partial)


def _commit() -> str | None:
    """The checkout's commit, and '+changes' when its tracked files differ from it; None
    outside git."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return git("rev-parse", "HEAD") + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def repeat_order(names: list[str], repeat: int) -> list[str]:
    """The arms in the order repeat `repeat` runs them: as given on even repeats, reversed on
    odd ones. With one order every time, the machine speeding up over a 50-minute run showed
    as auto (run first) 1.16x slower than its own choice run alone (last), 1.02x where the two
    ran next to each other (VGG-16 at 100 Mbit, 2026-11-29)."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"{c['dnn']}, batch {c['batch_size']}/worker, {c['workers']} workers on "
             f"{c.get('device', 'cpu')}"
             f"{' under horovodrun' if c.get('launcher') == 'horovodrun' else ''}, median s per "
             f"training step (steps {c['skip']}..{c['steps'] - 1}"
             f"{f' of {r} interleaved repeats' if (r := c.get('repeats', 1)) > 1 else ''}); "
             "compute only "
             f"{result['compute_only']['step_s']:.3f} s, one copy of the gradient "
             f"{result['copy_s']:.4f} s; bound: compute only + wire s + {COPIES_IN_BOUND} copies"]
    if not result["emulated"]:
        lines.append(f"loopback only: {result['why_not_emulated']}")
    for network, rows in result["networks"].items():
        lines.append(f"\n{network}:\n{'algorithm':<26}{'s/step':>9}{'MB/step':>9}{'wire s':>8}"
                     f"{'vs DDP':>8}{'bound s':>9}{'vs bound':>9}")
        ddp = rows.get("ddp", {}).get("step_s")
        for name, r in rows.items():
            wire = f"{r['wire_s_of_bytes']:.3f}" if r["wire_s_of_bytes"] is not None else "-"
            vs = f"{r['step_s'] / ddp:.2f}" if ddp else "-"
            bound = f"{r['bound_s']:.3f}" if "bound_s" in r else "-"
            vs_bound = f"{r['vs_bound']:.2f}" if "vs_bound" in r else "-"
            lines.append(f"{configs.LABELS.get(name, name):<26}{r['step_s']:>9.3f}"
                         f"{r['bytes_per_step'] / 1e6:>9.3f}{wire:>8}{vs:>8}{bound:>9}"
                         f"{vs_bound:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    write_json(args.json, result)
    if args.json:
        Path(f"{args.json}.partial").unlink(missing_ok=True)
    return result


if __name__ == "__main__":
    # A terminated benchmark still stops its trainers, which remove their namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
