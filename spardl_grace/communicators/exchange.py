"""One step's messages of a sparse all-reduce: the Exchange, and the statistics it keeps.

An Exchange is bound to one step of one tensor (transport, codec, statistics and the step's
key, `<name>.<step>`), so an algorithm's code names only what its paper names: which entries,
to whom, in which phase. It

* names every message: the transport sees `<phase>.<key>[.<suffix>]` (the phase is what
  CountingTransport and the statistics group by), the codec `<key>.<tag>` (the same on sender
  and receiver, for codecs that draw shared randomness);
* counts every byte once, in the phase of the `with ex.phase(...)` block it is sent in, and
  times selection, coding and communication;
* owns the sender's rule that conserves gradient mass with any codec: `take` subtracts from
  the sender's copy exactly what the receiver will decode, so whatever a codec drops or
  changes stays with the sender.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..payload import (
    Encoded,
    IdentityCodec,
    PayloadCodec,
    frame_overhead,
    pack_frames,
    unpack_frames,
)
from ..transport import Transport
from ..transport.base import QueuedOp
from ..transport.counting import ring_allreduce_bytes
from .schedules import bruck_rounds

#: what `take` logs before each write, so a caller can undo it: (tensor, positions, old values)
Undo = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class StepStats:
    """Per-step statistics of a sparse all-reduce: payload and framing bytes sent per phase,
    entries sent, and seconds spent selecting, coding and communicating."""

    def __init__(self, phases: tuple[str, ...] = ()) -> None:
        """`phases` are reported (as zeros) even when a step sends nothing in them."""
        self.payload_bytes: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.framing_bytes: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.entries: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.seconds: dict[str, float] = defaultdict(
            float, {k: 0.0 for k in ("selection_s", "coding_s", "comm_s")}
        )

    def add_bytes(self, phase: str, payload: int, framing: int = 0) -> None:
        """Count `payload` bytes (entries) and `framing` bytes (headers) sent in `phase`."""
        self.payload_bytes[phase] += payload
        self.framing_bytes[phase] += framing

    @contextmanager
    def timer(self, what: str) -> Iterator[None]:
        """Add the seconds the block takes to `what` ('selection_s', 'coding_s', 'comm_s')."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start

    def as_dict(self) -> dict[str, float]:
        """Flat statistics: '<phase>_payload_bytes', '<phase>_framing_bytes',
        '<phase>_entries', the seconds, and 'bytes_sent' (payload and framing, all phases)."""
        out: dict[str, float] = {}
        for phase, n in self.payload_bytes.items():
            out[f"{phase}_payload_bytes"] = n
        for phase, n in self.framing_bytes.items():
            out[f"{phase}_framing_bytes"] = n
        for phase, n in self.entries.items():
            out[f"{phase}_entries"] = n
        out.update(self.seconds)
        out["bytes_sent"] = sum(self.payload_bytes.values()) + sum(self.framing_bytes.values())
        return out


class Exchange:
    """The messages of one step of a sparse all-reduce on one tensor (see the module's
    docstring). Every rank must make the same calls in the same order, as with the transport."""

    def __init__(
        self,
        transport: Transport,
        key: str,
        phases: tuple[str, ...] = (),
        codec: PayloadCodec | None = None,
    ) -> None:
        self.transport = transport
        self.codec = codec or IdentityCodec()
        self.key = key
        self.stats = StepStats(phases)
        self._phase: str | None = None

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Messages sent within the block belong to `phase`."""
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    @property
    def current_phase(self) -> str:
        if self._phase is None:
            raise RuntimeError("a sparse all-reduce sent a message outside `with ex.phase(...)`")
        return self._phase

    def message_name(self, suffix: object = None) -> str:
        """The transport's name of a message of the current phase: `<phase>.<key>[.<suffix>]`."""
        base = f"{self.current_phase}.{self.key}"
        return base if suffix is None else f"{base}.{suffix}"

    @contextmanager
    def selecting(self) -> Iterator[None]:
        """Time the block as selection."""
        with self.stats.timer("selection_s"):
            yield

    # Coding

    def encode(self, block: torch.Tensor, chosen: torch.Tensor, tag: str) -> Encoded:
        """`block`'s entries at `chosen`, coded as the message `<key>.<tag>`."""
        with self.stats.timer("coding_s"):
            return self.codec.encode(block, chosen, f"{self.key}.{tag}")

    def encode_sparse(
        self, indices: torch.Tensor, values: torch.Tensor, length: int, tag: str
    ) -> Encoded:
        """A sparse vector of `length` entries given by its entries, coded as `<key>.<tag>`."""
        with self.stats.timer("coding_s"):
            return self.codec.encode_sparse(indices, values, length, f"{self.key}.{tag}")

    def decode(
        self, data: torch.Tensor, length: int, like: torch.Tensor, tag: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the message `<key>.<tag>` into a block of `length` entries
        of `like`'s dtype and device."""
        with self.stats.timer("coding_s"):
            return self.codec.decode(data, length, like.dtype, like.device, f"{self.key}.{tag}")

    def take(
        self, source: torch.Tensor, chosen: torch.Tensor, tag: str, undo: Undo | None = None
    ) -> Encoded:
        """Code `source`'s `chosen` entries as `<key>.<tag>` for sending, and subtract from
        `source` exactly what the receiver will decode (the sender keeps the rest). The
        entries count as sent in the current phase; with `undo`, the overwritten values are
        logged first."""
        enc = self.encode(source, chosen, tag)
        if undo is not None:
            undo.append((source, enc.indices, source.index_select(0, enc.indices)))
        source.index_add_(0, enc.indices, enc.values, alpha=-1)  # exactly source - values
        self.stats.entries[self.current_phase] += enc.indices.numel()
        return enc

    # Messages

    def sendrecv(
        self,
        data: torch.Tensor,
        dst: int,
        src: int,
        suffix: object = None,
        expected: int | None = None,
    ) -> torch.Tensor:
        """Send the uint8 `data` to dst while receiving from src (`expected` bytes when the
        receiver knows them: one round trip). Bytes count unless dst is this rank."""
        if dst != self.rank:
            self.stats.add_bytes(self.current_phase, data.numel())
        with self.stats.timer("comm_s"):
            return self.transport.sendrecv(
                data, dst, src, self.message_name(suffix), recv_numel=expected
            )

    def exchange(
        self,
        source: torch.Tensor,
        chosen: torch.Tensor,
        target: torch.Tensor,
        dst: int,
        src: int,
        tags: tuple[str, str],
        suffix: object = None,
        expected: int | None = None,
        undo: Undo | None = None,
    ) -> None:
        """One pairwise step: take `source`'s `chosen` entries (coded as tags[0]) and send them
        to dst, receive src's entries (coded as tags[1]) and add them into `target`."""
        enc = self.take(source, chosen, tags[0], undo)
        got = self.sendrecv(enc.data, dst, src, suffix, expected)
        idx, vals = self.decode(got, target.numel(), target, tags[1])
        if undo is not None:
            undo.append((target, idx, target.index_select(0, idx)))
        target.index_add_(0, idx, vals)

    def allgather(self, data: torch.Tensor, suffix: object = None) -> list[torch.Tensor]:
        """Every rank's uint8 `data`, in rank order; counted as sent to each of the P-1 others."""
        self.stats.add_bytes(self.current_phase, data.numel() * (self.size - 1))
        with self.stats.timer("comm_s"):
            return self.transport.allgather(data, self.message_name(suffix))

    def alltoall(self, messages: list[torch.Tensor], suffix: object = None) -> list[torch.Tensor]:
        """messages[j] to rank j, what every rank sent us in rank order (ours to ourselves
        costs nothing)."""
        sent = sum(m.numel() for j, m in enumerate(messages) if j != self.rank)
        self.stats.add_bytes(self.current_phase, sent)
        with self.stats.timer("comm_s"):
            return self.transport.alltoall(messages, self.message_name(suffix))

    def _count_ring_allreduce(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.add_bytes(self.current_phase, ring_allreduce_bytes(nbytes, self.size))

    def allreduce(self, tensor: torch.Tensor, suffix: object = None) -> torch.Tensor:
        """The sum over ranks, counted as a ring all-reduce: 2(P-1)/P of the tensor's bytes."""
        self._count_ring_allreduce(tensor)
        with self.stats.timer("comm_s"):
            return self.transport.allreduce(tensor, self.message_name(suffix))

    def queue_sum_(self, tensor: torch.Tensor) -> QueuedOp:
        """allreduce() in place of `tensor`, queued in the backend where the transport can
        (Transport.allreduce_async_); all of its entries count as sent, its time does not."""
        self.stats.entries[self.current_phase] = tensor.numel()
        self._count_ring_allreduce(tensor)
        return self.transport.allreduce_async_(tensor, self.message_name())

    def dense_average(self, tensor: torch.Tensor) -> torch.Tensor:
        """The all-reduced average of `tensor`, all of whose entries count as sent."""
        self.stats.entries[self.current_phase] = tensor.numel()
        return self.allreduce(tensor).div_(self.size)

    def bruck_allgather(
        self, piece: torch.Tensor, group: list[int], me: int, piece_size: int | None = None
    ) -> list[torch.Tensor]:
        """Every member of `group` (global ranks, in group order; we are group[me]) ends with
        every member's uint8 `piece`, returned in group order. ceil(log2 g) messages per
        member; each is one round trip when every piece has the known `piece_size` bytes."""
        held = [piece]
        g = len(group)
        for s, (distance, count) in enumerate(bruck_rounds(g)):
            message = pack_frames(held[:count])
            framing = frame_overhead(count)
            self.stats.add_bytes(self.current_phase, message.numel() - framing, framing)
            expected = None if piece_size is None else framing + count * piece_size
            with self.stats.timer("comm_s"):
                got = self.transport.sendrecv(
                    message,
                    dst=group[(me - distance) % g],
                    src=group[(me + distance) % g],
                    name=self.message_name(s),
                    recv_numel=expected,
                )
            held.extend(unpack_frames(got))
        return [held[(i - me) % g] for i in range(g)]

    def reduce_scatter(
        self, tensor: torch.Tensor, chosen: torch.Tensor, offsets: list[int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Sparse reduce-scatter over P regions (region j = tensor[offsets[j]:offsets[j+1]]
        belongs to rank j): one all-to-all sends our `chosen` entries (sorted positions) of
        region j, coded with region-relative indices, to rank j. Returns (sent, reduced,
        member): what the owners decode from us, as (distinct positions in `tensor`, values);
        the sum, in rank order, of what every rank sent for our region; and which positions of
        our region received anything."""
        me, phase = self.rank, self.current_phase
        bounds = torch.searchsorted(chosen, torch.tensor(offsets, device=chosen.device))
        positions, values, messages = [], [], []
        for j, part in enumerate(torch.split(chosen, torch.diff(bounds).tolist())):
            block = tensor[offsets[j] : offsets[j + 1]]
            enc = self.encode(block, part - offsets[j], f"{phase}.{me}.{j}")
            positions.append(offsets[j] + enc.indices)
            values.append(enc.values)
            messages.append(enc.data)
            if j != me:
                self.stats.entries[phase] += enc.indices.numel()
        sent = (torch.cat(positions), torch.cat(values))
        received = self.alltoall(messages)
        length = offsets[me + 1] - offsets[me]
        reduced = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
        member = torch.zeros(length, dtype=torch.bool, device=tensor.device)
        for src, data in enumerate(received):
            idx, vals = self.decode(data, length, tensor, f"{phase}.{src}.{me}")
            reduced.index_add_(0, idx, vals)
            member[idx] = True
        return sent, reduced, member
