"""Exchanges over gloo with their sends posted first against their receives posted first.

    python -m benchmarks.exchange_order --bandwidth 100mbit --json out.json
    python -m benchmarks.exchange_order --op alltoall --workers 4 --sizes 1000000

Ranks, each in its own namespace behind a shaped link (testbed.netem), time one op per
size in both orders and report the median seconds beside the wire time of what one rank
sends. gloo sends a message only once the receiver's ready-to-receive notice has arrived, and
that notice travels in the same TCP stream as the data: a receive posted after a send to the
same peer can queue its notice behind the whole outgoing message, and the two directions
then run one after the other. This is why spardl_grace's transports post receives first.

* `--op sendrecv` (2 ranks): the same message both ways with batch_isend_irecv, send or
  receive posted first;
* `--op alltoall`: a part of the given size to every other rank, through gloo's own
  all_to_all_single (which posts each peer's send before its receive) against point-to-point
  sends with every receive posted first (how spardl_grace's TorchDistTransport.alltoall
  sends its data).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.comm import machine
from benchmarks.launch import ROOT, launch_env
from testbed.netem import EmulatedNetwork, rate_bits_per_s, run_all
from spardl_grace.launch import free_port

ORDERS = {"sendrecv": ("send_first", "receive_first"),
          "alltoall": ("gloo_all_to_all_single", "receive_first")}


def posted(ops: list[dist.P2POp]) -> Callable[[], None]:
    """Post `ops` in their order with batch_isend_irecv and wait for all of them."""
    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return run


def exchange(nbytes: int, order: str) -> Callable[[], None]:
    """One exchange of `nbytes` with the other rank (of 2), the ops posted in `order`."""
    peer = 1 - dist.get_rank()
    out, into = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    send, recv = dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)
    return posted([send, recv] if order == "send_first" else [recv, send])


def alltoall(nbytes: int, order: str) -> Callable[[], None]:
    """One all-to-all of `nbytes` to every other rank: gloo's own, or point to point with
    every receive posted first, as spardl_grace's TorchDistTransport.alltoall sends its data
    (the transport first exchanges the sizes, whichever the order)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if order == "gloo_all_to_all_single":
        send = torch.zeros(size * nbytes, dtype=torch.uint8)
        into = torch.empty(size * nbytes, dtype=torch.uint8)
        return lambda: dist.all_to_all_single(into, send)
    peers = [(rank + i) % size for i in range(1, size)]
    out = torch.zeros(nbytes, dtype=torch.uint8)
    ops = [dist.P2POp(dist.irecv, torch.empty(nbytes, dtype=torch.uint8), j) for j in peers]
    ops += [dist.P2POp(dist.isend, out, j) for j in peers]
    return posted(ops)


def op_seconds(op: str, nbytes: int, order: str, repeat: int) -> list[float]:
    """This rank's seconds for each of `repeat` runs of `op` in `order`, each after a barrier."""
    run = (exchange if op == "sendrecv" else alltoall)(nbytes, order)
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def worker(op: str, sizes: list[int], repeat: int, out: str) -> None:
    """One rank: every size in both orders, alternating; rank 0 writes the slowest rank's
    median per case (an op is done when every end is)."""
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        for order in ORDERS[op]:
            mine = torch.tensor(op_seconds(op, nbytes, order, repeat), dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(every, mine)
            slower = torch.stack(every).max(dim=0).values.tolist()
            rows.append({"bytes": nbytes, "order": order, "median_s": statistics.median(slower),
                         "min_s": min(slower), "max_s": max(slower)})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run(op: str, workers: int, rate: str, sizes: list[int], repeat: int) -> dict[str, Any]:
    """Both orders of `op` on an emulated network of `workers` ranks at `rate`; beside each
    median the wire time of what one rank sends (a message, or P-1 parts)."""
    bits = rate_bits_per_s(rate)
    with tempfile.TemporaryDirectory() as tmp, EmulatedNetwork(workers, rate) as net:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "benchmarks.exchange_order", "--worker", "--out", str(out),
                "--op", op, "--sizes", ",".join(map(str, sizes)), "--repeat", str(repeat)]
        port, env = free_port(), launch_env()
        run_all([net.command(r, argv) for r in range(workers)],
                [net.rank_env(r, port, env) for r in range(workers)], ROOT, timeout=900)
        rows = json.loads(out.read_text())
    for row in rows:
        row["wire_s"] = row["bytes"] * (workers - 1) * 8 / bits
        row["vs_wire"] = row["median_s"] / row["wire_s"]
    return {"machine": machine(), "op": op, "workers": workers, "bandwidth": rate,
            "repeat": repeat, "exchanges": rows}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=sorted(ORDERS), default="sendrecv",
                   help="a pairwise exchange between 2 ranks, or an all-to-all")
    p.add_argument("--workers", type=int, default=None,
                   help="ranks (sendrecv: 2, the default; alltoall: at least 3, default 4)")
    p.add_argument("--bandwidth", default="100mbit", help="the emulated links' rate, e.g. 1gbit")
    p.add_argument("--sizes", default="294464,588924,16777216",
                   help="bytes per message or all-to-all part, comma-separated (default: "
                        "SparDL's VGG-16 messages at density 0.01, and 16 MB)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        p.error("--sizes needs positive byte counts and --repeat at least 1")
    if args.worker:
        worker(args.op, sizes, args.repeat, args.out)
        return None
    workers = args.workers or (2 if args.op == "sendrecv" else 4)
    if args.op == "sendrecv" and workers != 2:
        p.error("--op sendrecv runs on exactly 2 workers")
    if args.op == "alltoall" and workers < 3:
        p.error("--op alltoall needs at least 3 workers (with 2 it is a pairwise exchange)")
    result = run(args.op, workers, args.bandwidth, sizes, args.repeat)
    print(f"{args.op} over gloo, {workers} ranks, {args.bandwidth}; median of {args.repeat}")
    print(f"{'bytes':>10} {'order':<22} {'median s':>9} {'wire s':>8} {'vs wire':>8}")
    for row in result["exchanges"]:
        print(f"{row['bytes']:>10} {row['order']:<22} {row['median_s']:>9.4f} "
              f"{row['wire_s']:>8.4f} {row['vs_wire']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
