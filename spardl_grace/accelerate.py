"""Hugging Face Accelerate: a sparse all-reduce as the communication hook of the DDP module
that `accelerator.prepare` builds, its compression state in `accelerator.save_state`.

One added line after prepare:

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    spardl_grace.accelerate.register_comm_hook(accelerator, model, {
        'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
        'compress_ratio': 0.01})

The hook's state (residuals and schedules) is saved by every rank into a file of its own
in the checkpoint folder (spardl_grace.trainers.PerRankFiles, through Accelerate's save and
load pre-hooks: no collective, one rank's state in memory), so `accelerator.save_state(dir)`
writes it beside the model and optimizer, and `accelerator.load_state(dir)` restores it: a
resumed run continues bit for bit like one never stopped (with
`Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))`:
Accelerate's default sampler does not restore the data order, for dense DDP either); register
the hook before load_state (after it, the state is not read, and this warns). Call
save_state on every rank; a checkpoint saved from the main process alone holds rank 0's state
only, and resuming from it raises on every rank, naming the fix. Gradient accumulation works
inside `accelerator.accumulate(model)` (DDP's no_sync on every micro-batch but the last).
Tested with Accelerate 1.15.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .api import Synchronizer
from .ddp import CommHookState, comm_hook
from .step_hooks import steps_taken
from .trainers import PerRankFiles


def register_comm_hook(
    accelerator: Any,
    model: torch.nn.Module,
    grace: Synchronizer | Mapping[str, Any] | CommHookState,
    **state_options: Any,
) -> CommHookState:
    """Register spardl_grace.comm_hook on `model` (what accelerator.prepare returned), and the
    compression state's per-rank files with accelerator's save and load pre-hooks; returns the
    state.

    grace: GRACE's parameters (a dict), a communicator from grace_from_params, or a
    CommHookState built for this model. state_options: CommHookState's keywords
    (dense_warmup_steps, min_numel, overlap, first_step_timeout), with a dict or communicator.
    ValueError when prepare did not build DDP (one process, FSDP, DeepSpeed, ...), the model
    already has a communication hook (DDP takes one), or the Accelerator accumulates with
    GradientAccumulationPlugin(sync_each_batch=True)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        kind = getattr(accelerator, "distributed_type", "unknown")
        raise ValueError(
            f"the model is a {type(model).__name__} (Accelerate's distributed type "
            f"{getattr(kind, 'value', kind)}), not the DistributedDataParallel module that "
            "accelerator.prepare builds for 2 or more processes on CPUs or GPUs (MULTI_CPU, "
            "MULTI_GPU): pass prepare's result, launched with accelerate launch or torchrun "
            "(on a machine without GPUs under torchrun, build Accelerator(cpu=True), or each "
            "worker trains alone; or launch with accelerate launch --multi_gpu or "
            "--mpirun_hostfile); for FSDP see spardl_grace.fsdp"
        )
    plugin = getattr(getattr(accelerator, "gradient_state", None), "plugin_kwargs", {}) or {}
    if plugin.get("sync_each_batch") and plugin.get("num_steps", 1) > 1:
        raise ValueError(
            "GradientAccumulationPlugin(sync_each_batch=True) synchronises every micro-batch's "
            "accumulated gradient, and a compressed synchronisation would send what an earlier "
            "micro-batch already sent again: leave sync_each_batch at False (accumulate() then "
            "synchronises once per step)"
        )
    hooks = getattr(model, "_comm_hooks", [])
    if hooks:
        names = ", ".join(getattr(hook, "__qualname__", str(hook)) for hook, _ in hooks)
        raise ValueError(
            f"the model already has a communication hook ({names}) and DDP takes one: "
            "register spardl_grace's once, and no DistributedDataParallelKwargs(comm_hook=...)"
        )
    if isinstance(grace, CommHookState):
        if state_options:
            raise ValueError(
                f"{', '.join(sorted(state_options))}: give these to CommHookState, or pass "
                "GRACE's parameters instead of a built state"
            )
        state = grace
    else:
        state = CommHookState(grace, model, **state_options)
    model.register_comm_hook(state, comm_hook)
    _warn_if_loaded_before(accelerator, state)
    files = PerRankFiles(state)
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: files.save(folder))
    accelerator.register_load_state_pre_hook(lambda models, folder: files.load(folder))
    return state


def _warn_if_loaded_before(accelerator: Any, state: CommHookState) -> None:
    """Warn (and spare the hook's own first-step warning) when a prepared optimizer holds state
    no step of this process made: accelerator.load_state ran before the hook's load pre-hook
    was registered, so the compression state in its folder was not read."""
    for prepared in getattr(accelerator, "_optimizers", []):
        optimizer = getattr(prepared, "optimizer", prepared)
        if optimizer.state and steps_taken(optimizer) == 0:
            state.resume_checked = True
            warnings.warn(
                "spardl_grace.accelerate: the optimizer holds state that no step of this "
                "process made (accelerator.load_state before register_comm_hook?), and the "
                "compression state is read only by load_state calls after register_comm_hook: "
                "this run starts with fresh residuals and schedules. Register the hook right "
                "after accelerator.prepare, then call load_state",
                RuntimeWarning,
                stacklevel=3,
            )
            return


def log_stats(accelerator: Any, state: CommHookState, step: int | None = None) -> None:
    """Log `state`'s last synchronised step's statistics (bytes sent and seconds coding and
    communicating; the sparse all-reduces add each phase's bytes and entries and seconds
    selecting, 'auto' its decision) as `compression/NAME` through
    accelerator.log, to whatever trackers the Accelerator was given (W&B, TensorBoard, ...);
    nothing before the first synchronised step. Call it after optimizer.step(), e.g. beside
    your own accelerator.log."""
    stats = state.stats_to_log()
    if stats:
        accelerator.log(stats, step=step)
