"""Every sparse all-reduce side by side, on real processes and a real transport.

    python -m benchmarks.comm --algorithms dense,topka,topkdsa,gtopk,oktopk,spardl \\
        --workers 4 --numel 14700000 --density 0.01 --repeat 10 --json out.json
    python -m benchmarks.comm --gradient vgg16 --bandwidth 1gbit ...   # a real model's gradient,
                                                                       # on an emulated 1 Gbit net

Every sparse all-reduce also runs on the compact wire under its name with '_compact'
(spardl_compact: fixed-width block-relative indices and bfloat16 values, grace_from_params'
'wire': 'compact'); the others send the exact wire (int32 index, float32 value).

Each of --workers processes (gloo over TCP by default; --backend mpi or horovod) makes its
gradients once, then runs each algorithm in turn in the same run: --warmup untimed steps and
--repeat timed ones, with error feedback carried from step to step. A step's time is that of
its slowest rank (a barrier precedes each step); its communication time is that of the rank
that waited least for the others, the best estimate of the time on the wire. Recorded per algorithm: median, quartiles and
range of the total, selection, communication and coding seconds; bytes sent per rank against
the cost formula (benchmarks.costmodel); the ratio of its time to dense's; rank 0's message
trace and every rank's step statistics (the simulator's input); `replay_s`, the same step's
messages sent again with no computation between them (the communication alone, which
comm_s exceeds by the waits for peers still computing: the fastest rank's; `replay_rank0_s`
rank 0's; `replay_max_s` the slowest rank's, the time until every rank holds its result); and, before the algorithms, probes of
every op kind the cost model knows at this P (`probes`, benchmarks.costmodel.probe_op).
Passes over the gradient: `other_s` is a step's time outside selection, communication and
coding (on its busiest rank), `copy_s` the time of one copy of the gradient that every rank
takes at once just before each step, and `passes_vs_copy` the first in units of the second.
--bandwidth runs the ranks in network namespaces whose links tc shapes to that rate
(testbed.netem; root only); under --backend horovod, horovodrun starts on the first
namespace and reaches the others as on a cluster (benchmarks.twonode's ssh stand-in).

What PyTorch users run instead runs in the same run (--gradient MODEL, gloo): torch_ddp,
torch_fp16, torch_powersgd1 and torch_powersgd4 are DDP with torch's own all-reduce, fp16 and
PowerSGD (rank 1, 4) hooks on the model's real layer shapes; their time is DDP's backward minus
the same backward without DDP, their bytes what the hooks all-reduce (testbed.baselines).
Under --backend horovod, horovod_allreduce and horovod_fp16 are Horovod's own averaging
all-reduce of the gradient, plain and with Horovod's fp16 compression.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import costmodel, twonode
from benchmarks.comm_worker import HOROVOD, POWERSGD_START, TORCH_HOOKS
from benchmarks.launch import launch_env, launcher_command
from benchmarks.netns_ssh import on_node
from testbed.netem import EmulatedNetwork, rank_env, rate_bits_per_s, run_all
from spardl_grace.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("gloo", "mpi", "horovod")
GRADIENTS = ("random", "resnet20", "resnet56", "resnet50", "vgg16", "vgg19", "alexnet", "fashioncnn")
TIMES = ("total_s", "selection_s", "comm_s", "coding_s")
VALID = (*costmodel.ALGORITHMS, *costmodel.COMPACT, *TORCH_HOOKS, *HOROVOD)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch
    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_json(path: Path | str | None, data: dict[str, Any]) -> None:
    """Write a result file (creating its folder); nothing when path is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default=",".join(costmodel.ALGORITHMS),
                   help=f"comma-separated of {', '.join(VALID)}")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--numel", type=int, default=14_700_000, help="gradient size (random gradients)")
    p.add_argument("--gradient", default="random", choices=GRADIENTS,
                   help="seeded noise, or that model's real gradient on Fashion-MNIST batches")
    p.add_argument("--batch-size", type=int, default=16, help="per rank, for model gradients")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--teams", type=int, default=1, help="SparDL's d")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--replays", type=int, default=None,
                   help="replays of each algorithm's trace (replay_s; default: --repeat)")
    p.add_argument("--probe-repeat", type=int, default=3,
                   help="runs of each probe before the algorithms; its median is kept")
    p.add_argument("--backend", default="gloo", choices=BACKENDS)
    p.add_argument("--bandwidth", default=None, help="emulate links of this rate, e.g. 100mbit, 1gbit")
    p.add_argument("--codec", default=None,
                   help="DeepReduce codec as JSON GRACE keys, e.g. '{\"deepreduce\": \"index\", \"index\": \"delta\"}'")
    p.add_argument("--device", default="cpu", help="where the gradients live (cpu, cuda)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = set(args.algorithms) - set(VALID)
    if unknown or not args.algorithms:
        p.error(f"unknown algorithms {sorted(unknown)}; valid choices: {', '.join(VALID)}")
    hooks = [a for a in args.algorithms if a in TORCH_HOOKS]
    if hooks and (args.backend != "gloo" or args.gradient == "random"):
        p.error(f"{', '.join(hooks)} run PyTorch's DDP on a model's layer shapes: they need "
                "--backend gloo and --gradient MODEL")
    horovod = [a for a in args.algorithms if a in HOROVOD]
    if horovod and args.backend != "horovod":
        p.error(f"{', '.join(horovod)} run Horovod's own all-reduce: they need --backend horovod")
    if any(a.startswith("torch_powersgd") for a in hooks) and args.warmup < POWERSGD_START + 1:
        p.error(f"PyTorch's PowerSGD hook compresses from step {POWERSGD_START} on (it needs "
                f"vanilla steps first): --warmup >= {POWERSGD_START + 1}")
    if args.workers < 2:
        p.error("--workers must be >= 2")
    if args.teams < 1 or args.workers % args.teams:
        p.error(f"--teams must divide --workers ({args.workers})")
    if not 0 < args.density <= 1:
        p.error("--density must be in (0, 1]")
    if args.bandwidth is not None:
        try:
            rate_bits_per_s(args.bandwidth)
        except ValueError as exc:
            p.error(str(exc))
        if args.backend == "mpi":
            p.error("--bandwidth emulates the network for --backend gloo and horovod "
                    "(mpirun's ranks on emulated nodes: python -m benchmarks.twonode)")
    try:
        args.codec = json.loads(args.codec) if args.codec else {}
    except json.JSONDecodeError as exc:
        p.error(f"--codec is not JSON: {exc}")
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    args.replays = args.repeat if args.replays is None else args.replays
    if args.replays < 1 or args.probe_repeat < 1:
        p.error("--replays and --probe-repeat must be >= 1")
    return args


def launch(args: argparse.Namespace, config: Path, net: EmulatedNetwork | None) -> None:
    """Run the workers to completion; raises RuntimeError with their output if one fails."""
    worker = [sys.executable, "-m", "benchmarks.comm_worker", str(config)]
    env = launch_env()
    if args.backend == "horovod" and net is not None:
        # horovodrun on node 0 reaches every rank's namespace as on a cluster (benchmarks.twonode)
        command = twonode.commands("horovodrun", net, 1, worker[1:])[0]
        with twonode.ssh_to_nodes(net, env) as node_env:
            try:
                run_all([on_node(net.namespace(0), command)], [node_env], ROOT,
                        timeout=args.timeout * 2)
            except RuntimeError as exc:
                raise RuntimeError(f"benchmark {exc}") from None
        return
    if args.backend in ("mpi", "horovod"):
        cmds = [launcher_command(args.backend, args.workers, worker[1:])]
        envs = [env]
    else:
        port = free_port()
        cmds = [net.command(rank, worker) if net else worker for rank in range(args.workers)]
        envs = [net.rank_env(rank, port, env) if net else rank_env(rank, args.workers, port, env)
                for rank in range(args.workers)]
    try:
        run_all(cmds, envs, ROOT, timeout=args.timeout * 2)
    except RuntimeError as exc:
        raise RuntimeError(f"benchmark {exc}") from None


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2],
            "min": min(values), "max": max(values)}


def summarise(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per algorithm: step times (slowest rank per step), bytes, formula, ratio to dense."""
    numel = ranks[0]["numel"]
    out: dict[str, Any] = {}
    for name in args.algorithms:
        per_rank = [r["algorithms"][name]["steps"] for r in ranks]
        steps = len(per_rank[0])
        # A step takes as long as its slowest rank. Communication is timed on the rank that
        # waited least: the others' comm_s also holds the wait for the last one to arrive.
        times = {t: spread([(min if t == "comm_s" else max)(rank_steps[i][t] for rank_steps in per_rank)
                            for i in range(steps)]) for t in TIMES}
        mean_bytes = [statistics.fmean(s["bytes_sent"] for s in rank_steps) for rank_steps in per_rank]
        h = None
        if name.startswith("spardl") and args.teams > 1:
            h = statistics.fmean(s["stats"]["cross_entries"] for rs in per_rank for s in rs)
        formula = costmodel.formula_bytes(name, numel, args.workers, args.density, args.teams, h) \
            if name in (*costmodel.ALGORITHMS, *costmodel.COMPACT) else None
        # gTop-k's formula is its busiest rank's; every other algorithm's is symmetric.
        measured = max(mean_bytes) if name.startswith("gtopk") else statistics.fmean(mean_bytes)
        if all("copy_s" in s for rank_steps in per_rank for s in rank_steps):
            # Time outside selection, coding and communication (passes over the gradient,
            # allocations, bookkeeping) on each step's busiest rank, in copies of the gradient
            # timed in the same run.
            times["other_s"] = spread([max(s["total_s"] - sum(s[t] for t in TIMES[1:])
                                           for s in (rs[i] for rs in per_rank))
                                       for i in range(steps)])
            times["copy_s"] = spread([max(rs[i]["copy_s"] for rs in per_rank)
                                      for i in range(steps)])
            times["passes_vs_copy"] = times["other_s"]["median"] / times["copy_s"]["median"]
        replays = [r["algorithms"][name].get("replay_s") for r in ranks]
        if all(replays):
            times["replay_s"] = spread([min(rank[i] for rank in replays)
                                        for i in range(len(replays[0]))])
            # Rank 0's own: the rank whose trace messages_rank0 holds.
            times["replay_rank0_s"] = spread(replays[0])
            # The slowest rank's: the step ends when every rank holds its result. A rank whose
            # last op is a send (gTop-k's rank 0 at P not a power of two) can finish long
            # before the rank it sends to, as the socket buffers the message.
            times["replay_max_s"] = spread([max(rank[i] for rank in replays)
                                            for i in range(len(replays[0]))])
        out[name] = {**times, "bytes_sent_per_rank": statistics.fmean(mean_bytes),
                     "bytes_sent_max_rank": max(mean_bytes), "formula_bytes": formula,
                     "bytes_vs_formula": measured / formula if formula else None,
                     "messages_rank0": ranks[0]["algorithms"][name]["messages"],
                     "stats": [[s["stats"] for s in rs] for rs in per_rank]}
    if "dense" in out:
        dense = out["dense"]["total_s"]["median"]
        for record in out.values():
            record["time_vs_dense"] = record["total_s"]["median"] / dense
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Launch, collect and summarise one benchmark run."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "config.json")
        config.write_text(json.dumps({
            "algorithms": args.algorithms, "workers": args.workers, "numel": args.numel,
            "gradient": args.gradient, "batch_size": args.batch_size, "density": args.density,
            "teams": args.teams, "repeat": args.repeat, "warmup": args.warmup,
            "replays": args.replays, "probe_repeat": args.probe_repeat, "codec": args.codec,
            "device": args.device, "timeout": args.timeout, "bandwidth": args.bandwidth,
            "out": tmp}))
        if args.bandwidth:
            # horovodrun selects the nodes' interface by one name, as on a cluster
            interface = twonode.INTERFACE if args.backend == "horovod" else None
            with EmulatedNetwork(args.workers, args.bandwidth, interface_name=interface) as net:
                launch(args, config, net)
        else:
            launch(args, config, None)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.workers)]
    config = {k: v for k, v in vars(args).items() if k != "json"}
    return {"machine": machine(), "config": config, "numel": ranks[0]["numel"],
            "link": ranks[0]["link"], "probes": ranks[0]["probes"],
            "probes_slowest": ranks[0]["probes_slowest"],
            "algorithms": summarise(ranks, args)}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['config']['workers']} workers, {result['numel']:,} entries "
             f"({result['config']['gradient']}), density {result['config']['density']}, "
             f"network {result['config']['bandwidth'] or 'unshaped'}, backend "
             f"{result['config']['backend']}; medians over steps",
             f"{'algorithm':16s} {'total s':>9s} {'select s':>9s} {'comm s':>9s} {'coding s':>9s} "
             f"{'other s':>9s} {'copies':>7s} {'MB/rank':>9s} {'vs formula':>10s} {'vs dense':>9s}"]
    for name, r in result["algorithms"].items():
        vs_formula = f"{r['bytes_vs_formula']:.3f}" if r["bytes_vs_formula"] else "-"
        other = f"{r['other_s']['median']:9.3f}" if "other_s" in r else f"{'-':>9s}"
        copies = f"{r['passes_vs_copy']:7.1f}" if "passes_vs_copy" in r else f"{'-':>7s}"
        lines.append(f"{name:16s} {r['total_s']['median']:9.3f} {r['selection_s']['median']:9.3f} "
                     f"{r['comm_s']['median']:9.3f} {r['coding_s']['median']:9.3f} {other} {copies} "
                     f"{r['bytes_sent_per_rank'] / 1e6:9.3f} {vs_formula:>10s} "
                     f"{r.get('time_vs_dense', float('nan')):9.3f}")
    copies = [r["copy_s"]["median"] for r in result["algorithms"].values() if "copy_s" in r]
    if copies:
        lines.append(f"other s: time outside selection, communication and coding; copies: that "
                     f"time in copies of the gradient (one copy: {statistics.median(copies):.3f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    # A terminated benchmark still removes its namespaces and workers (the finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
