"""'topkdsa': TopkDSA, SparCML's split all-gather (Renggli et al.).

The flat tensor is split into P equal regions (length R = ceil(n/P), zero padded); worker j
owns region j.
1. Direct-send sparse reduce-scatter: every worker selects its exact local top-k of |A| and
   sends the entries that fall in region j (region-relative int32 indices) to worker j, in one
   all-to-all (the backend rotates destinations r+1, r+2, ...); worker j sums what it
   receives, in rank order.
2. All-gather of the reduced regions, each sparse or dense, whichever is smaller: the sparse
   message when its coded size is below the R dense values, else the dense region. The
   receiver tells them apart by size (a sparse message is never exactly R values long).

Cost per worker: (P-1) + log P latency terms; words between 4k(P-1)/P (supports identical
everywhere) and 2k(P-1)/P + n(P-1)/P (fill-in: the summed supports make the regions dense as
P grows). Residual: A minus what was delivered, i.e. A with the selected entries zeroed (the
identity codec); a lossy codec's error on the all-gather is kept by the region's owner, so
conservation holds exactly and rho = 1 gives the dense average.
"""

from __future__ import annotations

import math

import torch

from ..selection import count_for_ratio, topk_abs
from ..transport.base import as_bytes, from_bytes
from ._base import CodedAllreduce
from .exchange import Exchange


class TopkDSA(CodedAllreduce):
    """The 'topkdsa' communicator. Use with memory 'global_residual' (or 'residual'/'none')."""

    PHASES = ("reduce", "gather")

    def working_numel(self, numel: int) -> int:
        return self.transport.size * math.ceil(numel / self.transport.size)

    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, size, me = tensor.numel(), ex.size, ex.rank
        region = math.ceil(n / size)
        padded = self.working_copy(tensor, name)
        with ex.selecting():
            chosen = torch.sort(
                topk_abs(tensor, count_for_ratio(n, self.density_at(step, n)), self.scratch)
            ).values
        with ex.phase("reduce"):
            sent, reduced, member = ex.reduce_scatter(
                padded, chosen, [j * region for j in range(size + 1)]
            )
        positions, values = sent
        residual = padded  # A, less what the owners decode from us
        residual[positions] = padded[positions] - values
        with ex.phase("gather"):
            own = self._encode_region(ex, reduced, member, residual, me * region)
            pieces = ex.allgather(own)
        result = self.zeros_for_result(name, padded)
        for j, data in enumerate(pieces):
            result[j * region : (j + 1) * region] = self._decode_region(ex, data, reduced, j)
        result /= size
        return result[:n], residual[:n]

    @staticmethod
    def _encode_region(
        ex: Exchange,
        reduced: torch.Tensor,
        member: torch.Tensor,
        residual: torch.Tensor,
        offset: int,
    ) -> torch.Tensor:
        """The all-gather message of our reduced region: sparse if smaller, else dense. What a
        lossy codec changes stays in our residual."""
        dense = as_bytes(reduced)
        enc = ex.encode(reduced, torch.nonzero(member).reshape(-1), f"gather.{ex.rank}")
        if enc.data.numel() >= dense.numel():
            ex.stats.entries["gather"] = reduced.numel()
            return dense
        decoded = torch.zeros_like(reduced)
        decoded[enc.indices] = enc.values
        residual[offset : offset + reduced.numel()] += reduced - decoded
        ex.stats.entries["gather"] = enc.indices.numel()
        return enc.data

    @staticmethod
    def _decode_region(
        ex: Exchange, data: torch.Tensor, like: torch.Tensor, owner: int
    ) -> torch.Tensor:
        """Region `owner`'s reduced values (`like`'s length) from its all-gather message."""
        region = like.numel()
        if data.numel() == region * like.element_size():
            with ex.stats.timer("coding_s"):
                return from_bytes(data, like.dtype).to(like.device)
        idx, vals = ex.decode(data, region, like, f"gather.{owner}")
        out = torch.zeros_like(like)
        with ex.stats.timer("coding_s"):
            out[idx] = vals
        return out
