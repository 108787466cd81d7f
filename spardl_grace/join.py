"""Uneven inputs under DistributedOptimizer: ranks whose data run out at different steps.

    with spardl_grace.join_uneven_inputs(optimizer) as joined:
        for x, y in loader:            # a different number of batches on each rank
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    joined.last_rank                   # the rank that ran out last: every rank now holds its model

What Horovod's hvd.join() and torch's Join do for their own collectives, on the library's
channel, under any launcher (horovodrun, torchrun, mpirun). Every DistributedOptimizer the loop
steps goes into one block (join_uneven_inputs(opt_g, opt_d) for a GAN). Inside it, each step
that synchronises begins with one all-reduce of one number per optimizer: which optimizer
steps, from the ranks that still have data. A rank whose loop has ended waits at the block's
exit and takes part in the others' steps with zero gradients (zero moves with 'exchange':
'update'; its memory adds its residuals, as on any step), without an optimizer step: its
residuals and step counters move on as the others' do, so every rank stays at the same step,
and the average is still over all ranks, as DDP's Join divides by the initial world size.
Once every rank has ended, every rank takes the parameters and the optimizer states of the
rank that ended last (the highest rank among those that ended at the last step; with
'exchange_period', the one with the most local steps not yet exchanged), so the parameters
are the same bits when the block ends; residuals and module buffers stay each rank's own.
Collectives of the user's own inside the loop are not stood in for (they would wait for the
ranks in the block). Whatever else counts the steps a rank took, a learning-rate scheduler
stepped per batch or AMP's GradScaler, goes in `stateful=[...]`: every rank takes its state from
the same rank at the end, otherwise each rank's copy counts its own steps. For an optimizer
none of whose schedulers is in `stateful`, every rank warns at the end when a torch scheduler
was built on it and the ranks took different numbers of its steps, or when its learning rate
(or another setting of a parameter group) was not the last rank's.

Under the DDP hook, torch's Join runs the hook with DDP's zero buckets on the ranks that ended;
`Join([ddp_model, SameOptimizerState(optimizer, stateful=[...])])` gives every rank the last
rank's optimizer state (and the `stateful` objects' states) as well as DDP's parameters (see the
integrations guide).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from .agreement import agree
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .step_hooks import sharing_state, state_came_from_a_peer, steps_taken
from .transport import Transport, TransportError, shared_transport


@runtime_checkable
class Stateful(Protocol):
    """What `stateful=` takes: an object with state_dict() and load_state_dict(state), such as
    a torch LR scheduler or torch.amp.GradScaler (the protocol of
    torch.distributed.checkpoint's Stateful), whose state is whole on every rank: one rank's is
    sent to the others, so a sharded state (DTensors) does not belong here."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state, as torch.save can write it."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state that state_dict() gave."""
        ...


class UnevenInputs:
    """The block join_uneven_inputs(*optimizers) returns; after it ends, `last_rank` is the
    rank whose parameters and optimizer states every rank took (hvd.join()'s return value)
    and `steps_without_data` the steps (of any of the optimizers) this rank took part in
    after its own loop ended."""

    def __init__(
        self, optimizers: tuple[torch.optim.Optimizer, ...], stateful: Iterable[Stateful] = ()
    ):
        if not optimizers:
            raise ValueError("join_uneven_inputs takes the DistributedOptimizers of the loop")
        for optimizer in optimizers:
            if not hasattr(optimizer, "_sync") or not hasattr(optimizer, "_slots"):
                raise TypeError(
                    "join_uneven_inputs takes spardl_grace.DistributedOptimizers, got "
                    f"{type(optimizer).__name__}: under the DDP hook use torch's "
                    "torch.distributed.algorithms.Join([ddp_model, "
                    "spardl_grace.join.SameOptimizerState(optimizer)])"
                )
            if not optimizer._slots:
                raise ValueError(
                    "join_uneven_inputs: an optimizer has no parameter that needs a gradient, "
                    "so its steps never synchronise and there is nothing to join"
                )
        if len({id(o) for o in optimizers}) != len(optimizers):
            raise ValueError("join_uneven_inputs: an optimizer is given twice")
        if any(o._superseded for o in optimizers):  # type: ignore[attr-defined]
            raise ValueError(
                "join_uneven_inputs: an optimizer was taken over by a later DistributedOptimizer "
                "over its parameters: give the later one"
            )
        self.optimizers: tuple[Any, ...] = optimizers
        self.stateful = _checked_stateful(stateful)
        self.transport = _vote_channel(optimizers)
        self.last_rank: int | None = None
        self.steps_without_data = 0
        self._steps_at_entry: list[int] = []

    def __enter__(self) -> UnevenInputs:
        for optimizer in self.optimizers:
            if optimizer._join is not None:
                raise ValueError(
                    "join_uneven_inputs: an optimizer is already inside such a block; give "
                    "every optimizer of the loop to one block: join_uneven_inputs(a, b)"
                )
            if optimizer._in_a_step:
                raise ValueError(
                    "join_uneven_inputs: a step is under way (backward() ran, step() did "
                    "not): enter the block before the loop"
                )
        _agree_on_kinds(self.transport, self.stateful)  # before the loop, not after it
        for optimizer in self.optimizers:
            optimizer._join = self
        self._steps_at_entry = [steps_taken(o) for o in self.optimizers]
        return self

    def announce(self, optimizer: Any, has_data: bool = True) -> torch.Tensor:
        """The ranks' votes on the step about to begin: one all-reduce of one number per
        optimizer, 1 at `optimizer`'s place from each rank that steps it (the ranks with data,
        before its first bucket), 0 from the ranks that ran out. ValueError on every rank
        when the ranks with data step different optimizers."""
        votes = torch.zeros(len(self.optimizers), dtype=torch.int64)
        if has_data:
            mine = self.optimizers.index(optimizer)
            others = [o for o in self.optimizers if o is not optimizer]
            if any(o._in_a_step for o in others):
                raise ValueError(
                    "join_uneven_inputs: two of the block's optimizers synchronise in one "
                    "backward pass (parameter groups split between them): a rank that ran out "
                    "takes one optimizer's step at a time, so give them one "
                    "DistributedOptimizer"
                )
            votes[mine] = 1
        votes = self.transport.allreduce(votes, "join.ranks_with_data")
        if torch.count_nonzero(votes) > 1:
            raise ValueError(
                "join_uneven_inputs: the ranks that have data step different optimizers at "
                f"once (votes by position in the block's list: {votes.tolist()}): every rank "
                "must step them in the same order"
            )
        return votes

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if kind is None:
                for optimizer in self.optimizers:
                    # A loop left between backward() and step(): the step is under way on
                    # the ranks that took it, so finish its exchange, without the optimizer's
                    # step (announced as any step is, if no bucket of it has gone yet).
                    if optimizer._in_a_step:
                        optimizer.synchronize()
                        optimizer._synchronized = optimizer._gradients_synchronized = False
        finally:
            for optimizer in self.optimizers:
                optimizer._join = None
        if kind is not None:
            return
        last = True
        while (votes := self.announce(None, has_data=False)).any():
            last = False
            self.optimizers[int(votes.argmax())]._step_without_data()
            self.steps_without_data += 1
        root = self._last_to_end(last)
        for optimizer in self.optimizers:
            broadcast_parameters(
                [(name, p) for p, name in optimizer._names.items()], root, self.transport
            )
        _take_states(
            self.transport,
            root,
            self.optimizers,
            self.stateful,
            [steps_taken(o) - n for o, n in zip(self.optimizers, self._steps_at_entry)],
            "join_uneven_inputs(optimizer, stateful=[scheduler])",
        )
        self.last_rank = self.transport.global_rank(root)

    def _last_to_end(self, last: bool) -> int:
        """The rank whose model every rank takes: among those that ended at the last step, the
        one with the most local steps not yet exchanged ('exchange': 'update' with
        'exchange_period'), the highest rank of those."""
        kept = sum(o._local_steps for o in self.optimizers)
        return _highest_claim(self.transport, (1 + kept) * int(last))


def _highest_claim(transport: Transport, claim: int) -> int:
    """The highest rank among those whose `claim` is the largest (one all-reduce; every rank
    gets the same answer). A claim of 0 is no claim, and some rank must make one."""
    claims = torch.zeros(transport.size, dtype=torch.int64)
    claims[transport.rank] = claim
    claims = transport.allreduce(claims, "join.ended_last")
    return int(torch.nonzero(claims == claims.max()).max())


def _checked_stateful(objects: Iterable[Stateful]) -> tuple[Stateful, ...]:
    if isinstance(objects, Stateful) or not isinstance(objects, Iterable):
        raise TypeError(
            f"stateful= takes a list of objects, got a {type(objects).__name__}: "
            "stateful=[scheduler]"
        )
    objects = tuple(objects)
    for obj in objects:
        if not isinstance(obj, Stateful):
            raise TypeError(
                "stateful= takes objects with state_dict() and load_state_dict() (an LR "
                f"scheduler, a GradScaler), got {type(obj).__name__}"
            )
    return objects


def _take_states(
    transport: Transport,
    root: int,
    optimizers: tuple[torch.optim.Optimizer, ...],
    stateful: tuple[Stateful, ...],
    steps_in_block: list[int],
    how_to_pass: str,
) -> None:
    """Every rank takes root's optimizer states and `stateful` states (the ranks agreed on
    their kinds first: _agree_on_kinds), raises ValueError on every rank when some rank could
    not load one, then warns (every rank, at once) about each optimizer none of whose
    schedulers came along when the ranks took different numbers of its steps in the block
    (`steps_in_block`, this rank's) and a torch scheduler was built on it, or when its
    parameter-group settings were not root's (a learning rate set by hand from the rank's own
    count): either way the ranks' learning rates differ once it changes them."""
    own = [_group_settings(o) for o in optimizers]
    for optimizer in optimizers:
        broadcast_optimizer_state(optimizer, root, transport)
        state_came_from_a_peer(optimizer)
    failed, failure = 0, ""
    for i, obj in enumerate(stateful):
        state = broadcast_object(
            obj.state_dict() if transport.rank == root else None,
            root,
            transport,
            f"join.stateful.{i}",
        )
        if transport.rank != root and not failed:
            try:
                obj.load_state_dict(state)
            except Exception as exc:  # every rank raises below, not this one alone
                failed, failure = i + 1, f" ({type(exc).__name__}: {exc})"
    # by rank: this block's steps of each optimizer, whether its settings were root's, and
    # the first stateful object it could not load (1-based; 0: none), in one all-reduce
    seen = torch.zeros(transport.size, len(optimizers) + 2, dtype=torch.int64)
    seen[transport.rank, :-2] = torch.tensor(steps_in_block, dtype=torch.int64)
    seen[transport.rank, -2] = int(
        any(
            _group_settings(o) != settings and not _scheduled_in(o, stateful)
            for o, settings in zip(optimizers, own)
        )
    )
    seen[transport.rank, -1] = failed
    seen = transport.allreduce(seen, "join.steps_and_settings")
    if seen[:, -1].any():
        ranks = [transport.global_rank(int(r)) for r in torch.nonzero(seen[:, -1]).flatten()]
        obj = stateful[int(seen[:, -1][seen[:, -1] > 0].min()) - 1]
        raise ValueError(
            f"spardl_grace.join: ranks {ranks} could not load the last rank's state of "
            f"{type(obj).__qualname__}{failure}: give every rank the same kind of object, "
            "built alike"
        )
    uneven = [
        seen[:, i].tolist()
        for i, o in enumerate(optimizers)
        if _has_a_scheduler(o)
        and not _scheduled_in(o, stateful)
        and len(set(seen[:, i].tolist())) > 1
    ]
    differed = [transport.global_rank(int(r)) for r in torch.nonzero(seen[:, -2]).flatten()]
    if not uneven and not differed:
        return
    why = []
    if uneven:
        why.append(
            "the ranks took different numbers of steps of an optimizer with a learning-rate "
            f"scheduler (this block's steps by rank: {uneven[0]}) and the scheduler was not "
            "passed to the block"
        )
    if differed:
        why.append(
            f"the learning rate (or another parameter-group setting) of ranks {differed} "
            f"differed from rank {transport.global_rank(root)}'s, whose state every rank took"
        )
    warnings.warn(
        f"spardl_grace.join: {'; and '.join(why)}. If it counts each rank's own steps (a "
        "scheduler stepped per batch, a learning rate set from the loop's count), the ranks' "
        "learning rates differ once it changes them, and their replicas drift apart; one "
        f"stepped per epoch is safe. Pass the scheduler along either way: {how_to_pass}",
        RuntimeWarning,
        stacklevel=3,
    )


def _agree_on_kinds(transport: Transport, stateful: tuple[Stateful, ...]) -> None:
    agree(
        transport,
        "the join's stateful objects",
        {"kinds": [type(o).__qualname__ for o in stateful]},
    )


def _has_a_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a torch LRScheduler was built on `optimizer` or on the optimizer it wraps,
    before the wrap or after it: torch's LRScheduler marks the step it puts on the optimizer
    to record that it stepped."""
    return any(hasattr(o.step, "_wrapped_by_lr_sched") for o in sharing_state(optimizer))


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def _scheduled_in(optimizer: torch.optim.Optimizer, stateful: tuple[Stateful, ...]) -> bool:
    """Whether a scheduler of `optimizer` is among `stateful` (a wrapper shares its base
    optimizer's param_groups, so a scheduler built on either counts)."""
    return any(
        getattr(getattr(obj, "optimizer", None), "param_groups", None) is optimizer.param_groups
        for obj in stateful
    )


def _vote_channel(optimizers: tuple[Any, ...]) -> Transport:
    """The transport the block's votes and final broadcasts go over: the optimizers' own when
    they share one; else the process's channel for one-off collectives (shared_transport),
    which no communication thread uses (grace_from_params gives each communicator a channel of
    its own, so a GAN's two optimizers have two)."""
    transports = {id(o._sync.grace.transport): o._sync.grace.transport for o in optimizers}
    if len(transports) == 1:
        return next(iter(transports.values()))
    try:
        return shared_transport()
    except TransportError as exc:
        raise ValueError(
            "join_uneven_inputs: the optimizers synchronise over different transports and no "
            f"launcher's backend is active to carry the block's votes ({exc}): build their "
            "communicators on one transport"
        ) from exc


def join_uneven_inputs(
    *optimizers: torch.optim.Optimizer, stateful: Iterable[Stateful] = ()
) -> UnevenInputs:
    """A block inside which ranks may run out of data at different steps (see the module
    docstring): every rank enters it before its loop, with every DistributedOptimizer that
    synchronises the loop's steps (a GAN's two in one block), all on one transport, and in
    `stateful` whatever else counts the loop's steps (a scheduler stepped per batch, a
    GradScaler), the same kinds in the same order on every rank. A loop
    left between backward() and step() has that step's exchange finished at the exit. A
    block left by an exception does not wait for the others (their next step then fails with
    the transport's timeout, as without the block). TypeError for an optimizer that is not a
    DistributedOptimizer (the DDP hook takes torch's Join), ValueError for one without
    trainable parameters, one already in a block, or optimizers on different transports;
    TypeError for a `stateful` object without state_dict/load_state_dict, and ValueError on
    every rank as the block begins when the ranks gave different kinds of them, and at its
    end when some rank cannot load the last rank's state of one."""
    return UnevenInputs(optimizers, stateful)


class SameOptimizerState(Joinable):
    """For torch's Join with the DDP hook: `Join([ddp_model, SameOptimizerState(optimizer)])`.
    DDP's Join gives every rank the parameters of the rank that ended last (the highest of
    those that ended at the last step), not its optimizer's state, so with momentum or Adam the
    ranks' states, and from then on their replicas, would differ. At the block's end this
    gives every rank that rank's optimizer state too (spardl_grace.broadcast_optimizer_state,
    over `transport`, default the library's channel), and the `stateful` objects' states (a
    scheduler stepped per batch, a GradScaler: as join_uneven_inputs's). `process_group`:
    DDP's, when it was given one (Join needs its joinables to share it)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        transport: Transport | None = None,
        process_group: Any = None,
        stateful: Iterable[Stateful] = (),
    ):
        super().__init__()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"SameOptimizerState takes a torch.optim optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.transport = transport
        self.process_group = process_group
        self.stateful = _checked_stateful(stateful)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook whose post_hook broadcasts the optimizer's state from the last rank."""
        return _BroadcastStateAtEnd(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the optimizer's first parameter (Join's own count uses the first
        joinable's, DDP's)."""
        return self.optimizer.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> Any:
        """DDP's process group: the one given, else the default group. ValueError when this
        comes first in Join's list: the first joinable tells Join which ranks still have
        data, which DDP's forward does and this cannot."""
        import torch.distributed as dist

        if self._join_config.is_first_joinable and self._join_config.enable:
            raise ValueError(
                "SameOptimizerState goes after the DDP model in Join's list: "
                "Join([ddp_model, SameOptimizerState(optimizer)])"
            )
        return self.process_group if self.process_group is not None else dist.group.WORLD


class _BroadcastStateAtEnd(JoinHook):
    def __init__(self, joinable: SameOptimizerState):
        self.joinable = joinable
        self.steps_at_start = steps_taken(joinable.optimizer)  # Join asks for it as it begins

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the optimizer state of the rank DDP's Join takes the parameters
        from: the highest rank among the last to join (DDP's _sync_final_model's rule)."""
        transport = self.joinable.transport or shared_transport()
        _agree_on_kinds(transport, self.joinable.stateful)
        root = _highest_claim(transport, int(is_last_joiner))
        _take_states(
            transport,
            root,
            (self.joinable.optimizer,),
            self.joinable.stateful,
            [steps_taken(self.joinable.optimizer) - self.steps_at_start],
            "SameOptimizerState(optimizer, stateful=[scheduler])",
        )
