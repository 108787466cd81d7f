"""A DDP communication hook that synchronises DDP's buckets with a grace communicator.

    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'compress_ratio': 0.01})
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(spardl_grace.CommHookState(grc, ddp), spardl_grace.comm_hook)

DDP hands the hook its buckets by index, and rebuilds them (other parameters, other order)
after the first iteration. The hook names a bucket by its parameters instead, lays them out in
one canonical order (reverse registration order, as DistributedOptimizer does) whatever DDP's
order, and keeps the memory's residuals per parameter (spardl_grace.sync), so a rebuild
neither loses nor misplaces them, and a bucket holding the same parameters as one of
DistributedOptimizer's is synchronised bit for bit like it. DDP's own bucket size
(bucket_cap_mb) decides the fusion: pass a large bucket_cap_mb to DistributedDataParallel to
give SparDL the whole model in one buffer.

The hook returns at once with a pending future (GradientSync.submit(...).then(back into
DDP's layout)), and GradientSync's communication thread synchronises the bucket, so DDP's
backward goes on computing the next buckets' gradients meanwhile, as with DDP's own
all-reduce. Buckets are synchronised one at a time in DDP's bucket order, which is the same on
every rank. A step of plain dense averages queues each bucket's all-reduce in the backend
instead (spardl_grace.sync). The last bucket's hook waits until every bucket of the step is
done: DDP issues
its own collectives (the map of unused parameters) right after it, and they must not race the
thread's on the same process group; by then backward has nothing left to overlap.
"""

# No `from __future__ import annotations`: DDP compares comm_hook's annotations with the real
# types (dist.GradBucket, torch.futures.Future[torch.Tensor]) and rejects strings.
import functools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .api import Synchronizer
from .checkpoint import warn_if_resumed_afresh
from .registry import grace_from_params, refuse_update_exchange, resolve_params
from .step_hooks import watch
from .sync import (
    FIRST_STEP_TIMEOUT_S,
    Bucket,
    GradientSync,
    check_dense_path_keeps_momentum,
    settle,
    stable_name,
)

#: why the hook refuses DDP under compiled autograd's Python reducer
PYTHON_REDUCER = (
    "spardl_grace's DDP hook synchronises DDP's gradient buckets, and with "
    "torch._dynamo.config.optimize_ddp = 'python_reducer' (DDP under compiled autograd) DDP "
    "calls a comm hook with one parameter's gradient at a time: keep DDP's default reducer "
    "(torch.compile of the model or of the DDP module works with the hook), or synchronise "
    "with spardl_grace.DistributedOptimizer, which works under compiled autograd"
)


class CommHookState:
    """The hook's state: the grace communicator, parameter names, and the step count.

    grace: a communicator from grace_from_params(...), or GRACE's parameters themselves (a
    dict), checked now and built at the first synchronisation, when the process group exists:
    trainers that create it themselves (Lightning's DDPStrategy, Accelerate) take the state
    before they start the processes. model: the DistributedDataParallel module (or the module
    it wraps, a LightningModule); its parameter names key the residuals. dense_warmup_steps:
    the first iterations are synchronised dense. min_numel: buckets with fewer entries are
    always synchronised dense. overlap: synchronise on a communication thread while backward
    goes on (off, or with an MPI library without MPI_THREAD_MULTIPLE, the hook synchronises
    before it returns). first_step_timeout: the first iteration waits at most this many
    seconds (60) for the other ranks.

    Two synchronisations with no optimizer step between them (gradient accumulation without
    DDP's no_sync) raise ValueError on every rank: DDP would hand the hook the accumulated
    gradient, already averaged once, and a sparse all-reduce would send part of it again
    from the residuals. A step is seen when a torch.optim optimizer holding these parameters
    steps (any subclass, hand-written ones that write p.data included: torch calls its global
    step hooks) or when a parameter changes in place (an update under torch.no_grad()). Where
    neither is seen and no optimizer has ever stepped these parameters (an update of p.data
    by a function of the user's), the hook cannot tell accumulation from an update and warns
    once instead. A step whose result was not finite (a GradScaler skips its optimizer step)
    is exempt, and so is one with a bucket sent dense (its result is not checked), and so is
    a step skipped on purpose: the gradients set to None after the synchronisation
    (zero_grad(), torch's default set_to_none=True), so the next backward starts afresh."""

    def __init__(
        self,
        grace: Synchronizer | Mapping[str, Any],
        model: torch.nn.Module,
        dense_warmup_steps: int = 0,
        min_numel: int = 0,
        overlap: bool = True,
        first_step_timeout: float = FIRST_STEP_TIMEOUT_S,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be the DDP module (or the module it wraps), got {type(model).__name__}"
            )
        if isinstance(grace, Mapping):
            resolved = resolve_params(grace)  # bad keys raise now, not at the first step
            check_dense_path_keeps_momentum(
                resolved["momentum_correction"],
                max(dense_warmup_steps, resolved["dense_warmup_steps"]),
                min_numel,
            )
            self.momentum_correction = resolved["momentum_correction"]
            self.adam_freeze_step = resolved["adam_freeze_step"]
            refuse_update_exchange(resolved["exchange"], "the DDP hook")
        elif not isinstance(grace, Synchronizer):
            raise TypeError(
                "grace must be a communicator from grace_from_params(...) or a dict of its "
                f"parameters, got {type(grace).__name__}"
            )
        if getattr(model, "_use_python_reducer", False):
            raise ValueError(PYTHON_REDUCER)
        inner = (
            model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        )
        named = [(stable_name(n), p) for n, p in inner.named_parameters()]
        self.names = {p: n for n, p in named}
        self.position = {p: i for i, (_, p) in enumerate(named)}
        self._grace = grace
        self._sync_args = (dense_warmup_steps, min_numel, overlap, first_step_timeout)
        self._sync: GradientSync | None = None
        if isinstance(grace, Synchronizer):
            self.momentum_correction = getattr(grace.memory, "momentum_correction", 0.0)
            self.adam_freeze_step = grace.adam_freeze_step
            refuse_update_exchange(grace.exchange, "the DDP hook")
            self._sync = self._build(grace)
        #: steps of torch.optim optimizers that hold these parameters (optimizer_stepped)
        self.optimizer_steps = 0
        self._at_last_sync: tuple[int, int] | None = None
        self._warned_unseen_step = False
        #: whether every gradient the first backward since the last synchronisation
        #: accumulated found its parameter's gradient None (None: none arrived yet), and that
        #: backward's autograd graph task
        self._began_without_gradients: bool | None = None
        self._first_backward: int | None = None
        #: the parameters whose gradient this rank computed since the last synchronisation
        self.arrived: set[torch.Tensor] = set()
        _watch_gradients(self, [p for p in self.names if p.requires_grad])
        #: whether a resume without this state was checked for (at the first optimizer step
        #: after a synchronisation) or already reported (by the trainers' checkpoint load)
        self.resume_checked = False
        watch(inner, self, "the DDP hook")

    def _build(self, grace: Synchronizer) -> GradientSync:
        warmup, min_numel, overlap, timeout = self._sync_args
        return GradientSync(
            grace,
            warmup,
            min_numel,
            overlap,
            "spardl-ddp-comm",
            timeout,
            self.names.values(),
            {n: tuple(p.shape) for p, n in self.names.items()},
        )

    @property
    def grace_in_use(self) -> Synchronizer | None:
        """The communicator, once it has synchronised a step (None before)."""
        return self.sync.grace if self.synchronized_steps else None

    @property
    def synchronized_steps(self) -> int:
        """Steps synchronised so far (0 before the first)."""
        return self._sync.steps if self._sync is not None else 0

    @property
    def sync(self) -> GradientSync:
        """The GradientSync that synchronises the buckets (built from the parameters at first
        use when the state was given a dict)."""
        if self._sync is None:
            assert isinstance(self._grace, Mapping)
            self._sync = self._build(grace_from_params(dict(self._grace)))
        return self._sync

    def canonical(self, params: list[torch.Tensor]) -> tuple[Bucket, list[int]]:
        """The bucket of `params` in reverse registration order, and that order as indices
        into `params`."""
        if any(p not in self.names for p in params):
            raise ValueError(
                "DDP's bucket holds a parameter the hook state does not know: build "
                "CommHookState with the model DDP wraps"
            )
        order = sorted(range(len(params)), key=lambda j: -self.position[params[j]])
        return Bucket(
            tuple(self.names[params[j]] for j in order), tuple(params[j].numel() for j in order)
        ), order

    def gradient_arrives(self, param: torch.Tensor) -> None:
        """Before `param`'s gradient accumulates (a tensor hook, _watch_gradients): note, for
        the first backward since the last synchronisation, whether every gradient found its
        parameter's None, so that a step skipped on purpose (the gradients set to None after
        the synchronisation) is not taken for accumulation without no_sync(); and that
        `param` has a gradient to send (the others are idle: see comm_hook)."""
        self.arrived.add(param)
        if self._began_without_gradients is False:  # decided until the next synchronisation
            return
        task = torch._C._current_graph_task_id()
        if self._first_backward is None:
            self._first_backward = task
            self._began_without_gradients = param.grad is None
        elif task == self._first_backward:
            self._began_without_gradients = param.grad is None

    def check_optimizer_stepped(self, previous_finite: bool) -> None:
        """Called once a step is synchronised: ValueError if no optimizer step was seen since
        the previous synchronisation, when that one's result was finite (previous_finite), the
        gradients were not reset since it, and an optimizer has stepped these parameters
        before; a warning, once, when none ever has (see the class docstring)."""
        now = (sum(p._version for p in self.names), self.optimizer_steps)
        previous, self._at_last_sync = self._at_last_sync, now
        reset, self._began_without_gradients = self._began_without_gradients, None
        self._first_backward = None
        if previous != now or not previous_finite or reset:
            return
        if self.optimizer_steps:
            raise ValueError(
                "DDP synchronised the gradients twice without an optimizer step in between: "
                "gradient accumulation needs DDP's no_sync() on every backward but the last "
                "(Lightning's accumulate_grad_batches and Accelerate's accelerator.accumulate() "
                "do this); otherwise the hook would compress the gradient averaged at the "
                "previous backward again and count part of it twice. To skip a step on "
                "purpose (a loss spike), reset the gradients with zero_grad(set_to_none=True), "
                "torch's default, which the hook tells from accumulation. A forward of the DDP "
                "model with gradients enabled and no backward (an evaluation outside "
                "torch.no_grad()) makes DDP synchronise at the next backward even inside "
                "no_sync(): evaluate under torch.no_grad()"
            )
        if not self._warned_unseen_step:
            self._warned_unseen_step = True
            warnings.warn(
                "spardl_grace: DDP synchronised the gradients twice and no update of the "
                "parameters was seen in between (no torch.optim step, no in-place change). "
                "If your own code updates p.data, this is expected and you may ignore it; if "
                "you accumulate gradients, use DDP's no_sync() on every backward but the last, "
                "or part of the gradient is counted twice",
                RuntimeWarning,
                stacklevel=3,
            )

    def holds_parameters_of(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` updates any of the parameters this state synchronises."""
        return any(p in self.names for group in optimizer.param_groups for p in group["params"])

    def check_resumed(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by spardl_grace.step_hooks before each step of an optimizer that holds these
        parameters: at the first after a synchronisation, warns when the optimizer was resumed
        without this state (a step before any, as torch.distributed.checkpoint takes to create
        the optimizer's state, tells nothing)."""
        if self.resume_checked or not self.synchronized_steps:
            return
        self.resume_checked = True
        warn_if_resumed_afresh(optimizer, self.sync.grace.restored, "hook_state.state_dict()")

    def optimizer_stepped(self) -> None:
        """Called by spardl_grace.step_hooks after each step of an optimizer that holds these
        parameters."""
        self.optimizer_steps += 1

    @property
    def last_stats(self) -> dict[str, float]:
        """The last finished step's statistics, summed over its buckets."""
        return self.sync.last_stats

    def stats_to_log(self) -> dict[str, float]:
        """last_stats as floats named `compression/NAME`, what the Lightning callback and
        spardl_grace.accelerate.log_stats hand the trainers' loggers; empty before the first
        synchronised step."""
        if not self.synchronized_steps:
            return {}
        return {f"compression/{k}": float(v) for k, v in self.last_stats.items()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state; loads with torch.load(weights_only=True)."""
        return self.sync.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """ValueError if written by a run with another number of workers."""
        self.sync.load_state_dict(state)


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over ranks by state's grace
    communicator (dense during warm-up and for small buckets), in the bucket's dtype. The
    future is pending while the communication thread works on it (see the module docstring).
    """
    if isinstance(bucket, tuple):  # a state built with the wrapped module, not the DDP one
        raise ValueError(PYTHON_REDUCER)
    buffer = bucket.buffer()
    params = bucket.parameters()
    canonical, order = state.canonical(params)
    ddp_parts = torch.split(buffer, [p.numel() for p in params])
    reordered = order != sorted(order)
    flat = torch.cat([ddp_parts[j] for j in order]) if reordered else buffer
    # With find_unused_parameters, a parameter this rank did not use sends nothing and keeps
    # its residual: DDP leaves one that no rank used untouched, dropping what it would send.
    # Outside backward (torch's Join shadowing a rank that ran out) every parameter takes part,
    # as in a step with zero gradients.
    inside = _inside_backward()
    idle = tuple(state.names[p] for p in params if p not in state.arrived) if inside else ()
    future = state.sync.submit(flat, canonical, idle).then(
        functools.partial(_in_ddp_layout, buffer, ddp_parts, order, canonical, reordered)
    )
    if bucket.is_last():
        state.arrived = set()
        previous_finite = state.sync.last_step_finite
        state.sync.end_step()
        settle(future)  # its copy back into DDP's layout too, before DDP's own collectives
        if inside:
            state.check_optimizer_stepped(previous_finite)
    return future


def _watch_gradients(state: CommHookState, params: list[torch.Tensor]) -> None:
    """A tensor hook on each of `params` that tells `state` its gradient is arriving (see
    CommHookState.gradient_arrives). The hooks hold `state` weakly, and go with it, so a model
    wrapped again keeps no earlier state alive."""
    ref = weakref.ref(state)

    def hook_for(param: torch.Tensor) -> Any:
        def before_accumulation(grad: torch.Tensor) -> None:
            holder = ref()
            if holder is not None:
                holder.gradient_arrives(param)

        return before_accumulation

    handles = [p.register_hook(hook_for(p)) for p in params]
    weakref.finalize(state, _remove, handles)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _inside_backward() -> bool:
    """Whether the hook runs inside a backward pass, as DDP's reducer calls it. Outside one,
    DDP's Join is matching the other ranks' step on a rank whose data ran out (DDP's
    _match_all_reduce_for_bwd_pass hands the hook zero buckets): that rank takes no optimizer
    step, and the zeros it sends are its gradient, as DDP's Join means them."""
    return torch._C._current_graph_task_id() != -1


def _in_ddp_layout(
    buffer: torch.Tensor,
    ddp_parts: tuple[torch.Tensor, ...],
    order: list[int],
    canonical: Bucket,
    reordered: bool,
    synchronized: torch.futures.Future[torch.Tensor],
) -> torch.Tensor:
    """The average of DDP's bucket, laid out as `buffer` (parameters in DDP's order) and in
    its dtype.

    In DDP's layout the communicator's result is returned as it is, without a copy into
    `buffer`: DDP copies the future's tensor into the gradients before backward returns (its
    reducer copies from a hook's result unless it is the bucket buffer itself), and the
    communicator reuses that storage (reuse_results) only at the next step. A reordered bucket
    is written back into `buffer` in DDP's order."""
    result = synchronized.value()
    if reordered:
        for j, part in zip(order, torch.split(result, list(canonical.numels))):
            ddp_parts[j].copy_(part)
        result = buffer
    return result.to(buffer.dtype)
