"""The SparDL training CLI: train a model on a data set with any algorithm of the project.

    python -m experiments.main_trainer --dnn resnet20 --dataset fashion-mnist --nworkers 4 \\
        --compression --compressor spardl --density 0.01 --max-epochs 5
    torchrun --nproc-per-node 4 -m experiments.main_trainer --dnn resnet20 ...
    mpirun -np 4 python -m experiments.main_trainer ...
    horovodrun -np 4 -H localhost:4 --gloo python -m experiments.main_trainer ...
    python -m experiments.main_trainer --config run.yaml          # the same keys, in a file

Started as a plain command it launches --nworkers local worker processes itself (gloo); with
--bandwidth RATE each of them runs in its own network namespace behind a link shaped to RATE
(benchmarks.netem, root only). Under a launcher it joins that launcher's ranks. --device cuda
(the default where a GPU is visible) trains on rank r's GPU: NCCL where every rank has its own,
gloo where ranks share one. Without
--compression every algorithm runs dense. --compressor takes a sparse all-reduce (spardl,
topka, topkdsa, gtopk, oktopk, gaussiank, dense), a GRACE compressor (topk, randomk, qsgd, ...),
which then runs with GRACE's memory and communicator for it, or one of PyTorch's own choices
as they ship: DistributedDataParallel (torch_ddp) with its fp16 hook (torch_fp16), its
PowerSGD hook (torch_powersgd, --powersgd-rank) or post-local SGD (torch_postlocal,
--postlocal-period); or DiLoCo (diloco, --diloco-period: experiments.diloco).

The recipe (experiments.recipe) is by default the reference one: SGD with momentum 0.9 and
weight decay 1e-4, the learning rate warmed up linearly from lr/P over --warmup-epochs, then
multiplied by 0.1 at each epoch in --lr-decay; --optimizer adamw is the transformer's. With --momentum-correction m (DGC) the momentum moves into the gradient memory and
SGD runs without its own, with weight decay 1e-4/(1-m) (the same steady-state decay).
Evaluation (on rank 0, every --eval-every steps and after each epoch) is not counted in the
training time, which --time-budget bounds and --target-accuracy measures against (a resumed
run's clock starts again from zero).
Rank 0 writes OUT/log.jsonl (one line per start, step, evaluation and epoch) and OUT/epochs.csv,
and, with --log wandb or tensorboard, logs there too. Every rank checkpoints
OUT/ckpt-rank{r}.pt at the end of each epoch (and every --checkpoint-every steps); --resume
continues from the newest one every rank holds, and --resume auto does so only when there is
one, so that a launcher's restart (torchrun --max-restarts) continues the run.
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from deepreduce_compat import deepreduce_from_params
from experiments import recipe
from experiments.sharded import MODES as FSDP_MODES
from spardl_grace import launch, registry
from spardl_grace.registry import WIRES
from spardl_grace.warmup import warmup_density
from spardl_grace.checkpoint import load_agreed_checkpoint, save_checkpoint

SPARSE_ALLREDUCES = (*registry.SPARSE_ALLREDUCES, "dense")
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
BASELINES = ("torch_ddp", "torch_fp16", "torch_powersgd", "torch_postlocal",  # experiments.baselines
             "diloco")  # experiments.diloco
COMPRESSORS = (*SPARSE_ALLREDUCES, *GRACE_PAIRS, *BASELINES)
# DGC's density warm-up over this many first epochs is the sparse all-reduces' default: of
# DGC's techniques it alone brought SparDL near dense in the recorded ablation
# (experiments/results/ablation_mnistcnn); momentum correction and local clipping did not.
DEFAULT_WARMUP_EPOCHS = 0.25
# ... but it starts at density 0.0625, not DGC's 0.25: on an emulated 100 Mbit link DGC's start
# made SparDL reach the main job's target 1.49x later than a start at 0.0625, whose first
# stage costs 4x fewer bytes (experiments/results/main_job); DGC's start bought accuracy per
# step (ablation), which its bytes cost more than on a slow link.
DEFAULT_WARMUP_START = 0.0625
DENSITY_COMPRESSORS = (*(c for c in SPARSE_ALLREDUCES if c != "dense"), "topk", "randomk", "dgc")
LOGS = ("csv", "wandb", "tensorboard")
DEVICES = ("auto", "cpu", "cuda")
RESUME = ("never", "auto", "always")


def resolve_device(device: str, parser: argparse.ArgumentParser) -> str:
    """One of DEVICES as the place to compute: 'auto' is 'cuda' where a GPU is visible, else
    'cpu'; 'cuda' without a visible GPU is a usage error (parser.error) naming --device cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; use --device cpu")
    return device
# The sparse all-reduces' own split of a sync (seconds); GRACE's loop reports none of them.
TIME_SPLIT = ("selection_s", "comm_s", "coding_s")
_INIT_LOCK = threading.Lock()


def allreduce_params(name: str, teams: int) -> dict[str, Any]:
    """GRACE params of a sparse all-reduce (top-k with global residuals), or of dense."""
    if name in ("dense", "none"):
        return {"compressor": "none", "memory": "none", "communicator": "dense"}
    return {"compressor": "topk", "memory": "global_residual", "communicator": name, "teams": teams}


def _from_grace_config(args: argparse.Namespace) -> None:
    """Set --compression, --compressor and --density from --grace-config, so that the rest of
    the CLI (density warm-up, refusals, logs) sees the algorithm the config names."""
    config = args.grace_config
    communicator = config.get("communicator", "allreduce")
    args.compression = True
    args.compressor = communicator if communicator in SPARSE_ALLREDUCES \
        else config.get("compressor", "none")
    ratio = config.get("compress_ratio", config.get("density"))
    if ratio is not None:
        args.density = ratio


def grace_params(args: argparse.Namespace, steps_per_epoch: int | None = None) -> dict[str, Any]:
    """GRACE params for the CLI's algorithm choice (--grace-config's as given). With
    `steps_per_epoch`, a sparse all-reduce's --density-warmup becomes the library's warm-up
    (density_warmup_steps, density_warmup_start) unless --grace-config sets one."""
    if args.grace_config is not None:
        return {"seed": args.seed, **library_warmup(args, steps_per_epoch), **args.grace_config}
    if not args.compression:
        params = allreduce_params("dense", args.teams)
    elif args.compressor in (*SPARSE_ALLREDUCES, "none"):
        params = allreduce_params(args.compressor, args.teams)
    else:
        memory, communicator = GRACE_PAIRS[args.compressor]
        params = {"compressor": args.compressor, "memory": memory, "communicator": communicator}
    params.update(compress_ratio=args.density, seed=args.seed)
    if params["compressor"] == "powersgd":
        params["powersgd_rank"] = args.powersgd_rank
    if args.momentum_correction:
        params["momentum_correction"] = args.momentum_correction
    if args.local_clip_norm is not None:
        params["local_clip_norm"] = args.local_clip_norm
    if args.deepreduce:
        if params["communicator"] in ("dense", "allreduce", "broadcast"):
            raise SystemExit(f"--deepreduce codes sparse messages; {args.compressor} sends none")
        params.update(deepreduce=args.deepreduce, index=args.index, value=args.value)
    if args.wire is not None:
        params["wire"] = args.wire
    if args.min_entries is not None:
        params["min_entries"] = args.min_entries
    if args.adam_freeze_step:
        params["adam_freeze_step"] = args.adam_freeze_step
    if args.exchange != "gradient":
        params["exchange"] = args.exchange
    return {**params, **library_warmup(args, steps_per_epoch)}


def library_warmup(args: argparse.Namespace, steps_per_epoch: int | None) -> dict[str, Any]:
    """The library's density warm-up keys for --density-warmup epochs of `steps_per_epoch`
    steps, for a sparse all-reduce (none before the steps are known, or for anything else)."""
    if steps_per_epoch is None or not args.density_warmup or not library_warms_up(args):
        return {}
    return {"density_warmup_steps": round(args.density_warmup * steps_per_epoch),
            "density_warmup_start": args.density_warmup_start}


def library_warms_up(args: argparse.Namespace) -> bool:
    """Whether the algorithm is a sparse all-reduce, whose density warm-up the library runs
    (GRACE's compressors get the same schedule through set_density, from the trainer)."""
    return args.compression and args.compressor in SPARSE_ALLREDUCES and args.compressor != "dense"


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
    recipe.add_arguments(p)
    p.add_argument("--compression", action="store_true", help="use --compressor (otherwise dense)")
    p.add_argument("--compressor", default="spardl", choices=COMPRESSORS)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--grace-config", "--grace_config", dest="grace_config", type=grace_config,
                   default=None,
                   help="GRACE-benchmarks' config string, e.g. \"{'compressor': 'topk', 'memory': "
                        "'residual', 'communicator': 'allgather', 'compress_ratio': 0.01}\": these "
                        "GRACE params replace --compression, --compressor and --density")
    p.add_argument("--density-warmup", type=float, default=None,
                   help="DGC's density warm-up over these first epochs (a fraction is fine): "
                        "density --density-warmup-start, then x1/4 per stage (stages of equal length) "
                        f"while above --density. Default: {DEFAULT_WARMUP_EPOCHS} for the sparse "
                        "all-reduces (chosen by the recorded ablation), 0 otherwise")
    p.add_argument("--density-warmup-start", type=float, default=DEFAULT_WARMUP_START,
                   help=f"the warm-up's first density (default {DEFAULT_WARMUP_START}; DGC's is "
                        "0.25); each later stage has 1/4 of the one before. A warm-up step sends "
                        "about start/--density times a steady step's bytes, so on a slow link a "
                        "lower start costs less time")
    p.add_argument("--momentum-correction", type=float, default=None,
                   help="DGC's momentum correction m for a sparse all-reduce (SGD then runs "
                        "without momentum)")
    p.add_argument("--local-clip-norm", type=float, default=None,
                   help="DGC's local gradient clipping: each worker's gradient to this L2 norm "
                        "/ sqrt(P) (sparse all-reduces)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="powersgd and torch_powersgd")
    p.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="torch_powersgd: plain all-reduce before this step (torch's "
                        "start_powerSGD_iter, at least 2)")
    p.add_argument("--postlocal-period", type=int, default=4,
                   help="torch_postlocal: steps per model averaging (PeriodicModelAverager's "
                        "period, at least 2)")
    p.add_argument("--postlocal-start-iter", type=int, default=100,
                   help="torch_postlocal: DDP's gradient all-reduce before this step, local SGD "
                        "from it (start_localSGD_iter, the averager's warm_up steps)")
    p.add_argument("--diloco-period", type=int, default=50,
                   help="diloco: inner steps between outer steps (DiLoCo's H)")
    p.add_argument("--teams", type=int, default=1, help="SparDL's d")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="fuse gradients into buckets of at most this many MB, each synchronised "
                        "while backward goes on (default: one bucket for the whole model, which "
                        "SparDL wants; PyTorch DDP's own default is 25)")
    p.add_argument("--no-overlap", action="store_true",
                   help="synchronise each bucket after backward instead of while it goes on "
                        "(to measure what overlap buys)")
    p.add_argument("--ddp-hook", action="store_true",
                   help="run this library's algorithm through DistributedDataParallel and "
                        "spardl_grace.comm_hook instead of DistributedOptimizer")
    p.add_argument("--fsdp", default=None, choices=FSDP_MODES,
                   help="shard the model with FSDP2: hybrid (sharded inside each of "
                        "--fsdp-nodes nodes, the sparse all-reduce between them) or flat "
                        "(sharded over every rank, SparDL's Spar-Reduce-Scatter as FSDP's "
                        "reduce-scatter); this library's algorithms only, no checkpoints")
    p.add_argument("--fsdp-nodes", type=int, default=2,
                   help="--fsdp hybrid: the nodes (replicas); --nworkers must be a multiple")
    p.add_argument("--wire", default=None, choices=WIRES,
                   help="the sparse all-reduces' wire format (grace_from_params' 'wire'; "
                        "default: the library's)")
    p.add_argument("--min-entries", type=int, default=None,
                   help="the sparse all-reduces' floor on entries a tensor sends a step "
                        "(grace_from_params' 'min_entries'; default: the library's)")
    p.add_argument("--adam-freeze-step", type=int, default=0,
                   help="with --optimizer adamw and this library's algorithm: the first N steps "
                        "dense, then AdamW's second moment frozen so that its update is linear "
                        "in the sparse gradient (grace_from_params' 'adam_freeze_step'; "
                        "not with --fsdp)")
    p.add_argument("--exchange", default="gradient", choices=("gradient", "update"),
                   help="what this library's DistributedOptimizer synchronises: the gradient, or "
                        "each rank's own optimizer step (grace_from_params' 'exchange'; update: "
                        "not with --ddp-hook, --fsdp or a baseline)")
    p.add_argument("--deepreduce", default=None, choices=("value", "index", "both"))
    p.add_argument("--index", default="bloom")
    p.add_argument("--value", default="polyfit")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the model trains: cuda (rank r on GPU r mod the GPUs here), cpu, "
                        "or auto (cuda when a GPU is visible)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=None,
                   help="use only N training samples, evenly spaced over the set")
    p.add_argument("--test-samples", type=int, default=None,
                   help="evaluate on N test samples, evenly spaced over the set")
    p.add_argument("--max-steps", type=int, default=None, help="stop each epoch after N steps")
    p.add_argument("--log", default="csv", help=f"comma-separated of {', '.join(LOGS)} (csv/jsonl always)")
    p.add_argument("--out", default="runs/train")
    p.add_argument("--resume", nargs="?", const="always", default="never", choices=RESUME,
                   help="always (the bare flag): continue from the newest checkpoint every rank "
                        "holds in OUT (ckpt-rank{r}.pt or the previous one, kept beside it), "
                        "refusing when there is none; auto: the same when there is one, a fresh "
                        "start otherwise (what a launcher's restart needs); never (default)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps within an epoch (0: at each epoch's end only)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a silent peer is an error")
    p.add_argument("--bandwidth", default=None,
                   help="run the --nworkers workers on an emulated network whose links are "
                        "shaped to this rate, e.g. 100mbit, 1gbit (root only)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps as well as after each epoch (0: epochs only)")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="log the training time at which test accuracy first reaches this")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop at the first evaluation after this many seconds of training")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop at the first evaluation that reaches --target-accuracy")
    if known.config:
        p.set_defaults(**load_config(known.config, p))
    args = p.parse_args(argv)
    from experiments.datasets import DATASET_TASKS
    from experiments.models import MODEL_TASKS
    task = MODEL_TASKS[args.dnn]
    if task != DATASET_TASKS[args.dataset]:
        fits = sorted(d for d, t in DATASET_TASKS.items() if t == task)
        p.error(f"--dnn {args.dnn} reads {task} data; data sets for it: {', '.join(fits)}")
    args.device = resolve_device(args.device, p)
    unknown = set(filter(None, args.log.split(","))) - set(LOGS)
    if unknown:
        p.error(f"unknown --log {sorted(unknown)}; valid choices: {', '.join(LOGS)}")
    if args.nworkers < 1 or args.batch_size < 1 or args.max_epochs < 0 or args.eval_every < 0 \
            or (args.density_warmup or 0) < 0 or args.checkpoint_every < 0:
        p.error("--nworkers and --batch-size must be >= 1, --max-epochs, --density-warmup, "
                "--eval-every and --checkpoint-every >= 0")
    if args.stop_at_target and args.target_accuracy is None:
        p.error("--stop-at-target needs --target-accuracy")
    if not 0 < args.density_warmup_start <= 1:
        p.error(f"--density-warmup-start must be in (0, 1], got {args.density_warmup_start}")
    if args.grace_config is not None:
        _from_grace_config(args)
    recipe.resolve(args, p)
    if args.density_warmup and not (args.compression and args.compressor in DENSITY_COMPRESSORS):
        p.error(f"--density-warmup needs --compression with one of {', '.join(DENSITY_COMPRESSORS)}")
    if args.density_warmup is None:
        sparse = args.compression and args.compressor in SPARSE_ALLREDUCES and args.compressor != "dense"
        args.density_warmup = DEFAULT_WARMUP_EPOCHS if sparse else 0.0
    if args.powersgd_rank < 1 or args.powersgd_start_iter < 2:
        p.error("--powersgd-rank must be >= 1 and --powersgd-start-iter >= 2 (torch's hook "
                "needs one plain step before it starts its error feedback)")
    if args.diloco_period < 1:
        p.error(f"--diloco-period must be >= 1, got {args.diloco_period}")
    if args.postlocal_period < 2 or args.postlocal_start_iter < 0:
        p.error("--postlocal-period must be >= 2 (1 is plain DDP) and --postlocal-start-iter "
                ">= 0")
    if args.bandwidth is not None:
        from benchmarks.netem import rate_bits_per_s
        try:
            rate_bits_per_s(args.bandwidth)
        except ValueError as exc:
            p.error(f"--bandwidth: {exc}")
    baseline = args.compression and args.compressor in BASELINES
    if args.adam_freeze_step and (args.optimizer != "adamw" or baseline or args.fsdp
                                  or args.adam_freeze_step < 0):
        p.error("--adam-freeze-step N (N >= 1) freezes AdamW's second moment in this library's "
                "DistributedOptimizer or DDP hook: it needs --optimizer adamw, and neither a "
                "baseline nor --fsdp")
    if args.exchange == "update" and (not args.compression or baseline or args.fsdp
                                      or args.ddp_hook or args.momentum_correction
                                      or args.adam_freeze_step):
        p.error("--exchange update synchronises each rank's optimizer step in this library's "
                "DistributedOptimizer: it needs --compression with this library's algorithm, "
                "and none of a baseline, --fsdp, --ddp-hook, --momentum-correction, "
                "--adam-freeze-step")
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    if args.bucket_cap_mb is not None and baseline and args.compressor == "torch_powersgd":
        p.error("torch_powersgd runs with one bucket: PyTorch's PowerSGD hook fails on gloo with "
                "several (\"Received data size doesn't match expected size\")")
    if args.no_overlap and baseline:
        p.error(f"--no-overlap belongs to this library's paths; {args.compressor} is DDP's own")
    if args.ddp_hook and baseline:
        p.error(f"--ddp-hook runs this library's algorithms through DDP; {args.compressor} is "
                "DDP already")
    if args.fsdp is not None:
        why = None
        if baseline or args.ddp_hook:
            why = "its sharded modes run this library's algorithms, not DDP"
        elif args.resume != "never" or args.checkpoint_every:
            why = "it keeps no checkpoints (--resume, --checkpoint-every)"
        elif args.fsdp == "hybrid" and (args.fsdp_nodes < 2 or args.nworkers % args.fsdp_nodes):
            why = (f"hybrid needs --fsdp-nodes >= 2 dividing --nworkers, got "
                   f"{args.fsdp_nodes} and {args.nworkers}")
        elif args.fsdp == "flat" and not (args.compression and args.compressor == "spardl"):
            why = "flat makes SparDL's reduce-scatter FSDP's: it needs --compression --compressor spardl"
        elif args.bucket_cap_mb is not None or args.no_overlap or args.deepreduce:
            why = "FSDP's units are its buckets: no --bucket-cap-mb, --no-overlap or --deepreduce"
        if why:
            p.error(f"--fsdp {args.fsdp}: {why}")
    if baseline:
        if args.resume != "never":
            p.error(f"--resume: {args.compressor}'s hook state is not checkpointed; resume works "
                    "with this library's algorithms")
        if args.momentum_correction or args.local_clip_norm is not None or args.deepreduce \
                or args.wire is not None or args.min_entries is not None:
            p.error(f"{args.compressor} is torch's own DDP path: --momentum-correction, "
                    "--local-clip-norm, --deepreduce, --wire and --min-entries belong to this "
                    "library's algorithms")
    else:
        from spardl_grace.registry import resolve_params
        try:
            resolve_params(grace_params(args))
        except ValueError as exc:
            p.error(str(exc))
    return args


def new_run_id(transport) -> str:
    """A fresh id for this run, drawn on rank 0 and the same on every rank; checkpoints carry it
    so that a resume never mixes the checkpoints of two runs."""
    drawn = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    return bytes(transport.broadcast(drawn, 0, "trainer.run_id").tolist()).hex()


def epoch_list(text: str) -> tuple[float, ...]:
    """'81,122' -> (81.0, 122.0); argparse reports a bad value as an error."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs, got {text!r}") from None


def grace_config(text: str) -> dict[str, Any]:
    """GRACE-benchmarks' --grace_config: a Python dict literal of GRACE params, single quotes
    and all, e.g. "{'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather'}"."""
    try:
        config = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        config = None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(
            f"expected a dict of GRACE params such as \"{{'compressor': 'topk', 'memory': "
            f"'residual', 'communicator': 'allgather', 'compress_ratio': 0.01}}\", got {text!r}")
    return config


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
def train_device(device: str, rank: int) -> torch.device:
    """This rank's device: GPU (local rank mod the GPUs here) under --device cuda."""
    if device != "cuda":
        return torch.device("cpu")
    index = launch.local_rank(default=rank) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    train_device(args.device, rank)
    launch.start_torch_distributed(launch.torch_backend(args.device, world), args.timeout,
                                   f"tcp://127.0.0.1:{port}", rank, world)
    from spardl_grace.transport.torch_dist import TorchDistTransport, destroy_and_exit
    train(args, TorchDistTransport(timeout=args.timeout))
    destroy_and_exit()


def _exit_through_python_on_sigterm() -> None:
    """For the process that started the workers itself: terminated, it exits through Python,
    so that its with-blocks remove the emulated network's namespaces and multiprocessing ends
    the spawned workers. Never in a worker: its main thread may sit in a backend's wait, where
    a Python handler runs only once the wait ends, and a launcher's SIGTERM must stop it now."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def launch_on_emulated_network(args: argparse.Namespace) -> None:
    """--nworkers processes, each in its own network namespace behind a link shaped to
    --bandwidth, joining over env:// (rank 0's address); rank 0's output is shown."""
    from benchmarks.netem import EmulatedNetwork, available, run_all
    why = available()
    if why:
        raise SystemExit(f"--bandwidth {args.bandwidth} emulates the network with namespaces, "
                         f"which is not possible here: {why}. Run without --bandwidth (loopback) "
                         "or as root with iproute2 installed")
    out = Path(args.out)
    config = out / "worker-config.json"
    options = {k: v for k, v in vars(args).items() if k not in ("config", "bandwidth")}
    config.write_text(json.dumps(options))
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    worker = [sys.executable, "-m", "experiments.main_trainer", "--config", str(config.resolve())]
    port = launch.free_port()
    _exit_through_python_on_sigterm()
    with EmulatedNetwork(args.nworkers, args.bandwidth) as net:
        run_all([net.command(r, worker) for r in range(args.nworkers)],
                [net.rank_env(r, port, env) for r in range(args.nworkers)], root, stream=0)


def start(args: argparse.Namespace) -> None:
    """Join the launcher's ranks, or launch --nworkers local ones."""
    kind = launch.detect_launcher()
    if args.bandwidth is not None:
        if kind != "none" or args.nworkers < 2:
            raise SystemExit("--bandwidth launches --nworkers (>= 2) workers itself on an emulated "
                             f"network; started by {kind} with --nworkers {args.nworkers}, shape "
                             "your launcher's network instead")
        launch_on_emulated_network(args)
        return
    if kind == "none" and args.nworkers == 1 and args.compression and args.compressor in BASELINES:
        raise SystemExit(f"{args.compressor} is DistributedDataParallel: use --nworkers >= 2 or "
                         "a launcher (torchrun)")
    if kind == "none" and args.nworkers > 1:
        import torch.multiprocessing as mp
        _exit_through_python_on_sigterm()
        mp.spawn(_spawned, args=(args.nworkers, launch.free_port(), args), nprocs=args.nworkers)
        return
    if kind == "none":
        from spardl_grace.transport import run_local
        run_local(1, lambda t: train(args, t))
        return
    backend = "gloo"
    if kind == "torchrun":
        train_device(args.device, int(os.environ["RANK"]))
        world = int(os.environ["WORLD_SIZE"])
        backend = launch.torch_backend(args.device, launch.local_world_size(world))
    train(args, launch.join(args.timeout, kind, backend))
    if kind == "torchrun":
        from spardl_grace.transport.torch_dist import destroy_and_exit
        destroy_and_exit()


# --------------------------------------------------------------------------- training
class Logger:
    """JSONL of every record and a CSV of epoch summaries on rank 0; W&B and TensorBoard when
    asked for (W&B offline unless WANDB_API_KEY is set)."""

    def __init__(self, args: argparse.Namespace, rank: int, config: dict[str, Any],
                 append: bool = False):
        """`append`: continue the logs of a resumed run instead of starting them anew."""
        self.active = rank == 0
        self.out = Path(args.out)
        self.wandb = self.tensorboard = None
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
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
    """(mean loss, accuracy) over a test set, on the model's device; per token for a language
    model."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(images[i:i + 500].to(device)) for i in range(0, len(images), 500)])
    model.train()
    logits, labels = flat_outputs(logits, labels.to(device))
    return (torch.nn.functional.cross_entropy(logits, labels).item(),
            (logits.argmax(1) == labels).float().mean().item())


def residual_norm(grace) -> float:
    """L2 norm of every residual this rank's communicator holds (what error feedback still
    owes)."""
    residuals = getattr(grace.memory, "residuals", {})
    return float(torch.sqrt(sum((r.float() ** 2).sum() for r in residuals.values()))) \
        if residuals else 0.0


class GraceSync:
    """This library's path: DistributedOptimizer with a grace communicator, bytes counted by
    a CountingTransport (the trainer's sync interface, as experiments.baselines.TorchDDPSync)."""

    def __init__(self, model: torch.nn.Module, optimizer, counting):
        self.model = model
        self.optimizer = optimizer
        self.counting = counting

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def step(self) -> None:
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    @property
    def bytes_sent(self) -> int:
        return self.counting.bytes_sent

    @property
    def last_stats(self) -> dict[str, float]:
        return self.optimizer.last_stats

    def set_density(self, density: float) -> None:
        self.grace.set_density(density)

    def compression_state(self) -> dict[str, Any]:
        return self.optimizer.compression_state_dict()

    def load_compression_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_compression_state_dict(state)

    def residual_norm(self) -> float:
        return residual_norm(self.grace)

    @property
    def grace(self):
        return self.optimizer.grace


class GraceHookSync(GraceSync):
    """This library's algorithm through DistributedDataParallel and spardl_grace.comm_hook:
    DDP synchronises each bucket during backward, as with its own all-reduce."""

    def __init__(self, model: torch.nn.Module, optimizer, counting, grc, bucket_cap_mb: float,
                 overlap: bool = True):
        import spardl_grace
        if not torch.distributed.is_initialized():
            raise RuntimeError("--ddp-hook is DistributedDataParallel: it needs torch.distributed "
                               "(self-launched workers, torchrun, or mpirun with env://), not "
                               "threads or Horovod")
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        super().__init__(ddp, optimizer, counting)
        self.hook = spardl_grace.CommHookState(grc, ddp, overlap=overlap)
        ddp.register_comm_hook(self.hook, spardl_grace.comm_hook)

    def synchronize(self) -> None:
        """Nothing to do: DDP has synchronised during backward."""

    def step(self) -> None:
        self.optimizer.step()

    @property
    def grace(self):
        return self.hook.sync.grace

    @property
    def last_stats(self) -> dict[str, float]:
        return self.hook.last_stats

    def compression_state(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_compression_state(self, state: dict[str, Any]) -> None:
        self.hook.load_state_dict(state)


def build_sync(args: argparse.Namespace, model: torch.nn.Module, transport,
               steps_per_epoch: int | None = None):
    """(sync, grace params or None): the algorithm the arguments ask for, with the optimiser
    of --optimizer's recipe (experiments.recipe), and the library's density warm-up for a
    sparse all-reduce when `steps_per_epoch` is known."""
    import spardl_grace
    optimizer = recipe.make_optimizer(args, model)
    if args.compression and args.compressor == "diloco":
        from experiments.diloco import DiLoCoSync
        return DiLoCoSync(model, optimizer, args.diloco_period), None
    if args.compression and args.compressor in BASELINES:
        from experiments.baselines import TorchDDPSync
        postlocal = args.compressor == "torch_postlocal"
        return TorchDDPSync(model, optimizer, args.compressor, args.powersgd_rank,
                            args.postlocal_start_iter if postlocal else args.powersgd_start_iter,
                            args.bucket_cap_mb, args.postlocal_period), None
    params = grace_params(args, steps_per_epoch)
    if args.fsdp is not None:
        if not torch.distributed.is_initialized():
            raise SystemExit("--fsdp needs torch.distributed: workers the CLI starts itself "
                             "(--nworkers >= 2) or torchrun, not Horovod or one thread")
        from experiments.sharded import ShardedSync
        return ShardedSync(model, args.fsdp, args.fsdp_nodes, params,
                           lambda sharded: recipe.make_optimizer(args, sharded)), params
    counting = spardl_grace.transport.CountingTransport(transport)
    grc = deepreduce_from_params(params, transport=counting)
    if args.ddp_hook:
        from experiments.baselines import ONE_BUCKET_MB
        return GraceHookSync(model, optimizer, counting, grc, args.bucket_cap_mb or ONE_BUCKET_MB,
                             not args.no_overlap), params
    distributed = spardl_grace.DistributedOptimizer(
        optimizer, grc, named_parameters=model.named_parameters(),
        bucket_cap_mb=args.bucket_cap_mb, overlap=not args.no_overlap)
    return GraceSync(model, distributed, counting), params


class Clock:
    """Training seconds: running while training, stopped during evaluation."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> float:
        if self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None
        return self.total


def spread_subset(inputs: torch.Tensor, labels: torch.Tensor, count: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` samples evenly spaced over the whole set (all of them when count is None or
    larger): a data set stored by class (the tweets are) keeps its class mixture, where its
    first `count` samples would all be of one class."""
    if count is None or count >= len(labels):
        return inputs, labels
    chosen = torch.arange(count) * len(labels) // count
    return inputs[chosen], labels[chosen]


def train(args: argparse.Namespace, transport) -> dict[str, Any]:
    """Train on this rank; returns the final summary (identical metrics on every rank)."""
    import spardl_grace
    from benchmarks.netem import interface_tx_bytes
    from experiments.datasets import DATASETS, load_dataset
    from spardl_grace.transport.counting import ring_allreduce_bytes
    from experiments.models import build_model

    rank, world = transport.rank, transport.size
    tokenizer = "wordpiece" if args.dnn == "bert" else "words"
    images, labels = load_dataset(args.dataset, "train", args.data_dir, tokenizer)
    images, labels = spread_subset(images, labels, args.train_samples)
    test_images = test_labels = None
    if rank == 0:  # the replicas are identical: rank 0 evaluates for all
        test_images, test_labels = load_dataset(args.dataset, "test", args.data_dir, tokenizer)
        test_images, test_labels = spread_subset(test_images, test_labels, args.test_samples)
    _, channels, classes = DATASETS[args.dataset]

    device = train_device(args.device, rank)
    with _INIT_LOCK:  # local workers are threads sharing torch's global generator
        torch.manual_seed(args.seed)
        model = build_model(args.dnn, channels, classes).to(device)
    spardl_grace.broadcast_parameters(model.state_dict(), 0, transport)
    shard = torch.arange(rank, len(images), world)
    steps_per_epoch = len(shard) // args.batch_size
    if args.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    sync, params = build_sync(args, model, transport, steps_per_epoch)
    # GRACE's compressors warm up through set_density, on the library's schedule.
    warmup = (round(args.density_warmup * steps_per_epoch), args.density_warmup_start, args.density)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        sync.optimizer, lambda s: recipe.lr_factor(s, steps_per_epoch, args, world))
    n_params = sum(p.numel() for p in model.parameters())
    dense_bytes = ring_allreduce_bytes(4 * n_params, world)  # fp32 gradients, dense

    out = Path(args.out)
    checkpoint = out / f"ckpt-rank{rank}.pt"
    first_step = 0
    resumed = None
    if args.resume != "never":
        try:
            resumed = load_agreed_checkpoint(transport, checkpoint)
        except ValueError as exc:  # raised on every rank alike
            raise SystemExit(f"--resume {args.resume}: {exc}") from None
        if resumed is None and args.resume == "always":
            raise SystemExit(f"--resume: no rank holds a checkpoint in {out} "
                             "(--resume auto starts fresh then)")
    if resumed is not None:
        saved = resumed[0]
        model.load_state_dict(saved["model"])
        sync.optimizer.load_state_dict(saved["optimizer"])
        sync.load_compression_state(saved["compression"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda_rng"], device)
        first_step, run_id = saved["step"], saved["run_id"]
    else:
        run_id = new_run_id(transport)
    first_epoch, first_in_epoch = divmod(first_step, max(steps_per_epoch, 1))

    def save(step: int) -> None:
        """This rank's whole state after `step` steps (crash-safe; the previous one is kept)."""
        state = None if args.fsdp else sync.compression_state()
        if state is not None:
            save_checkpoint({"model": model.state_dict(), "optimizer": sync.optimizer.state_dict(),
                             "compression": state, "scheduler": scheduler.state_dict(),
                             "rng": torch.get_rng_state(), "step": step, "run_id": run_id,
                             "summary": summary,
                             **({"cuda_rng": torch.cuda.get_rng_state(device)}
                                if device.type == "cuda" else {})},
                            checkpoint)
    logger = Logger(args, rank, {**vars(args), "grace": params, "workers": world},
                    append=resumed is not None)
    # Each start of the run, fresh or resumed, is on record: a launcher's restarts show.
    logger.log({"kind": "start", "step": first_step, "resumed": resumed is not None}, first_step)
    progress = _progress(rank, args.max_epochs * steps_per_epoch)
    clock = Clock()
    run = {"time_to_target_s": None, "steps_to_target": None, "steps": 0, "stopped": False,
           "last_eval": None,
           "bytes_at_start": sync.bytes_sent, "wire_at_start": interface_tx_bytes()}
    window = {"step": first_epoch * steps_per_epoch, "bytes": sync.bytes_sent,
              "wire": interface_tx_bytes()}

    def evaluation(step: int, epoch: float) -> dict[str, Any]:
        """Evaluate on rank 0 with the clock stopped; every rank gets the same figures."""
        figures = torch.zeros(4, dtype=torch.float64)
        scored = sync.evaluation_model(rank) if args.fsdp else model  # every rank gathers
        if rank == 0:
            train_s = clock.stop()
            loss, acc = evaluate(scored, test_images, test_labels)
            stop = (args.time_budget is not None and train_s >= args.time_budget) or \
                (args.stop_at_target and acc >= args.target_accuracy)
            figures = torch.tensor([loss, acc, float(stop), train_s], dtype=torch.float64)
        else:
            clock.stop()
        # Rank 0's clock is the run's: every rank logs and stops on the same figures.
        figures = transport.broadcast(figures, 0, f"trainer.eval.{step}")
        test_loss, test_acc, stop, train_s = figures.tolist()
        if args.target_accuracy is not None and run["time_to_target_s"] is None \
                and test_acc >= args.target_accuracy:
            run["time_to_target_s"], run["steps_to_target"] = train_s, step
        steps = max(step - window["step"], 1)
        wire = interface_tx_bytes()
        record = {"kind": "eval", "step": step, "epoch": epoch, "train_s": train_s,
                  "test_loss": test_loss, "test_accuracy": test_acc,
                  "eval/loss": test_loss, "eval/top-1": test_acc,
                  "bytes_sent_per_step": (sync.bytes_sent - window["bytes"]) / steps,
                  "time_to_target_s": run["time_to_target_s"]}
        if wire is not None and window["wire"] is not None:
            record["wire_bytes_per_step"] = (wire - window["wire"]) / steps
        window.update(step=step, bytes=sync.bytes_sent, wire=wire)
        logger.log(record, step)
        run["stopped"], run["last_eval"] = bool(stop), record
        clock.start()
        return record

    # The last finished epoch's summary: a run resumed after its last step (killed while it
    # was ending) has no epoch left to train and reports the one its checkpoint holds.
    summary: dict[str, Any] = dict(resumed[0].get("summary", {})) if resumed is not None else {}
    for epoch in range(first_epoch, args.max_epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch * 100 + rank))]
        sync_s, sent_before, clock_before = 0.0, sync.bytes_sent, clock.total
        losses, correct, seen, samples, done = [], 0, 0, 0, 0
        split = dict.fromkeys(TIME_SPLIT, 0.0)
        clock.start()
        start = first_in_epoch if epoch == first_epoch else 0
        for i in range(start, steps_per_epoch):
            step = epoch * steps_per_epoch + i
            density = None
            if args.density_warmup:
                density = warmup_density(step, *warmup)
                if not library_warms_up(args):
                    sync.set_density(density)
            batch = order[i * args.batch_size:(i + 1) * args.batch_size]
            x, y = images[batch].to(device), labels[batch].to(device)
            step_start = time.perf_counter()
            sync.optimizer.zero_grad()
            logits, y = flat_outputs(sync.model(x), y)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            t0 = time.perf_counter()
            sync.synchronize()
            sync_s += time.perf_counter() - t0
            recipe.clip(sync.model, args.clip_norm)
            sync.step()
            scheduler.step()
            step_s = time.perf_counter() - step_start
            losses.append(loss.item())
            correct += int((logits.argmax(1) == y).sum())
            seen += y.numel()  # tokens for a language model
            samples += len(x)
            done += 1
            run["steps"] += 1
            times = {k: float(sync.last_stats.get(k, 0.0)) for k in TIME_SPLIT}
            for k, v in times.items():
                split[k] += v
            record = {"kind": "step", "step": step, "epoch": epoch, "loss": loss.item(),
                      "lr": scheduler.get_last_lr()[0], "step_s": step_s, **times}
            if density is not None:
                record["density"] = density
            logger.log(record, step)
            progress.update(1)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 \
                    and i + 1 < steps_per_epoch:
                save(step + 1)
            if args.eval_every and (step + 1) % args.eval_every == 0 and i + 1 < steps_per_epoch:
                evaluation(step + 1, epoch + (i + 1) / steps_per_epoch)
                if run["stopped"]:
                    break
        # Stopped by the budget: the evaluation that said so is this epoch's last.
        last = run["last_eval"] if run["stopped"] else \
            evaluation(epoch * steps_per_epoch + start + done,
                       epoch + (start + done) / max(steps_per_epoch, 1))
        clock.stop()
        elapsed = clock.total - clock_before
        bytes_per_step = (sync.bytes_sent - sent_before) / max(done, 1)
        summary = {"kind": "epoch", "step": epoch * steps_per_epoch + done, "epoch": epoch,
                   "train_loss": sum(losses) / max(len(losses), 1),
                   "train_accuracy": correct / max(seen, 1), "test_loss": last["test_loss"],
                   "test_accuracy": last["test_accuracy"],
                   "samples_per_s": samples * world / max(elapsed, 1e-9),
                   "throughput": samples * world / max(elapsed, 1e-9),
                   "bytes_sent_per_step": bytes_per_step,
                   "compression_ratio": bytes_per_step / dense_bytes if dense_bytes else 1.0,
                   "train_s": clock.total, "sync_s": sync_s, "compute_s": elapsed - sync_s,
                   **split, "residual_norm": sync.residual_norm(), "lr": scheduler.get_last_lr()[0],
                   "time_to_target_s": run["time_to_target_s"]}
        logger.log(summary, summary["step"])
        save(epoch * steps_per_epoch + start + done)
        if run["stopped"]:
            break
    progress.close()
    steps = max(run["steps"], 1)
    summary = {**summary, "steps_run": run["steps"], "time_to_target_s": run["time_to_target_s"],
               "steps_to_target": run["steps_to_target"], "stopped_by_budget": run["stopped"],
               "bytes_sent_per_step_run": (sync.bytes_sent - run["bytes_at_start"]) / steps,
               "dense_bytes_per_step": dense_bytes, "parameters": n_params}
    wire = interface_tx_bytes()
    if wire is not None and run["wire_at_start"] is not None:
        summary["wire_bytes_per_step_run"] = (wire - run["wire_at_start"]) / steps
    logger.log({**summary, "kind": "run"}, summary["step"])
    logger.close()
    digest = (sync.local_parameters() if args.fsdp else
              torch.cat([p.detach().reshape(-1) for p in model.parameters()])).cpu()
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
