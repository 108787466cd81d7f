"""'oktopk': Ok-Topk (Li and Hoefler, PPoPP 2022), the sparse all-reduce with thresholds.

Per name and step t (counted after the dense warm-up):
1. Dense warm-up: the first `warmup` steps are a plain dense all-reduce (the reference code
   uses 128 to 512; default 0 here).
2. Local selection |A| >= theta_local (non-zero entries only). theta_local is the exact k-th
   largest |A| every `threshold_interval` steps (tau = 32) and reused in between, nudged after
   each step: divided by `local_scale` (1.012) when fewer than 2k/3 were selected, multiplied
   when more than 5k/4. Unlike the reference code, a reused threshold that selects fewer than
   k/2 or more than 3k/2 entries is recomputed at once (a local top-k, no communication): with
   error feedback the magnitudes grow for many steps after a recomputation, and a 1.2% nudge
   per step cannot follow, which multiplies the traffic (measured: 5x k by the third step).
3. Balanced regions, recomputed every `region_interval` steps (tau' = 64): every worker reads
   its sorted selected indices at positions i*floor(c/P), i = 1..P-1; the all-reduced average
   of these splits the tensor into P regions holding about equal numbers of selected entries
   (a worker with fewer than P selected entries proposes equal regions instead).
4. Split and reduce: one all-to-all sends our entries of region j (region-relative int32
   indices) to worker j, which sums them in rank order.
5. Global selection: worker j keeps |reduced| >= theta_global in its region and everything is
   all-gathered; result = values / P. theta_global is the exact k-th largest |reduced| over all
   regions every `threshold_interval` steps (a distributed radix select: a few all-reduces of 16
   counters, not the reference code's all-gather of every reduced value), and otherwise reused,
   divided by `global_scale` (1.008) when fewer than 2k/3 were selected, multiplied when more
   than 4k/3. As for the local threshold, and again unlike the reference code, a reused
   theta_global is checked first (one all-reduce of the selected count, 8 bytes) and
   recomputed at once when it would select fewer than k/2 or more than 3k/2 entries.
6. Residual: A minus what was delivered, i.e. A zeroed at (locally selected AND globally
   selected) indices: contributions to an index that was not globally selected stay with their
   owners, so conservation holds exactly (a lossy codec's error on the all-gather is kept by
   the region's owner). With rho = 1 everything is selected and the result is the dense average.

Cost per worker: O(P) latency; the payload (steps 4-5) is at most about 6k(P-1)/P words while
the thresholds keep the counts near k (4k(P-1)/P with balanced regions). The size exchanges,
the boundary all-reduce (every tau') and the radix select (every tau) add a few hundred bytes.
Indices always travel as int32, never packed into floats.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..api import Memory
from ..params import int_at_least, number_above, ranged
from ..payload import PayloadCodec
from ..selection import count_for_ratio, not_below, sparse_nonzero, topk_abs
from ..transport import Transport
from ._base import CodedAllreduce
from .collectives import global_kth_magnitude
from .exchange import Exchange

LOCAL_BAND = (2 / 3, 5 / 4)  # nudge theta_local when the local count leaves [2k/3, 5k/4]
GLOBAL_BAND = (2 / 3, 4 / 3)  # nudge theta_global when the global count leaves [2k/3, 4k/3]
GUARD_BAND = (1 / 2, 3 / 2)  # recompute a reused threshold at once outside [k/2, 3k/2]
PARAMS = (
    ranged("oktopk_warmup_steps", 0, "Ok-Topk's dense steps before sparsifying", int_at_least(0)),
    ranged(
        "oktopk_threshold_interval",
        32,
        "Ok-Topk's tau: steps between exact threshold recomputations",
        int_at_least(1),
    ),
    ranged(
        "oktopk_region_interval",
        64,
        "Ok-Topk's tau': steps between balanced region recomputations",
        int_at_least(1),
    ),
    ranged(
        "oktopk_local_scale",
        1.012,
        "Ok-Topk's nudge factor of the local threshold",
        number_above(1),
    ),
    ranged(
        "oktopk_global_scale",
        1.008,
        "Ok-Topk's nudge factor of the global threshold",
        number_above(1),
    ),
)
DEFAULTS: dict[str, Any] = {p.key.removeprefix("oktopk_"): p.default for p in PARAMS}


def check_params(
    warmup: int,
    threshold_interval: int,
    region_interval: int,
    local_scale: float,
    global_scale: float,
) -> None:
    """ValueError naming the key (as grace_from_params spells it) of the first invalid value."""
    values = (warmup, threshold_interval, region_interval, local_scale, global_scale)
    for param, value in zip(PARAMS, values):
        param.validate(value)


def _kth_magnitude(tensor: torch.Tensor, k: int) -> float:
    """The k-th largest |value|, NaNs ranked first (as topk_abs ranks them) but never the
    threshold itself: a NaN threshold would pass every entry."""
    top = tensor.index_select(0, topk_abs(tensor, k)).abs()
    return float(torch.nan_to_num(top, nan=math.inf, posinf=math.inf).min())


def _at_least(tensor: torch.Tensor, theta: float) -> torch.Tensor:
    """Sorted positions of the non-zero entries with |value| >= theta or NaN."""
    mask = not_below(tensor.abs(), theta)
    if not theta > 0:  # above 0 the threshold itself excludes the zeros
        mask &= tensor != 0
    return sparse_nonzero(mask)


def _nudge(theta: float, count: int, k: int, band: tuple[float, float], scale: float) -> float:
    if count < band[0] * k:
        return theta / scale
    if count > band[1] * k:
        return theta * scale
    return theta


class OkTopk(CodedAllreduce):
    """The 'oktopk' communicator. Use with memory 'global_residual' (or 'residual'/'none').

    warmup: dense steps before sparsification (int >= 0); threshold_interval, region_interval:
    tau and tau' (ints >= 1); local_scale, global_scale: the nudge factors (> 1)."""

    PHASES = ("dense", "reduce", "gather", "threshold", "regions")
    #: each rank's threshold estimates its own gradients' top-k
    RANK_LOCAL_STATE = ("theta_local",)

    def __init__(
        self,
        memory: Memory,
        transport: Transport,
        density: float,
        warmup: int = DEFAULTS["warmup_steps"],
        threshold_interval: int = DEFAULTS["threshold_interval"],
        region_interval: int = DEFAULTS["region_interval"],
        local_scale: float = DEFAULTS["local_scale"],
        global_scale: float = DEFAULTS["global_scale"],
        codec: PayloadCodec | None = None,
    ):
        super().__init__(memory, transport, density, codec)
        check_params(warmup, threshold_interval, region_interval, local_scale, global_scale)
        self.warmup = warmup
        self.threshold_interval = threshold_interval
        self.region_interval = region_interval
        self.local_scale = float(local_scale)
        self.global_scale = float(global_scale)
        self._theta_local: dict[str, float] = {}
        self._theta_global: dict[str, float] = {}
        self._offsets: dict[str, list[int]] = {}

    def region_offsets(self, name: str) -> list[int] | None:
        """The P+1 region boundaries currently used for `name` (None before the first sparse
        step)."""
        return self._offsets.get(name)

    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        if step < self.warmup:
            with ex.phase("dense"):
                return ex.dense_average(tensor), torch.zeros_like(tensor)
        t = step - self.warmup
        k = count_for_ratio(n, self.density_at(step, n))
        everything = k >= n

        with ex.selecting():
            if not everything and (
                t % self.threshold_interval == 0 or name not in self._theta_local
            ):
                self._theta_local[name] = _kth_magnitude(tensor, k)
            theta = 0.0 if everything else self._theta_local[name]
            chosen = _at_least(tensor, theta)
            if not everything and not GUARD_BAND[0] * k <= chosen.numel() <= GUARD_BAND[1] * k:
                theta = self._theta_local[name] = _kth_magnitude(tensor, k)
                chosen = _at_least(tensor, theta)
            if not everything:
                self._theta_local[name] = _nudge(
                    theta, chosen.numel(), k, LOCAL_BAND, self.local_scale
                )
        if t % self.region_interval == 0 or name not in self._offsets:
            with ex.phase("regions"):
                self._offsets[name] = self._balanced_offsets(ex, chosen, n)
        offsets = self._offsets[name]

        with ex.phase("reduce"):
            sent, reduced, member = ex.reduce_scatter(tensor, chosen, offsets)
        me = ex.rank
        lo = offsets[me]

        candidates = sparse_nonzero(member)
        magnitudes = reduced.index_select(0, candidates).abs()
        recomputed = False
        with ex.phase("threshold"):
            if everything:
                global_theta = 0.0
            elif t % self.threshold_interval == 0 or name not in self._theta_global:
                global_theta = self._recompute_global(
                    ex, name, reduced.index_select(0, candidates), k
                )
                recomputed = True
            else:
                global_theta = self._theta_global[name]
                mine = not_below(magnitudes, global_theta).sum().to(torch.int64).reshape(1).cpu()
                count = int(ex.allreduce(mine, "count")[0])
                if not GUARD_BAND[0] * k <= count <= GUARD_BAND[1] * k:
                    global_theta = self._recompute_global(
                        ex, name, reduced.index_select(0, candidates), k
                    )
                    recomputed = True
        with ex.selecting():
            selected = candidates[not_below(magnitudes, global_theta)]
        with ex.phase("gather"):
            enc = ex.encode(reduced, selected, f"gather.{me}")
            ex.stats.entries["gather"] = enc.indices.numel()
            pieces = ex.allgather(enc.data)

        result = self.zeros_for_result(name, tensor)
        delivered = self.scratch.get("delivered", n, torch.bool, tensor.device).zero_()
        support = []
        for j, data in enumerate(pieces):
            idx, vals = ex.decode(data, offsets[j + 1] - offsets[j], tensor, f"gather.{j}")
            support.append(offsets[j] + idx)
            result.index_copy_(0, support[-1], vals)
            delivered.index_fill_(0, support[-1], True)
        everywhere = torch.cat(support)
        self.record_support(name, result, everywhere)
        # Senders are credited with what they sent to delivered indices; the owner keeps the
        # difference a lossy codec made to what it delivered (its own piece, support[me]).
        positions, values = sent
        credited = delivered.index_select(0, positions)
        positions = positions[credited]
        residual = self.working_copy(tensor, name)
        residual.index_copy_(0, positions, residual.index_select(0, positions) - values[credited])
        mine = support[me]
        residual.index_add_(
            0, mine, reduced.index_select(0, mine - lo) - result.index_select(0, mine)
        )
        # Zeros need no division.
        result.index_copy_(0, everywhere, result.index_select(0, everywhere) / ex.size)
        if not everything and not recomputed:
            count = int(delivered.sum())
            self._theta_global[name] = _nudge(
                global_theta, count, k, GLOBAL_BAND, self.global_scale
            )
        return result, residual

    def _recompute_global(self, ex: Exchange, name: str, values: torch.Tensor, k: int) -> float:
        theta = float(global_kth_magnitude(ex, values, k))
        self._theta_global[name] = theta
        return theta

    def _balanced_offsets(self, ex: Exchange, chosen: torch.Tensor, n: int) -> list[int]:
        """P+1 region boundaries splitting the selected entries of all workers about evenly."""
        size = ex.size
        if chosen.numel() >= size:
            step = chosen.numel() // size
            proposal = (
                chosen[torch.arange(1, size, device=chosen.device) * step].to(torch.int64).cpu()
            )
        else:
            proposal = torch.arange(1, size, dtype=torch.int64) * n // size
        total = ex.allreduce(proposal)
        inner = (total // size).tolist()
        return [0, *inner, n]

    def _own_state(self) -> dict[str, Any]:
        return {
            **super()._own_state(),
            "theta_local": dict(self._theta_local),
            "theta_global": dict(self._theta_global),
            "offsets": {k: list(v) for k, v in self._offsets.items()},
        }

    def _load_own_state(self, state: dict[str, Any]) -> None:
        super()._load_own_state(state)
        self._theta_local = dict(state.get("theta_local", {}))
        self._theta_global = dict(state.get("theta_global", {}))
        self._offsets = {k: list(v) for k, v in state.get("offsets", {}).items()}
