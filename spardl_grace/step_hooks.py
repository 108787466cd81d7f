"""What the library does inside the steps of optimizers it does not own.

Under the DDP hook and FSDP2 the user's optimizer steps on its own, yet two options need a
hand in that step: momentum correction takes an SGD's momentum over for the step
(spardl_grace.momentum), and 'adam_freeze_step' runs an Adam's update with its second moment
frozen (spardl_grace.frozen_adam); and the DDP hook counts the steps taken, to tell an
accumulation without no_sync() from a step it did not see. watch(model, holder, where)
registers, once per process, torch's global optimizer step pre- and post-hooks; before a step
of any optimizer that updates a watched holder's parameters each option does its part (and
the holder checks, once, that a resumed optimizer came with its compression state:
spardl_grace.checkpoint.warn_if_resumed_afresh); a step given a closure computes its
gradients inside it, so there each option acts once the closure has run; after
the step what it changed for the step is put back (before the next step, if the step raised)
and every such holder is told that a step was taken (a step that raised is not counted).
One more global post-hook, registered on import, counts every optimizer's steps in this
process (steps_taken), so a state loaded from a checkpoint can be told from one made here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

#: model -> (a DDP hook state or FSDP2's ShardSync, the integration's name), for as long as the
#: model lives (a second watch of the model replaces the first); the holder has
#: momentum_correction, adam_freeze_step, synchronized_steps, grace_in_use (its communicator
#: once it has synchronised, else None), holds_parameters_of(optimizer), check_resumed(optimizer)
#: (before each step) and optimizer_stepped()
_WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str]] = weakref.WeakKeyDictionary()
_HOOKS: list[Any] = []
#: optimizers in a step: what puts back what the options changed for it
_UNDO: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Callable[[], None]]] = (
    weakref.WeakKeyDictionary()
)


#: optimizer -> the steps it took in this process (counted from the import of this module,
#: which every way into the library makes before a user's script builds its optimizer)
_STEPS_TAKEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


#: optimizers inside a step of their own class's that a wrapping step calls (a
#: DistributedOptimizer's step calls its optimizer class's, and torch hooks both)
_INNER: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


#: a wrapper -> the optimizer whose state it shares (inherit_steps): its steps are that one's
#: too, so a second wrapper built from the same optimizer counts the first one's steps
_SHARES_STATE_OF: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.optim.Optimizer] = (
    weakref.WeakKeyDictionary()
)


def sharing_state(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """`optimizer`, then the optimizer whose state it shares (inherit_steps), and so on."""
    chain = []
    current: torch.optim.Optimizer | None = optimizer
    while current is not None:
        chain.append(current)
        current = _SHARES_STATE_OF.get(current)
    return chain


def _count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _INNER:
        return
    for current in sharing_state(optimizer):
        _STEPS_TAKEN[current] = _STEPS_TAKEN.get(current, 0) + 1


@contextmanager
def inner_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, a step of `optimizer` is part of an outer one, counted once."""
    _INNER.add(optimizer)
    try:
        yield
    finally:
        _INNER.discard(optimizer)


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """How many steps `optimizer` took in this process: state it holds beyond them came from
    elsewhere (a checkpoint)."""
    return _STEPS_TAKEN.get(optimizer, 0)


def inherit_steps(new: torch.optim.Optimizer, old: torch.optim.Optimizer) -> None:
    """`new` shares `old`'s state (a wrapper built from it): it counts `old`'s steps, and its
    own steps count for `old` too."""
    _STEPS_TAKEN[new] = steps_taken(old)
    _SHARES_STATE_OF[new] = old


#: optimizers whose state a join gave them from another rank (spardl_grace.join): it is that
#: rank's, made in its steps (which its own first step checked), not a checkpoint's
_STATE_FROM_A_PEER: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def state_came_from_a_peer(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer`'s state was just taken from another rank of this run, at a join's end."""
    _STATE_FROM_A_PEER.add(optimizer)


def has_state_from_a_peer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a join gave `optimizer` another rank's state (state_came_from_a_peer)."""
    return optimizer in _STATE_FROM_A_PEER


register_optimizer_step_post_hook(_count)


def watch(model: torch.nn.Module, holder: Any, where: str) -> None:
    """Act in every step of any optimizer that updates `holder`'s parameters, for as long as
    `model` lives (the caller may drop `holder`, which must hold no strong reference to
    `model`). `where` names the integration in errors."""
    _register()
    _WATCHED[model] = (holder, where)


def _register() -> None:
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before))
        _HOOKS.append(register_optimizer_step_post_hook(_after))


#: id of a parameter a sharding took out of its model -> (a weak reference to it, the
#: function that did); an entry leaves when its parameter is freed
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def mark_replaced(parameters: Iterable[torch.Tensor], where: str) -> None:
    """`parameters` are no longer their model's (`where`, a sharding, registered new ones in
    their place): from now on a step of an optimizer that holds any of them raises
    RuntimeError before it runs, since it could change nothing the model uses."""
    _register()
    for p in parameters:
        _REPLACED[id(p)] = (weakref.ref(p, _forgetting(id(p))), where)


def _forgetting(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _REPLACED.pop(key, None)

    return forget


def _refuse_replaced(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                where = entry[1]
                raise RuntimeError(
                    f"this {type(optimizer).__name__} holds the parameters the model had "
                    f"before {where}, which fully_shard replaced with sharded ones: its steps "
                    "would change nothing the model uses, and the model would not train. "
                    f"Build the optimizer after {where}, from model.parameters()"
                )


def _before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    _put_back(optimizer)  # a step that raised left its changes in place
    if _REPLACED:
        _refuse_replaced(optimizer)
    for holder, where in list(_WATCHED.values()):
        if not holder.holds_parameters_of(optimizer):
            continue
        # torch passes the step's own arguments, the optimizer first
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            _take_over(optimizer, holder, where)
            return None
        # The step computes its gradients in the closure (Lightning's automatic optimisation
        # passes one): the options act once it has run, on what it synchronised.
        return _with_closure(args, kwargs, _after_closure(closure, optimizer, holder, where))
    return None


def _after_closure(
    closure: Callable[[], Any], optimizer: torch.optim.Optimizer, holder: Any, where: str
) -> Callable[[], Any]:
    """`closure`, after whose first call the options act (_take_over)."""
    taken = False

    def closure_then_take_over() -> Any:
        nonlocal taken
        loss = closure()
        if not taken:
            taken = True
            _take_over(optimizer, holder, where)
        return loss

    return closure_then_take_over


def _with_closure(args: Any, kwargs: Any, closure: Callable[[], Any]) -> tuple[Any, Any]:
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def _take_over(optimizer: torch.optim.Optimizer, holder: Any, where: str) -> None:
    """What each option does before `optimizer` updates `holder`'s parameters (the module
    docstring), with what puts it back after the step."""
    from .adam_advice import warn_once_for
    from .frozen_adam import take_over_step
    from .momentum import take_over_momentum

    holder.check_resumed(optimizer)
    warn_once_for(holder, optimizer, holder.grace_in_use, where)
    undo: list[Callable[[], None]] = []
    try:
        undo += take_over_momentum(optimizer, holder, where)
        undo += take_over_step(optimizer, holder, where)
    except BaseException:
        for action in reversed(undo):
            action()
        raise
    _UNDO[optimizer] = undo


def _after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _put_back(optimizer)
    for holder, _ in list(_WATCHED.values()):
        if holder.holds_parameters_of(optimizer):
            holder.optimizer_stepped()


def _put_back(optimizer: torch.optim.Optimizer) -> None:
    for action in reversed(_UNDO.pop(optimizer, [])):
        action()
