"""What 'communicator': 'auto' decides with: its candidates, a fitted link, each candidate's
predicted step, and the choice. Pure functions, no communication, so every branch is tested
on synthetic figures.

A candidate is 'dense' (float32 all-reduce), 'dense16' (the all-reduce in bfloat16, as DDP's
bf16 hook) or 'spardl@D' (SparDL at density D on the compact wire, one team). A step of
candidate c is predicted as

    compute + sync(c)

where compute is the measured step time outside synchronisation and sync(c) sums over the
step's tensors the alpha-beta cost of c's messages: a ring all-reduce of the tensor's bytes
for the dense ones (the all-reduce's fitted alpha and beta), SparDL's Spar-Reduce-Scatter
rounds and Bruck all-gather for the sparse ones (the point-to-point fit; the same schedules
and message sizes as the implementation, spardl_grace.communicators.schedules and
spardl_grace.compact), plus SparDL's local work: its selection (measured seconds per entry of
the tensor at that density) and the coding of what it keeps (measured seconds per kept entry:
encoding a message, taking it out of the sender's block, decoding it and adding it in at the
receiver, times the entries a rank codes a step, spardl_coded_entries), and a measured
correction where a candidate's real synchronisation was seen to differ from its prediction.
The model is the one benchmarks.costmodel validates (there with per-op traces and token
buckets); this is its small, closed form.

The choice is the least compression among the near-fastest: of the candidates whose
predicted step is within `budget` (5%) of the fastest's, the one that sends the most bytes,
because a denser synchronisation costs less accuracy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .communicators.schedules import bruck_rounds, srs_schedule
from .communicators.spardl import block_layout
from .compact import message_bytes
from .payload import frame_overhead
from .transport.counting import ring_allreduce_bytes

#: the candidates of 'auto_candidates' when none are given, least compression first
DEFAULT_CANDIDATES = (
    "dense",
    "dense16",
    "spardl@0.1",
    "spardl@0.03",
    "spardl@0.01",
    "spardl@0.003",
    "spardl@0.001",
)
#: what a candidate's name may be, in words (for errors)
CANDIDATE_RULE = "'dense', 'dense16' or 'spardl@D' with a density D in (0, 1)"
_SPARDL = re.compile(r"spardl@(\d*\.?\d+(?:e-?\d+)?)")


@dataclass(frozen=True)
class Candidate:
    """One choice of 'auto': `kind` 'dense', 'dense16' or 'spardl', and SparDL's density
    (1 for the dense ones)."""

    name: str
    kind: str
    density: float = 1.0


def parse_candidate(name: object) -> Candidate:
    """The candidate a name describes; ValueError naming the valid forms otherwise."""
    if name in ("dense", "dense16"):
        return Candidate(str(name), str(name))
    match = _SPARDL.fullmatch(name) if isinstance(name, str) else None
    if match is not None and 0 < float(match.group(1)) < 1:
        return Candidate(name, "spardl", float(match.group(1)))  # type: ignore[arg-type]
    raise ValueError(f"unknown 'auto' candidate {name!r}; valid: {CANDIDATE_RULE}")


def parse_candidates(names: Iterable[object]) -> tuple[Candidate, ...]:
    """The candidates of `names` (a list or tuple of names), each once; ValueError for an
    unknown name, a repeated one or none."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(
            f"auto_candidates must be a list of candidate names ({CANDIDATE_RULE}), got {names!r}"
        )
    candidates = tuple(parse_candidate(n) for n in names)
    if not candidates:
        raise ValueError(f"auto_candidates needs at least one candidate ({CANDIDATE_RULE})")
    if len({c.name for c in candidates}) != len(candidates):
        raise ValueError(f"auto_candidates names a candidate twice: {list(names)}")
    return candidates


@dataclass(frozen=True)
class Fit:
    """A message of b bytes takes alpha + beta * b seconds."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        """The time of a message of `nbytes` bytes."""
        return self.alpha + self.beta * nbytes

    @classmethod
    def least_squares(cls, samples: Sequence[tuple[float, float]]) -> Fit:
        """The (alpha, beta) that fit (bytes, seconds) samples best, both kept >= 0: a
        negative intercept (noise on a fast link) becomes 0 with beta refitted through the
        origin, a negative slope (latency-bound) becomes 0 with alpha the mean time."""
        if not samples:
            raise ValueError("a link fit needs at least one (bytes, seconds) sample")
        n = len(samples)
        mean_b = sum(b for b, _ in samples) / n
        mean_t = sum(t for _, t in samples) / n
        spread = sum((b - mean_b) ** 2 for b, _ in samples)
        beta = sum((b - mean_b) * (t - mean_t) for b, t in samples) / spread if spread else 0.0
        alpha = mean_t - beta * mean_b
        if beta <= 0:
            return cls(max(mean_t, 0.0), 0.0)
        if alpha < 0:
            through_origin = sum(b * t for b, t in samples) / sum(b * b for b, _ in samples)
            return cls(0.0, max(through_origin, 0.0))
        return cls(alpha, beta)


@dataclass(frozen=True)
class Link:
    """The link as the library's own channel measured it: point-to-point messages (SparDL's)
    and all-reduces of float32 (dense's) and of bfloat16 (dense16's; where not measured, as
    float32's), alpha per call and beta per byte a rank sends: a backend may sum 16-bit types
    more slowly than float32 (see measured)."""

    p2p: Fit
    allreduce: Fit
    allreduce16: Fit | None = None

    @classmethod
    def measured(cls, p2p: Fit, allreduce: Fit, allreduce16: Fit) -> Link:
        """The link from probe fits, bfloat16's time per byte no less than float32's: a byte
        of either crosses the wire alike and a 16-bit sum costs no less per byte, so a lower
        slope is the probe's noise (on a fast link its sizes resolve the slope poorly; on
        such a fit a loopback plan took bfloat16 dense, which then ran twice its predicted
        step)."""
        return cls(p2p, allreduce, Fit(allreduce16.alpha, max(allreduce16.beta, allreduce.beta)))

    @property
    def gbit_per_s(self) -> float:
        """The point-to-point bandwidth, Gbit/s (inf when no time per byte was measured)."""
        return math.inf if self.p2p.beta <= 0 else 8 / self.p2p.beta / 1e9


NO_LINK = Link(Fit(0.0, 0.0), Fit(0.0, 0.0))


def floored_density(density: float, numel: int, min_entries: int) -> float:
    """SparDL's density for a tensor of `numel` entries with the floor of min_entries
    (SparseAllreduce.density_at after any warm-up)."""
    if min_entries and numel:
        density = max(density, min(1.0, (min_entries + 0.5) / numel))
    return density


def _spardl_messages(numel: int, size: int, density: float) -> list[int]:
    """The bytes of each message a rank sends in one SparDL step (one team, compact wire):
    Spar-Reduce-Scatter's one block per message, then the Bruck rounds of the final blocks
    (framed: several blocks go in one message)."""
    block, kb = block_layout(numel, size, density)
    piece = message_bytes(kb, block)
    messages = [piece for rnd in srs_schedule(size) for _ in range(rnd.blocks)]
    return messages + [pieces * piece + frame_overhead(pieces) for _, pieces in bruck_rounds(size)]


def spardl_coded_entries(numel: int, size: int, density: float) -> int:
    """Entries one rank codes in a SparDL step over a tensor of `numel` (one team): k_b for
    each Spar-Reduce-Scatter message it sends (and each it receives and adds in, as many) and
    for each of the size - 1 final pieces of the all-gather it decodes."""
    _, kb = block_layout(numel, size, density)
    return kb * (sum(rnd.blocks for rnd in srs_schedule(size)) + size - 1)


def sync_bytes(candidate: Candidate, numels: Sequence[int], size: int, min_entries: int) -> float:
    """Bytes a rank sends in one step of `candidate` over tensors of `numels` (what
    last_stats' 'bytes_sent' counts: payload and framing)."""
    if size == 1:
        return 0.0
    if candidate.kind != "spardl":
        width = 4 if candidate.kind == "dense" else 2
        return float(sum(ring_allreduce_bytes(width * n, size) for n in numels))
    return float(
        sum(
            sum(_spardl_messages(n, size, floored_density(candidate.density, n, min_entries)))
            for n in numels
        )
    )


def sync_seconds(
    candidate: Candidate,
    numels: Sequence[int],
    size: int,
    link: Link,
    local_s_per_entry: float = 0.0,
    min_entries: int = 0,
    coding_s_per_entry: float = 0.0,
) -> float:
    """Predicted seconds one step of `candidate` spends synchronising tensors of `numels`
    over `link` (before any measured correction); local_s_per_entry: the candidate's own work
    per entry of the tensors on this rank (SparDL's selection at its density, dense16's
    casts); coding_s_per_entry: SparDL's work per entry it codes (spardl_coded_entries)."""
    if size == 1:
        return 0.0
    local = local_s_per_entry * sum(numels)
    if candidate.kind == "dense":
        return sum(link.allreduce.seconds(ring_allreduce_bytes(4 * n, size)) for n in numels)
    if candidate.kind == "dense16":
        fit = link.allreduce16 or link.allreduce
        return local + sum(fit.seconds(ring_allreduce_bytes(2 * n, size)) for n in numels)
    total = local
    for n in numels:
        density = floored_density(candidate.density, n, min_entries)
        total += sum(link.p2p.seconds(b) for b in _spardl_messages(n, size, density))
        total += coding_s_per_entry * spardl_coded_entries(n, size, density)
    return total


def choose(steps: Sequence[float], sent: Sequence[float], budget: float) -> int:
    """The index of the candidate to use: among those whose predicted step is at most
    (1 + budget) times the fastest's, the one that sends the most bytes (the least
    compression); the first such in candidate order on a tie."""
    if not steps or len(steps) != len(sent):
        raise ValueError("choose needs one predicted step and one byte count per candidate")
    if not 0 < budget <= 1:
        raise ValueError(f"auto_budget must be in (0, 1], got {budget!r}")
    fastest = min(steps)
    near = [i for i, s in enumerate(steps) if s <= fastest * (1 + budget)]
    return max(near, key=lambda i: (sent[i], -i))
