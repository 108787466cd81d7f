"""Building blocks shared by the sparse all-reduces: counted collectives (bytes per phase
into a StepStats), the Bruck all-gather of framed pieces, the sparse reduce-scatter by
regions, and the distributed radix select of the k-th magnitude over all ranks."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..payload import PayloadCodec, frame_overhead, pack_frames, unpack_frames
from ..transport import Transport
from ..transport.counting import ring_allreduce_bytes
from .schedules import bruck_rounds

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


def global_kth_magnitude(
    transport: Transport,
    values: torch.Tensor,
    k: int,
    name: str,
    stats: StepStats,
    phase: str = "threshold",
) -> torch.Tensor:
    """The exact k-th largest |v| over the union of every rank's `values` (one floating dtype
    on every rank), as a 0-d tensor of that dtype; 0 when fewer than k values exist in all.

    A radix select on the magnitudes' bit patterns (non-negative floats order like their bits):
    one all-reduce of 2**RADIX_BITS counters per digit, so the volume is independent of k and
    of the number of values. Every rank returns the same bits."""
    bits, as_int = _magnitude_bits(values)
    width = values.element_size() * 8

    def allreduce(counts: torch.Tensor, suffix: str) -> torch.Tensor:
        return counted_allreduce(transport, counts, f"{name}.{suffix}", stats, phase)

    total = int(allreduce(torch.tensor([values.numel()], dtype=torch.int64), "n")[0])
    if k <= 0 or total < k:
        return torch.zeros((), dtype=values.dtype)
    radix = 1 << RADIX_BITS
    prefix, remaining = 0, k
    candidates = bits
    for r, shift in enumerate(range(width - RADIX_BITS, -1, -RADIX_BITS)):
        digits = (candidates >> shift) & (radix - 1)
        counts = allreduce(torch.bincount(digits, minlength=radix).cpu(), str(r))
        at_least = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])
        digit = int(torch.nonzero(at_least >= remaining).max())
        remaining -= int(at_least[digit] - counts[digit])
        prefix |= digit << shift
        candidates = candidates[digits == digit]
    return torch.tensor([prefix], dtype=torch.int64).to(as_int).view(values.dtype)[0]


def bruck_allgather(
    transport: Transport,
    piece: torch.Tensor,
    group: list[int],
    me: int,
    name: str,
    stats: StepStats,
    phase: str,
    piece_size: int | None = None,
) -> list[torch.Tensor]:
    """Every member of `group` (global ranks, in group order; we are group[me]) ends with every
    member's uint8 `piece`, returned in group order. ceil(log2 g) messages per member; each is
    one round trip when every piece has the known `piece_size` bytes."""
    held = [piece]
    for s, (distance, count) in enumerate(bruck_rounds(len(group))):
        message = pack_frames(held[:count])
        stats.add_bytes(phase, message.numel() - frame_overhead(count), frame_overhead(count))
        expected = None if piece_size is None else frame_overhead(count) + count * piece_size
        with stats.timer("comm_s"):
            got = transport.sendrecv(
                message,
                dst=group[(me - distance) % len(group)],
                src=group[(me + distance) % len(group)],
                name=f"{name}.{s}",
                recv_numel=expected,
            )
        held.extend(unpack_frames(got))
    g = len(group)
    return [held[(i - me) % g] for i in range(g)]


def counted_allreduce(
    transport: Transport, tensor: torch.Tensor, name: str, stats: StepStats, phase: str
) -> torch.Tensor:
    """transport.allreduce, counted as a ring all-reduce: 2(P-1)/P of the tensor's bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    stats.add_bytes(phase, ring_allreduce_bytes(nbytes, transport.size))
    with stats.timer("comm_s"):
        return transport.allreduce(tensor, name)


def dense_average(
    transport: Transport, tensor: torch.Tensor, name: str, stats: StepStats, phase: str = "dense"
) -> torch.Tensor:
    """The all-reduced average of `tensor` (counted as a ring all-reduce)."""
    stats.entries[phase] = tensor.numel()
    return counted_allreduce(transport, tensor, name, stats, phase).div_(transport.size)


def allgather_bytes(
    transport: Transport, data: torch.Tensor, name: str, stats: StepStats, phase: str
) -> list[torch.Tensor]:
    """transport.allgather of a uint8 message, counted as sent to each of the P-1 others."""
    stats.add_bytes(phase, data.numel() * (transport.size - 1))
    with stats.timer("comm_s"):
        return transport.allgather(data, name)


def alltoall_bytes(
    transport: Transport, messages: list[torch.Tensor], name: str, stats: StepStats, phase: str
) -> list[torch.Tensor]:
    """transport.alltoall of uint8 messages (ours to ourselves costs nothing)."""
    stats.add_bytes(phase, sum(m.numel() for j, m in enumerate(messages) if j != transport.rank))
    with stats.timer("comm_s"):
        return transport.alltoall(messages, name)


def split_and_reduce(
    transport: Transport,
    codec: PayloadCodec,
    tensor: torch.Tensor,
    chosen: torch.Tensor,
    offsets: list[int],
    key: str,
    stats: StepStats,
    phase: str = "reduce",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse reduce-scatter over P regions (region j = tensor[offsets[j]:offsets[j+1]] belongs
    to rank j): one all-to-all sends our `chosen` entries (sorted positions) of region j, coded
    with region-relative indices, to rank j. Returns (sent, reduced, member): what the owners
    decode from us, as a dense vector like `tensor`; the sum, in rank order, of what every rank
    sent for our region; and which positions of our region received anything."""
    me = transport.rank
    bounds = torch.searchsorted(chosen, torch.tensor(offsets, device=chosen.device))
    sent = torch.zeros_like(tensor)
    messages = []
    for j, part in enumerate(torch.split(chosen, torch.diff(bounds).tolist())):
        block = tensor[offsets[j] : offsets[j + 1]]
        with stats.timer("coding_s"):
            enc = codec.encode(block, part - offsets[j], f"{key}.{phase}.{me}.{j}")
        sent[offsets[j] + enc.indices] = enc.values
        messages.append(enc.data)
        if j != me:
            stats.entries[phase] += enc.indices.numel()
    received = alltoall_bytes(transport, messages, f"{phase}.{key}", stats, phase)
    length = offsets[me + 1] - offsets[me]
    reduced = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
    member = torch.zeros(length, dtype=torch.bool, device=tensor.device)
    for src, data in enumerate(received):
        with stats.timer("coding_s"):
            idx, vals = codec.decode(
                data, length, tensor.dtype, tensor.device, f"{key}.{phase}.{src}.{me}"
            )
        reduced.index_add_(0, idx, vals)
        member[idx] = True
    return sent, reduced, member


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
