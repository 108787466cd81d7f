"""'dense': the uncompressed baseline every sparse all-reduce is measured against.

The compensated gradient (plain gradient unless a memory holds something) is summed with the
transport's all-reduce (ring or tree, whatever the backend uses: 2n(P-1)/P words, 2(P-1)
latency terms for a ring) and divided by P. Nothing is dropped, so the residual is zero.
"""

from __future__ import annotations

import torch

from ..api import Memory, SparseAllreduce
from ..memories.none import NoneMemory
from ..transport import Transport
from ..transport.base import QueuedOp
from .exchange import Exchange


class Dense(SparseAllreduce):
    """The 'dense' communicator: all-reduce, average, zero residual. Ignores the density."""

    def __init__(self, memory: Memory, transport: Transport, density: float = 1.0):
        super().__init__(memory, transport, density)
        self._zeros: dict[str, torch.Tensor] = {}

    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        ex = Exchange(self.transport, name, ("dense",))
        with ex.phase("dense"):
            result = ex.dense_average(tensor)
        self.last_stats = ex.stats.as_dict()
        return result, self._zero_residual(name, tensor)

    @property
    def can_queue(self) -> bool:
        """Whether queue() may stand in for step(): the memory keeps nothing (GRACE's 'none'),
        so a step is its all-reduce alone."""
        return isinstance(self.memory, NoneMemory)

    def queue(self, tensor: torch.Tensor, name: str) -> QueuedOp:
        """step() of the flat `tensor` with its all-reduce queued in the backend where the
        transport can (Transport.allreduce_async_), for a memory that keeps nothing
        (can_queue): the ranks agree on `name` now, then `tensor` is summed in place; the
        future holds the average (`tensor` itself), bit-identical to step()'s."""
        self.agree(tensor, name)
        ex = Exchange(self.transport, name, ("dense",))
        with ex.phase("dense"):
            queued = ex.queue_sum_(tensor)
        self.last_stats = ex.stats.as_dict()
        size = self.transport.size
        return QueuedOp(queued.future.then(lambda done: done.value().div_(size)), queued.wait)

    def _zero_residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """One zero tensor per name, returned every step: memories replace their entries and
        never write into them (Memory.stores), so it stays zero, and no step pays for a new
        gradient-sized allocation."""
        zeros = self._zeros.get(name)
        if (
            zeros is None
            or zeros.shape != like.shape
            or zeros.dtype != like.dtype
            or zeros.device != like.device
        ):
            zeros = self._zeros[name] = torch.zeros_like(like)
        return zeros


class Dense16(Dense):
    """The dense all-reduce in bfloat16, as DDP's bf16_compress_hook sends it: each rank's
    gradient divided by P (so the sum cannot overflow), rounded to bfloat16, summed, and
    widened back; 2 bytes an entry instead of 4. The rounding error of each rank's own
    contribution is its residual, so a memory that keeps residuals sends it later (the sum's
    own rounding is not kept). 'communicator': 'auto' offers it as the candidate 'dense16'."""

    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.transport.size
        ex = Exchange(self.transport, name, ("dense16",))
        with ex.phase("dense16"):
            half = (tensor / size).to(torch.bfloat16)
            residual = tensor - half.to(tensor.dtype) * size
            ex.stats.entries["dense16"] = tensor.numel()
            result = ex.allreduce(half).to(tensor.dtype)
        self.last_stats = ex.stats.as_dict()
        return result, residual

    @property
    def can_queue(self) -> bool:
        """Never: queue() would send the float32 tensor."""
        return False
