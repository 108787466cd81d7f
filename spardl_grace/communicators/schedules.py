"""Communication schedules as pure functions, so they can be checked without communicating."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SRSRound:
    """One round of Spar-Reduce-Scatter: worker r sends blocks (r + distance + b) % m for
    b in range(blocks) to (r + distance) % m, and receives blocks (r + b) % m from
    (r - distance) % m, one block per message."""

    distance: int
    blocks: int


def srs_schedule(m: int) -> list[SRSRound]:
    """SparDL's non-recursive reduce-scatter for any m >= 1 workers.

    L = ceil(log2 m) rounds; round i uses distance 2^(L-1-i); round 0 carries m - 2^(L-1)
    blocks and round i >= 1 carries 2^(L-1-i). The rounds carry m - 1 blocks in all, one per
    message, and every worker's contribution to every block reaches the block's owner exactly
    once (checked for m = 2..40 in the tests)."""
    if m < 1:
        raise ValueError(f"number of workers must be >= 1, got {m}")
    if m == 1:
        return []
    levels = (m - 1).bit_length()  # ceil(log2 m)
    rounds = [SRSRound(2 ** (levels - 1), m - 2 ** (levels - 1))]
    rounds += [SRSRound(2 ** (levels - 1 - i), 2 ** (levels - 1 - i)) for i in range(1, levels)]
    return rounds


def bruck_rounds(g: int) -> list[tuple[int, int]]:
    """Bruck all-gather among g members: per round (distance, pieces). Member j sends its
    first `pieces` held pieces to (j - distance) % g and receives as many from
    (j + distance) % g; after ceil(log2 g) rounds it holds pieces j, j+1, ..., j+g-1."""
    rounds = []
    distance = 1
    while distance < g:
        rounds.append((distance, min(distance, g - distance)))
        distance *= 2
    return rounds
