"""The Bloom index codec against a C Bloom filter doing what DeepReduce's bloom_cpu does.

    python -m benchmarks.bloom_speed [--numel 1000000] [--densities 0.01,0.001] [--repeat 5]
        [--json PATH]

The top-k positions (k = density * numel) of seeded Gaussian noise are coded by this
library's BloomIndex (policy p0, eps = 0.1 k / numel, DeepReduce's default rate) and, when
pybloomfiltermmap3 is installed (the C library DeepReduce's bloom_cpu codec uses; `pip install
pybloomfiltermmap3`), by that filter used as bloom_cpu uses it: one filter of capacity k at the
same rate, every position added, the receiver's positions found by testing every position of
the block (the sender does the same to send the values the receiver will decode), the filter
shipped as base64. Per filter and density: encode, decode and their sum (medians of --repeat,
one thread), the bytes shipped, and the false positives the receiver decodes.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.comm import machine, write_json
from deepreduce_compat.index_codecs import BloomIndex


def positions(numel: int, density: float) -> torch.Tensor:
    """The sorted top-k positions by magnitude of seeded Gaussian noise."""
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return torch.sort(torch.topk(noise.abs(), int(numel * density)).indices).values


def ours(chosen: torch.Tensor, numel: int, repeat: int) -> dict[str, Any]:
    codec = BloomIndex("p0")
    encode_s, decode_s = [], []
    for i in range(repeat + 1):  # the first round is not counted
        start = time.perf_counter()
        section, sent = codec.encode(chosen, numel, f"bloom.{i}")
        middle = time.perf_counter()
        got = codec.decode(section, sent.numel(), numel, f"bloom.{i}")
        end = time.perf_counter()
        if i:
            encode_s.append(middle - start)
            decode_s.append(end - middle)
    assert torch.equal(got, sent) and bool(torch.isin(chosen, got).all())
    return _row(encode_s, decode_s, section.numel(), got.numel() - chosen.numel())


def c_filter(chosen: torch.Tensor, numel: int, repeat: int) -> dict[str, Any] | None:
    """pybloomfiltermmap3 as DeepReduce's bloom_cpu uses it; None when not installed."""
    try:
        from pybloomfilter import BloomFilter
    except ImportError:
        return None
    k = chosen.numel()
    listed = chosen.tolist()
    encode_s, decode_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "filter.bf")
        for i in range(repeat + 1):
            start = time.perf_counter()
            bf = BloomFilter(k, 0.1 * k / numel, path)
            for x in listed:
                bf.add(x)
            sent = [x for x in range(numel) if x in bf]  # the values of these go out
            shipped = bf.to_base64()
            middle = time.perf_counter()
            received = BloomFilter.from_base64(path, shipped)
            got = [x for x in range(numel) if x in received]
            end = time.perf_counter()
            if i:
                encode_s.append(middle - start)
                decode_s.append(end - middle)
    assert got == sent
    return _row(encode_s, decode_s, len(shipped), len(got) - k)


def _row(encode_s: list[float], decode_s: list[float], nbytes: int, false_positives: int):
    encode, decode = statistics.median(encode_s), statistics.median(decode_s)
    return {"encode_ms": 1e3 * encode, "decode_ms": 1e3 * decode,
            "total_ms": 1e3 * (encode + decode), "bytes": nbytes,
            "false_positives": false_positives}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=10**6)
    p.add_argument("--densities", default="0.01,0.001")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for density in (float(d) for d in args.densities.split(",") if d):
        chosen = positions(args.numel, density)
        row = {"density": density, "k": chosen.numel(),
               "ours": ours(chosen, args.numel, args.repeat),
               "c_filter": c_filter(chosen, args.numel, args.repeat)}
        if row["c_filter"] is not None:
            row["ours_vs_c"] = row["ours"]["total_ms"] / row["c_filter"]["total_ms"]
        rows.append(row)
        print(row, flush=True)
    result = {"machine": machine(), "config": {**vars(args), "json": None}, "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
