"""A pairwise exchange over gloo with its send posted first against its receive posted first.

    python -m benchmarks.exchange_order --bandwidth 100mbit --json out.json

Two ranks, each in its own namespace behind a shaped link (benchmarks.netem), exchange the
same message both ways with torch.distributed.batch_isend_irecv, the two ops in either order,
and report the median seconds beside the wire time of one message. gloo sends a message only
once the receiver's ready-to-receive notice has arrived, and that notice travels in the same
TCP stream as the data: a receive posted after a send to the same peer can queue its notice
behind the whole outgoing message, and the exchange then takes about twice the wire time.
This is why spardl_grace's transports post the receive first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.comm import machine
from benchmarks.launch import ROOT, launch_env
from benchmarks.netem import EmulatedNetwork, rate_bits_per_s, run_all
from spardl_grace.launch import free_port

ORDERS = ("send_first", "receive_first")


def exchange_seconds(nbytes: int, order: str, repeat: int) -> list[float]:
    """This rank's seconds for each of `repeat` exchanges of `nbytes` with the other rank, the
    ops posted in `order`, each after a barrier."""
    peer = 1 - dist.get_rank()
    out, into = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    send, recv = dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)
    ops = [send, recv] if order == "send_first" else [recv, send]
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        times.append(time.perf_counter() - start)
    return times


def worker(sizes: list[int], repeat: int, out: str) -> None:
    """One rank: every size in both orders, alternating; rank 0 writes the slower rank's
    median per case (an exchange is done when both ends are)."""
    dist.init_process_group("gloo")
    rows = []
    for nbytes in sizes:
        for order in ORDERS:
            mine = torch.tensor(exchange_seconds(nbytes, order, repeat), dtype=torch.float64)
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine)
            slower = torch.stack(both).max(dim=0).values.tolist()
            rows.append({"bytes": nbytes, "order": order, "median_s": statistics.median(slower),
                         "min_s": min(slower), "max_s": max(slower)})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run(rate: str, sizes: list[int], repeat: int) -> dict[str, Any]:
    """Both orders on a 2-rank emulated network of `rate`; the wire time of one message
    beside each median."""
    bits = rate_bits_per_s(rate)
    with tempfile.TemporaryDirectory() as tmp, EmulatedNetwork(2, rate) as net:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "benchmarks.exchange_order", "--worker", "--out", str(out),
                "--sizes", ",".join(map(str, sizes)), "--repeat", str(repeat)]
        port, env = free_port(), launch_env()
        run_all([net.command(r, argv) for r in range(2)],
                [net.rank_env(r, port, env) for r in range(2)], ROOT, timeout=900)
        rows = json.loads(out.read_text())
    for row in rows:
        row["wire_s"] = row["bytes"] * 8 / bits
        row["vs_wire"] = row["median_s"] / row["wire_s"]
    return {"machine": machine(), "bandwidth": rate, "repeat": repeat, "exchanges": rows}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="100mbit", help="the emulated links' rate, e.g. 1gbit")
    p.add_argument("--sizes", default="294464,588924,16777216",
                   help="bytes per message, comma-separated (default: SparDL's VGG-16 messages "
                        "at density 0.01, and 16 MB)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        p.error("--sizes needs positive byte counts and --repeat at least 1")
    if args.worker:
        worker(sizes, args.repeat, args.out)
        return None
    result = run(args.bandwidth, sizes, args.repeat)
    print(f"pairwise exchange over gloo, 2 ranks, {args.bandwidth}; median of {args.repeat}")
    print(f"{'bytes':>10} {'order':<14} {'median s':>9} {'wire s':>8} {'vs wire':>8}")
    for row in result["exchanges"]:
        print(f"{row['bytes']:>10} {row['order']:<14} {row['median_s']:>9.4f} "
              f"{row['wire_s']:>8.4f} {row['vs_wire']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
