"""A Horovod user's script with this library's defaults, against Horovod's own dense optimizer
in the same run: does SparDL reach dense accuracy without tuning? (issue 39)

    horovodrun -np 2 -H localhost:2 --gloo python -m experiments.horovod_defaults \\
        --dnn mnistcnn --epochs 1 --json out.json

Every rank trains the model twice, from the same initial weights on the same batches: first
with hvd.DistributedOptimizer (Horovod's averaging all-reduce), then with

    spardl_grace.DistributedOptimizer(optimizer, grace_from_params(
        {'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
         'compress_ratio': DENSITY, **PARAMS}), named_parameters=model.named_parameters())

where PARAMS is empty unless --params gives more keys (to try other settings; likewise
--optimizer-args for DistributedOptimizer's keywords): the library's
defaults, density warm-up included. SGD with momentum --momentum (0.9; Horovod's own example,
examples/pytorch/pytorch_mnist.py, uses 0.5 with lr 0.01 times the ranks and batch 64) and
weight decay 1e-4, batch
--batch-size per rank, each rank its own shard of Fashion-MNIST's training images, reshuffled
each epoch. Rank 0 tests both models on --test-samples test images and prints (and writes with
--json) their accuracies and the bytes each sent per step and rank.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from experiments.evaluation import evaluate
from spardl_grace.transport.counting import ring_allreduce_bytes
from testbed.datasets import load_fashion_mnist
from testbed.models import build_model

WEIGHT_DECAY = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dnn", default="mnistcnn", choices=("mnistcnn", "fashioncnn"))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--params", default="{}", help="more grace_from_params keys, as JSON")
    p.add_argument("--optimizer-args", default="{}",
                   help="more spardl_grace.DistributedOptimizer keywords, as JSON")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--train-samples", type=int, default=None, help="default: all 60,000")
    p.add_argument("--test-samples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.params = json.loads(args.params)
    args.optimizer_args = json.loads(args.optimizer_args)
    return args


def train(args: argparse.Namespace, kind: str, hvd: Any) -> dict[str, Any]:
    """Train a fresh model (seeded, the same on every rank) with `kind`'s optimizer: 'horovod'
    or 'spardl'. Returns rank 0's test accuracy and the bytes sent per step and rank."""
    import spardl_grace

    torch.manual_seed(args.seed)
    model = build_model(args.dnn, 1, 10)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=WEIGHT_DECAY)
    numel = sum(p.numel() for p in model.parameters())
    if kind == "horovod":
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        grc = spardl_grace.grace_from_params({
            "compressor": "topk", "memory": "global_residual", "communicator": "spardl",
            "compress_ratio": args.density, **args.params})
        optimizer = spardl_grace.DistributedOptimizer(
            sgd, grc, named_parameters=model.named_parameters(), **args.optimizer_args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    images, labels = load_fashion_mnist("train")
    if args.train_samples is not None:
        images, labels = images[: args.train_samples], labels[: args.train_samples]
    rank, size = hvd.rank(), hvd.size()
    steps_per_epoch = len(images) // (size * args.batch_size)
    sent, steps = 0.0, 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(args.seed + epoch))
        shard = order[rank::size]
        model.train()
        for i in range(steps_per_epoch):
            batch = shard[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
            optimizer.step()
            sent += (ring_allreduce_bytes(4 * numel, size) if kind == "horovod"
                     else optimizer.last_stats["bytes_sent"])
            steps += 1
    test_images, test_labels = load_fashion_mnist("test")
    _, accuracy = evaluate(model, test_images[: args.test_samples], test_labels[: args.test_samples])
    return {"test_accuracy": accuracy, "bytes_per_step": sent / max(steps, 1), "steps": steps}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import horovod.torch as hvd

    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    result = {"config": {**vars(args), "ranks": hvd.size()},
              "horovod": train(args, "horovod", hvd), "spardl": train(args, "spardl", hvd)}
    gap = 100 * (result["spardl"]["test_accuracy"] - result["horovod"]["test_accuracy"])
    result["gap_points"] = gap
    if hvd.rank() == 0:
        for kind in ("horovod", "spardl"):
            r = result[kind]
            print(f"{kind:<8} test accuracy {r['test_accuracy']:.4f}  "
                  f"{r['bytes_per_step']:>12,.0f} bytes/step")
        print(f"SparDL with the library's defaults: {gap:+.2f} points against Horovod's dense optimizer")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
