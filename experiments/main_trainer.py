"""The SparDL training CLI: train a model on a data set with any algorithm of the project.

    python -m experiments.main_trainer --dnn resnet20 --dataset fashion-mnist --nworkers 4 \\
        --compression --compressor spardl --density 0.01 --max-epochs 5
    torchrun --nproc-per-node 4 -m experiments.main_trainer --dnn resnet20 ...
    mpirun -np 4 python -m experiments.main_trainer ...
    horovodrun -np 4 -H localhost:4 --gloo python -m experiments.main_trainer ...
    python -m experiments.main_trainer --config run.yaml          # the same keys, in a file

Started as a plain command it launches --nworkers local worker processes itself (gloo).
Under a launcher it joins that launcher's ranks. Without --compression every algorithm runs
dense. --compressor takes a sparse all-reduce (spardl, topka, topkdsa, gtopk, oktopk,
gaussiank, dense) or a GRACE compressor (topk, randomk, qsgd, ...), which then runs with
GRACE's memory and communicator for it.

The recipe is the reference one: SGD with momentum 0.9 and weight decay 1e-4, the learning
rate warmed up linearly from lr/P over --warmup-epochs, then multiplied by 0.1 at each epoch in
--lr-decay. Rank 0 writes OUT/log.jsonl (one line per step and per epoch) and OUT/epochs.csv,
and, with --log wandb or tensorboard, logs there too. Every rank checkpoints OUT/ckpt-rank{r}.pt
at the end of each epoch; --resume continues from it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

SPARSE_ALLREDUCES = ("spardl", "topka", "topkdsa", "gtopk", "oktopk", "gaussiank", "dense")
# GRACE compressor -> (memory, communicator), as GRACE's examples pair them.
GRACE_PAIRS = {
    "none": ("none", "allreduce"), "fp16": ("none", "allreduce"),
    "randomk": ("residual", "allreduce"), "powersgd": ("powersgd", "allreduce"),
    "topk": ("residual", "allgather"), "threshold": ("residual", "allgather"),
    "dgc": ("dgc", "allgather"), "qsgd": ("none", "allgather"), "terngrad": ("none", "allgather"),
    "signsgd": ("none", "allgather"), "signum": ("none", "allgather"),
    "efsignsgd": ("efsignsgd", "allgather"), "onebit": ("residual", "allgather"),
    "natural": ("none", "allgather"),
}
COMPRESSORS = (*SPARSE_ALLREDUCES, *GRACE_PAIRS)
DENSITY_COMPRESSORS = (*(c for c in SPARSE_ALLREDUCES if c != "dense"), "topk", "randomk", "dgc")
LOGS = ("csv", "wandb", "tensorboard")
# The sparse all-reduces' own split of a sync (seconds); GRACE's loop reports none of them.
TIME_SPLIT = ("selection_s", "comm_s", "coding_s")
_INIT_LOCK = threading.Lock()


def allreduce_params(name: str, teams: int) -> dict[str, Any]:
    """GRACE params of a sparse all-reduce (top-k with global residuals), or of dense."""
    if name in ("dense", "none"):
        return {"compressor": "none", "memory": "none", "communicator": "dense"}
    return {"compressor": "topk", "memory": "global_residual", "communicator": name, "teams": teams}


def grace_params(args: argparse.Namespace) -> dict[str, Any]:
    """GRACE params for the CLI's algorithm choice."""
    if not args.compression:
        params = allreduce_params("dense", args.teams)
    elif args.compressor in (*SPARSE_ALLREDUCES, "none"):
        params = allreduce_params(args.compressor, args.teams)
    else:
        memory, communicator = GRACE_PAIRS[args.compressor]
        params = {"compressor": args.compressor, "memory": memory, "communicator": communicator}
    params.update(compress_ratio=args.density, seed=args.seed)
    if args.deepreduce:
        if params["communicator"] in ("dense", "allreduce", "broadcast"):
            raise SystemExit(f"--deepreduce codes sparse messages; {args.compressor} sends none")
        params.update(deepreduce=args.deepreduce, index=args.index, value=args.value)
    return params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from experiments.datasets import DATASETS
    from experiments.models import MODELS

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file with any of these options (CLI wins)")
    p.add_argument("--dnn", default="resnet20", choices=sorted(MODELS))
    p.add_argument("--dataset", default="fashion-mnist", choices=sorted(DATASETS))
    p.add_argument("--data-dir", default=None)
    p.add_argument("--nworkers", type=int, default=1, help="workers to launch when started as a plain command")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="lr from lr/P to lr over these epochs")
    p.add_argument("--lr-decay", type=epoch_list, default=(),
                   help="comma-separated epochs at which lr is multiplied by 0.1")
    p.add_argument("--compression", action="store_true", help="use --compressor (otherwise dense)")
    p.add_argument("--compressor", default="spardl", choices=COMPRESSORS)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--density-warmup", type=int, default=0,
                   help="DGC's density warm-up: density 0.25, 0.0625, ... (x1/4 per epoch, never "
                        "below --density) over these first epochs")
    p.add_argument("--teams", type=int, default=1, help="SparDL's d")
    p.add_argument("--deepreduce", default=None, choices=("value", "index", "both"))
    p.add_argument("--index", default="bloom")
    p.add_argument("--value", default="polyfit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=None, help="use only the first N training samples")
    p.add_argument("--test-samples", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None, help="stop each epoch after N steps")
    p.add_argument("--log", default="csv", help=f"comma-separated of {', '.join(LOGS)} (csv/jsonl always)")
    p.add_argument("--out", default="experiments/results/run")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt-rank{r}.pt")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a silent peer is an error")
    if known.config:
        p.set_defaults(**load_config(known.config, p))
    args = p.parse_args(argv)
    from experiments.datasets import DATASET_TASKS
    from experiments.models import MODEL_TASKS
    task = MODEL_TASKS[args.dnn]
    if task != DATASET_TASKS[args.dataset]:
        fits = sorted(d for d, t in DATASET_TASKS.items() if t == task)
        p.error(f"--dnn {args.dnn} reads {task} data; data sets for it: {', '.join(fits)}")
    unknown = set(filter(None, args.log.split(","))) - set(LOGS)
    if unknown:
        p.error(f"unknown --log {sorted(unknown)}; valid choices: {', '.join(LOGS)}")
    if args.nworkers < 1 or args.batch_size < 1 or args.max_epochs < 0 or args.density_warmup < 0:
        p.error("--nworkers and --batch-size must be >= 1, --max-epochs and --density-warmup >= 0")
    if args.density_warmup and not (args.compression and args.compressor in DENSITY_COMPRESSORS):
        p.error(f"--density-warmup needs --compression with one of {', '.join(DENSITY_COMPRESSORS)}")
    return args


def warmup_density(epoch: int, args: argparse.Namespace) -> float:
    """DGC's schedule: 0.25 ** (epoch + 1) during the warm-up epochs, never below --density."""
    if epoch < args.density_warmup:
        return max(args.density, 0.25 ** (epoch + 1))
    return args.density


def epoch_list(text: str) -> tuple[float, ...]:
    """'81,122' -> (81.0, 122.0); argparse reports a bad value as an error."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs, got {text!r}") from None


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Options from a YAML/JSON file, by their CLI names (dashes or underscores)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml
        config = yaml.safe_load(text) or {}
    else:
        config = json.loads(text)
    valid = {a.dest for a in parser._actions}
    out = {}
    for key, value in config.items():
        dest = key.replace("-", "_")
        if dest not in valid:
            raise SystemExit(f"{path}: unknown option {key!r}; valid: {', '.join(sorted(valid - {'help'}))}")
        out[dest] = value
    return out


# --------------------------------------------------------------------------- launching
def launcher() -> str:
    """'horovod', 'torchrun', 'mpirun' or 'none', from the environment the launcher sets."""
    if "HOROVOD_RANK" in os.environ:
        return "horovod"
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return "mpirun"
    return "none"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=args.timeout))
    from spardl_grace.transport.torch_dist import TorchDistTransport, destroy_and_exit
    train(args, TorchDistTransport(timeout=args.timeout))
    destroy_and_exit()


def start(args: argparse.Namespace) -> None:
    """Join the launcher's ranks, or launch --nworkers local ones."""
    kind = launcher()
    if kind == "none" and args.nworkers > 1:
        import torch.multiprocessing as mp
        mp.spawn(_spawned, args=(args.nworkers, free_port(), args), nprocs=args.nworkers)
        return
    from spardl_grace.transport import default_transport, run_local
    if kind == "none":
        run_local(1, lambda t: train(args, t))
        return
    if kind == "horovod":
        import horovod.torch as hvd
        hvd.init()
    elif kind == "torchrun":
        import torch.distributed as dist
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(seconds=args.timeout))
    train(args, default_transport(timeout=args.timeout))
    if kind == "torchrun":
        from spardl_grace.transport.torch_dist import destroy_and_exit
        destroy_and_exit()


# --------------------------------------------------------------------------- training
def lr_factor(step: int, steps_per_epoch: int, args: argparse.Namespace, world: int) -> float:
    """Linear warm-up from 1/P to 1 over warmup_epochs, then x0.1 at each --lr-decay epoch."""
    epoch = step / max(steps_per_epoch, 1)
    factor = 1.0
    if args.warmup_epochs > 0 and epoch < args.warmup_epochs:
        factor = 1.0 / world + (1.0 - 1.0 / world) * epoch / args.warmup_epochs
    for milestone in args.lr_decay:
        if epoch >= milestone:
            factor *= 0.1
    return factor


class Logger:
    """JSONL of every record and a CSV of epoch summaries on rank 0; W&B and TensorBoard when
    asked for (W&B offline unless WANDB_API_KEY is set)."""

    def __init__(self, args: argparse.Namespace, rank: int, config: dict[str, Any]):
        self.active = rank == 0
        self.out = Path(args.out)
        self.wandb = self.tensorboard = None
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        mode = "a" if args.resume else "w"
        self.jsonl = open(self.out / "log.jsonl", mode)
        self.csv_path = self.out / "epochs.csv"
        logs = set(filter(None, args.log.split(",")))
        if "wandb" in logs:
            try:
                import wandb
            except ImportError as exc:
                raise SystemExit("--log wandb needs the wandb package: pip install wandb") from exc
            os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project="spardl-grace", config=config, dir=str(self.out))
        if "tensorboard" in logs:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit("--log tensorboard needs the tensorboard package: "
                                 "pip install tensorboard") from exc
            self.tensorboard = SummaryWriter(str(self.out / "tensorboard"))

    def log(self, record: dict[str, Any], step: int) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if self.tensorboard is not None:
            for k, v in numbers.items():
                self.tensorboard.add_scalar(f"{record['kind']}/{k}", v, step)
        if record["kind"] == "epoch":
            new = not self.csv_path.exists()
            with open(self.csv_path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(record))
                if new:
                    writer.writeheader()
                writer.writerow(record)

    def close(self) -> None:
        if self.active:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()
            if self.tensorboard is not None:
                self.tensorboard.close()


def flat_outputs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logits and targets of a language model (N x L x V, N x L) as rows; a
    classifier's unchanged."""
    if logits.dim() == 3:
        return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return logits, labels


def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(mean loss, accuracy) over a test set; per token for a language model."""
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(images[torch.arange(i, min(i + 500, len(images)))])
                            for i in range(0, len(images), 500)])
    model.train()
    logits, labels = flat_outputs(logits, labels)
    return (torch.nn.functional.cross_entropy(logits, labels).item(),
            (logits.argmax(1) == labels).float().mean().item())


def train(args: argparse.Namespace, transport) -> dict[str, Any]:
    """Train on this rank; returns the final summary (identical metrics on every rank)."""
    import spardl_grace
    from experiments.datasets import DATASETS, load_dataset
    from spardl_grace.transport.counting import ring_allreduce_bytes
    from experiments.models import build_model

    counting = spardl_grace.CountingTransport(transport)
    rank, world = transport.rank, transport.size
    tokenizer = "wordpiece" if args.dnn == "bert" else "words"
    images, labels = load_dataset(args.dataset, "train", args.data_dir, tokenizer)
    test_images, test_labels = load_dataset(args.dataset, "test", args.data_dir, tokenizer)
    images, labels = images[:args.train_samples], labels[:args.train_samples]
    test_images, test_labels = test_images[:args.test_samples], test_labels[:args.test_samples]
    _, channels, classes = DATASETS[args.dataset]

    with _INIT_LOCK:  # local workers are threads sharing torch's global generator
        torch.manual_seed(args.seed)
        model = build_model(args.dnn, channels, classes)
    spardl_grace.broadcast_parameters(model.state_dict(), 0, transport)
    params = grace_params(args)
    grc = spardl_grace.grace_from_params(params, transport=counting)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    optimizer = spardl_grace.DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())
    shard = torch.arange(rank, len(images), world)
    steps_per_epoch = len(shard) // args.batch_size
    if args.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps_per_epoch, args, world))
    n_params = sum(p.numel() for p in model.parameters())
    dense_bytes = ring_allreduce_bytes(4 * n_params, world)  # fp32 gradients, dense

    out = Path(args.out)
    checkpoint = out / f"ckpt-rank{rank}.pt"
    first_epoch = 0
    if args.resume:
        if not checkpoint.exists():
            raise SystemExit(f"--resume: {checkpoint} does not exist")
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        optimizer.load_compression_state_dict(saved["compression"])
        scheduler.load_state_dict(saved["scheduler"])
        first_epoch = saved["epoch"] + 1
    logger = Logger(args, rank, {**vars(args), "grace": params, "workers": world})
    progress = _progress(rank, args.max_epochs * steps_per_epoch)

    summary: dict[str, Any] = {}
    for epoch in range(first_epoch, args.max_epochs):
        if args.density_warmup:
            optimizer.grace.set_density(warmup_density(epoch, args))
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch * 100 + rank))]
        start, sync_s, sent_before = time.perf_counter(), 0.0, counting.bytes_sent
        losses, correct, seen, samples = [], 0, 0, 0
        split = dict.fromkeys(TIME_SPLIT, 0.0)
        for i in range(steps_per_epoch):
            batch = order[i * args.batch_size:(i + 1) * args.batch_size]
            x, y = images[batch], labels[batch]
            optimizer.zero_grad()
            logits, y = flat_outputs(model(x), y)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            t0 = time.perf_counter()
            optimizer.synchronize()
            sync_s += time.perf_counter() - t0
            with optimizer.skip_synchronize():
                optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            correct += int((logits.argmax(1) == y).sum())
            seen += y.numel()  # tokens for a language model
            samples += len(x)
            step = epoch * steps_per_epoch + i
            stats = optimizer.grace.last_stats
            times = {k: float(stats.get(k, 0.0)) for k in TIME_SPLIT}
            for k, v in times.items():
                split[k] += v
            logger.log({"kind": "step", "step": step, "epoch": epoch, "loss": loss.item(),
                        "lr": scheduler.get_last_lr()[0], **times}, step)
            progress.update(1)
        elapsed = time.perf_counter() - start
        bytes_per_step = (counting.bytes_sent - sent_before) / max(steps_per_epoch, 1)
        test_loss, test_acc = evaluate(model, test_images, test_labels)
        residuals = getattr(optimizer.grace.memory, "residuals", {})
        residual_norm = float(torch.sqrt(sum((r.float() ** 2).sum() for r in residuals.values()))) \
            if residuals else 0.0
        summary = {"kind": "epoch", "step": (epoch + 1) * steps_per_epoch, "epoch": epoch,
                   "train_loss": sum(losses) / max(len(losses), 1),
                   "train_accuracy": correct / max(seen, 1), "test_loss": test_loss,
                   "test_accuracy": test_acc, "samples_per_s": samples * world / elapsed,
                   "bytes_sent_per_step": bytes_per_step,
                   "compression_ratio": bytes_per_step / dense_bytes if dense_bytes else 1.0,
                   "sync_s": sync_s, "compute_s": elapsed - sync_s, **split,
                   "residual_norm": residual_norm,
                   "lr": scheduler.get_last_lr()[0]}
        logger.log(summary, summary["step"])
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "compression": optimizer.compression_state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}, checkpoint)
    progress.close()
    logger.close()
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save({"rank": rank, "params": digest, "summary": summary}, out / f"final-rank{rank}.pt")
    return summary


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(rank: int, total: int):
    """tqdm on rank 0 when installed and attached to a terminal."""
    if rank != 0 or not sys.stderr.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="step")


def main(argv: list[str] | None = None) -> None:
    # Several ranks share a machine's cores; the spawned workers inherit this.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    start(args)


if __name__ == "__main__":
    main()
