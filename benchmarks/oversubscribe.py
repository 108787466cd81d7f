"""What torch's intra-op threads cost an exchange when a host's ranks outnumber its cores.

    python -m benchmarks.oversubscribe --ranks 4 --json benchmarks/results/oversubscribe.json

P gloo ranks on this host exchange messages with their ring neighbours through the library's
torch.distributed transport (TorchDistTransport.sendrecv with the size known: one round trip,
the 8-byte header concatenated to the payload), first with one torch thread each, then with
torch's default (one per core). Each cell is the median over the exchanges of the slowest
rank's seconds per exchange. Messages over 32,768 bytes cross torch's grain for parallel loops,
so building them runs on the intra-op threads; with more threads than cores those threads wait
to be scheduled (spardl_grace.transport.threads warns of this).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spardl_grace.launch import free_port
from spardl_grace.transport.threads import cores

SIZES = (16_384, 30_000, 40_000, 65_536, 262_144)


def _rank(rank: int, size: int, port: int, threads: int, sizes: list[int], repeat: int,
          out: str) -> None:
    from spardl_grace.transport.torch_dist import TorchDistTransport

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    transport = TorchDistTransport()
    seconds: dict[int, list[float]] = {}
    for nbytes in sizes:
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for i in range(repeat):
            transport.barrier(f"b.{nbytes}.{i}")
            start = time.perf_counter()
            transport.sendrecv(payload, (rank + 1) % size, (rank - 1) % size, f"x.{nbytes}.{i}",
                               recv_numel=nbytes)
            seconds.setdefault(nbytes, []).append(time.perf_counter() - start)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seconds))
    dist.destroy_process_group()


def measure(ranks: int, threads: int, sizes: list[int], repeat: int, tmp: Path) -> dict[str, Any]:
    """Per size, the median over exchanges of the slowest rank's seconds, and its p90."""
    mp.spawn(_rank, args=(ranks, free_port(), threads, sizes, repeat, str(tmp)), nprocs=ranks)
    per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    cells = {}
    for nbytes in sizes:
        slowest = sorted(max(r[str(nbytes)][i] for r in per_rank) for i in range(repeat))
        cells[str(nbytes)] = {"median_s": statistics.median(slowest),
                              "p90_s": slowest[math.ceil(0.9 * (repeat - 1))]}
    return cells


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--threads", type=int, default=cores(),
                   help="torch threads per rank in the crowded case (default: the cores)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message bytes")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    result: dict[str, Any] = {"ranks": args.ranks, "cores": cores(), "repeat": args.repeat,
                              "threads": {}}
    for threads in sorted({1, args.threads}):
        with tempfile.TemporaryDirectory() as tmp:
            result["threads"][str(threads)] = measure(args.ranks, threads, sizes, args.repeat,
                                                      Path(tmp))
    print(f"{args.ranks} ranks on {result['cores']} cores, slowest rank's ms per exchange "
          "(median / p90):")
    print("| bytes | " + " | ".join(f"{t} thread(s)" for t in result["threads"]) + " |")
    print("|---|" + "---|" * len(result["threads"]))
    for nbytes in sizes:
        row = [f"{1e3 * c[str(nbytes)]['median_s']:.2f} / {1e3 * c[str(nbytes)]['p90_s']:.2f}"
               for c in result["threads"].values()]
        print(f"| {nbytes:,} | " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
