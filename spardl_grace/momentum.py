"""Momentum correction with the optimizer as the user built it.

DGC's momentum correction (grace_from_params' 'momentum_correction': m) keeps the momentum in
the gradient memory, before the sparse all-reduce (or 'auto'), so the optimizer must not apply
it a second time. The user's torch.optim.SGD(momentum=m, weight_decay=wd, nesterov=...)
stays as it is: for the length of each step the library runs it without momentum (the memory
holds it: a velocity per name, masked where a sparse result was applied) and with weight decay
wd / (1 - m), the steady-state decay that momentum gives wd (DGC's recipe), then puts the
groups back. Its param_groups and state_dict() keep the user's values; the velocities are in
the compression state, so checkpoints carry them. DistributedOptimizer does this in its own
step(); the DDP hook and FSDP2, whose optimizers step on their own, through torch's global
step hooks (spardl_grace.step_hooks). Nesterov momentum runs as DGC's Nesterov variant (the
memory accumulates g + m * u instead of u). An SGD built without momentum (DGC's own recipe,
weight decay scaled by hand) runs as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

#: what each taken-over group is given for the step: momentum, nesterov, weight decay
_SAVED = ("momentum", "nesterov", "weight_decay")


def taken_over_groups(optimizer: torch.optim.Optimizer, m: float) -> list[dict[str, Any]]:
    """The param groups whose momentum the memory takes over (momentum m); ValueError for a
    group whose momentum the memory cannot stand in for: another value than m, dampening,
    or an optimizer other than SGD with momentum (Adam's moments are not DGC's velocity)."""
    groups = []
    for group in optimizer.param_groups:
        # Adam's family keeps its momentum as betas[0], its first moment
        momentum = group.get("momentum", 0.0) or group.get("betas", (0.0,))[0]
        if not momentum:
            continue
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(
                f"momentum correction ({m}) stands in for SGD's momentum; "
                f"{type(optimizer).__name__} has momentum {momentum} of its own (Adam's first "
                "moment is not DGC's velocity): leave momentum_correction at 0, or give the "
                "optimizer no momentum"
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


def take_over_momentum(optimizer: torch.optim.Optimizer, holder: Any, where: str) -> list:
    """For spardl_grace.step_hooks: hand the momentum of `optimizer` over for its step when
    `holder` runs momentum correction; what puts it back after. A Nesterov SGD is refused: the
    memory must run DGC's Nesterov variant from the first backward on, before `where` sees the
    optimizer."""
    m = holder.momentum_correction
    if not m:
        return []
    groups = taken_over_groups(optimizer, m)
    if uses_nesterov(groups):
        raise ValueError(
            "momentum correction with nesterov=True is DGC's Nesterov variant, which the memory "
            f"must run from the first backward on, before {where} sees the optimizer: use "
            "spardl_grace.DistributedOptimizer, or nesterov=False"
        )
    saved = hand_over(groups, m)
    return [lambda: restore(groups, saved)]
