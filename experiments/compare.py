"""The README's main job: train a small CNN on Fashion-MNIST with 4 worker processes (gloo),
once with dense all-reduce and once with SparDL, and compare accuracy, bytes and time.

    python -m experiments.compare                # about 3 minutes on 2 CPU cores
    python -m experiments.compare --quick        # a reduced run (CI)

Writes OUT/results.json and OUT/loss.png (OUT defaults to experiments/results/main_job) and
prints a comparison table. Each worker trains on its own shard; gradients of the whole model
are fused into one buffer and synchronised with one grc.step per iteration.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.datasets import load_fashion_mnist
from experiments.main_trainer import evaluate, free_port
from experiments.models import FashionCNN
from spardl_grace import CountingTransport, grace_from_params
from spardl_grace.fusion import assign_grads, flatten_grads
from spardl_grace.transport.torch_dist import TorchDistTransport, destroy_and_exit

CONFIGS = {
    "dense": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
    "spardl": {"compressor": "topk", "memory": "global_residual", "communicator": "spardl"},
    "topk_allgather": {"compressor": "topk", "memory": "residual", "communicator": "allgather"},
}


def worker(rank: int, world: int, port: int, algo: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    transport = CountingTransport(TorchDistTransport(timeout=120))
    params = dict(CONFIGS[algo])
    if algo != "dense":
        params["compress_ratio"] = args.density
    grc = grace_from_params(params, transport=transport)

    images, labels = load_fashion_mnist("train", args.data_dir)
    images, labels = images[: args.train_samples], labels[: args.train_samples]
    shard = torch.arange(rank, len(images), world)
    test_images, test_labels = load_fashion_mnist("test", args.data_dir)
    test_images, test_labels = test_images[: args.test_samples], test_labels[: args.test_samples]

    torch.manual_seed(args.seed)  # the same initial model on every worker (one process each)
    model = FashionCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    order = torch.Generator().manual_seed(args.seed + rank)
    history, comm_seconds, steps = [], 0.0, 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        perm = shard[torch.randperm(len(shard), generator=order)]
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            batch = perm[i:i + args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            t0 = time.perf_counter()
            assign_grads(model.parameters(), grc.step(flatten_grads(model.parameters()), "model"))
            comm_seconds += time.perf_counter() - t0
            opt.step()
            history.append(loss.item())
            steps += 1
    wall = time.perf_counter() - start
    test_loss, test_acc = evaluate(model, test_images, test_labels)
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result = {"algorithm": algo, "rank": rank, "loss_history": history, "test_loss": test_loss,
              "test_accuracy": test_acc, "steps": steps, "wall_s": wall, "sync_s": comm_seconds,
              "bytes_sent_per_step": transport.bytes_sent / max(steps, 1),
              "parameters": sum(p.numel() for p in model.parameters()),
              "params_digest": digest}
    torch.save(result, Path(out) / f"{algo}-rank{rank}.pt")
    destroy_and_exit()


def run_algorithm(algo: str, args: argparse.Namespace, out: Path) -> list[dict]:
    mp.spawn(worker, args=(args.workers, free_port(), algo, args, str(out)), nprocs=args.workers)
    return [torch.load(out / f"{algo}-rank{r}.pt", weights_only=True) for r in range(args.workers)]


def summarise(per_rank: list[dict]) -> dict:
    first = per_rank[0]
    identical = all(torch.equal(r["params_digest"], first["params_digest"]) for r in per_rank)
    history = torch.tensor([r["loss_history"] for r in per_rank]).mean(0)
    return {"algorithm": first["algorithm"], "test_accuracy": first["test_accuracy"],
            "test_loss": first["test_loss"], "steps": first["steps"],
            "final_train_loss": history[-max(1, len(history) // 10):].mean().item(),
            "bytes_sent_per_step_per_rank": sum(r["bytes_sent_per_step"] for r in per_rank) / len(per_rank),
            "wall_s": max(r["wall_s"] for r in per_rank),
            "sync_s": max(r["sync_s"] for r in per_rank),
            "identical_replicas": identical, "parameters": first["parameters"],
            "loss_history": history.tolist()}


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in summaries:
        h = torch.tensor(s["loss_history"])
        window = max(1, len(h) // 25)
        smooth = torch.nn.functional.avg_pool1d(h.view(1, 1, -1), window, 1).view(-1)
        ax.plot(range(window - 1, len(h)), smooth, label=f"{s['algorithm']} (test acc {s['test_accuracy']:.3f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (mean over workers, smoothed)")
    ax.set_title("Fashion-MNIST, FashionCNN, 4 workers (gloo)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-samples", type=int, default=60000)
    p.add_argument("--test-samples", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST *.gz files")
    p.add_argument("--algorithms", default="dense,spardl", help=f"comma-separated of {sorted(CONFIGS)}")
    p.add_argument("--out", default="experiments/results/main_job")
    p.add_argument("--quick", action="store_true", help="a reduced run (1 epoch of 2000 samples)")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_samples, args.test_samples = 1, 2000, 1000
    unknown = set(args.algorithms.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"unknown algorithm(s) {sorted(unknown)}; valid: {sorted(CONFIGS)}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarise(run_algorithm(a, args, out)) for a in args.algorithms.split(",")]
    for f in out.glob("*-rank*.pt"):
        f.unlink()
    (out / "results.json").write_text(json.dumps(
        {"config": vars(args), "results": summaries}, indent=1))
    plot(summaries, out / "loss.png")
    dense = next((s for s in summaries if s["algorithm"] == "dense"), None)
    print(f"\n{'algorithm':<10}{'test acc':>10}{'train loss':>12}{'bytes/step/rank':>17}"
          f"{'vs dense':>10}{'sync s':>9}{'wall s':>9}{'replicas':>10}")
    for s in summaries:
        ratio = s["bytes_sent_per_step_per_rank"] / dense["bytes_sent_per_step_per_rank"] if dense else float("nan")
        print(f"{s['algorithm']:<10}{s['test_accuracy']:>10.4f}{s['final_train_loss']:>12.4f}"
              f"{s['bytes_sent_per_step_per_rank']:>17,.0f}{ratio:>10.3f}{s['sync_s']:>9.1f}"
              f"{s['wall_s']:>9.1f}{'identical' if s['identical_replicas'] else 'DIFFER':>10}")
    print(f"\nresults: {out / 'results.json'}  plot: {out / 'loss.png'}")
    return summaries


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
