"""How much DeepReduce's codecs shrink SparDL's traffic, on real gradients.

    python -m benchmarks.codecs [--workers 4] [--density 0.01] [--steps 5] [--json PATH]

Each of `workers` local ranks (threads) computes FashionCNN gradients on its own Fashion-MNIST
batches; SparDL (with error feedback) synchronises them for `steps` steps once per codec
configuration, the same gradients every time. Reported per configuration: mean payload bytes
sent per step per rank, the ratio to uncoded SparDL, mean coding seconds per step, and the
relative L2 difference of the first step's result from the uncoded one (the codec's error, and for
Bloom p0 also the values of its false positives, which are applied too).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.comm import machine, write_json
from testbed.datasets import load_fashion_mnist
from testbed.models.small import FashionCNN
from deepreduce_compat import deepreduce_from_params
from spardl_grace.transport import run_local
from spardl_grace.fusion import flatten_grads

CONFIGS = {
    "identity": {"wire": "exact"},  # uncoded: the papers' int32 index and float32 value
    "compact wire (the default)": {"wire": "compact"},
    "delta + none": {"deepreduce": "index", "index": "delta"},
    "rle + none": {"deepreduce": "index", "index": "rle"},
    "huffman + none": {"deepreduce": "index", "index": "huffman"},
    "bloom p0 + none": {"deepreduce": "index", "index": "bloom", "policy": "p0"},
    "bloom conflict_sets + none": {"deepreduce": "index", "index": "bloom", "policy": "conflict_sets"},
    "none + fp16": {"deepreduce": "value", "value": "fp16"},
    "none + polyfit": {"deepreduce": "value", "value": "polyfit"},
    "none + dexp": {"deepreduce": "value", "value": "dexp"},
    "delta + fp16": {"deepreduce": "both", "index": "delta", "value": "fp16"},
    "delta + qsgd": {"deepreduce": "both", "index": "delta", "value": "qsgd"},
    "huffman + qsgd": {"deepreduce": "both", "index": "huffman", "value": "qsgd"},
    "bloom p0 + polyfit": {"deepreduce": "both", "index": "bloom", "value": "polyfit"},
    "bloom p0 + qsgd": {"deepreduce": "both", "index": "bloom", "value": "qsgd"},
    "rle + deflate": {"deepreduce": "both", "index": "rle", "value": "deflate"},
}


def gradients(workers: int, steps: int, batch: int = 64) -> list[list[torch.Tensor]]:
    """grads[rank][step]: FashionCNN's flat gradient on each rank's own batches."""
    images, labels = load_fashion_mnist("train")
    torch.manual_seed(0)
    model = FashionCNN()
    out = []
    for rank in range(workers):
        per_step = []
        for step in range(steps):
            lo = (rank * steps + step) * batch
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(images[lo:lo + batch]), labels[lo:lo + batch]).backward()
            per_step.append(flatten_grads(model.parameters()).clone())
        out.append(per_step)
    return out


def run(config: dict, grads, density: float) -> dict:
    def fn(t):
        grc = deepreduce_from_params({"compressor": "topk", "memory": "global_residual",
                                      "communicator": "spardl", "compress_ratio": density,
                                      "min_entries": 0, **config}, transport=t)
        sent, coding, results = [], [], []
        for grad in grads[t.rank]:
            results.append(grc.step(grad.clone(), "model"))
            sent.append(grc.last_stats["bytes_sent"])
            coding.append(grc.last_stats["coding_s"])
        return sent, coding, results
    per_rank = run_local(len(grads), fn)
    sent = [b for r in per_rank for b in r[0]]
    coding = [c for r in per_rank for c in r[1]]
    return {"bytes_per_step_per_rank": sum(sent) / len(sent),
            "coding_s_per_step": sum(coding) / len(coding), "first_result": per_rank[0][2][0]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    grads = gradients(args.workers, args.steps)
    rows, base = [], None
    for name, config in CONFIGS.items():
        start = time.perf_counter()
        out = run(config, grads, args.density)
        base = base or out
        error = float((out["first_result"] - base["first_result"]).norm() / base["first_result"].norm())
        rows.append({"codec": name, **{k: v for k, v in out.items() if k != "first_result"},
                     "ratio_to_identity": out["bytes_per_step_per_rank"] / base["bytes_per_step_per_rank"],
                     "relative_difference_step0": error, "wall_s": time.perf_counter() - start})
        print(f"{name:28s} {rows[-1]['bytes_per_step_per_rank']:9.0f} B  "
              f"x{rows[-1]['ratio_to_identity']:.3f}  coding {rows[-1]['coding_s_per_step'] * 1e3:7.2f} ms  "
              f"difference {error:.4f}")
    write_json(args.json, {
        "machine": {**machine(), "torch_threads": torch.get_num_threads()},
        "model": "FashionCNN (18,378 parameters), batch 64 per worker, Fashion-MNIST",
        "workers": args.workers, "density": args.density, "steps": args.steps,
        "results": rows})
    return rows


if __name__ == "__main__":
    main()
