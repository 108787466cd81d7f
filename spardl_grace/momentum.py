"""Momentum correction with the optimizer as the user built it.

DGC's momentum correction (grace_from_params' 'momentum_correction': m) keeps the momentum in
the gradient memory, before the sparse all-reduce, so the optimizer must not apply it a second
time. The user's torch.optim.SGD(momentum=m, weight_decay=wd, nesterov=...) stays as it is:
for the length of each step the library runs it without momentum (the memory holds it: a
velocity per name, masked where the result was applied) and with weight decay wd / (1 - m),
the steady-state decay that momentum gives wd (DGC's recipe), then puts the groups back. Its
param_groups and state_dict() keep the user's values; the velocities are in the compression
state, so checkpoints carry them. DistributedOptimizer does this in its own step(); the DDP
hook and FSDP2, whose optimizers step on their own, through torch's global step hooks
(watch). Nesterov momentum runs as DGC's Nesterov variant (the memory accumulates
g + m * u instead of u). An SGD built without momentum (DGC's own recipe, weight decay
scaled by hand) runs as it is.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

#: what each taken-over group is given for the step: momentum, nesterov, weight decay
_SAVED = ("momentum", "nesterov", "weight_decay")


def taken_over_groups(optimizer: torch.optim.Optimizer, m: float) -> list[dict[str, Any]]:
    """The param groups whose momentum the memory takes over (momentum m); ValueError for a
    group whose momentum the memory cannot stand in for: another value than m, dampening,
    or an optimizer other than SGD with momentum (Adam's moments are not DGC's velocity)."""
    groups = []
    for group in optimizer.param_groups:
        momentum = group.get("momentum", 0.0)
        if not momentum:
            continue
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(
                f"momentum correction ({m}) stands in for SGD's momentum; "
                f"{type(optimizer).__name__} has momentum {momentum} of its own: give it "
                "momentum=0, or leave momentum_correction at 0"
            )
        if momentum != m or group.get("dampening", 0.0):
            raise ValueError(
                f"momentum correction ({m}) takes over the optimizer's momentum, which is "
                f"{momentum} with dampening {group.get('dampening', 0.0)}: build SGD with "
                f"momentum={m} (and dampening 0), or with momentum=0 and weight decay already "
                "scaled by 1/(1 - m) (DGC's recipe)"
            )
        groups.append(group)
    return groups


def uses_nesterov(groups: list[dict[str, Any]]) -> bool:
    """Whether the taken-over groups ask for Nesterov momentum; ValueError if only some do
    (one memory holds one velocity rule)."""
    kinds = {bool(group.get("nesterov", False)) for group in groups}
    if len(kinds) > 1:
        raise ValueError(
            "momentum correction runs one velocity rule for the whole model: the optimizer's "
            "groups mix nesterov=True and nesterov=False"
        )
    return kinds == {True}


def hand_over(groups: list[dict[str, Any]], m: float) -> list[tuple[Any, ...]]:
    """Set each group to run without momentum and with weight decay / (1 - m); return what
    restore() puts back."""
    saved = [tuple(group[k] for k in _SAVED) for group in groups]
    for group in groups:
        group.update(momentum=0.0, nesterov=False, weight_decay=group["weight_decay"] / (1 - m))
    return saved


def restore(groups: list[dict[str, Any]], saved: list[tuple[Any, ...]]) -> None:
    """Put back the momentum, nesterov and weight decay that hand_over() saved."""
    for group, values in zip(groups, saved):
        group.update(zip(_SAVED, values))


@contextlib.contextmanager
def momentum_handed_over(optimizer: torch.optim.Optimizer, m: float) -> Iterator[None]:
    """Within the block, the optimizer's taken-over groups run without their momentum (see
    the module docstring); afterwards, and after an exception, they are as the user built
    them."""
    groups = taken_over_groups(optimizer, m) if m else []
    saved = hand_over(groups, m)
    try:
        yield
    finally:
        restore(groups, saved)


#: what takes over momentum for optimizers it does not own, by the model it serves, for as
#: long as that lives: model -> (a DDP hook state or FSDP2's ShardSync, the integration's name)
_WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str]] = weakref.WeakKeyDictionary()
_HOOKS: list[Any] = []
#: optimizers in a step whose momentum is taken over: their groups and what to give back
_HANDED_OVER: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple] = weakref.WeakKeyDictionary()


def watch(model: torch.nn.Module, holder: Any, where: str) -> None:
    """Take the momentum over in every step of any optimizer that updates `holder`'s
    parameters, through torch's global optimizer step hooks, for as long as `model` lives
    (the caller may drop `holder`). `holder` has `momentum_correction` (0: nothing to do) and
    `holds_parameters_of(optimizer)`, and holds no strong reference to `model`; a Nesterov
    SGD is refused, since the memory must run DGC's Nesterov variant from the first backward
    on, before the optimizer is seen."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_hand_over))
        _HOOKS.append(register_optimizer_step_post_hook(_give_back))
    _WATCHED[model] = (holder, where)


def _hand_over(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _give_back(optimizer, args, kwargs)  # a step that raised kept its groups handed over
    for holder, where in list(_WATCHED.values()):
        m = holder.momentum_correction
        if m and holder.holds_parameters_of(optimizer):
            groups = taken_over_groups(optimizer, m)
            if uses_nesterov(groups):
                raise ValueError(
                    "momentum correction with nesterov=True is DGC's Nesterov variant, which "
                    f"the memory must run from the first backward on, before {where} sees the "
                    "optimizer: use spardl_grace.DistributedOptimizer, or nesterov=False"
                )
            _HANDED_OVER[optimizer] = (groups, hand_over(groups, m))
            return


def _give_back(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    handed = _HANDED_OVER.pop(optimizer, None)
    if handed is not None:
        restore(*handed)
