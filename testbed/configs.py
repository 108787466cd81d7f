"""The vocabulary both drivers share: the training CLI's options for each named algorithm and
ablation config, the devices it computes on, and the GRACE params of the sparse all-reduces.
experiments (the training CLI, the ablations, the comparisons) and benchmarks (the step and
communication benchmarks) both read it here, so neither imports the other."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from spardl_grace.api import DEFAULT_MIN_ENTRIES
from spardl_grace.planner import DEFAULT_CANDIDATES

DEVICES = ("auto", "cpu", "cuda")
#: the training CLI's --optimizer choices (experiments.recipe builds them)
OPTIMIZERS = ("sgd", "adamw")


def resolve_device(device: str, parser: argparse.ArgumentParser) -> str:
    """One of DEVICES as the place to compute: 'auto' is 'cuda' where a GPU is visible, else
    'cpu'; 'cuda' without a visible GPU is a usage error (parser.error) naming --device cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; use --device cpu")
    return device


def allreduce_params(name: str, teams: int) -> dict[str, Any]:
    """GRACE params of a sparse all-reduce (top-k with global residuals), or of dense."""
    if name in ("dense", "none"):
        return {"compressor": "none", "memory": "none", "communicator": "dense"}
    params = {"compressor": "topk", "memory": "global_residual", "communicator": name}
    return {**params, "teams": teams} if name == "spardl" else params


# The sparse all-reduces run with the training CLI's default DGC density warm-up (chosen by the
# recorded ablation); a per-step benchmark of their steady state turns it off.
STEADY = ["--density-warmup", "0"]
ALGORITHMS: dict[str, list[str]] = {
    "ddp": ["--compression", "--compressor", "torch_ddp"],
    "fp16": ["--compression", "--compressor", "torch_fp16"],
    "powersgd1": ["--compression", "--compressor", "torch_powersgd", "--powersgd-rank", "1"],
    "powersgd4": ["--compression", "--compressor", "torch_powersgd", "--powersgd-rank", "4"],
    "dense": [],  # this library's dense DistributedOptimizer
    # the library's own choice among dense, 16-bit dense and SparDL densities
    "auto": ["--compression", "--compressor", "auto"],
    # auto measuring 4 dense steps instead of its default 10 (what the measuring costs)
    "auto_measure4": ["--grace-config", repr({"compressor": "none", "memory": "global_residual",
                                              "communicator": "auto", "auto_measure_steps": 4})],
    # each of auto's candidates alone, on auto's own path (2 dense steps, then that candidate
    # for good): the fixed choices auto is measured against
    **{f"fixed_{c}": ["--grace-config", repr({"communicator": "auto", "memory": "global_residual",
                                              "auto_candidates": [c], "auto_measure_steps": 2,
                                              "auto_replan_window": 0})]
       for c in DEFAULT_CANDIDATES},
    **{name: ["--compression", "--compressor", name]
       for name in ("spardl", "topka", "topkdsa", "gtopk", "oktopk")},
    "spardl_d2": ["--compression", "--compressor", "spardl", "--teams", "2"],
    "spardl_nowarmup": ["--compression", "--compressor", "spardl", *STEADY],
    # DGC's own warm-up (from density 0.25), which the training CLI's default (from 0.0625) replaced
    "spardl_dgcwarmup": ["--compression", "--compressor", "spardl", "--density-warmup-start", "0.25"],
    "spardl_002": ["--compression", "--compressor", "spardl", "--density", "0.02"],  # overrides --density
    "spardl_0005": ["--compression", "--compressor", "spardl", "--density", "0.005"],
    # fp16 values (DeepReduce's value codec): 0.75 of the bytes; senders keep the rounding error
    "spardl_fp16": ["--compression", "--compressor", "spardl", "--deepreduce", "value",
                    "--value", "fp16"],
    # and lossless delta-coded indices on top: about half of SparDL's bytes
    "spardl_delta_fp16": ["--compression", "--compressor", "spardl", "--deepreduce", "both",
                          "--index", "delta", "--value", "fp16"],
    # the compact wire (22-bit indices and bfloat16 values on VGG-16, 4 ranks) and the exact one
    "spardl_compact": ["--compression", "--compressor", "spardl", "--wire", "compact"],
    "spardl_exact": ["--compression", "--compressor", "spardl", "--wire", "exact"],
    "topka_compact": ["--compression", "--compressor", "topka", "--wire", "compact"],
    "spardl_0005_compact": ["--compression", "--compressor", "spardl", "--density", "0.005",
                            "--wire", "compact"],
    # DDP's own 25 MB buckets, each communicated while backward goes on: what DDP users run
    "ddp_25mb": ["--compression", "--compressor", "torch_ddp", "--bucket-cap-mb", "25"],
    "dense_25mb": ["--bucket-cap-mb", "25"],
    "dense_hook_25mb": ["--ddp-hook", "--bucket-cap-mb", "25"],
    "dense_25mb_no_overlap": ["--bucket-cap-mb", "25", "--no-overlap"],
    "dense_hook_25mb_no_overlap": ["--ddp-hook", "--bucket-cap-mb", "25", "--no-overlap"],
    "spardl_hook": ["--compression", "--compressor", "spardl", "--ddp-hook"],
    # SparDL per 25 or 10 MB bucket, each synchronised while backward goes on, and without that
    "spardl_25mb": ["--compression", "--compressor", "spardl", "--bucket-cap-mb", "25"],
    "spardl_10mb": ["--compression", "--compressor", "spardl", "--bucket-cap-mb", "10"],
    "spardl_25mb_no_overlap": ["--compression", "--compressor", "spardl", "--bucket-cap-mb", "25",
                               "--no-overlap"],
}
SPARSE_ALGORITHMS = ("spardl", "spardl_hook", "spardl_d2", "spardl_25mb", "spardl_10mb",
                     "spardl_25mb_no_overlap", "spardl_dgcwarmup", "spardl_002",
                     "spardl_0005", "spardl_fp16", "spardl_delta_fp16", "spardl_compact",
                     "spardl_exact", "topka_compact", "spardl_0005_compact", "topka", "topkdsa",
                     "gtopk", "oktopk")
LABELS = {"ddp": "PyTorch DDP", "fp16": "DDP fp16 hook", "powersgd1": "PowerSGD hook rank 1",
          "powersgd4": "PowerSGD hook rank 4", "dense": "dense (this library)",
          "spardl": "SparDL", "spardl_d2": "SparDL d=2", "spardl_nowarmup": "SparDL, no warm-up",
          "spardl_dgcwarmup": "SparDL, DGC's warm-up", "spardl_002": "SparDL at density 0.02",
          "spardl_0005": "SparDL at density 0.005", "spardl_fp16": "SparDL, fp16 values",
          "spardl_delta_fp16": "SparDL, delta indices and fp16 values",
          "spardl_compact": "SparDL, compact wire", "spardl_exact": "SparDL, exact wire",
          "topka_compact": "TopkA, compact wire",
          "spardl_0005_compact": "SparDL at density 0.005, compact wire",
          "ddp_25mb": "PyTorch DDP, 25 MB buckets", "dense_25mb": "dense, 25 MB buckets",
          "dense_hook_25mb": "dense via this library's DDP hook, 25 MB buckets",
          "dense_25mb_no_overlap": "dense, 25 MB buckets, no overlap",
          "dense_hook_25mb_no_overlap": "dense via the DDP hook, 25 MB buckets, no overlap",
          "spardl_hook": "SparDL via this library's DDP hook",
          "topka": "TopkA", "topkdsa": "TopkDSA", "gtopk": "gTop-k", "oktopk": "Ok-Topk",
          "spardl_25mb": "SparDL, 25 MB buckets", "spardl_10mb": "SparDL, 10 MB buckets",
          "spardl_25mb_no_overlap": "SparDL, 25 MB buckets, no overlap",
          "auto": "auto (the library's choice)",
          "auto_measure4": "auto, 4 measuring steps",
          **{f"fixed_{c}": f"{c} alone (auto's path)" for c in DEFAULT_CANDIDATES}}


def algorithm_options(name: str, warmup: bool = True) -> list[str]:
    """The training CLI's options for `name`; the sparse all-reduces with the recipe's density
    warm-up unless `warmup` is False (a per-step benchmark wants the steady state)."""
    if name not in SPARSE_ALGORITHMS:
        return list(ALGORITHMS[name])
    return [*ALGORITHMS[name], *([] if warmup else STEADY)]


TECHNIQUES = {
    "warmup": ["--density-warmup", "0.25", "--density-warmup-start", "0.25"],  # DGC's
    "warmup1": ["--density-warmup", "1", "--density-warmup-start", "0.25"],
    "warmup16": ["--density-warmup", "0.25", "--density-warmup-start", "0.0625"],
    "warmup2ep": ["--density-warmup", "2", "--density-warmup-start", "0.25"],  # DGC's stages, longer
    # PowerSGD's dense start (its first 10% of steps, 0.8 epoch of the 8-epoch recipe) as a
    # warm-up: dense, then 1/4, ... in equal stages over 0.8 epoch, then the target
    "warmupdense": ["--density-warmup", "0.8", "--density-warmup-start", "1"],
    "lrwarmup": ["--warmup-epochs", "0.25"],
    "mc": ["--momentum-correction", "0.9"],
    "mcnomask": ["--momentum-correction", "0.9", "--no-momentum-masking"],  # velocity kept
    "clip": ["--local-clip-norm", "5"],
    "compact": ["--wire", "compact"],
    "exact": ["--wire", "exact"],
    "floor": ["--min-entries", str(DEFAULT_MIN_ENTRIES)],  # the library's default floor
    # per-layer selection: a cap below any tensor's size puts every parameter in its own bucket,
    # so each selects its own top entries (and the floor, with "floor", holds per tensor)
    "layer": ["--bucket-cap-mb", "1e-9"],
    "hybrid": ["--fsdp", "hybrid"],  # FSDP2 inside 2 "nodes", the sparse all-reduce between
    "flat": ["--fsdp", "flat"],  # FSDP2 over every rank, SparDL's reduce-scatter
    "update": ["--exchange", "update"],  # each rank's optimizer step synchronised, not the gradient
    # SparseLoCo's cheap entries: DeepReduce's delta-coded indices and QSGD values
    "coded": ["--deepreduce", "both", "--index", "delta", "--value", "qsgd"],
}
LR_TECHNIQUES = ("lrwarmup",)  # they change the optimiser, not the synchronisation
# PyTorch's own answers, as they ship: config name prefix -> (trainer --compressor, the option
# its number sets). Their compression starts at START_FRACTION of the run's steps, as torch's
# PowerSGD docs advise ("start with 10% of total training steps"; post-local SGD's start is
# then moved up to a period later, so that its last step averages the models).
TORCH_BASELINES = {"fp16": ("torch_fp16", None),
                   "powersgd": ("torch_powersgd", "--powersgd-rank"),
                   "postlocal": ("torch_postlocal", "--postlocal-period"),
                   "diloco": ("diloco", "--diloco-period")}  # not torch's, but as plain
START_FRACTION = 0.1


def config_options(config: str, total_steps: int = 0) -> list[str]:
    """The CLI options of a config ALGORITHM[@DENSITY][+TECHNIQUE...]: 'dense' (with learning-
    rate techniques only); 'fp16', 'powersgdR' (PowerSGD's hook at rank R), 'postlocalH' (post-
    local SGD averaging every H steps), which start compressing at START_FRACTION of
    `total_steps`; a sparse all-reduce ('spardl@0.003+warmup2ep+compact'), without the
    library's floor unless 'floor' is among the techniques; or 'auto' (the library's choice,
    with its default floor)."""
    head, *techniques = config.split("+")
    algorithm, _, density = head.partition("@")
    options = ["--density", density] if density else []
    if density:
        try:
            ok = 0 < float(density) <= 1
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"density {density!r} must be a number in (0, 1]")
    if algorithm == "dense":
        if set(techniques) - set(LR_TECHNIQUES) or density:
            raise ValueError(f"dense takes only the learning-rate techniques: {', '.join(LR_TECHNIQUES)}")
        return [option for t in techniques for option in TECHNIQUES[t]]
    baseline = _torch_baseline(algorithm, total_steps)
    if baseline is not None:
        if set(techniques) - set(LR_TECHNIQUES) or density:
            raise ValueError(f"{algorithm} is PyTorch's own; it takes only the learning-rate "
                             f"techniques: {', '.join(LR_TECHNIQUES)}")
        return baseline + [option for t in techniques for option in TECHNIQUES[t]]
    if algorithm == "auto" and density:
        raise ValueError(f"{config!r}: auto chooses its own density; write auto")
    options += ["--compression", "--compressor", algorithm]
    if not any(t.startswith("warmup") for t in techniques):
        options += ["--density-warmup", "0"]  # the training CLI warms up by default
    if "floor" not in techniques and algorithm != "auto":
        # so that a config's density is the density sent; auto keeps the library's floor, as
        # its users get it
        options += ["--min-entries", "0"]
    for t in techniques:
        if t.startswith("adamfreeze"):
            options += ["--adam-freeze-step", str(_freeze_step(t, total_steps))]
            continue
        if t.startswith("every"):
            # with "update": each rank's own N steps between exchanges of their moves (DiLoCo's H)
            period = t[len("every"):]
            if not (period.isdigit() and int(period) >= 1):
                raise ValueError(f"{t!r}: write everyN, N >= 1 (the exchange period)")
            options += ["--exchange-period", period]
            continue
        if t not in TECHNIQUES:
            raise ValueError(f"unknown technique {t!r}; valid: {', '.join(TECHNIQUES)}, "
                             "adamfreeze, adamfreezePCT, everyN")
        options += TECHNIQUES[t]
    return options


def _freeze_step(technique: str, total_steps: int) -> int:
    """The step at which 'adamfreeze' (at START_FRACTION of the steps, when PowerSGD's hook
    starts compressing) or 'adamfreezePCT' (at PCT percent of them) freezes AdamW's variance."""
    percent = technique[len("adamfreeze"):]
    if percent and not (percent.isdigit() and 0 < int(percent) < 100):
        raise ValueError(f"{technique!r}: write adamfreeze or adamfreezePCT, 0 < PCT < 100")
    fraction = int(percent) / 100 if percent else START_FRACTION
    return max(1, round(fraction * total_steps))


def _torch_baseline(algorithm: str, total_steps: int) -> list[str] | None:
    """The options of one of TORCH_BASELINES ('powersgd4'), or None for another algorithm."""
    for prefix, (compressor, option) in TORCH_BASELINES.items():
        if not algorithm.startswith(prefix):
            continue
        number = algorithm[len(prefix):]
        if (option is None) != (number == ""):
            raise ValueError(f"{algorithm!r}: write {prefix}" + ("" if option is None else "N, N >= 1"))
        if option is not None and not (number.isdigit() and int(number) >= 1):
            raise ValueError(f"{algorithm!r}: {prefix} takes a whole number, e.g. {prefix}4")
        start = str(max(2, round(START_FRACTION * total_steps)))
        options = ["--compression", "--compressor", compressor, "--density-warmup", "0"]
        if option is not None:
            options += [option, number]
        if compressor == "torch_powersgd":
            options += ["--powersgd-start-iter", start]
        if compressor == "torch_postlocal":
            # Later by under one period, so that the last step averages: the model scored at
            # the end is then the average, as a user would save it.
            aligned = int(start) + (total_steps - 1 - int(start)) % int(number)
            options += ["--postlocal-start-iter", str(aligned)]
        return options
    return None


