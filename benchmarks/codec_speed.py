"""Encode/decode throughput and size of every DeepReduce codec configuration on a large real
gradient.

    python -m benchmarks.codec_speed [--model vgg16] [--density 0.01] [--repeat 3] [--json PATH]
        [--device cuda] [--data-dir DIR]

One gradient of --model on a Fashion-MNIST batch; its top-k (k = density * n) by magnitude is
the sparse payload every configuration of benchmarks.codecs.CONFIGS codes, as a sparse
all-reduce would. Per configuration: bytes against the uncoded 8 bytes per entry, encode and
decode throughput in MB/s of uncoded payload (medians of --repeat), and the relative L2 error
of the decoded values (0 for lossless codecs; for Bloom p0 also the false positives' values).
With --device cuda the gradient, the codecs' work and the decoded payload live on the GPU and
each time is taken between synchronisations.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.codecs import CONFIGS
from benchmarks.comm import machine, write_json
from benchmarks.comm_worker import synchronize
from benchmarks.kernels import benchmark_device, device_name
from deepreduce_compat.codec import codec_from_params
from spardl_grace.selection import count_for_ratio, topk_abs
from spardl_grace.payload import IdentityCodec


def real_gradient(model_name: str, batch: int = 16, data_dir: Path | None = None) -> torch.Tensor:
    from testbed.datasets import load_fashion_mnist
    from testbed.models import build_model
    from spardl_grace.fusion import flatten_grads
    images, labels = load_fashion_mnist("train", data_dir)
    torch.manual_seed(0)
    model = build_model(model_name, 1, 10)
    torch.nn.functional.cross_entropy(model(images[:batch]), labels[:batch]).backward()
    return flatten_grads(model.parameters()).clone()


def measure(config: dict[str, Any], grad: torch.Tensor, indices: torch.Tensor,
            repeat: int) -> dict[str, Any]:
    codec = codec_from_params(config) if config else IdentityCodec()
    raw = 8 * indices.numel()
    encode_s, decode_s = [], []
    for i in range(repeat + 1):  # the first round warms caches up and is not counted
        synchronize(grad.device)
        start = time.perf_counter()
        enc = codec.encode(grad, indices, f"speed.{i}")
        synchronize(grad.device)
        encoded = time.perf_counter() - start
        start = time.perf_counter()
        idx, vals = codec.decode(enc.data, grad.numel(), grad.dtype, grad.device, f"speed.{i}")
        synchronize(grad.device)
        if i:
            encode_s.append(encoded)
            decode_s.append(time.perf_counter() - start)
    decoded = torch.zeros_like(grad).index_put_((idx,), vals, accumulate=True)
    truth = torch.zeros_like(grad)
    truth[indices] = grad[indices]
    return {"bytes": enc.data.numel(), "ratio_to_uncoded": enc.data.numel() / raw,
            "encode_mb_per_s": raw / statistics.median(encode_s) / 1e6,
            "decode_mb_per_s": raw / statistics.median(decode_s) / 1e6,
            "encode_s": statistics.median(encode_s), "decode_s": statistics.median(decode_s),
            "relative_error": float((decoded - truth).norm() / truth.norm())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg16")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="where the gradient and the coding live (cpu, cuda)")
    p.add_argument("--data-dir", type=Path, default=None, help="Fashion-MNIST's IDX files")
    args = p.parse_args(argv)
    device = benchmark_device(p, args.device)
    torch.set_num_threads(1)
    grad = real_gradient(args.model, data_dir=args.data_dir).to(device)
    indices = torch.sort(topk_abs(grad, count_for_ratio(grad.numel(), args.density))).values
    rows = {name: measure(config, grad, indices, args.repeat) for name, config in CONFIGS.items()}
    print(f"{args.model}: {grad.numel():,} entries, k = {indices.numel():,}")
    for name, r in rows.items():
        print(f"{name:28s} x{r['ratio_to_uncoded']:.3f}  encode {r['encode_mb_per_s']:8.1f} MB/s  "
              f"decode {r['decode_mb_per_s']:8.1f} MB/s  error {r['relative_error']:.4f}")
    out = {"machine": machine(), "device": str(device),
           "device_name": device_name(device),
           "model": args.model, "numel": grad.numel(), "k": indices.numel(),
           "density": args.density, "torch_threads": 1, "configs": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
