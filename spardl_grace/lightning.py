"""PyTorch Lightning: a sparse all-reduce as DDPStrategy's communication hook, its compression
state in Lightning's checkpoints.

One changed line in a Lightning script, the callback (it builds the hook's state from the
LightningModule and registers the hook on the module DDPStrategy wraps):

    trainer = L.Trainer(strategy="ddp", callbacks=[spardl_grace.lightning.GradientCompression(
        {'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
         'compress_ratio': 0.01})])

or Lightning's own form for PowerSGD, with the callback to checkpoint the state:

    state = spardl_grace.CommHookState(params, model)
    trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_state=state,
                                             ddp_comm_hook=spardl_grace.comm_hook),
                        callbacks=[spardl_grace.lightning.GradientCompression(state)])

Lightning's DDPStrategy registers a communication hook only when it trains on CUDA and
ignores it otherwise; the callback registers it on the CPU (gloo) too, once. The compression
state (residuals, schedules) of every rank rides in Lightning's checkpoints under the
callback's key (spardl_grace.trainers.AllRanksState), so `trainer.fit(model, ckpt_path=...)`
continues bit for bit like a run never stopped. Gradient accumulation
(accumulate_grad_batches) works: Lightning skips DDP's synchronisation on every micro-batch
but the last.

Built on `lightning.pytorch` (Lightning 2.x; `pytorch_lightning` where the `lightning`
package is not installed). Tested with Lightning 2.6.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .ddp import CommHookState, comm_hook
from .registry import resolve_params
from .trainers import AllRanksState

#: how a Lightning checkpoint resumes without the compression state
_WITHOUT_IT = (
    "delete the GradientCompression callback's entry under the checkpoint's 'callbacks' "
    "(torch.load, del, torch.save)"
)

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]


class GradientCompression(pl.Callback):
    """Synchronises DDPStrategy's gradient buckets with a grace communicator and keeps its
    state in the trainer's checkpoints.

    grace: GRACE's parameters (a dict: the state is built from the LightningModule when the
    fit starts, after Lightning started the processes), or a CommHookState, for the one passed
    to DDPStrategy(ddp_comm_state=...). A strategy other than DDPStrategy (FSDP, DeepSpeed,
    one device) raises ValueError, as does a DDPStrategy given another hook or state.

    One callback given a dict may serve fits of several LightningModules (a hyper-parameter
    loop): each new module gets a state of its own, starting afresh.

    log_stats: after each training batch, log the last synchronised step's statistics
    (CommHookState's last_stats: bytes sent and seconds coding and communicating; the sparse
    all-reduces add each phase's bytes and entries and seconds selecting, 'auto' its
    decision) as `compression/NAME` through the LightningModule's log_dict, so they reach
    whatever loggers the trainer has (W&B, TensorBoard, CSV); False logs nothing."""

    def __init__(self, grace: Mapping[str, Any] | CommHookState, log_stats: bool = True):
        if not isinstance(grace, (Mapping, CommHookState)):
            raise TypeError(
                "grace must be a dict of GRACE's parameters or a spardl_grace.CommHookState, "
                f"got {type(grace).__name__}"
            )
        if isinstance(grace, Mapping):
            resolve_params(grace)  # bad parameters raise here, not at the fit
        if not isinstance(log_stats, bool):
            raise TypeError(f"log_stats must be True or False, got {log_stats!r}")
        self._grace = grace
        self.log_stats = log_stats
        self.state: CommHookState | None = grace if isinstance(grace, CommHookState) else None

    @property
    def state_key(self) -> str:
        # the callback's name before 0.3: checkpoints written then keep loading
        return "spardl_grace.SparseAllreduce"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the strategy, and build the state from `pl_module` if given parameters."""
        strategy = trainer.strategy
        ddp = pl.strategies.DDPStrategy
        if not isinstance(strategy, ddp) or isinstance(strategy, pl.strategies.DeepSpeedStrategy):
            raise ValueError(
                f"spardl_grace.lightning.GradientCompression runs as DDP's communication hook, but "
                f"the trainer's strategy is {type(strategy).__name__}: use strategy='ddp' (or "
                "DDPStrategy(...)) with 2 or more processes; for FSDP see spardl_grace.fsdp"
            )
        hook = getattr(strategy, "_ddp_comm_hook", None)
        given = getattr(strategy, "_ddp_comm_state", None)
        if hook is not None and (hook is not comm_hook or given is not self.state):
            raise ValueError(
                "the DDPStrategy already has a communication hook "
                f"({getattr(hook, '__name__', hook)}) with another state: pass the same "
                "CommHookState to DDPStrategy(ddp_comm_state=state, "
                "ddp_comm_hook=spardl_grace.comm_hook) and to GradientCompression(state), or leave "
                "the strategy's hook unset and give SparseAllreduce the parameters"
            )
        if self.state is not None and not any(
            p in self.state.names for p in pl_module.parameters()
        ):
            if not isinstance(self._grace, Mapping):
                raise ValueError(
                    "the CommHookState given to GradientCompression was built for another "
                    "LightningModule: build one per module, or give GradientCompression GRACE's "
                    "parameters (a dict), which builds a state for each fit's module"
                )
            # a new module (a hyper-parameter loop): its compression starts afresh
            self.state = None
        if self.state is None:
            assert isinstance(self._grace, Mapping)
            self.state = CommHookState(self._grace, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hook on the DDP module the strategy built, unless Lightning did."""
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"the strategy wrapped the model in {type(model).__name__}, not "
                "DistributedDataParallel"
            )
        if any(state is self.state for _, state in getattr(model, "_comm_hooks", [])):
            return
        model.register_comm_hook(self.state, comm_hook)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Log the last synchronised step's statistics (see log_stats)."""
        stats = self.state.stats_to_log() if self.log_stats and self.state is not None else {}
        if stats:
            pl_module.log_dict(stats, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, gathered to rank 0, which Lightning writes (a
        collective: Lightning asks every rank)."""
        return AllRanksState(self._built(), _WITHOUT_IT).state_dict()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Warn when the checkpoint holds no state of this callback (Lightning then skips
        load_state_dict, and the residuals start afresh)."""
        if self.state_key not in checkpoint.get("callbacks", {}):
            if self.state is not None:
                self.state.resume_checked = True
            warnings.warn(
                "spardl_grace: the checkpoint holds no compression state of this callback; "
                "the residuals start afresh (a checkpoint written without it)",
                RuntimeWarning,
                stacklevel=2,
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's part of a state_dict() (ValueError with another number of ranks)."""
        AllRanksState(self._built(), _WITHOUT_IT).load_state_dict(state_dict)

    def _built(self) -> CommHookState:
        if self.state is None:
            raise RuntimeError("the compression state exists once the trainer's setup has run")
        return self.state


def __getattr__(name: str) -> Any:
    """SparseAllreduce, the callback's name before 0.3 (it shared it with the ABC
    spardl_grace.api.SparseAllreduce), for one more release with a DeprecationWarning."""
    if name == "SparseAllreduce":
        warnings.warn(
            "spardl_grace.lightning.SparseAllreduce is now spardl_grace.lightning."
            "GradientCompression; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return GradientCompression
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
