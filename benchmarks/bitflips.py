"""Fault injection in messages: one bit of one message that a rank receives is flipped, and a
step of a sparse all-reduce must either raise (the codec's checksum or its bounds checks) or,
where the payload has no checksum, the flip is counted as a silent wrong result.

    python -m benchmarks.bitflips --trials 40 --json benchmarks/results/bitflips.json

Each trial runs 4 ranks (threads, spardl_grace.transport.run_local) of SparDL for 3 steps on random
gradients, with a BitFlipTransport on a random rank that flips a random bit of a random
received message, and the same steps without it. Outcomes: 'detected' (a rank raised
ValueError or TransportError: the message failed its CRC-32 or decoded to entries outside the
block, or a flipped fingerprint made the ranks' agreement fail; the others were released
with PeerFailure), 'silent' (every rank finished but a result or a residual differs from the
clean run: a wrong result, now or later), 'harmless' (every rank finished with the clean
run's results and residuals), or 'other' (any other exception: a bug in a decoder's checks).
Time to detection runs from the flip to the first exception.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.comm import machine, write_json
from deepreduce_compat import deepreduce_from_params
from spardl_grace.transport import run_local
from spardl_grace.transport import Transport, TransportError
from spardl_grace.transport.local import PeerFailure

CONFIGS: dict[str, dict[str, Any]] = {
    "identity": {"wire": "exact"},  # the papers' format: int32 index, float32 value
    "identity + checksum": {"wire": "exact", "checksum": True},
    "deepreduce delta + fp16": {"deepreduce": "both", "index": "delta", "value": "fp16"},
    "deepreduce bloom + polyfit": {"deepreduce": "both", "index": "bloom", "value": "polyfit"},
    "compact": {"wire": "compact"},  # the library's default
    "compact + checksum": {"wire": "compact", "checksum": True},
}
WORKERS, STEPS, NUMEL, DENSITY = 4, 3, 20_000, 0.01


class BitFlipTransport(Transport):
    """`inner`, except that the `nth` message this rank receives (counting every message of
    sendrecv, allgather and alltoall, from 0) has bit `bit` (taken modulo its size in bits)
    flipped. `flipped_at` is the perf_counter() time of the flip (None before it)."""

    def __init__(self, inner: Transport, nth: int, bit: int):
        self.inner, self.nth, self.bit = inner, nth, bit
        self.rank, self.size, self.timeout = inner.rank, inner.size, inner.timeout
        self.thread_safe = getattr(inner, "thread_safe", True)
        self.received = 0
        self.flipped_at: float | None = None

    def _maybe_flip(self, message: torch.Tensor) -> torch.Tensor:
        index, self.received = self.received, self.received + 1
        if index != self.nth or message.numel() == 0:
            return message
        bit = self.bit % (8 * message.numel())
        flipped = message.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        self.flipped_at = time.perf_counter()
        return flipped

    def sendrecv(self, tensor, dst, src, name, recv_numel=None):
        """inner.sendrecv, the received message possibly flipped."""
        return self._maybe_flip(self.inner.sendrecv(tensor, dst, src, name, recv_numel=recv_numel))

    def allgather(self, tensor, name):
        """inner.allgather, each received message possibly flipped (ours is not received)."""
        return [t if r == self.rank else self._maybe_flip(t)
                for r, t in enumerate(self.inner.allgather(tensor, name))]

    def alltoall(self, tensors, name):
        """inner.alltoall, each received message possibly flipped (ours is not received)."""
        return [t if r == self.rank else self._maybe_flip(t)
                for r, t in enumerate(self.inner.alltoall(tensors, name))]

    def allreduce(self, tensor, name):
        """inner.allreduce, untouched (a sum has no message to flip)."""
        return self.inner.allreduce(tensor, name)

    def broadcast(self, tensor, root, name):
        """inner.broadcast, untouched."""
        return self.inner.broadcast(tensor, root, name)

    def barrier(self, name="barrier"):
        """inner.barrier."""
        self.inner.barrier(name)


def _steps(transport: Transport, config: dict[str, Any]) -> list[torch.Tensor]:
    # No floor: 200 entries of 20,000, the density the recorded trials ran at.
    grc = deepreduce_from_params({"compressor": "topk", "memory": "global_residual",
                                  "communicator": "spardl", "compress_ratio": DENSITY,
                                  "min_entries": 0, **config}, transport=transport)
    g = torch.Generator().manual_seed(transport.rank)
    results = [grc.step(torch.randn(NUMEL, generator=g), "w").clone() for _ in range(STEPS)]
    return [*results, grc.memory.residuals["w"].clone()]


def trial(config: dict[str, Any], clean: list[list[torch.Tensor]], victim: int, nth: int,
          bit: int) -> dict[str, Any]:
    """One flip in a run of CONFIGS' `config`: its outcome (against `clean`, clean_run's
    results) and time to detection."""
    flips: dict[int, BitFlipTransport] = {}
    raised: dict[int, tuple[BaseException, float]] = {}
    lock = threading.Lock()

    def faulty(t: Transport) -> list[torch.Tensor]:
        transport = t
        if t.rank == victim:
            transport = flips[victim] = BitFlipTransport(t, nth, bit)
        try:
            return _steps(transport, config)
        except BaseException as exc:
            with lock:
                raised[t.rank] = (exc, time.perf_counter())
            raise

    try:
        results = run_local(WORKERS, faulty, timeout=30.0)
    except BaseException:
        results = None
    flip = flips[victim]
    out: dict[str, Any] = {"victim": victim, "nth": nth, "bit": bit,
                           "flipped": flip.flipped_at is not None}
    originals = {r: e for r, (e, _) in raised.items() if not isinstance(e, PeerFailure)}
    if results is not None:
        same = all(torch.equal(a, b) for got, want in zip(results, clean)
                   for a, b in zip(got, want))
        out["outcome"] = "harmless" if same else "silent"
    elif originals and all(isinstance(e, (ValueError, TransportError))
                           for e in originals.values()):
        out["outcome"] = "detected"
        error = next(iter(originals.values()))
        out["error"] = f"{type(error).__name__}: {str(error)[:160]}"
        first = min(when for e, when in raised.values() if not isinstance(e, PeerFailure))
        out["detection_s"] = first - flip.flipped_at if flip.flipped_at else None
    else:
        out["outcome"] = "other"
        out["error"] = repr(next(iter(originals.values()), None))[:160]
    return out


def clean_run(config: dict[str, Any]) -> tuple[list[list[torch.Tensor]], int]:
    """The steps of `config` without a flip (each rank's results and residual), and how many
    messages the rank that receives fewest gets (the range of nth)."""
    def counted(t: Transport) -> tuple[list[torch.Tensor], int]:
        counter = BitFlipTransport(t, nth=-1, bit=0)
        return _steps(counter, config), counter.received

    runs = run_local(WORKERS, counted)
    return [results for results, _ in runs], min(count for _, count in runs)


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per outcome and the time to detection (median, max) of one config's trials."""
    flipped = [t for t in trials if t["flipped"]]
    times = [t["detection_s"] for t in flipped if t.get("detection_s") is not None]
    return {
        "injected": len(flipped),
        **{o: sum(t["outcome"] == o for t in flipped)
           for o in ("detected", "silent", "harmless", "other")},
        "detection_s_median": statistics.median(times) if times else None,
        "detection_s_max": max(times) if times else None,
    }


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The summaries as a markdown table."""
    rows = ["| payload | flips injected | detected (raised) | silent wrong results | harmless | "
            "other | time to detection, median (max) |", "|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        timing = ("-" if s["detection_s_median"] is None else
                  f"{1e3 * s['detection_s_median']:.1f} ms ({1e3 * s['detection_s_max']:.1f} ms)")
        rows.append(f"| {name} | {s['injected']} | {s['detected']} | {s['silent']} | "
                    f"{s['harmless']} | {s['other']} | {timing} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated of: {', '.join(CONFIGS)}")
    p.add_argument("--trials", type=int, default=40, help="flips per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown or args.trials < 1:
        p.error(f"unknown config(s) {unknown}; valid: {', '.join(CONFIGS)}" if unknown
                else "--trials must be >= 1")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    trials: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        clean, count = clean_run(CONFIGS[name])
        trials[name] = [trial(CONFIGS[name], clean, rng.randrange(WORKERS), rng.randrange(count),
                              rng.randrange(1 << 30)) for _ in range(args.trials)]
    summary = {name: summarize(t) for name, t in trials.items()}
    print(table(summary))
    result = {"machine": machine(), "workers": WORKERS, "steps": STEPS, "numel": NUMEL,
              "density": DENSITY, "summary": summary, "trials": trials}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
