"""DistributedOptimizer: Horovod's optimizer wrapper, synchronising with a grace communicator.

    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'compress_ratio': 0.01})
    optimizer = spardl_grace.DistributedOptimizer(optimizer, grc,
                                                  named_parameters=model.named_parameters())

The same call works under horovodrun, torchrun and mpirun: the transport is the grace
communicator's. Gradients are fused into flat buckets (by default the whole model in one, which
SparDL wants). A gradient hook counts each parameter's backward passes; when every parameter of
a bucket has its `backward_passes_per_step` passes, the bucket is handed to a communication
thread, so later buckets overlap with the rest of the backward pass. Buckets are always
synchronised in the same order on every rank (a bucket waits for the ones before it), whatever
order the hooks fire in, so ranks whose models leave different parameters unused cannot
deadlock. step() waits for the results, writes the averages into .grad, and steps.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from .adam_advice import advise_adam_user
from .api import Synchronizer, communication_dtype
from .buffers import BufferPool
from .checkpoint import warn_if_resumed_afresh
from .frozen_adam import check_optimizer, frozen_step
from .fusion import assign_grads, assign_params, flatten_grads, flatten_params
from .horovod_compat import (
    check_compression,
    check_process_set,
    compression_name,
    default_grace,
    parameter_groups,
    scale_factors,
)
from .memories.residual import ResidualMemory
from .momentum import momentum_handed_over, taken_over_groups, uses_nesterov
from .step_hooks import inherit_steps, inner_step, sharing_state
from .sync import FIRST_STEP_TIMEOUT_S, Bucket, GradientSync, stable_name


def plan_buckets(
    named: list[tuple[str, torch.nn.Parameter]],
    bucket_cap_mb: float | None,
    explicit: list[list[torch.nn.Parameter]] | None = None,
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Parameters grouped into buckets: in reverse order (the order backward produces their
    gradients, and DDP's), one group per (device, communication dtype), each group cut into
    buckets of at most bucket_cap_mb megabytes (None: one bucket per group). `explicit`
    (Horovod's groups): one bucket per group and (device, dtype) instead, the bucket whose
    last parameter comes latest first."""
    if explicit is not None:
        return _explicit_buckets(named, explicit)
    groups: dict[tuple[Any, torch.dtype], list] = {}
    for name, p in reversed(named):
        groups.setdefault((p.device, communication_dtype(p.dtype)), []).append((name, p))
    if bucket_cap_mb is None:
        return list(groups.values())
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 or None (one bucket), got {bucket_cap_mb!r}")
    cap = bucket_cap_mb * 2**20
    buckets = []
    for (_, dtype), members in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in members:
            if current and size + p.numel() * itemsize > cap:
                buckets.append(current)
                current, size = [], 0
            current.append((name, p))
            size += p.numel() * itemsize
        buckets.append(current)
    return buckets


def _explicit_buckets(
    named: list[tuple[str, torch.nn.Parameter]], explicit: list[list[torch.nn.Parameter]]
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    position = {p: i for i, (_, p) in enumerate(named)}
    buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
    for group in explicit:
        members = sorted((p for p in group if p in position), key=lambda p: -position[p])
        split: dict[tuple[Any, torch.dtype], list] = {}
        for p in members:
            split.setdefault((p.device, communication_dtype(p.dtype)), []).append(
                (named[position[p]][0], p)
            )
        buckets.extend(split.values())
    return sorted(buckets, key=lambda bucket: -position[bucket[0][1]])


def _named(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
):
    """(name, parameter) for every parameter of the optimizer, in the optimizer's order;
    Horovod's checks on named_parameters."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"noname.{i}", p) for i, p in enumerate(in_optimizer)]
    named = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
        raise ValueError(
            "named_parameters must be (name, parameter) pairs, as from model.named_parameters()"
        )
    named = [(stable_name(n), p) for n, p in named]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(in_optimizer) if p not in by_param]
    if missing:
        raise ValueError(
            f"named_parameters does not name the optimizer's parameters at "
            f"positions {missing}: pass model.named_parameters() of the model whose "
            "parameters the optimizer holds"
        )
    return [(by_param[p], p) for p in in_optimizer]


SYNCHRONIZED_TWICE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). The gradients were averaged once, by synchronize(); step() does "
    "not synchronise them again (Horovod's own optimizer would, at the cost of a second "
    "all-reduce). Use optimizer.skip_synchronize() around step() after synchronize()."
)


STEP_SKIPPING_SYNCHRONIZE = (
    "optimizer.step() inside optimizer.skip_synchronize() before this step's gradients were "
    "synchronised: each rank would step on its own gradients and the replicas would drift "
    "apart. Call optimizer.synchronize() first (then clip or unscale the averaged gradients), "
    "then step inside skip_synchronize(), as with Horovod."
)


CHANGED_AFTER_SENT = (
    "spardl_grace: the gradients of {names} changed after backward() handed them to the "
    "synchronisation, and step() would overwrite the change with the average of what was "
    "sent (a GradScaler's unscale_, which scaler.step() calls, would leave the scaled "
    "gradient for the step). Change the averaged gradients instead, as with Horovod: "
    "loss.backward(); optimizer.synchronize(); scaler.unscale_(optimizer); "
    "clip_grad_norm_(...); then `with optimizer.skip_synchronize(): scaler.step(optimizer)`"
)

NOT_SYNCHRONISED = (
    "spardl_grace: {names} have gradients, but this DistributedOptimizer does not synchronise "
    "them (frozen, requires_grad=False, when it wrapped the optimizer, or added to the "
    "optimizer afterwards), so the ranks' replicas would drift apart: wrap the optimizer "
    "again once they train (the new wrapper takes the parameters over; "
    "new.load_compression_state_dict(old.compression_state_dict()) carries the residuals)"
)


def _some(names: list[str]) -> str:
    """The first three of `names` and how many more."""
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _BucketSlot:
    def __init__(self, members: list[tuple[str, torch.nn.Parameter]]):
        self.params = [p for _, p in members]
        self.bucket = Bucket(tuple(n for n, _ in members), tuple(p.numel() for p in self.params))
        self.dtype = communication_dtype(self.params[0].dtype)
        # Gradients already in the communication dtype are flattened into a pooled buffer.
        self.flattens_in_place = all(p.dtype == self.dtype for p in self.params)
        self.ready = 0
        #: each parameter's gradient as it was sent, and its version then (None: no gradient)
        self.sent: list[tuple[torch.Tensor, int] | None] = []

    def changed_since_sent(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient was changed in place, or replaced, after the bucket
        was sent."""
        return [
            p
            for p, sent in zip(self.params, self.sent)
            if sent is not None and (p.grad is not sent[0] or p.grad._version != sent[1])
        ]


#: id(parameter) -> (the parameter, the DistributedOptimizer whose gradient hook synchronises
#: it), both weakly (a WeakKeyDictionary would compare tensors with ==, element-wise)
_SYNCHRONISED_BY: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _synchronised_by(p: torch.Tensor) -> _DistributedOptimizer | None:
    entry = _SYNCHRONISED_BY.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


SUPERSEDED = (
    "this DistributedOptimizer no longer synchronises: a later DistributedOptimizer was built "
    "over its parameters and took them over. Step the later one"
)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class (see DistributedOptimizer)."""

    def _setup(
        self,
        grace: Synchronizer,
        named,
        backward_passes_per_step: int,
        buckets: list[list[tuple[str, torch.nn.Parameter]]],
        dense_warmup_steps: int,
        min_numel: int,
        overlap: bool,
        first_step_timeout: float,
        scale: tuple[float, float] = (1.0, 1.0),
        sparse_as_dense: bool = False,
        adam_freeze_step: int = 0,
        exchange: str = "gradient",
        outer: tuple[int, float, float] = (1, 1.0, 0.0),
    ) -> None:
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        self._sync = GradientSync(
            grace,
            dense_warmup_steps,
            min_numel,
            overlap,
            "spardl-comm",
            first_step_timeout,
            [n for n, _ in named],
            {n: tuple(p.shape) for n, p in named},
        )
        self._adam_freeze_step = adam_freeze_step
        self._exchange = exchange
        self._exchange_period, self._outer_lr, self._outer_momentum = outer
        # 'exchange': 'update''s parameters at the last exchange (None: not taken yet), the
        # outer step's momentum buffers, and the own steps since the last exchange, per bucket
        self._anchor: list[torch.Tensor] | None = None
        self._outer_buffers: list[torch.Tensor | None] | None = None
        self._local_steps = 0
        self._momentum_correction = getattr(grace.memory, "momentum_correction", 0.0)
        self.backward_passes_per_step = backward_passes_per_step
        self._slots = [_BucketSlot(m) for m in buckets]
        self._scale_before, self._scale_after = scale
        self._sparse_as_dense = sparse_as_dense
        self._was_sparse: set[torch.nn.Parameter] = set()
        self._slot_of = {p: i for i, slot in enumerate(self._slots) for p in slot.params}
        self._names = {p: n for n, p in named}
        self._passes = dict.fromkeys(self._slot_of, 0)
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        # Autograd runs a model on two devices on two threads, each calling _on_gradient:
        # counting a gradient and launching the buckets whose turn has come is one step.
        self._launching = threading.Lock()
        self._flat_pool = BufferPool()  # each bucket's flat gradients, reused once released
        self._synchronized = False
        #: whether a step that synchronises (not one that only creates the optimizer's state,
        #: as Horovod's broadcast_optimizer_state and torch.distributed.checkpoint take) came
        self._resume_checked = False
        self._gradients_synchronized = False  # this step's gradients, by synchronize()
        self._should_synchronize = True
        #: the spardl_grace.join_uneven_inputs block this optimizer is in (None: none): each
        #: synchronising step first tells the ranks that ran out which optimizer steps
        self._join: Any = None
        self._superseded = False
        self._take_over_from_earlier()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient) for p in self._slot_of
        ]
        for p in self._slot_of:
            _SYNCHRONISED_BY[id(p)] = (weakref.ref(p), weakref.ref(self))

    def _take_over_from_earlier(self) -> None:
        """Retire the DistributedOptimizers built earlier over any of these parameters (a
        second wrap of the same optimizer, a notebook cell run again): their gradient hooks go,
        so each gradient is synchronised once, by this one, and their step() raises. Warns,
        since their residuals stay with them; ValueError while a step of theirs is under way."""
        earlier = {
            id(o): o
            for p in self._slot_of
            if (o := _synchronised_by(p)) is not None and not o._superseded
        }
        if any(o._in_a_step for o in earlier.values()):
            raise ValueError(
                "an earlier DistributedOptimizer over these parameters is in a step "
                "(backward() ran, step() did not): build the new one between steps"
            )
        for old in earlier.values():
            for hook in old._hooks:
                hook.remove()
            old._superseded = True
            warnings.warn(
                "spardl_grace: this DistributedOptimizer takes over parameters that an earlier "
                "one synchronised; the earlier one no longer synchronises (its step() "
                "raises). Its residuals stay with it: with the same communicator, "
                "new.load_compression_state_dict(earlier.compression_state_dict()) carries "
                "them over",
                RuntimeWarning,
                stacklevel=4,
            )

    @property
    def grace(self) -> Synchronizer:
        return self._sync.grace

    @property
    def _in_a_step(self) -> bool:
        """Whether a step is under way: gradients counted or buckets sent since the last
        step() or synchronize()."""
        return bool(self._pending) or any(self._passes.values())

    @property
    def _exchanges_updates(self) -> bool:
        """Whether this step exchanges the optimizer's step ('exchange': 'update'), not the
        gradient: from the first step on, or with 'adam_freeze_step' W once the W dense
        gradient steps that estimate the shared second moment are done. Counted in the steps
        before this one: synchronize() called before step() in the W-th dense step has counted
        that step already, and that step must still end with the optimizer's own update."""
        done = self._sync.steps - int(self._gradients_synchronized)
        return self._exchange == "update" and done >= self._adam_freeze_step

    @property
    def buckets(self) -> list[Bucket]:
        return [slot.bucket for slot in self._slots]

    @property
    def last_stats(self) -> dict[str, float]:
        """The last synchronised step's statistics (bytes sent, entries, seconds selecting,
        coding and communicating), summed over its buckets."""
        return self._sync.last_stats

    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        with self._launching:
            self._count_gradient(p)

    def _count_gradient(self, p: torch.nn.Parameter) -> None:
        if self._synchronized and not self._in_a_step:
            # A new backward after synchronize() with no step in between (a step skipped on
            # purpose): its gradients are this step's, not yet synchronised.
            self._synchronized = self._gradients_synchronized = False
        self._passes[p] += 1
        if self._passes[p] > self.backward_passes_per_step:
            raise RuntimeError(
                f"the gradient of '{self._names[p]}' was computed {self._passes[p]} times before "
                f"step() or synchronize(), with backward_passes_per_step="
                f"{self.backward_passes_per_step}: raise backward_passes_per_step to accumulate "
                "gradients locally"
            )
        if self._passes[p] == self.backward_passes_per_step and not self._exchanges_updates:
            slot = self._slots[self._slot_of[p]]
            slot.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose turn has come and whose gradients are
        all in."""
        while len(self._pending) < len(self._slots):
            slot = self._slots[len(self._pending)]
            if slot.ready < len(slot.params):
                return
            self._launch(slot)

    def _launch(self, slot: _BucketSlot) -> None:
        if self._join is not None and not self._pending:
            self._join.announce(self)
        self._densify(slot)
        out = (
            self._flat_pool.take(
                slot.bucket.key, slot.bucket.numel, slot.dtype, slot.params[0].device
            )
            if slot.flattens_in_place
            else None
        )
        flat = flatten_grads(slot.params, slot.dtype, out)
        slot.sent = [(p.grad, p.grad._version) if p.grad is not None else None for p in slot.params]
        if self._scale_before != 1.0:
            flat.mul_(self._scale_before)
        self._pending.append(self._sync.submit(flat, slot.bucket))

    def _densify(self, slot: _BucketSlot) -> None:
        """Sparse gradients (nn.Embedding(sparse=True)) made dense for the synchronisation
        with sparse_as_dense, and made sparse again after it, as Horovod does; ValueError
        without it."""
        for p in slot.params:
            if p.grad is None or p.grad.layout == torch.strided:
                continue
            if not self._sparse_as_dense:
                raise ValueError(
                    f"the gradient of '{self._names[p]}' is sparse (an nn.Embedding with "
                    "sparse=True): pass sparse_as_dense=True to synchronise it dense, as with "
                    "Horovod's sparse_as_dense (spardl_grace does not all-gather sparse "
                    "gradients)"
                )
            p.grad = p.grad.to_dense()
            self._was_sparse.add(p)

    def _finish(self, slot: _BucketSlot, result: torch.Tensor) -> None:
        """The bucket's synchronised gradients into .grad, in Horovod's scale for its op."""
        assign_grads(slot.params, result)
        for p in slot.params:
            if self._scale_after != 1.0:
                cast(torch.Tensor, p.grad).mul_(self._scale_after)
            if p in self._was_sparse:
                p.grad = cast(torch.Tensor, p.grad).to_sparse()

    def synchronize(self) -> None:
        """Finish this step's communication and write the averaged gradients into .grad.
        Buckets whose gradients never arrived (unused parameters) are sent with zeros for
        the missing ones, so every rank takes part in every bucket. With 'exchange':
        'update' the gradients stay this rank's own (step() exchanges the updates), so this
        only closes the backward passes."""
        if self._superseded:
            raise RuntimeError(SUPERSEDED)
        if self._exchanges_updates:
            self._passes = dict.fromkeys(self._passes, 0)
            self._synchronized = True
            return
        with self._launching:
            while len(self._pending) < len(self._slots):
                self._launch(self._slots[len(self._pending)])
        try:
            self._sync.wait_queued()  # within the transport's timeout, unlike future.wait()
            self._check_unchanged_since_sent()
            for slot, future in zip(self._slots, self._pending):
                self._finish(slot, future.wait())
        finally:
            self._pending = []
            self._was_sparse = set()
            for slot in self._slots:
                slot.ready = 0
            self._passes = dict.fromkeys(self._passes, 0)
            self._sync.end_step()
        self._synchronized = True
        self._gradients_synchronized = True

    def _check_unchanged_since_sent(self) -> None:
        """RuntimeError, before any gradient is overwritten, when a gradient changed after its
        bucket was sent: the average written into .grad would undo the change (a GradScaler's
        unscale_ would leave the scaled average for the step)."""
        changed = [self._names[p] for slot in self._slots for p in slot.changed_since_sent()]
        if changed:
            raise RuntimeError(CHANGED_AFTER_SENT.format(names=_some(changed)))

    def _check_every_gradient_synchronised(self) -> None:
        """ValueError when a parameter of the optimizer that requires a gradient has one but
        is not among those this wrapper synchronises (frozen when it wrapped the optimizer, or
        added to it later): its replicas would drift apart. The step's synchronisation is
        finished first, on every rank alike, so that a new wrapper can take over."""
        unsynchronised = [
            self._names.get(p, f"a parameter of shape {tuple(p.shape)}")
            for group in cast(torch.optim.Optimizer, self).param_groups
            for p in group["params"]
            if p.requires_grad and p.grad is not None and p not in self._slot_of
        ]
        if unsynchronised:
            if not self._synchronized:
                self.synchronize()
            self._synchronized = self._gradients_synchronized = False
            raise ValueError(NOT_SYNCHRONISED.format(names=_some(unsynchronised)))

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """step() inside this block does not synchronise: call synchronize() first, change the
        averaged gradients (clipping, unscaling), then step, as with Horovod."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronise (unless synchronize() already did, or inside skip_synchronize()) and
        step. A step on an optimizer without state, after no backward pass, with every
        gradient zero, is how Horovod's broadcast_optimizer_state creates the state on the
        ranks that have none while the others wait for it: that step does not synchronise and
        leaves the parameters as they were (see _creates_state)."""
        if self._superseded:
            raise RuntimeError(SUPERSEDED)
        for shared in sharing_state(cast(torch.optim.Optimizer, self)):
            # what torch's LRScheduler checks, on whichever of them it was built
            shared._opt_called = True  # type: ignore[attr-defined]
        if not self._resume_checked and not self._creates_state():
            self._resume_checked = True
            warn_if_resumed_afresh(
                cast(torch.optim.Optimizer, self),
                self._sync.grace.restored,
                "optimizer.compression_state_dict()",
            )
        self._check_every_gradient_synchronised()
        if self._exchanges_updates:
            self._synchronized = False
            return (
                self._create_state(closure)
                if self._creates_state()
                else self._exchange_update(closure)
            )
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(SYNCHRONIZED_TWICE, stacklevel=2)
            elif self._creates_state():
                return self._create_state(closure)
            else:
                self.synchronize()
        elif not self._synchronized and self._in_a_step:
            raise RuntimeError(STEP_SKIPPING_SYNCHRONIZE)
        self._synchronized = self._gradients_synchronized = False
        frozen = bool(self._adam_freeze_step) and self._sync.steps > self._adam_freeze_step
        return self._own_step(closure, frozen)

    def _own_step(self, closure, frozen: bool):
        """The optimizer's update from .grad, returning the closure's loss: an Adam's with its
        second moment frozen (spardl_grace.frozen_adam) when `frozen`, else the wrapped
        optimizer's own step, with momentum correction's momentum handed over for it."""
        if frozen:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            frozen_step(cast(torch.optim.Optimizer, self))
            return loss
        with (
            momentum_handed_over(cast(torch.optim.Optimizer, self), self._momentum_correction),
            inner_step(cast(torch.optim.Optimizer, self)),
        ):
            # The wrapped optimizer's class follows this mixin in the MRO (see
            # DistributedOptimizer).
            return super().step(closure)  # type: ignore[misc]

    def _exchange_update(self, closure):
        """'exchange': 'update': the wrapped optimizer steps on this rank's own gradients
        (with 'adam_freeze_step', Adam's update with the shared second moment frozen). Every
        'exchange_period' such steps, each rank's move since the last exchange (the
        parameters then minus now, in the communication dtype) is synchronised bucket by
        bucket as a gradient would be (compressed, with the memory's error feedback), and
        every rank takes the outer step from the parameters of the last exchange (see
        _outer_step), the same bits on every rank."""
        if self._anchor is None:
            self._anchor = [flatten_params(slot.params, slot.dtype) for slot in self._slots]
        loss = self._own_step(closure, frozen=bool(self._adam_freeze_step))
        self._local_steps += 1
        if self._local_steps < self._exchange_period:
            self._passes = dict.fromkeys(self._passes, 0)
            return loss
        if self._join is not None:
            self._join.announce(self)
        try:
            for slot, anchor in zip(self._slots, self._anchor):
                moved = anchor - flatten_params(slot.params, slot.dtype)
                self._pending.append(self._sync.submit(moved, slot.bucket))
            self._sync.wait_queued()
            for i, (slot, future) in enumerate(zip(self._slots, self._pending)):
                assign_params(slot.params, self._outer_step(i, future.wait()))
        finally:
            self._pending = []
            self._passes = dict.fromkeys(self._passes, 0)
            self._local_steps = 0
            self._sync.end_step()
        # The next moves start from what the parameters hold now (rounded to their dtype);
        # exchanging every step, from what they hold when that step begins, so a change the
        # user's loop makes between steps stays the user's and is not sent as a move.
        self._anchor = (
            None
            if self._exchange_period == 1
            else [flatten_params(slot.params, slot.dtype) for slot in self._slots]
        )
        return loss

    def _outer_step(self, i: int, average: torch.Tensor) -> torch.Tensor:
        """Bucket i's parameters after an exchange: its anchor minus 'outer_lr' times the
        averaged move, with 'outer_momentum' m > 0 the move made Nesterov's with torch.optim.SGD's
        formulas (buffer = m * buffer + move, the first one the move itself; step = move + m *
        buffer): DiLoCo's outer optimizer. Updates the anchor in place."""
        anchor = cast(list[torch.Tensor], self._anchor)[i]
        if self._outer_momentum:
            if self._outer_buffers is None:
                self._outer_buffers = [None] * len(self._slots)
            buffer = self._outer_buffers[i]
            if buffer is None:
                buffer = self._outer_buffers[i] = average.clone()
            else:
                buffer.mul_(self._outer_momentum).add_(average)
            average = average.add(buffer, alpha=self._outer_momentum)
        if self._outer_lr == 1.0:
            return anchor.sub_(average)
        return anchor.add_(average, alpha=-self._outer_lr)

    def _step_without_data(self) -> None:
        """The other ranks' synchronising step, taken by a rank whose data ran out
        (spardl_grace.join): every bucket sent with zero gradients (the memory adds its
        residuals as on any step), in bucket order, the averages dropped, no optimizer step."""
        try:
            for slot in self._slots:
                zeros = torch.zeros(
                    slot.bucket.numel, dtype=slot.dtype, device=slot.params[0].device
                )
                self._pending.append(self._sync.submit(zeros, slot.bucket))
            self._sync.wait_queued()
            for future in self._pending:
                future.wait()
        finally:
            self._pending = []
            self._sync.end_step()

    def _creates_state(self) -> bool:
        """Whether this step() only creates the optimizer's state: Horovod's
        broadcast_optimizer_state fills zero gradients and calls step() on the ranks whose
        optimizer has no state, and only there (its own optimizer skips its all-reduce; with
        ours the other ranks would wait forever). Such a step has no state yet, no backward
        pass since the last step, and zero gradients, so its average is zero everywhere."""
        if self.state or self._pending or any(self._passes.values()):  # type: ignore[attr-defined]
            return False
        return all(p.grad is None or not p.grad.any() for p in self._slot_of)

    def _create_state(self, closure):
        """The wrapped optimizer's step on the zero gradients, creating its state, with the
        parameters put back (weight decay would move them on these ranks only)."""
        before = [p.detach().clone() for p in self._slot_of]
        result = self._own_step(closure, frozen=False)
        with torch.no_grad():
            for p, kept in zip(self._slot_of, before):
                p.copy_(kept)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise RuntimeError(
                "zero_grad() was called after backward() and before step() or "
                "synchronize(): the gradients are being communicated. Call "
                "zero_grad() before backward(), or step()/synchronize() first"
            )
        # The wrapped optimizer's class follows this mixin in the MRO (see DistributedOptimizer).
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    @property
    def _keeps_outer_state(self) -> bool:
        """Whether 'exchange': 'update' carries state from one step to the next: local steps
        between exchanges, or the outer step's momentum."""
        return self._exchange == "update" and (
            self._exchange_period > 1 or self._outer_momentum > 0
        )

    def compression_state_dict(self) -> dict[str, Any]:
        """This rank's compression state (residuals, step counters, thresholds, warm-up
        progress; with 'exchange_period' or 'outer_momentum', the outer state too: see
        _outer_state_dict); save it per rank next to optimizer.state_dict(). Loads with
        torch.load(weights_only=True)."""
        state = self._sync.state_dict()
        if self._keeps_outer_state:
            state["outer"] = self._outer_state_dict()
        return state

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from compression_state_dict(); ValueError if it was written by a run with
        another number of workers (residuals and schedules do not carry over), or without the
        outer state this run's 'exchange_period' or 'outer_momentum' needs."""
        outer = state.get("outer")
        if self._keeps_outer_state and outer is None:
            raise ValueError(
                "this checkpoint holds no outer state ('exchange': 'update' with "
                "'exchange_period' or 'outer_momentum' keeps the parameters of the last "
                "exchange and the outer momentum): it was written by a run without them"
            )
        self._sync.load_state_dict(state)
        if outer is not None:
            self._load_outer_state_dict(outer)

    def _outer_state_dict(self) -> dict[str, Any]:
        """The state 'exchange_period' and 'outer_momentum' carry between steps, the same on
        every rank by design: the steps since the last exchange, the parameters then and the
        outer momentum (per bucket; None before the first)."""
        return {
            "local_steps": self._local_steps,
            "anchor": None if self._anchor is None else [a.clone() for a in self._anchor],
            "momentum": None
            if self._outer_buffers is None
            else [None if b is None else b.clone() for b in self._outer_buffers],
        }

    def _load_outer_state_dict(self, outer: dict[str, Any]) -> None:
        """Take an _outer_state_dict(), its tensors moved to the buckets' devices."""

        def placed(tensors):
            if tensors is None:
                return None
            return [
                None if t is None else t.to(slot.params[0].device)
                for t, slot in zip(tensors, self._slots)
            ]

        self._local_steps = int(outer["local_steps"])
        self._anchor = placed(outer["anchor"])
        self._outer_buffers = placed(outer["momentum"])


def _step_through_the_wrapper(wrapped: torch.optim.Optimizer) -> None:
    """A learning-rate scheduler built on the optimizer before the wrap replaced its step with
    an instance attribute (torch's LRScheduler records that the optimizer stepped); copied
    with the optimizer's state it would shadow the wrapper's step() and step the plain
    optimizer alone, unsynchronised. It goes: the wrapper's own step() records the step for
    every scheduler of either (_DistributedOptimizer.step). TypeError for any other step set
    on the instance, which would shadow it just the same."""
    own = wrapped.__dict__.pop("step", None)
    if own is not None and not getattr(own, "_wrapped_by_lr_sched", False):
        name = getattr(own, "__qualname__", own)
        raise TypeError(
            f"the optimizer's step was replaced on the instance ({name!r}), which would "
            "shadow DistributedOptimizer's step(): wrap the optimizer first, then patch the "
            "wrapper's step"
        )


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    grace: Synchronizer | Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    backward_passes_per_step: int = 1,
    *,
    compression: Any = None,
    op: int | None = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    bucket_cap_mb: float | None = None,
    dense_warmup_steps: int = 0,
    min_numel: int = 0,
    overlap: bool = True,
    first_step_timeout: float = FIRST_STEP_TIMEOUT_S,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() applies gradients averaged over all ranks by `grace`.

    The result is an instance of a subclass of the optimizer's own class sharing its state,
    so learning-rate schedulers and optimizer.state_dict() work unchanged. The call forms of
    Horovod 0.28 (DistributedOptimizer(optimizer, named_parameters=..., compression=..., op=...,
    ...), or named_parameters second) and of GRACE (DistributedOptimizer(optimizer, grc,
    named_parameters=...), or grace=grc) are accepted as they are.

    grace: a communicator from grace_from_params(...); None: SparDL at density 0.01 with the
        default floor of 2,048 entries a step on the compact wire (horovod_compat.DEFAULT_PARAMS
        and grace_from_params' defaults) on the active backend.
    named_parameters: model.named_parameters(); names key the residuals in checkpoints.
    backward_passes_per_step: backward passes whose gradients are summed locally before one
        synchronisation.
    compression, op, gradient_predivide_factor, num_groups, groups, sparse_as_dense,
        process_set: Horovod's keywords with Horovod's meaning (spardl_grace.horovod_compat):
        Compression.none or .fp16 (16-bit values on the wire), hvd.Average or hvd.Sum, the
        predivide split of the average, explicit groups as buckets, sparse gradients made
        dense, the global process set only; anything else raises ValueError naming the valid
        choices.
    bucket_cap_mb: fuse gradients into buckets of at most this size (None: one bucket per
        device and dtype, the whole model); not with groups.
    dense_warmup_steps: the first steps are synchronised dense (grace_from_params'
        'dense_warmup_steps' says the same; give one or the other). With grace_from_params'
        'adam_freeze_step' W (an Adam or AdamW only), the first W steps are dense whatever
        this says, and from step W on step() runs the optimizer's update with its second
        moment frozen (spardl_grace.frozen_adam).
    min_numel: buckets smaller than this are synchronised dense.
    overlap: communicate from a background thread while backward goes on (off automatically
        for an MPI library without thread support).
    first_step_timeout: the first step in this process waits at most this many seconds (60)
        for the other ranks, so a step that only some ranks take fails fast (TransportTimeout);
        later steps wait the transport's timeout.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    if grace is not None and not isinstance(grace, Synchronizer):
        if named_parameters is not None:
            raise TypeError(
                f"the second argument must be a grace communicator (grace_from_params(...)), "
                f"got {type(grace).__name__}"
            )
        grace, named_parameters = None, grace  # Horovod's DistributedOptimizer(opt, named)
    check_process_set(process_set)
    wire = compression_name(compression)
    if grace is None:
        grace = default_grace()
    check_compression(wire, grace)
    before, after = scale_factors(op, gradient_predivide_factor, grace.world_size)
    if grace.exchange == "update" and (before, after) != (1.0, 1.0):
        raise ValueError(
            "'exchange': 'update' averages the ranks' optimizer steps: op must be Average and "
            "gradient_predivide_factor 1.0"
        )
    if groups is not None or num_groups:
        if bucket_cap_mb is not None:
            raise ValueError("pass groups (Horovod's) or bucket_cap_mb, not both")
    mc = getattr(grace.memory, "momentum_correction", 0.0)
    if mc:  # only ResidualMemory has momentum_correction, and with it nesterov
        memory = cast(ResidualMemory, grace.memory)
        memory.nesterov = uses_nesterov(taken_over_groups(optimizer, mc))
    if grace.adam_freeze_step:
        check_optimizer(optimizer, grace.adam_freeze_step)
    advise_adam_user(optimizer, grace, "DistributedOptimizer")
    every = _named(optimizer, named_parameters)  # frozen ones too: their residuals may resume
    named = [(n, p) for n, p in every if p.requires_grad]
    explicit = parameter_groups(groups, num_groups, [p for _, p in named])
    cls: type[_DistributedOptimizer] = type(
        optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {}
    )
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    _step_through_the_wrapper(cast(torch.optim.Optimizer, wrapped))
    inherit_steps(cast(torch.optim.Optimizer, wrapped), optimizer)  # its state came from them
    if hasattr(wrapped, "_patch_step_function"):  # torch's step hooks and profiling
        wrapped._patch_step_function()
    wrapped._setup(
        grace,
        every,
        backward_passes_per_step,
        plan_buckets(named, bucket_cap_mb, explicit) if named else [],
        dense_warmup_steps,
        min_numel,
        overlap,
        first_step_timeout,
        (before, after),
        sparse_as_dense,
        grace.adam_freeze_step,
        grace.exchange,
        (grace.exchange_period, grace.outer_lr, grace.outer_momentum),
    )
    return cast(torch.optim.Optimizer, wrapped)  # cls derives from the optimizer's own class
