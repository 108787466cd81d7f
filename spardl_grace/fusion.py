"""Gradient fusion: the whole model's gradients as one flat buffer, and back.

SparDL selects per block of the *fused* gradient, so one step over the flat buffer (rather
than one per layer) gives it the whole model to balance and the fewest messages."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def flatten_grads(
    params: Iterable[torch.nn.Parameter],
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradients of `params` concatenated (zeros for parameters without a gradient), in
    `dtype` if given; written into `out` (a 1-D tensor of the total size) where every gradient
    already has its dtype and device, which saves allocating a gradient-sized tensor."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    if out is not None and all(g.dtype == out.dtype and g.device == out.device for g in grads):
        return torch.cat(grads, out=out)
    flat = torch.cat(grads)
    return flat if dtype is None else flat.to(dtype)


def assign_grads(params: Iterable[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set each parameter's .grad to its slice of `flat` (the inverse of flatten_grads): copied
    into the existing .grad where it is a plain contiguous tensor of the parameter's shape,
    dtype and device (no allocation, as Horovod does), a new tensor otherwise. Never a view of
    `flat`."""
    params = list(params)
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat buffer has {flat.numel()} entries, the parameters {total}")
    offset = 0
    for p in params:
        part = flat[offset : offset + p.numel()].view_as(p)
        grad = p.grad
        if (
            grad is not None
            and grad.layout == torch.strided
            and grad.is_contiguous()
            and grad.shape == p.shape
            and grad.dtype == p.dtype
            and grad.device == p.device
        ):
            grad.copy_(part)
        else:
            p.grad = part.to(p.dtype).clone()
        offset += p.numel()


def flatten_params(params: Iterable[torch.nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
    """The parameters' values back to back in `dtype`: a new tensor, never a view of them."""
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


def assign_params(params: Iterable[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy each parameter's slice of `flat` (the inverse of flatten_params) into the
    parameter, in its own dtype."""
    params = list(params)
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat buffer has {flat.numel()} entries, the parameters {total}")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
