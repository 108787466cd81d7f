"""What a wire's coding costs against selection, as work in one process.

    python -m benchmarks.wire_coding [--numel 14722890] [--workers 4] [--density 0.01]
        [--algorithms spardl,topka] [--wires exact,compact] [--repeat 10] [--json PATH]

benchmarks.comm times coding inside --workers processes; on the 2-core machine four of them
share two cores, and the seconds of a small op then include waiting for a core. This benchmark
times the work itself: it runs two steps of each algorithm on --workers ranks (threads over the
local transport) with a codec that records every encode and decode rank 0 asks of it, replays
the second step's calls alone on one thread, and sets their median against the selection of
the same gradient at the density (topk_abs, one thread), which every rank's step does at least
once. Issue 40 asks for coding at most 10% of that selection on a CPU.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.comm import machine, write_json
from benchmarks.kernels import timed
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.payload import Encoded, PayloadCodec
from spardl_grace.selection import count_for_ratio, topk_abs

WIRES = ("exact", "compact")


class RecordingCodec(PayloadCodec):
    """Forwards to `inner`; between record(True) and record(False), keeps each call (method and
    copies of its arguments) so that it can be replayed later on the same inner codec. Its
    state is private: the ranks' agreement on settings compares a codec's public attributes,
    and only rank 0 records."""

    def __init__(self, inner: PayloadCodec):
        self.inner = inner
        self.name = inner.name
        self._recording = False
        self._calls: list[tuple[str, tuple[Any, ...]]] = []

    def _record(self, method: str, *args: Any) -> None:
        if self._recording:
            self._calls.append((method, tuple(a.clone() if isinstance(a, torch.Tensor) else a
                                             for a in args)))

    def encode_bytes(self, block, indices, key):
        self._record("encode_bytes", block, indices, key)
        return self.inner.encode_bytes(block, indices, key)

    def encode(self, block, indices, key) -> Encoded:
        self._record("encode", block, indices, key)
        return self.inner.encode(block, indices, key)

    def encode_sparse(self, indices, values, size, key) -> Encoded:
        self._record("encode_sparse", indices, values, size, key)
        return self.inner.encode_sparse(indices, values, size, key)

    def decode(self, data, block_size, dtype, device, key):
        self._record("decode", data, block_size, dtype, device, key)
        return self.inner.decode(data, block_size, dtype, device, key)

    def fixed_size(self, count, dtype, block_size):
        return self.inner.fixed_size(count, dtype, block_size)

    def record(self, on: bool) -> None:
        self._recording = on

    @property
    def calls(self) -> int:
        return len(self._calls)

    def replay(self) -> None:
        for method, args in self._calls:
            getattr(self.inner, method)(*args)


def recorded_calls(algorithm: str, wire: str, numel: int, workers: int,
                   density: float) -> RecordingCodec:
    """Rank 0's codec after two steps of `algorithm` on `wire`, holding the second step's calls."""
    params = {"communicator": algorithm, "compressor": "topk", "memory": "global_residual",
              "compress_ratio": density, "wire": wire, "min_entries": 0}

    def fn(transport):
        grc = grace_from_params(params, transport=transport)
        recorder = grc.codec = RecordingCodec(grc.codec)
        g = torch.Generator().manual_seed(transport.rank)
        for step in range(2):
            recorder.record(step == 1 and transport.rank == 0)
            grc.step(torch.randn(numel, generator=g), "w")
        return recorder

    return run_local(workers, fn)[0]


def run(numel: int, workers: int, density: float, algorithms: list[str], wires: list[str],
        repeat: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    k = count_for_ratio(numel, density)
    cpu = torch.device("cpu")
    selection = timed(lambda: topk_abs(gradient, k), cpu, repeat)
    rows = {}
    for algorithm in algorithms:
        for wire in wires:
            recorder = recorded_calls(algorithm, wire, numel, workers, density)
            coding = timed(recorder.replay, cpu, repeat)
            rows[f"{algorithm}, {wire}"] = {"calls": recorder.calls, "coding_s": coding,
                                            "share_of_selection": coding / selection}
    return {"machine": machine(), "numel": numel, "workers": workers, "density": density,
            "k": k, "selection_s": selection, "rows": rows}


def table(out: dict[str, Any]) -> str:
    """The results as lines of text: each row's coding time and its share of the selection."""
    head = (f"{out['numel']:,} entries, density {out['density']}, {out['workers']} ranks; "
            f"selection (topk_abs, one thread) {out['selection_s'] * 1e3:.1f} ms")
    return "\n".join([head] + [
        f"{name:20s} {r['calls']:3d} calls  coding {r['coding_s'] * 1e3:7.2f} ms  "
        f"{100 * r['share_of_selection']:5.1f}% of selection" for name, r in out["rows"].items()])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=14_722_890, help="gradient size (VGG-16's)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--algorithms", default="spardl,topka")
    p.add_argument("--wires", default=",".join(WIRES))
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    wires = [w for w in args.wires.split(",") if w]
    unknown = sorted(set(wires) - set(WIRES))
    if unknown:
        p.error(f"unknown wire(s) {', '.join(unknown)}; valid: {', '.join(WIRES)}")
    out = run(args.numel, args.workers, args.density,
              [a for a in args.algorithms.split(",") if a], wires, args.repeat)
    print(table(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
