"""The per-step kernels of the sparse all-reduces, timed against the memory-bandwidth floor.

    python -m benchmarks.kernels [--device cuda] [--numel 14700000] [--density 0.01] [--json PATH]

Kernels: the exact top-k of abs(x) (topk_abs, with its sampled-threshold prefilter) and plain
torch.topk, a threshold selection (abs(x) >= t, nonzero), the scatter of k entries into a zero
tensor and the scatter-add of k entries, and the encode/decode of the codecs a sparse
all-reduce sends with (identity, delta, fp16, qsgd). The floor of each is the bytes it must
touch at least once (read the input, write the output) divided by the device's measured copy
bandwidth; `vs floor` is time / floor. On CUDA the times are taken between synchronisations.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.comm import machine, write_json
from benchmarks.comm_worker import synchronize
from deepreduce_compat.codec import codec_from_params
from spardl_grace.selection import count_for_ratio, topk_abs
from spardl_grace.compact import CompactCodec
from spardl_grace.payload import IdentityCodec


def benchmark_device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """--device as a torch.device; a parser error where it names CUDA and none is here."""
    device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs after one warm-up run."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(x: torch.Tensor, repeat: int) -> float:
    """Bytes per second of a device copy, counting the bytes read and the bytes written."""
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x), x.device, repeat)
    return 2 * x.numel() * x.element_size() / seconds


def run(device: torch.device, numel: int, density: float, repeat: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g).to(device)
    k = count_for_ratio(numel, density)
    idx = torch.sort(topk_abs(x, k)).values
    vals = x[idx]
    threshold = float(x[idx].abs().min())
    bandwidth = copy_bandwidth(x, repeat)
    n_bytes, k_bytes = 4 * numel, 8 * k
    kernels: dict[str, tuple[Callable[[], Any], int]] = {
        "topk_abs (prefilter)": (lambda: topk_abs(x, k), n_bytes + k_bytes),
        "torch.topk of abs(x)": (lambda: torch.topk(x.abs(), k, sorted=False), n_bytes + k_bytes),
        "threshold select": (lambda: torch.nonzero(x.abs() >= threshold), n_bytes + k_bytes),
        "scatter k into zeros": (lambda: torch.zeros_like(x).index_put_((idx,), vals), n_bytes + k_bytes),
        "scatter-add k": (lambda: x.index_add_(0, idx, torch.zeros_like(vals)), k_bytes + 2 * 4 * k),
    }
    codecs = {"identity": IdentityCodec(), "compact": CompactCodec(),
              "delta": codec_from_params({"deepreduce": "index", "index": "delta"}),
              "fp16": codec_from_params({"deepreduce": "value", "value": "fp16"}),
              "qsgd": codec_from_params({"deepreduce": "value", "value": "qsgd"})}
    for name, codec in codecs.items():
        data = codec.encode(x, idx, "kernels").data
        kernels[f"encode {name}"] = (lambda c=codec: c.encode(x, idx, "kernels"), k_bytes + data.numel())
        kernels[f"decode {name}"] = (lambda c=codec, d=data: c.decode(d, numel, x.dtype, device, "kernels"),
                                     data.numel() + k_bytes)
    rows = {}
    for name, (fn, touched) in kernels.items():
        seconds = timed(fn, device, repeat)
        floor = touched / bandwidth
        rows[name] = {"seconds": seconds, "bytes_touched": touched, "floor_seconds": floor,
                      "vs_floor": seconds / floor}
    return {"machine": machine(), "device": str(device),
            "device_name": device_name(device),
            "torch_threads": torch.get_num_threads(), "numel": numel, "k": k,
            "copy_bandwidth_bytes_per_s": bandwidth, "kernels": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--numel", type=int, default=14_700_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = benchmark_device(p, args.device)
    out = run(device, args.numel, args.density, args.repeat)
    print(f"{out['device_name']}: {args.numel:,} entries, k = {out['k']:,}, copy bandwidth "
          f"{out['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    for name, r in out["kernels"].items():
        print(f"{name:24s} {r['seconds'] * 1e3:9.3f} ms  floor {r['floor_seconds'] * 1e3:8.3f} ms  "
              f"x{r['vs_floor']:.1f}")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
