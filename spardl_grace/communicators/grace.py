"""GRACE's communicators: allreduce, allgather and broadcast of compressed tensors."""

from __future__ import annotations

from typing import Any

import torch

from ..api import Communicator, aggregate, average_of, same_sizes
from ..transport import Transport
from ..transport.counting import ring_allreduce_bytes


class Allreduce(Communicator):
    """Sums each compressed tensor over workers (valid only for compressors whose compressed
    form is linear and identical in shape everywhere: none, fp16, randomk, powersgd)."""

    def send_receive(self, tensors, name, ctx):
        reduced = []
        for i, t in enumerate(tensors):
            total = self.transport.allreduce(t, f"allreduce.{name}.{i}")
            reduced.append(total / self.world_size if average_of(self.compressor) else total)
        return self.compressor.decompress(reduced, ctx)

    def bytes_sent_for(self, tensors: list[torch.Tensor]) -> int:
        """A ring all-reduce's bytes for each tensor."""
        return sum(
            ring_allreduce_bytes(t.numel() * t.element_size(), self.world_size) for t in tensors
        )


class Allgather(Communicator):
    """Gathers every worker's compressed tensors (sizes may differ), decompresses each with the
    local context, aggregates and averages."""

    def send_receive(self, tensors, name, ctx):
        gathered = [
            self.transport.allgather(t.reshape(-1), f"allgather.{name}.{i}")
            for i, t in enumerate(tensors)
        ]
        if same_sizes(self.compressor):
            gathered = [
                [g.view(t.shape) for g in per_rank] for t, per_rank in zip(tensors, gathered)
            ]
        return self._combine(list(zip(*gathered)), ctx)

    def _combine(self, per_worker, ctx):
        decompressed = [self.compressor.decompress(list(ts), ctx) for ts in per_worker]
        aggregated = aggregate(self.compressor, decompressed)
        return aggregated / self.world_size if average_of(self.compressor) else aggregated


class Broadcast(Allgather):
    """Every worker in turn broadcasts its compressed tensors (sizes first when they vary).
    `rank`: grace_dl.dist's Broadcast(compressor, memory, world_size, rank) form; it must be
    the transport's rank (ValueError otherwise)."""

    def __init__(
        self,
        compressor: Any,
        memory: Any,
        transport: Transport | int | None = None,
        rank: int | None = None,
    ):
        super().__init__(compressor, memory, transport)
        if rank is not None and rank != self.transport.rank:
            raise ValueError(
                f"Broadcast was given rank {rank}, but this process is rank "
                f"{self.transport.rank} of the active backend: pass dist.get_rank(), or leave "
                "it out"
            )

    def send_receive(self, tensors, name, ctx):
        per_worker = []
        for root in range(self.world_size):
            received = []
            for i, t in enumerate(tensors):
                shape = t.shape
                if not same_sizes(self.compressor):
                    count = torch.tensor([t.numel()], dtype=torch.int64)
                    shape = (
                        int(
                            self.transport.broadcast(count, root, f"broadcast.{name}.{root}.{i}.n")
                        ),
                    )
                buf = t.reshape(shape) if root == self.transport.rank else t.new_empty(shape)
                received.append(self.transport.broadcast(buf, root, f"broadcast.{name}.{root}.{i}"))
            per_worker.append(received)
        return self._combine(per_worker, ctx)
