"""The training CLI's optimiser recipes: which optimiser, its learning-rate schedule and
gradient clipping.

'sgd' is the CNN recipe of the SparDL paper's runs: SGD with momentum 0.9 and weight decay
1e-4, the learning rate warmed up linearly from lr/P over --warmup-epochs (Goyal et al.) and
cut by 10 at each --lr-decay epoch. 'adamw' is the transformer recipe of nanoGPT and
torchtitan: AdamW with betas (0.9, 0.95) and weight decay 0.1 on the matrices only (not on
norms and biases), the learning rate warmed up linearly from 0 over --warmup-epochs and then
cosine-decayed to a tenth of lr at the run's last step (--lr-schedule cosine, its default).
"""
from __future__ import annotations

import argparse
import math

import torch

from testbed.configs import OPTIMIZERS

SCHEDULES = ("step", "cosine")
SGD_MOMENTUM = 0.9
ADAMW_BETAS = (0.9, 0.95)
DEFAULT_WEIGHT_DECAY = {"sgd": 1e-4, "adamw": 0.1}
DEFAULT_SCHEDULE = {"sgd": "step", "adamw": "cosine"}
COSINE_FLOOR = 0.1  # nanoGPT's min_lr = lr / 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The recipe's options on the training CLI's parser."""
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS,
                   help="sgd: momentum 0.9 (the CNN recipe); adamw: betas (0.9, 0.95), decay on "
                        "the matrices only (the transformer recipe)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"default {DEFAULT_WEIGHT_DECAY['sgd']} for sgd, "
                        f"{DEFAULT_WEIGHT_DECAY['adamw']} for adamw")
    p.add_argument("--lr-schedule", default=None, choices=SCHEDULES,
                   help="step: warm-up from lr/P, x0.1 at each --lr-decay epoch (sgd's default); "
                        "cosine: warm-up from 0, then cosine to lr/10 at the last step "
                        "(adamw's default)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="clip the synchronised gradient to this global L2 norm before each step")


def resolve(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Fill the optimiser-dependent defaults; refuse what the recipe cannot do."""
    if args.weight_decay is None:
        args.weight_decay = DEFAULT_WEIGHT_DECAY[args.optimizer]
    if args.lr_schedule is None:
        args.lr_schedule = DEFAULT_SCHEDULE[args.optimizer]
    if args.weight_decay < 0 or (args.clip_norm is not None and not args.clip_norm > 0):
        p.error("--weight-decay must be >= 0 and --clip-norm > 0")
    if args.lr_schedule == "cosine" and args.lr_decay:
        p.error("--lr-decay belongs to --lr-schedule step; cosine decays by itself")
    if args.optimizer != "sgd" and args.momentum_correction:
        p.error(f"--momentum-correction is DGC's for SGD's momentum; --optimizer "
                f"{args.optimizer} keeps its own moments")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups: decay on tensors of two or more dimensions (matrices, embeddings,
    convolutions), none on norms' scales and biases, as nanoGPT and torchtitan do."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The recipe's optimiser over `model`'s parameters. Under momentum correction SGD runs
    without momentum and with weight decay scaled by 1/(1 - m), as DGC's recipe does (the
    library carries the momentum)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr,
                                 betas=ADAMW_BETAS)
    mc = args.momentum_correction or 0.0
    return torch.optim.SGD(model.parameters(), lr=args.lr,
                           momentum=0.0 if mc else SGD_MOMENTUM,
                           weight_decay=args.weight_decay / (1.0 - mc))


def lr_factor(step: int, steps_per_epoch: int, args: argparse.Namespace, world: int) -> float:
    """The learning rate at `step` as a fraction of --lr (see the module docstring)."""
    epoch = step / max(steps_per_epoch, 1)
    if args.lr_schedule == "cosine":
        warmup = args.warmup_epochs * steps_per_epoch
        if step < warmup:
            return (step + 1) / warmup
        total = max(args.max_epochs * steps_per_epoch - warmup, 1)
        progress = min((step - warmup) / total, 1.0)
        return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
    factor = 1.0
    if args.warmup_epochs > 0 and epoch < args.warmup_epochs:
        factor = 1.0 / world + (1.0 - 1.0 / world) * epoch / args.warmup_epochs
    for milestone in args.lr_decay:
        if epoch >= milestone:
            factor *= 0.1
    return factor


def clip(model: torch.nn.Module, max_norm: float | None) -> None:
    """Clip the gradients of `model` to `max_norm` (global L2) when it is set."""
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                       max_norm)
