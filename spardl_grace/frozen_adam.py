"""Adam with its second moment frozen: the optimizer-aware sparse synchronisation for Adam and
AdamW (grace_from_params' 'adam_freeze_step').

Top-k with error feedback hands the optimizer a gradient that is zero at most entries on most
steps, and the residual an entry has gathered when it is finally sent. Adam divides each entry
by the root of its own running mean square, so that burst moves the entry by about one step of
full size whatever it holds: what error feedback held back is lost, and the entries that are
rarely sent barely move. 1-bit Adam's remedy (Tang et al., 2021) makes the update linear: the
first steps are synchronised dense and Adam runs as it is, then its second moment is frozen
and the update is the momentum of the synchronised gradient divided by the frozen root, so a
burst of k steps' gradients moves an entry as far as the k steps would have.

frozen_step() is that update on a torch.optim.Adam or AdamW's own param_groups and state
(DistributedOptimizer calls it in its step; under the DDP hook, whose optimizer steps on its
own, spardl_grace.step_hooks runs it before the optimizer's step and hides the gradients from
that step): the
learning rate (and its scheduler), betas, eps, weight decay (decoupled for AdamW, added to the
gradient for Adam) and maximize are the user's; the first moment and the step count carry on
in the optimizer's state, the second moment is left as it was, and each parameter's state
records the step its variance was frozen at ('variance_frozen_at'), so optimizer.state_dict()
resumes it.
"""

from __future__ import annotations

from typing import Any

import torch

#: the optimizers whose update frozen_step() knows
ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)


def check_optimizer(optimizer: torch.optim.Optimizer, freeze_step: int) -> None:
    """ValueError unless `optimizer` is an Adam or AdamW that frozen_step() can continue:
    without amsgrad (its running maximum is a second moment that would go on moving)."""
    if not isinstance(optimizer, ADAM_FAMILY):
        raise ValueError(
            f"'adam_freeze_step' ({freeze_step}) freezes the second moment of torch.optim.Adam "
            f"or AdamW; the optimizer is {type(optimizer).__name__} (for SGD, leave it at 0 "
            "and use 'momentum_correction' if you want DGC's)"
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ValueError("'adam_freeze_step' freezes Adam's second moment: amsgrad=False only")


@torch.no_grad()
def frozen_step(optimizer: torch.optim.Optimizer) -> None:
    """One Adam/AdamW step on the parameters' .grad with the second moment frozen at the
    value it had after the optimizer's last own step (see the module docstring).
    RuntimeError for a parameter with a gradient but no Adam state: it had no gradient during
    the dense steps, so it has no second moment to freeze."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if "exp_avg_sq" not in state:
                raise RuntimeError(
                    "a parameter of shape "
                    f"{tuple(p.shape)} has a gradient but no Adam state: it had none during the "
                    "dense steps before 'adam_freeze_step', so it has no second moment to freeze"
                )
            if "variance_frozen_at" not in state:
                state["variance_frozen_at"] = torch.as_tensor(
                    state["step"], dtype=torch.float32
                ).clone()
            grad = -p.grad if group["maximize"] else p.grad
            if decay and decoupled:
                p.mul_(1 - lr * decay)
            elif decay:
                grad = grad.add(p, alpha=decay)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            variance = state["exp_avg_sq"] / (1 - beta2 ** float(state["variance_frozen_at"]))
            p.addcdiv_(state["exp_avg"], variance.sqrt_().add_(eps), value=-lr / (1 - beta1**step))


def take_over_step(optimizer: torch.optim.Optimizer, holder: Any, where: str) -> list:
    """For spardl_grace.step_hooks (the DDP hook): once `holder` has synchronised more than its
    adam_freeze_step steps, run frozen_step() on `optimizer` and hide the gradients from the
    optimizer's own step, which then leaves every parameter alone; what gives the gradients
    back after it. ValueError (naming `where`) when the optimizer is not an Adam it can
    continue."""
    freeze = getattr(holder, "adam_freeze_step", 0)
    if not freeze:
        return []
    check_optimizer(optimizer, freeze)
    if holder.synchronized_steps <= freeze:
        return []
    frozen_step(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None

    def give_back() -> None:
        for p, grad in zip(params, grads):
            p.grad = grad

    return [give_back]


def refuse_without_the_step(freeze_step: int, where: str) -> None:
    """ValueError for 'adam_freeze_step' on a path that cannot run it: FSDP2 has no dense
    steps to estimate the second moment from."""
    if freeze_step:
        raise ValueError(
            f"'adam_freeze_step' ({freeze_step}) needs dense steps to estimate Adam's second "
            f"moment, which {where} does not run: use spardl_grace.DistributedOptimizer or the "
            "DDP hook, or leave 'adam_freeze_step' at 0"
        )
