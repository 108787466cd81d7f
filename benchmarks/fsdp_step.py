"""FSDP2 training steps across two emulated nodes: native HSDP against SparDL between the nodes
(hybrid), and flat FSDP against SparDL as its reduce-scatter (flat).

    python -m benchmarks.fsdp_step --rates 100mbit,1gbit --json benchmarks/results/fsdp_step.json

Two nodes of 2 ranks each (benchmarks.twonode: a network namespace per node, their eth0 links
shaped to the rate; the ranks of a node talk over its loopback, unshaped), torchrun across them,
VGG-16 (CIFAR shape, 14.7M parameters) with every convolution and the classifier a fully_shard
unit. For each mode and rate, one launch: a few warm-up steps, then timed steps; reported per
step: the median time and the bytes each node's eth0 sent (across the slow link) and its
loopback carried (inside the node), read from the kernel's counters around the timed steps.

Modes (MODES): 'hsdp' (FSDP's HSDP, fp32; a dense all-reduce across the nodes), 'hsdp-bf16'
(reduce_dtype bfloat16), 'hybrid-spardl', 'hybrid-spardl-compact', 'hybrid-topka' (hybrid_shard,
density --density; exact wire but for '-compact'), 'flat' (fully_shard over all 4 ranks),
'flat-spardl' (flat_shard, exact wire) and
'flat-bound' (flat, with a reduce-scatter that sends nothing: the time of the all-gathers and the
compute alone, the bound flat-spardl can approach). Needs root (namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("hsdp", "hsdp-bf16", "hybrid-spardl", "hybrid-spardl-compact", "hybrid-topka", "flat",
         "flat-spardl", "flat-bound")
# The exact wire, as the recorded tables ran; 'hybrid-spardl-compact' sends the library's default.
SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "wire": "exact"}


def _counter(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


class _FreeReduceScatter:
    """A reduce-scatter that sends nothing: each rank keeps its own block of its own gradient
    (scaled as FSDP's AVG would scale the sum). For the 'flat-bound' mode only: wrong as
    training, right as a timing bound."""

    def allocate(self, size, *, dtype, device):
        import torch
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        output_tensor.copy_(input_tensor.view(size, -1)[rank])


def _build(mode: str, density: float, dnn: str):
    """The model, sharded as `mode` says, and the ShardSync when the library shards it."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from testbed.models import build_model
    from spardl_grace import fsdp

    torch.manual_seed(0)
    model = build_model(dnn, 3, 10)
    units = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    world = torch.distributed.get_world_size()
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    params = {"compress_ratio": density, "min_entries": 0}  # every unit at `density`
    if mode in ("hsdp", "hsdp-bf16", "flat", "flat-bound"):
        mesh = mesh2d if mode.startswith("hsdp") else init_device_mesh("cpu", (world,))
        kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)} if mode == "hsdp-bf16" else {}
        for unit in units:
            fully_shard(unit, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        if mode == "flat-bound":
            for module in [*units, model]:
                module.set_custom_reduce_scatter(_FreeReduceScatter())
        return model, None
    if mode == "flat-spardl":
        return model, fsdp.flat_shard(model, {**SPARDL, **params}, units)
    chosen = {"hybrid-spardl": SPARDL,
              "hybrid-spardl-compact": {**SPARDL, "wire": "compact"},
              "hybrid-topka": {"compressor": "topk", "memory": "global_residual",
                               "communicator": "topka", "wire": "exact"}}[mode]
    return model, fsdp.hybrid_shard(model, mesh2d, {**chosen, **params}, units)


def worker(args: argparse.Namespace) -> None:
    """One rank of one mode: train, time, count, (global rank 0) print the JSON row, and end the
    process."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    model, sync = _build(args.mode, args.density, args.dnn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    before = (_counter("eth0"), _counter("lo")) if local == 0 else (0, 0)
    sent_before = sync.bytes_sent if sync is not None else 0
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    after = (_counter("eth0"), _counter("lo")) if local == 0 else (0, 0)
    counted = (sync.bytes_sent - sent_before) if sync is not None else 0
    mine = {"rank": rank, "local": local, "eth0": after[0] - before[0], "lo": after[1] - before[1],
            "times": times, "library_bytes": counted}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if rank == 0:
        steps = args.steps
        print("ROW " + json.dumps({
            "mode": args.mode, "density": args.density, "steps": steps,
            "step_s_median": statistics.median(max(r["times"][i] for r in rows) for i in range(steps)),
            "step_s": [max(r["times"][i] for r in rows) for i in range(steps)],
            "slow_link_bytes_per_step": sum(r["eth0"] for r in rows) / steps,
            "inside_node_bytes_per_step": sum(r["lo"] for r in rows) / steps,
            "library_bytes_per_step": sum(r["library_bytes"] for r in rows) / steps,
        }), flush=True)
    # torch 2.13's gloo can abort a worker that exits normally after its last collective
    # ("terminate called without an active exception"; it failed a CI run): end without that race.
    from spardl_grace.transport.torch_dist import destroy_and_exit
    destroy_and_exit()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {', '.join(MODES)}")
    p.add_argument("--rates", default="100mbit,1gbit", help="the link between the nodes, tc's units")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--dnn", default="vgg16", help="a model of testbed.models, 3 x 32 x 32 input")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--json", default=None)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # a worker's own mode
    args = p.parse_args(argv)
    if args.mode is not None:
        worker(args)
        return {}
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; valid: {', '.join(MODES)}")
    from benchmarks import twonode
    from benchmarks.comm import machine, write_json

    rows = []
    for rate in [r for r in args.rates.split(",") if r]:
        for mode in modes:
            script = ["-m", "benchmarks.fsdp_step", "--mode", mode, "--density", str(args.density),
                      "--dnn", args.dnn,
                      "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
                      "--steps", str(args.steps)]
            run = twonode.run("torchrun", script, rate=rate, timeout=args.timeout)
            found = [line[4:] for line in run.stdout[0].splitlines() if line.startswith("ROW ")]
            if max(run.returncodes) != 0 or not found:
                raise SystemExit(f"{mode} at {rate} failed:\n" + "\n".join(
                    o[-2000:] + e[-4000:] for o, e in zip(run.stdout, run.stderr)))
            row = {"rate": rate, **json.loads(found[0])}
            rows.append(row)
            print(f"{rate:>8} {mode:<22} {row['step_s_median']:7.3f} s/step  across "
                  f"{row['slow_link_bytes_per_step'] / 1e6:8.3f} MB  inside "
                  f"{row['inside_node_bytes_per_step'] / 1e6:8.3f} MB", flush=True)
    result = {"benchmark": "fsdp_step", "machine": machine(), "argv": sys.argv[1:] if argv is None else argv,
              "model": args.dnn, "nodes": 2, "ranks_per_node": 2, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
