"""Shared pieces of the sparsifying compressors: (values, indices) <-> dense."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def count_for_ratio(numel: int, ratio: float) -> int:
    """How many entries a ratio keeps: at least one of a non-empty tensor (GRACE's rule)."""
    return min(numel, max(1, int(numel * ratio))) if numel else 0


PREFILTER_MIN_NUMEL = 1 << 16  # below this torch.topk is as fast as the prefilter
PREFILTER_SAMPLE = 1 << 14
PREFILTER_MARGIN = 1.5         # aim the threshold at about 1.5 k candidates


class Scratch:
    """Buffers reused from call to call, one per purpose: allocating (and first touching) a
    gradient-sized tensor costs as much as a pass over it, so per-step temporaries live here.
    A buffer is valid until the next get() for the same purpose."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of `numel` entries (contents undefined)."""
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype \
                or buffer.device != device:
            buffer = self._buffers[purpose] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


def topk_abs(flat: torch.Tensor, k: int, scratch: Scratch | None = None) -> torch.Tensor:
    """Indices (int64) of the k largest |flat|, in no particular order.

    For large tensors and k <= n/8, a threshold t is first estimated from an evenly strided
    sample so that about 1.5 k entries have |x| >= t, and torch.topk runs over those
    candidates only. Whenever at least k entries pass, the candidates hold every entry of the
    top k, so the result is the exact top-k (ties at the k-th magnitude may be broken
    differently); otherwise the full torch.topk runs. On a CPU this is several times faster
    than torch.topk over all entries (benchmarks.comm measures it). With `scratch`, the
    magnitudes and the candidate mask are written into its buffers instead of new tensors
    (same result)."""
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if scratch is None:
        magnitudes = flat.abs()
    else:
        magnitudes = torch.abs(flat, out=scratch.get("magnitudes", n, flat.dtype, flat.device))
    if n >= PREFILTER_MIN_NUMEL and k <= n // 8:
        stride = n // PREFILTER_SAMPLE
        sample = magnitudes[::stride]
        rank = min(sample.numel(), math.ceil(sample.numel() * PREFILTER_MARGIN * k / n) + 8)
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        if scratch is None:
            mask = magnitudes >= threshold
        else:
            mask = torch.ge(magnitudes, threshold, out=scratch.get("mask", n, torch.bool, flat.device))
        candidates = torch.nonzero(mask).reshape(-1)
        if candidates.numel() >= k:
            return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    return torch.topk(magnitudes, k, sorted=False).indices


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
