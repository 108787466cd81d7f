"""Shared pieces of the sparsifying compressors: (values, indices) <-> dense."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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
