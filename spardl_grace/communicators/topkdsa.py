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
from .collectives import StepStats, allgather_bytes, split_and_reduce

PHASES = ("reduce", "gather")


class TopkDSA(CodedAllreduce):
    """The 'topkdsa' communicator. Use with memory 'global_residual' (or 'residual'/'none')."""

    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        stats = StepStats(PHASES)
        step = self.next_step(name)
        n, size, me = tensor.numel(), self.transport.size, self.transport.rank
        if n == 0:
            self.last_stats = stats.as_dict()
            return tensor.clone(), tensor.clone()
        region = math.ceil(n / size)
        padded = torch.zeros(size * region, dtype=tensor.dtype, device=tensor.device)
        padded[:n] = tensor
        key = f"{name}.{step}"

        with stats.timer("selection_s"):
            chosen = torch.sort(
                topk_abs(tensor, count_for_ratio(n, self.density), self.scratch)
            ).values
        sent, reduced, member = split_and_reduce(
            self.transport,
            self.codec,
            padded,
            chosen,
            [j * region for j in range(size + 1)],
            key,
            stats,
        )
        residual = padded - sent
        own = self._encode_region(
            reduced, member, f"{key}.gather.{me}", stats, residual, me * region
        )
        pieces = allgather_bytes(self.transport, own, f"gather.{key}", stats, "gather")
        result = self.zeros_for_result(name, padded)
        for j, data in enumerate(pieces):
            with stats.timer("coding_s"):
                result[j * region : (j + 1) * region] = self._decode_region(
                    data, region, tensor.dtype, tensor.device, f"{key}.gather.{j}"
                )
        result /= size
        self.last_stats = stats.as_dict()
        return result[:n], residual[:n]

    def _encode_region(
        self,
        reduced: torch.Tensor,
        member: torch.Tensor,
        key: str,
        stats: StepStats,
        residual: torch.Tensor,
        offset: int,
    ) -> torch.Tensor:
        """The all-gather message of our reduced region: sparse if smaller, else dense. What a
        lossy codec changes stays in our residual."""
        dense = as_bytes(reduced)
        with stats.timer("coding_s"):
            enc = self.codec.encode(reduced, torch.nonzero(member).reshape(-1), key)
        if enc.data.numel() >= dense.numel():
            stats.entries["gather"] = reduced.numel()
            return dense
        decoded = torch.zeros_like(reduced)
        decoded[enc.indices] = enc.values
        residual[offset : offset + reduced.numel()] += reduced - decoded
        stats.entries["gather"] = enc.indices.numel()
        return enc.data

    def _decode_region(
        self, data: torch.Tensor, region: int, dtype: torch.dtype, device: torch.device, key: str
    ) -> torch.Tensor:
        if data.numel() == region * torch.empty((), dtype=dtype).element_size():
            return from_bytes(data, dtype).to(device)
        idx, vals = self.codec.decode(data, region, dtype, device, key)
        out = torch.zeros(region, dtype=dtype, device=device)
        out[idx] = vals
        return out
