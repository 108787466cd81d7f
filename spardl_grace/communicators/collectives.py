"""Building blocks shared by the sparse all-reduces beside their Exchange (which holds the
counted collectives, the Bruck all-gather and the sparse reduce-scatter): realigning sparse
values, and the distributed radix select of the k-th magnitude over all ranks."""

from __future__ import annotations

import torch

from .exchange import Exchange

RADIX_BITS = 4  # digit width of the distributed radix select: 16 counters per round


def realign(indices: torch.Tensor, values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """values[i] where indices[i] == t, for each t in `targets`, and 0 where `indices` (sorted
    ascending, unique) does not contain t."""
    out = torch.zeros(targets.numel(), dtype=values.dtype, device=values.device)
    if indices.numel() == 0 or targets.numel() == 0:
        return out
    pos = torch.searchsorted(indices, targets).clamp_(max=indices.numel() - 1)
    hit = indices[pos] == targets
    out[hit] = values[pos[hit]]
    return out


_INT_OF_WIDTH = {16: torch.int16, 32: torch.int32, 64: torch.int64}


def _magnitude_bits(values: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """|values| as non-negative int64 ordered like the magnitudes, and the same-width int dtype."""
    as_int = _INT_OF_WIDTH[values.element_size() * 8]
    return values.abs().view(as_int).to(torch.int64), as_int


def global_kth_magnitude(ex: Exchange, values: torch.Tensor, k: int) -> torch.Tensor:
    """The exact k-th largest |v| over the union of every rank's `values` (one floating dtype
    on every rank), as a 0-d tensor of that dtype; 0 when fewer than k values exist in all.

    A radix select on the magnitudes' bit patterns (non-negative floats order like their bits):
    one all-reduce of 2**RADIX_BITS counters per digit (in `ex`'s current phase), so the volume
    is independent of k and of the number of values. Every rank returns the same bits."""
    bits, as_int = _magnitude_bits(values)
    width = values.element_size() * 8
    total = int(ex.allreduce(torch.tensor([values.numel()], dtype=torch.int64), "n")[0])
    if k <= 0 or total < k:
        return torch.zeros((), dtype=values.dtype)
    radix = 1 << RADIX_BITS
    prefix, remaining = 0, k
    candidates = bits
    for r, shift in enumerate(range(width - RADIX_BITS, -1, -RADIX_BITS)):
        digits = (candidates >> shift) & (radix - 1)
        counts = ex.allreduce(torch.bincount(digits, minlength=radix).cpu(), r)
        at_least = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])
        digit = int(torch.nonzero(at_least >= remaining).max())
        remaining -= int(at_least[digit] - counts[digit])
        prefix |= digit << shift
        candidates = candidates[digits == digit]
    return torch.tensor([prefix], dtype=torch.int64).to(as_int).view(values.dtype)[0]
