"""The warning for the one choice measured to train far behind dense: an Adam-type optimizer
stepping on a selection of the raw gradient's entries.

On the accuracy page's transformer (AdamW, 1,000 steps), SparDL at density 0.01 on the
gradient ended 0.94 above dense's loss, where PowerSGD rank 4 ended 0.15 above; the choosing
guide's Adam row gives what does better. warn_if_adam_on_selected_gradient() says so once, when
DistributedOptimizer wraps such an optimizer and, under the DDP hook and FSDP2, at the first
step of one (spardl_grace.step_hooks). 'adam_freeze_step' and 'exchange': 'update' are the
library's answers to it and do not warn; neither does a selection at density 1, nor anything
that sends every entry (dense, a quantiser, PowerSGD). 'auto' with its default candidates
does not warn either: under such an optimizer it keeps to dense and bfloat16 dense, the
guide's choice there (advise_adam_user), and says so once on its logger.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from .api import SparseAllreduce, Synchronizer

#: what each way in can do instead (the choosing guide's Adam row, as far as it applies there)
_INSTEAD = {
    "DistributedOptimizer": (
        "exchange the optimizer's steps ('exchange': 'update', 'exchange_period': 4, "
        "'compress_ratio': 0.4 with coded entries: the choosing guide's best sparse arm), or "
        "freeze Adam's second moment after a dense start ('adam_freeze_step'), or synchronise "
        "dense in 16 bits where half the bytes is enough"
    ),
    "the DDP hook": (
        "freeze Adam's second moment after a dense start ('adam_freeze_step'), or register "
        "DDP's bf16/fp16 compress hook where half the bytes is enough, or exchange the "
        "optimizer's steps with DistributedOptimizer ('exchange': 'update')"
    ),
    "FSDP2": (
        "keep FSDP2's own dense reduce-scatter (in bf16 where half the bytes is enough), or "
        "exchange the optimizer's steps with DistributedOptimizer ('exchange': 'update')"
    ),
}


def is_adam_type(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is an Adam of some kind (torch's Adam, AdamW, NAdam, RAdam,
    Adamax, and others' FusedAdam or AdamW8bit), told by its classes' names: they divide each
    entry by its own running mean square, as the measured AdamW does."""
    return any("adam" in cls.__name__.lower() for cls in type(optimizer).__mro__)


def selection_of(grace: Synchronizer) -> str | None:
    """Words for the selection of the raw gradient's entries that `grace` sends ('SparDL at
    density 0.01'), or None when it sends every entry or exchanges the optimizer's steps."""
    from .communicators.auto import Auto
    from .compressors import DgcCompressor, RandomKCompressor, ThresholdCompressor, TopKCompressor
    from .planner import parse_candidates

    if getattr(grace, "exchange", "gradient") != "gradient" or getattr(
        grace, "adam_freeze_step", 0
    ):
        return None
    if isinstance(grace, Auto):
        sparse = [
            c.name for c in parse_candidates(grace.candidates.split(",")) if c.kind == "spardl"
        ]
        return f"'auto', which may choose {' or '.join(sparse)}" if sparse else None
    if isinstance(grace, SparseAllreduce):
        if grace.density >= 1:
            return None
        return f"{type(grace).__name__} at density {grace.density:g}"
    compressor = getattr(grace, "compressor", None)
    compressor = getattr(compressor, "sparsifier", compressor)  # inside DeepReduce's wrappers
    sparsifiers = (TopKCompressor, RandomKCompressor, ThresholdCompressor, DgcCompressor)
    if not isinstance(compressor, sparsifiers):
        return None
    ratio = getattr(compressor, "compress_ratio", None)
    if ratio is not None and ratio >= 1:
        return None
    at = f" at compress_ratio {ratio:g}" if ratio is not None else ""
    return f"compressor {type(compressor).__name__}{at}"


def advise_adam_user(
    optimizer: torch.optim.Optimizer, grace: Synchronizer, where: str, stacklevel: int = 3
) -> None:
    """Before `optimizer` steps on what `grace` synchronises: when it is an Adam
    (is_adam_type), 'auto' with its default candidates keeps to those that send every entry
    (Auto.keep_to_dense, logged once on rank 0), and any other selection of the raw
    gradient warns (warn_if_adam_on_selected_gradient)."""
    from .communicators.auto import LOG, Auto
    from .planner import DEFAULT_CANDIDATES

    if (
        isinstance(grace, Auto)
        and grace.candidates == ",".join(DEFAULT_CANDIDATES)
        and is_adam_type(optimizer)
        and grace.keep_to_dense()
    ):
        if grace.transport.rank == 0:
            LOG.info(
                "auto: %s is an Adam, which trains far behind dense on a selection of the raw "
                "gradient: choosing among %s only (docs/guide/choosing.md, the Adam row; name "
                "'auto_candidates' to choose SparDL's densities anyway)",
                type(optimizer).__name__,
                grace.candidates,
            )
        return
    warn_if_adam_on_selected_gradient(optimizer, grace, where, stacklevel + 1)


def warn_if_adam_on_selected_gradient(
    optimizer: torch.optim.Optimizer, grace: Synchronizer, where: str, stacklevel: int = 3
) -> None:
    """RuntimeWarning when `optimizer` is an Adam (is_adam_type) and `grace` sends a selection
    of the raw gradient (selection_of); `where` ('DistributedOptimizer', 'the DDP hook',
    'FSDP2') chooses the advice."""
    selected = selection_of(grace)
    if selected is None or not is_adam_type(optimizer):
        return
    warnings.warn(
        f"spardl_grace: {type(optimizer).__name__} steps on {selected}, a selection of the "
        "raw gradient's entries, through "
        f"{where}. Under an Adam-type optimizer that trains far behind dense (measured on "
        "a transformer with AdamW: SparDL at 0.01 ended 0.94 above dense's loss, PowerSGD rank "
        f"4 0.15 above). Instead, {_INSTEAD[where]}: docs/guide/choosing.md, the Adam row. "
        "Silence this with warnings.filterwarnings('ignore', 'spardl_grace: .* steps on').",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


#: the DDP hook states and ShardSyncs that have warned (warn_once_for)
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_once_for(
    holder: Any, optimizer: torch.optim.Optimizer, grace: Synchronizer | None, where: str
) -> None:
    """For spardl_grace.step_hooks, before a step of `optimizer` that updates `holder`'s
    parameters (a DDP hook state's, a ShardSync's): advise_adam_user once per holder, once its
    communicator `grace` has synchronised (None: not yet)."""
    if grace is None or holder in _WARNED:
        return
    _WARNED.add(holder)
    # the user's optimizer.step(), torch's step wrapper, step_hooks' pre-hook and _take_over
    advise_adam_user(optimizer, grace, where, stacklevel=6)
