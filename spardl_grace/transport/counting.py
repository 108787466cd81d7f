"""CountingTransport: a wrapper that records every message a rank sends and receives.

Point-to-point and all-to-all messages are recorded as they are. Collectives are recorded by
the per-rank volume of their bandwidth-optimal algorithm, which is what the cost formulas of
../shared/reference/ALGORITHMS.md assume:
  allgather  - our piece goes to each of the P-1 others; we receive every other piece;
  allreduce  - ring all-reduce: 2 (P-1)/P of the tensor each way;
  broadcast  - the root sends the tensor once to each other rank (receivers receive it once).
The `phase` of a message is its name up to the first '.', so algorithms group their messages
by naming them 'phase.detail'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import QueuedOp, Transport


@dataclass(frozen=True)
class Message:
    """One recorded message or collective: its op, its name (the phase is the part before
    the first dot), the peer, and the bytes this rank sent and received."""

    op: str
    name: str
    peer: int  # the other rank; -1 for a collective recorded as a volume
    bytes_sent: int
    bytes_received: int

    @property
    def phase(self) -> str:
        return self.name.split(".", 1)[0]


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of `nbytes`: 2(P-1)/P of them."""
    return 2 * nbytes * (size - 1) // size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountingTransport(Transport):
    """Delegates to `inner` and records a Message per transfer in `messages`."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.timeout = inner.timeout
        self.messages: list[Message] = []
        #: point-to-point round trips: 1 per sendrecv whose size the receiver knew, else 2
        self.round_trips = 0

    def global_rank(self, rank: int) -> int:
        """`inner`'s job rank of `rank`."""
        return self.inner.global_rank(rank)

    @property
    def bytes_sent(self) -> int:
        return sum(m.bytes_sent for m in self.messages)

    @property
    def bytes_received(self) -> int:
        return sum(m.bytes_received for m in self.messages)

    def bytes_sent_by_phase(self) -> dict[str, int]:
        """Bytes this rank sent since the last reset(), summed per phase (srs, cross, sag, ...)."""
        out: dict[str, int] = defaultdict(int)
        for m in self.messages:
            out[m.phase] += m.bytes_sent
        return dict(out)

    def reset(self) -> None:
        """Forget the recorded messages and round trips."""
        self.messages.clear()
        self.round_trips = 0

    def _record(self, op: str, name: str, peer: int, sent: int, received: int) -> None:
        self.messages.append(Message(op, name, peer, sent, received))

    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
        got = self.inner.sendrecv(tensor, dst, src, name, recv_numel)
        # A size the receiver does not know travels first (torch.distributed, MPI).
        self.round_trips += 1 if recv_numel is not None else 2
        self._record("send", name, dst, _nbytes(tensor), 0)
        self._record("recv", name, src, 0, _nbytes(got))
        return got

    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        parts = self.inner.allgather(tensor, name)
        others = sum(_nbytes(p) for r, p in enumerate(parts) if r != self.rank)
        self._record("allgather", name, -1, _nbytes(tensor) * (self.size - 1), others)
        return parts

    def alltoall(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        parts = self.inner.alltoall(tensors, name)
        for peer in range(self.size):
            if peer != self.rank:
                self._record("alltoall", name, peer, _nbytes(tensors[peer]), _nbytes(parts[peer]))
        return parts

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        out = self.inner.allreduce(tensor, name)
        volume = ring_allreduce_bytes(_nbytes(tensor), self.size)
        self._record("allreduce", name, -1, volume, volume)
        return out

    @property
    def queues_collectives(self) -> bool:  # type: ignore[override]
        return self.inner.queues_collectives

    def allreduce_async_(self, tensor: torch.Tensor, name: str) -> QueuedOp:
        volume = ring_allreduce_bytes(_nbytes(tensor), self.size)
        queued = self.inner.allreduce_async_(tensor, name)
        self._record("allreduce", name, -1, volume, volume)
        return queued

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        out = self.inner.broadcast(tensor, root, name)
        if self.rank == root:
            self._record("broadcast", name, -1, _nbytes(tensor) * (self.size - 1), 0)
        else:
            self._record("broadcast", name, root, 0, _nbytes(tensor))
        return out

    def barrier(self, name: str = "barrier") -> None:
        self.inner.barrier(name)
