"""The SparDL training CLI: train a model on a data set with any algorithm of the project.

    python -m experiments.main_trainer --dnn resnet20 --dataset fashion-mnist --nworkers 4 \
        --compression --compressor spardl --density 0.01 --max-epochs 5
    torchrun --nproc-per-node 4 -m experiments.main_trainer --dnn resnet20 ...
    mpirun -np 4 python -m experiments.main_trainer ...
    horovodrun -np 4 -H localhost:4 --gloo python -m experiments.main_trainer ...
    python -m experiments.main_trainer --config run.yaml          # the same keys, in a file

Started as a plain command it launches --nworkers local worker processes itself (gloo); with
--bandwidth RATE each of them runs in its own network namespace behind a link shaped to RATE
(testbed.netem, root only). Under a launcher it joins that launcher's ranks. --device cuda
(the default where a GPU is visible) trains on rank r's GPU: NCCL where every rank has its own,
gloo where ranks share one. Without
--compression every algorithm runs dense. --compressor takes a sparse all-reduce (spardl,
topka, topkdsa, gtopk, oktopk, gaussiank, dense), auto (the library chooses among dense,
16-bit dense and SparDL densities from the measured link: spardl_grace.communicators.auto),
a GRACE compressor (topk, randomk, qsgd, ...),
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
import json
from pathlib import Path
from typing import Any

from experiments import recipe
from experiments.sharded import MODES as FSDP_MODES
from spardl_grace import registry
from spardl_grace.registry import WIRES
from testbed.configs import DEVICES, allreduce_params, resolve_device

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
BASELINES = ("torch_ddp", "torch_fp16", "torch_powersgd", "torch_postlocal",  # testbed.baselines
             "diloco")  # experiments.diloco
COMPRESSORS = (*SPARSE_ALLREDUCES, "auto", *GRACE_PAIRS, *BASELINES)
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
RESUME = ("never", "auto", "always")


def _from_grace_config(args: argparse.Namespace) -> None:
    """Set --compression, --compressor and --density from --grace-config, so that the rest of
    the CLI (density warm-up, refusals, logs) sees the algorithm the config names."""
    config = args.grace_config
    communicator = config.get("communicator", "allreduce")
    args.compression = True
    args.compressor = communicator if communicator in (*SPARSE_ALLREDUCES, "auto") \
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
    if args.compression and args.compressor == "auto":
        return auto_params(args)
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
    params.update(dgc_options(args))
    if args.deepreduce:
        if params["communicator"] in ("dense", "allreduce", "broadcast"):
            sender = args.compressor if args.compression else "dense (no --compression)"
            raise SystemExit(f"--deepreduce codes sparse messages; {sender} sends none")
        params.update(deepreduce=args.deepreduce, index=args.index, value=args.value)
    if args.wire is not None:
        params["wire"] = args.wire
    if args.min_entries is not None:
        params["min_entries"] = args.min_entries
    if args.adam_freeze_step:
        params["adam_freeze_step"] = args.adam_freeze_step
    if args.exchange != "gradient":
        params["exchange"] = args.exchange
    params.update(outer_options(args))
    return {**params, **library_warmup(args, steps_per_epoch)}

def outer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The GRACE keys of --exchange-period, --outer-lr and --outer-momentum that differ from
    the library's defaults (an exchange every step, the average as it is)."""
    return {k: getattr(args, k) for k in registry.OUTER_KEYS
            if getattr(args, k) != registry.DEFAULTS[k]}

def auto_params(args: argparse.Namespace) -> dict[str, Any]:
    """GRACE params of 'communicator': 'auto' (it chooses the density itself: --density is not
    passed on), with SparDL's floor where --min-entries sets one and DGC's techniques where
    --momentum-correction, --no-momentum-masking and --local-clip-norm ask for them."""
    params = {"compressor": "none", "memory": "global_residual", "communicator": "auto",
              "seed": args.seed}
    if args.min_entries is not None:
        params["min_entries"] = args.min_entries
    return {**params, **dgc_options(args)}

def dgc_options(args: argparse.Namespace) -> dict[str, Any]:
    """The GRACE keys of DGC's techniques that --momentum-correction, --no-momentum-masking and
    --local-clip-norm ask for (none when they are left alone)."""
    params: dict[str, Any] = {}
    if args.momentum_correction:
        params["momentum_correction"] = args.momentum_correction
    if not args.momentum_masking:
        params["momentum_masking"] = False
    if args.local_clip_norm is not None:
        params["local_clip_norm"] = args.local_clip_norm
    return params

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
    """The training CLI's arguments (a --config file's keys as defaults, the command line
    winning), checked: a bad value or combination exits with a usage error naming the valid
    choices."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (_data_and_recipe, _compression, _paths, _run):
        add(p)
    if known.config:
        p.set_defaults(**load_config(known.config, p))
    args = p.parse_args(argv)
    _check_run(args, p)
    _check_compression(args, p)
    _check_paths(args, p)
    return args


def _data_and_recipe(p: argparse.ArgumentParser) -> None:
    """The model, the data set and the optimizer's recipe."""
    from testbed.datasets import DATASETS
    from testbed.models import MODELS

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


def _compression(p: argparse.ArgumentParser) -> None:
    """The algorithm and its settings: density, warm-up, DGC's techniques, the baselines'."""
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
                   help="DGC's momentum correction m for a sparse all-reduce or auto (SGD then "
                        "runs without momentum)")
    p.add_argument("--no-momentum-masking", dest="momentum_masking", action="store_false",
                   help="with --momentum-correction: keep the velocity where the result was "
                        "applied (no DGC momentum factor masking)")
    p.add_argument("--local-clip-norm", type=float, default=None,
                   help="DGC's local gradient clipping: each worker's gradient to this L2 norm "
                        "/ sqrt(P) (sparse all-reduces, auto)")
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
    p.add_argument("--diloco-outer-lr", type=float, default=0.7,
                   help="diloco: the outer Nesterov SGD's learning rate (the paper's 0.7)")
    p.add_argument("--diloco-outer-momentum", type=float, default=0.9,
                   help="diloco: the outer SGD's Nesterov momentum (the paper's 0.9; 0: none)")
    p.add_argument("--diloco-outer-density", type=float, default=None,
                   help="diloco: average the outer gradient with SparDL at this density, with "
                        "error feedback (default: a dense all-reduce)")


def _paths(p: argparse.ArgumentParser) -> None:
    """Which path synchronises: buckets, overlap, the DDP hook, FSDP2, the wire."""
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
    p.add_argument("--exchange-period", type=int, default=registry.DEFAULTS["exchange_period"],
                   help="with --exchange update: each rank's optimizer steps this many times on "
                        "its own gradients between exchanges of their moves (DiLoCo's H; "
                        "grace_from_params' 'exchange_period')")
    p.add_argument("--outer-lr", type=float, default=registry.DEFAULTS["outer_lr"],
                   help="with --exchange update: the outer step's learning rate on the averaged "
                        "move (grace_from_params' 'outer_lr'; default %(default)s, plain "
                        "averaging; DiLoCo uses 0.7)")
    p.add_argument("--outer-momentum", type=float, default=registry.DEFAULTS["outer_momentum"],
                   help="with --exchange update: the outer step's Nesterov momentum "
                        "(grace_from_params' 'outer_momentum'; default %(default)s; DiLoCo "
                        "uses 0.9)")
    p.add_argument("--deepreduce", default=None, choices=("value", "index", "both"))
    p.add_argument("--index", default="bloom")
    p.add_argument("--value", default="polyfit")


def _run(p: argparse.ArgumentParser) -> None:
    """Where and how long it runs, what it records, and how it resumes."""
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
    p.add_argument("--bandwidth-change", default=None, metavar="STEP:RATE",
                   help="with --bandwidth: every rank reshapes what it sends to RATE at the "
                        "start of step STEP (a link that changes mid-run)")
    p.add_argument("--load-burst", default=None, metavar="STEP:STEPS",
                   help="rank 0 starts a busy process per core at the start of step STEP and "
                        "stops them STEPS steps later (other work on the machine: what "
                        "'communicator': 'auto' measures through and must recover from)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps as well as after each epoch (0: epochs only)")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="log the training time at which test accuracy first reaches this")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop at the first evaluation after this many seconds of training")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop at the first evaluation that reaches --target-accuracy")


def _check_run(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The model fits the data set, the device is there, the counts are in range; the density
    warm-up's default for the algorithm."""
    from testbed.datasets import DATASET_TASKS
    from testbed.models import MODEL_TASKS
    task = MODEL_TASKS[args.dnn]
    if task != DATASET_TASKS[args.dataset]:
        fits = sorted(d for d, t in DATASET_TASKS.items() if t == task)
        p.error(f"--dnn {args.dnn} reads {task} data; data sets for it: {', '.join(fits)}")
    args.device = resolve_device(args.device, p)
    unknown = set(filter(None, args.log.split(","))) - set(LOGS)
    if unknown:
        p.error(f"unknown --log {sorted(unknown)}; valid choices: {', '.join(LOGS)}")
    if args.nworkers < 1 or args.batch_size < 1 or args.max_epochs < 1 or args.eval_every < 0 \
            or (args.density_warmup or 0) < 0 or args.checkpoint_every < 0:
        p.error("--nworkers, --batch-size and --max-epochs must be >= 1, --density-warmup, "
                "--eval-every and --checkpoint-every >= 0")
    if args.lr <= 0 or (args.train_samples is not None and args.train_samples < 1):
        p.error(f"--lr must be > 0 and --train-samples >= 1, got {args.lr} and "
                f"{args.train_samples}")
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
    if args.bandwidth is not None:
        from testbed.netem import rate_bits_per_s
        try:
            rate_bits_per_s(args.bandwidth)
        except ValueError as exc:
            p.error(f"--bandwidth: {exc}")
    if args.bandwidth_change is not None:
        args.bandwidth_change = _bandwidth_change(args, p)
    if args.load_burst is not None and not isinstance(args.load_burst, (list, tuple)):
        from testbed.load import load_burst
        try:
            args.load_burst = load_burst(str(args.load_burst))
        except ValueError as exc:
            p.error(f"--load-burst: {exc}")


def _bandwidth_change(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[int, str]:
    """--bandwidth-change STEP:RATE as (step, rate); a usage error when malformed or without
    --bandwidth (a launcher's own network cannot be reshaped from here)."""
    from testbed.netem import rate_change
    if isinstance(args.bandwidth_change, (list, tuple)):  # a worker's copy, already parsed
        return int(args.bandwidth_change[0]), str(args.bandwidth_change[1])
    try:
        change = rate_change(str(args.bandwidth_change))
    except ValueError as exc:
        p.error(f"--bandwidth-change STEP:RATE, e.g. 40:100mbit: {exc}")
    if args.bandwidth is None and args.config is None:
        p.error("--bandwidth-change reshapes the emulated network of --bandwidth: give both")
    return change


def _check_compression(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The compressors' own ranges, and the optimizer-aware options' preconditions."""
    if args.powersgd_rank < 1 or args.powersgd_start_iter < 2:
        p.error("--powersgd-rank must be >= 1 and --powersgd-start-iter >= 2 (torch's hook "
                "needs one plain step before it starts its error feedback)")
    if args.teams != 1 and not (args.compression and args.compressor == "spardl"):
        p.error(f"--teams sets SparDL's d: it needs --compression --compressor spardl, got "
                f"{args.compressor if args.compression else 'dense (no --compression)'}")
    if args.diloco_period < 1:
        p.error(f"--diloco-period must be >= 1, got {args.diloco_period}")
    if not args.diloco_outer_lr > 0 or not 0 <= args.diloco_outer_momentum < 1:
        p.error("--diloco-outer-lr must be > 0 and --diloco-outer-momentum in [0, 1), got "
                f"{args.diloco_outer_lr} and {args.diloco_outer_momentum}")
    if args.diloco_outer_density is not None and not 0 < args.diloco_outer_density <= 1:
        p.error(f"--diloco-outer-density must be in (0, 1], got {args.diloco_outer_density}")
    if args.postlocal_period < 2 or args.postlocal_start_iter < 0:
        p.error("--postlocal-period must be >= 2 (1 is plain DDP) and --postlocal-start-iter "
                ">= 0")
    baseline = is_baseline(args)
    if args.adam_freeze_step and (args.optimizer != "adamw" or baseline or args.fsdp
                                  or args.adam_freeze_step < 0):
        p.error("--adam-freeze-step N (N >= 1) freezes AdamW's second moment in this library's "
                "DistributedOptimizer or DDP hook: it needs --optimizer adamw, and neither a "
                "baseline nor --fsdp")
    if args.exchange == "update" and (not args.compression or baseline or args.fsdp
                                      or args.ddp_hook or args.momentum_correction):
        p.error("--exchange update synchronises each rank's optimizer step in this library's "
                "DistributedOptimizer: it needs --compression with this library's algorithm, "
                "and none of a baseline, --fsdp, --ddp-hook, --momentum-correction")
    outer = [f"--{k.replace('_', '-')}" for k in outer_options(args)]
    if outer and args.exchange != "update":
        p.error(f"{', '.join(outer)} shape the exchange of the ranks' optimizer steps: "
                "they need --exchange update")


def is_baseline(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for one of PyTorch's own paths (or DiLoCo): BASELINES."""
    return bool(args.compression and args.compressor in BASELINES)


def _check_paths(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The combinations each path refuses (baselines, the DDP hook, FSDP2), and the library's
    own check of the params the arguments make."""
    baseline = is_baseline(args)
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
        if args.momentum_correction or not args.momentum_masking \
                or args.local_clip_norm is not None or args.deepreduce \
                or args.wire is not None or args.min_entries is not None:
            p.error(f"{args.compressor} is torch's own DDP path: --momentum-correction, "
                    "--no-momentum-masking, --local-clip-norm, --deepreduce, --wire and "
                    "--min-entries belong to this library's algorithms")
    else:
        from spardl_grace.registry import resolve_params
        try:
            resolve_params(grace_params(args))
        except ValueError as exc:
            p.error(str(exc))


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
