"""'topka': top-k all-gather (TopkA), the simplest sparse all-reduce.

Every worker selects the exact top-k of |A| (k = floor(rho*n)), all-gathers its coded entries
(int32 indices, values), and every worker sums the P pieces in rank order (so all get the
same bits) and divides by P. The result has up to kP non-zeros.

Cost per worker: log P latency terms (with a tree/recursive all-gather), 2k(P-1) words.
Residual: A minus what the others decode from our piece, so with the identity codec A with
the sent entries zeroed; conservation holds exactly and rho = 1 is the dense average.

'gaussiank' is the same exchange with the selection of Shi et al.'s Gaussian-k: a threshold
from a normal fit of A (no sort), refined a few times towards k entries.
"""

from __future__ import annotations

import torch

from ..selection import count_for_ratio, topk_abs
from ._base import CodedAllreduce
from .exchange import Exchange

# Gaussian-k's refinement (reference code): up to 3 corrections while the count is outside
# [2k/3, 4k/3]: halve the threshold when too few are selected, raise it by 1.5 when too many.
GAUSSIAN_REFINEMENTS = 3
GAUSSIAN_BAND = (2 / 3, 4 / 3)
GAUSSIAN_LOWER, GAUSSIAN_RAISE = 0.5, 1.5


class TopkA(CodedAllreduce):
    """The 'topka' communicator. Use with memory 'global_residual' (or 'residual'/'none')."""

    PHASES = ("gather",)

    def select(self, tensor: torch.Tensor, k: int) -> torch.Tensor:
        """int64 positions this worker sends: the exact top-k of |tensor|."""
        return topk_abs(tensor, k, self.scratch)

    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        residual = self.working_copy(tensor, name)  # A, less what the others decode from us
        with ex.selecting():
            chosen = self.select(tensor, count_for_ratio(n, self.density_at(step, n)))
        with ex.phase("gather"):
            mine = ex.take(residual, chosen, str(ex.rank))
            pieces = ex.allgather(mine.data)
        result = self.zeros_for_result(name, tensor)
        support = []
        for rank, data in enumerate(pieces):
            # Our own piece decodes to what its encoding reported: no need to decode it.
            idx, vals = (
                (mine.indices, mine.values)
                if rank == ex.rank
                else ex.decode(data, n, tensor, str(rank))
            )
            result.index_add_(0, idx, vals)
            support.append(idx)
        # Zeros need no division; a position sent by several ranks is written several times
        # with the same quotient.
        positions = torch.cat(support)
        result.index_copy_(0, positions, result.index_select(0, positions) / ex.size)
        self.record_support(name, result, positions)
        return result, residual


class GaussianK(TopkA):
    """The 'gaussiank' communicator: TopkA with a threshold estimated from a normal fit of the
    compensated gradient instead of an exact top-k; the count varies around k."""

    def select(self, tensor: torch.Tensor, k: int) -> torch.Tensor:
        n = tensor.numel()
        if k >= n:
            return torch.arange(n, device=tensor.device)
        magnitude = tensor.abs()
        work = tensor.float()
        quantile = float(torch.special.ndtri(torch.tensor(1.0 - k / (2 * n), dtype=torch.float64)))
        threshold = float(work.mean().abs() + work.std(unbiased=False) * quantile)
        low, high = GAUSSIAN_BAND
        for _ in range(GAUSSIAN_REFINEMENTS):
            count = int((magnitude > threshold).sum())
            if count < low * k:
                threshold *= GAUSSIAN_LOWER
            elif count > high * k:
                threshold *= GAUSSIAN_RAISE
            else:
                break
        chosen = torch.nonzero(magnitude > threshold).reshape(-1)
        return chosen if chosen.numel() else topk_abs(tensor, 1)
