"""DGC's density warm-up (Lin et al., ICLR 2018): start dense-ish and shrink to the target.

Sending 1% of the entries from the very first step costs accuracy: the first steps move the
model most and a sparse all-reduce then delays most of each gradient. DGC warms the density up
in stages: start (DGC's 0.25), start/4, start/16, ... while above the target, in equal stages
over the first `steps` steps, then the target. A sparse all-reduce applies it per tensor name,
by that name's own step counter (the one its checkpoint saves), so every integration
(DistributedOptimizer, the DDP hook, GRACE's own loop) gets the same schedule with nothing to
call per step.
"""

from __future__ import annotations

#: each stage's density is the previous one's times this (DGC's)
STAGE_FACTOR = 0.25


def warmup_stages(start: float, target: float) -> list[float]:
    """The stage densities start, start/4, start/16, ... that lie above `target` (none when
    start <= target)."""
    stages: list[float] = []
    while start * STAGE_FACTOR ** len(stages) > target:
        stages.append(start * STAGE_FACTOR ** len(stages))
    return stages


def warmup_density(step: int, steps: int, start: float, target: float) -> float:
    """The density of step `step` (0 first) of a warm-up of `steps` steps from `start` down to
    `target`: stage floor(step * stages / steps) while that is a stage, then `target`."""
    stages = warmup_stages(start, target)
    if steps <= 0 or step >= steps or not stages:
        return target
    return stages[step * len(stages) // steps]
