"""Building blocks shared by the sparse all-reduces."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

from ..payload import frame_overhead, pack_frames, unpack_frames
from ..transport import Transport
from .schedules import bruck_rounds


def bruck_allgather(transport: Transport, piece: torch.Tensor, group: list[int], me: int,
                    name: str, stats: "StepStats", phase: str) -> list[torch.Tensor]:
    """Every member of `group` (global ranks, in group order; we are group[me]) ends with every
    member's uint8 `piece`, returned in group order. ceil(log2 g) messages per member."""
    held = [piece]
    for s, (distance, count) in enumerate(bruck_rounds(len(group))):
        message = pack_frames(held[:count])
        stats.add_bytes(phase, message.numel() - frame_overhead(count), frame_overhead(count))
        with stats.timer("comm_s"):
            got = transport.sendrecv(message, dst=group[(me - distance) % len(group)],
                                     src=group[(me + distance) % len(group)], name=f"{name}.{s}")
        held.extend(unpack_frames(got))
    g = len(group)
    return [held[(i - me) % g] for i in range(g)]


class StepStats:
    """Per-step statistics of a sparse all-reduce: payload and framing bytes sent per phase,
    entries sent, and seconds spent selecting, coding and communicating."""

    def __init__(self, phases: tuple[str, ...] = ()) -> None:
        """`phases` are reported (as zeros) even when a step sends nothing in them."""
        self.payload_bytes: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.framing_bytes: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.entries: dict[str, int] = defaultdict(int, {p: 0 for p in phases})
        self.seconds: dict[str, float] = defaultdict(
            float, {k: 0.0 for k in ("selection_s", "coding_s", "comm_s")})

    def add_bytes(self, phase: str, payload: int, framing: int = 0) -> None:
        self.payload_bytes[phase] += payload
        self.framing_bytes[phase] += framing

    @contextmanager
    def timer(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start

    def as_dict(self) -> dict[str, float]:
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
