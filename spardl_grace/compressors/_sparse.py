"""Shared pieces of the sparsifying compressors: (values, indices) <-> dense."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def count_for_ratio(numel: int, ratio: float) -> int:
    """How many entries a ratio keeps: at least one of a non-empty tensor (GRACE's rule)."""
    return min(numel, max(1, int(numel * ratio))) if numel else 0


def topk_abs(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64) of the k largest |flat|, in no particular order."""
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return torch.topk(flat.abs(), k, sorted=False).indices


def desparsify(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
    dense[indices.long()] = values
    return dense


class SparseCompressorMixin:
    """decompress for compressors that send [values, indices] with ctx = (numel, shape)."""

    def decompress(self, tensors: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        values, indices = tensors
        numel, shape = ctx
        return desparsify(values, indices, numel).view(shape)
