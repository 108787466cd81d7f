"""'communicator': 'auto': the library picks the compression for the user's link and model.

Its first `measure_steps` steps are synchronised dense (float32), and it measures what a step
spends outside synchronisation (compute). Then every rank probes the link on the library's
own channel (point-to-point messages and all-reduces of a few sizes, spardl_grace.planner's
fit) and times SparDL's local work: its selection at each candidate density and the coding of
a message per entry it keeps; rank 0 predicts each
candidate's step (spardl_grace.planner), picks the least compression within `budget` of the
fastest, and broadcasts the plan, so every rank takes rank 0's decision (the ranks' agreement
checks it with the rest of the settings on the next step). The plan is in last_stats on each
step's first tensor (what the integrations sum once a step) and in one log line of the
'spardl_grace.auto' logger on rank 0, whose record carries the whole plan (Auto.plan) as
its `auto_plan` attribute for handlers that keep it.

Every `replan_window` steps the ranks take rank 0's median measured synchronisation of the
window against the plan's prediction. A window strays when they differ by more than
`replan_tolerance` of the prediction and by more than `budget` of the predicted step (an error
the budget already tolerates cannot pay for a re-plan). The first window that measures a family
(SparDL's, after a plan made on dense steps), or a kind whose correction was lent by the other
kind of its family (bfloat16 dense after float32's measuring steps, or float32 dense after
bfloat16's window corrected the family: each all-reduce has a fit of its own; a kind measured
on its own steps keeps its correction), calibrates it: if it strays, it re-plans at once (the
model was wrong for this machine); if not, the model stands as it is. Any later stray is
confirmed by a second window of half the length straying the same way before it re-plans (the
link changed), so the noise of one window on a steady link does not cost a probe. A window also
strays, awaiting confirmation the same way, when its median compute (the step's time outside
synchronisation) differs from the plan's by as much: other work on the machine came or went, so
a plan made under a passing load is made again once it has gone, although the choice's own
synchronisation may still match its prediction. A re-plan after a confirmed stray probes again
(the calibrating re-plan reuses its plan's probe) and plans again with a correction of the
choice's family from what it measured, dropping the other family's (measured under the
conditions that changed: that family's next plan is calibrated afresh by its first window):
above the model, the excess in seconds is added to each member's prediction (the stragglers'
wait and the framework's overhead the model does not see, alike at every density); below it,
each member's prediction is scaled by the ratio (the probe overestimated the cost of a byte).
The candidates share one memory, so the residuals carry over a change of plan (a dense step
sends them all), and so does DGC's momentum correction where the memory has it: the velocity
is masked after SparDL's steps and kept whole after the dense ones (synchronous SGD with
momentum, weight decay aside), so the momentum survives every change of plan. Its state
(plan, link, measurements, corrections, SparDL's counters) is checkpointed with the memory.

A step is recognised without help from the caller: it begins where a tensor name comes again,
so every integration (DistributedOptimizer, the DDP hook, GRACE's own loop) gets the same
schedule, on every rank alike (they synchronise the same names in the same order).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any, cast

import torch

from ..api import DEFAULT_MIN_ENTRIES, Memory, Synchronizer
from ..compact import CompactCodec
from ..payload import PayloadCodec
from ..planner import (
    DEFAULT_CANDIDATES,
    NO_LINK,
    Candidate,
    Fit,
    Link,
    choose,
    parse_candidates,
    sync_bytes,
    sync_seconds,
)
from ..selection import count_for_ratio, topk_abs
from ..transport import Transport
from .dense import Dense, Dense16
from .spardl import SparDL

LOG = logging.getLogger("spardl_grace.auto")

#: bytes of the link probes, in the order they run: point-to-point ring messages and
#: all-reduces; a kind's ladder stops after the first size whose probe took PROBE_BUDGET_S
PROBE_P2P_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
PROBE_ALLREDUCE_BYTES = (1 << 12, 1 << 15, 1 << 18, 1 << 21)
PROBE_BUDGET_S = 0.025
PROBE_REPEATS = 3
#: entries of the tensor SparDL's selection is timed on (at most)
SELECTION_PROBE_NUMEL = 1 << 21
#: entries of the message SparDL's coding is timed on (at most): enough for a per-entry figure
CODING_PROBE_ENTRIES = 1 << 16
#: the measured candidate's corrected prediction stays within these factors of the model's
CORRECTION_RANGE = (0.25, 8.0)


def _median_seconds(run: Any, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ladder(
    transport: Transport, device: torch.device, name: str, sizes: Sequence[int], op: Any
) -> list[tuple[float, float]]:
    """(bytes, median seconds) of op(nbytes, tag) for `sizes` in order, the first run of each
    untimed (it pays any set-up); after each size the ranks take rank 0's word on whether
    its probe stayed within PROBE_BUDGET_S, and the ladder stops after the first that did
    not, so a slow link is probed in a fraction of a second and every rank runs the same
    probes."""
    samples = []
    for i, nbytes in enumerate(sizes):
        tag = f"{name}.{nbytes}"
        op(nbytes, tag)
        seconds = _median_seconds(lambda n=nbytes, t=tag: op(n, t), PROBE_REPEATS, device)
        samples.append((float(nbytes), seconds))
        if i + 1 < len(sizes):
            more = torch.tensor([1 if seconds < PROBE_BUDGET_S else 0], dtype=torch.int32)
            if not int(transport.broadcast(more.to(device), 0, f"{tag}.more").cpu()[0]):
                break
    return samples


def probe_link(transport: Transport, device: torch.device, name: str) -> Link:
    """Fit the link from timed ring messages (each rank sends to the next, receives from the
    previous) and all-reduces of rising sizes (PROBE_*_BYTES, while within PROBE_BUDGET_S);
    every rank must call it at the same point. Each rank fits its own timings (rank 0's are
    what the plan uses); an all-reduce's bytes are those a rank sends in a ring."""
    if transport.size == 1:
        return NO_LINK
    size, rank = transport.size, transport.rank
    dst, src = (rank + 1) % size, (rank - 1) % size
    messages = {n: torch.zeros(n, dtype=torch.uint8, device=device) for n in PROBE_P2P_BYTES}
    tensors = {n: torch.zeros(n // 4, device=device) for n in PROBE_ALLREDUCE_BYTES}
    halves = {n: torch.zeros(n // 2, dtype=torch.bfloat16, device=device) for n in tensors}
    ladders = {
        "p2p": (
            PROBE_P2P_BYTES,
            lambda n, tag: transport.sendrecv(messages[n], dst, src, tag, recv_numel=n),
        ),
        "allreduce": (PROBE_ALLREDUCE_BYTES, lambda n, tag: transport.allreduce(tensors[n], tag)),
        "allreduce16": (PROBE_ALLREDUCE_BYTES, lambda n, tag: transport.allreduce(halves[n], tag)),
    }
    got = {
        kind: _ladder(transport, device, f"{name}.{kind}", sizes, op)
        for kind, (sizes, op) in ladders.items()
    }

    def fit(samples: list[tuple[float, float]]) -> Fit:
        return Fit.least_squares([(2 * b * (size - 1) / size, t) for b, t in samples])

    return Link.measured(
        Fit.least_squares(got["p2p"]), fit(got["allreduce"]), fit(got["allreduce16"])
    )


def local_seconds_per_entry(
    densities: Sequence[float], numel: int, size: int, device: torch.device, codec: PayloadCodec
) -> tuple[list[float], float, float]:
    """Seconds of each candidate's own work on a rank, timed here on a block of
    min(numel, SELECTION_PROBE_NUMEL) random entries: per entry of the block, SparDL's top-k
    selection at each of `densities` and dense16's casts (Dense16.reduce's passes before and
    after its all-reduce); per entry kept, SparDL's coding of one message at the densest of
    `densities` (at most CODING_PROBE_ENTRIES entries) with `codec` (encode, take it out of
    the sender's block, decode, add it into the receiver's: what
    spardl_grace.planner.spardl_coded_entries counts)."""
    n = max(1, min(numel, SELECTION_PROBE_NUMEL))
    sample = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)

    def casts() -> None:
        half = (sample / size).to(torch.bfloat16)
        _ = sample - half.to(sample.dtype) * size
        _ = half.to(sample.dtype)

    selection = [
        _median_seconds(lambda d=d: topk_abs(sample, count_for_ratio(n, d)), 3, device) / n
        for d in densities
    ]
    kept = min(count_for_ratio(n, max(densities, default=0.01)), CODING_PROBE_ENTRIES)
    chosen = topk_abs(sample, kept)
    sender, receiver = sample.clone(), torch.zeros_like(sample)

    def coding() -> None:
        encoded = codec.encode(sender, chosen, "auto.coding")
        sender.index_add_(0, encoded.indices, encoded.values, alpha=-1)
        indices, values = codec.decode(encoded.data, n, sample.dtype, device, "auto.coding")
        receiver.index_add_(0, indices, values)

    return (
        selection,
        _median_seconds(casts, 3, device) / n,
        _median_seconds(coding, 3, device) / kept,
    )


class Auto(Synchronizer):
    """The 'auto' communicator (see the module docstring). memory: the error feedback the
    candidates share ('global_residual' keeps SparDL's residuals); candidates: names of
    spardl_grace.planner (DEFAULT_CANDIDATES); budget: how much slower than the fastest
    predicted step a less compressed candidate may be (0.05); measure_steps: dense steps
    measured before the first plan; replan_window: steps between checks of the plan (0:
    never re-plan); replan_tolerance: how far measured synchronisation may stray from the
    plan's, as a share of it, before a window counts as straying; min_entries: SparDL's
    floor (SparseAllreduce.set_min_entries)."""

    def __init__(
        self,
        memory: Memory,
        transport: Transport | int | None = None,
        candidates: Sequence[str] = DEFAULT_CANDIDATES,
        budget: float = 0.05,
        measure_steps: int = 10,
        replan_window: int = 20,
        replan_tolerance: float = 0.25,
        min_entries: int = DEFAULT_MIN_ENTRIES,
    ):
        super().__init__(memory, transport)
        self._candidates: tuple[Candidate, ...] = parse_candidates(list(candidates))
        self._by_name = {c.name: c for c in self._candidates}
        if not 0 < budget <= 1:
            raise ValueError(f"auto_budget must be in (0, 1], got {budget!r}")
        if (
            isinstance(measure_steps, bool)
            or not isinstance(measure_steps, int)
            or measure_steps < 2
        ):
            raise ValueError(f"auto_measure_steps must be an int >= 2, got {measure_steps!r}")
        if (
            isinstance(replan_window, bool)
            or not isinstance(replan_window, int)
            or replan_window < 0
        ):
            raise ValueError(f"auto_replan_window must be an int >= 0, got {replan_window!r}")
        if not replan_tolerance > 0:
            raise ValueError(f"auto_replan_tolerance must be > 0, got {replan_tolerance!r}")
        self.candidates = ",".join(c.name for c in self._candidates)
        self.budget = float(budget)
        self.measure_steps = measure_steps
        self.replan_window = replan_window
        self.replan_tolerance = float(replan_tolerance)
        self.min_entries = min_entries
        self._dense = Dense(memory, self.transport)
        self._dense16 = Dense16(memory, self.transport)
        self._sparse = SparDL(memory, self.transport, 0.01, codec=CompactCodec())
        self._sparse.set_min_entries(min_entries)
        self._measure_dense()
        self._steps = 0
        self._plan: dict[str, Any] = {}
        self._compute: list[float] = []  # the latest steps' time outside synchronisation
        self._window: list[float] = []  # synchronisation seconds per step since the plan
        #: per candidate name, (seconds added, factor) correcting the model (see _correction)
        self._corrections: dict[str, tuple[float, float]] = {}
        #: kinds whose correction was lent by another kind of their family, not measured
        #: on their own steps: their first window calibrates them (see _inferred_from)
        self._unmeasured: set[str] = set()
        #: which way the last window strayed since the plan (+1 slower, -1 faster, 0 not)
        self._strayed = 0
        #: the last probe: the link and the local seconds (local_seconds_per_entry's)
        self._probed: tuple[Link, list[float], float, float] | None = None
        self._replans = 0
        self._seen: set[str] = set()
        self._numels: dict[str, int] = {}  # this step's tensors
        self._last_numels: dict[str, int] = {}  # the last whole step's
        self._step_start: float | None = None
        self._step_sync = 0.0

    @property
    def plan(self) -> dict[str, Any]:
        """The current plan (empty while measuring): 'choice', 'compute_s', the link
        ('p2p_alpha_s', 'p2p_beta_s_per_byte', 'allreduce_alpha_s',
        'allreduce_beta_s_per_byte', the same of bfloat16's all-reduce 'allreduce16_...',
        'link_gbit_per_s'), each candidate's 'predicted_step_s',
        'predicted_sync_s' and 'sent_bytes' by name, and the step it was made at."""
        return dict(self._plan)

    def keep_to_dense(self) -> bool:
        """Leave SparDL's densities out of the candidates, keeping those that send every entry
        (dense, dense16); every rank must call it alike. For an Adam-type optimizer, which
        trains far behind dense on a selection of the raw gradient (spardl_grace.adam_advice).
        Only when a dense candidate remains, and before a plan among SparDL's densities (a
        plan among the dense ones, resumed from a checkpoint, stands); returns whether the
        candidates changed."""
        dense = tuple(c for c in self._candidates if c.kind != "spardl")
        planned = self._plan.get("predicted_step_s", {})
        if any(self._by_name[n].kind == "spardl" for n in planned):
            return False
        if not dense or len(dense) == len(self._candidates):
            return False
        self._candidates = dense
        self._by_name = {c.name: c for c in dense}
        self.candidates = ",".join(c.name for c in dense)
        return True

    def _family(self, name: str) -> str:
        """'spardl' for SparDL's densities, 'dense' for dense and dense16: what one measured
        correction speaks for."""
        return "spardl" if self._by_name[name].kind == "spardl" else "dense"

    def _switch(self, name: str) -> None:
        """Synchronise with candidate `name` from the next tensor on."""
        self.choice = name
        chosen = self._by_name[name]
        if chosen.kind == "spardl":
            self._sparse.set_density(chosen.density)
        self._mask_velocity(chosen.kind == "spardl")

    def _measure_dense(self) -> None:
        """Synchronise dense while measuring (dense need not be among the candidates)."""
        #: the candidate in use (dense while measuring); part of the ranks' fingerprint
        self.choice = "dense"
        self._mask_velocity(False)

    def _mask_velocity(self, sparse: bool) -> None:
        """With momentum correction, the memory masks its velocity after SparDL's steps and
        keeps it whole after the dense ones (ResidualMemory.keep_velocity)."""
        keep_velocity = getattr(self.memory, "keep_velocity", None)
        if keep_velocity is not None:
            keep_velocity(not sparse)

    def _inner(self) -> Synchronizer:
        return {"dense": self._dense, "dense16": self._dense16}.get(self.choice, self._sparse)

    def synchronize(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The current candidate's synchronisation of `tensor`; at the first tensor of a
        step, the plan is made or checked first (a collective every rank takes there)."""
        now = time.perf_counter()
        if name in self._seen:
            self._close_step(now)
        first = not self._seen
        if first:
            self._step_start = now if self._step_start is None else self._step_start
            self._plan_or_check(tensor.device)
        self._seen.add(name)
        self._numels[name] = tensor.numel()
        self.agree(tensor, name)
        start = time.perf_counter()
        inner = self._inner()
        inner.reuse_results = self.reuse_results
        result = inner.synchronize(tensor, name)
        self._step_sync += time.perf_counter() - start
        self.last_stats = {**inner.last_stats, **(self._decision_stats() if first else {})}
        return result

    def _close_step(self, now: float) -> None:
        if self._step_is_measured():
            start = cast(float, self._step_start)  # set: _step_is_measured checked it
            self._compute.append(max(now - start - self._step_sync, 0.0))
            del self._compute[: -max(self.measure_steps, self.replan_window)]
            if self._keeps_window():
                self._window.append(self._step_sync)
        self._steps += 1
        self._step_start, self._step_sync = now, 0.0
        self._last_numels, self._numels = self._numels, {}
        self._seen = set()

    def _step_is_measured(self) -> bool:
        """Whether the open step counts in the measurements: the first step after a start pays
        one-time costs (agreement, buffers)."""
        return self._step_start is not None and self._steps >= 1

    def _keeps_window(self) -> bool:
        """Whether a step's synchronisation joins the window: while measuring, or to check
        the plan (replan_window)."""
        return bool(self.replan_window) or not self._plan

    def _plan_or_check(self, device: torch.device) -> None:
        if not self._plan:
            if self._steps >= self.measure_steps:
                self._replan(device, measured_dense=True)
            return
        due = max(1, self.replan_window // 2) if self._strayed else self.replan_window
        if self.replan_window and len(self._window) >= due:
            steps = len(self._window)
            ratio, measured, compute = self._measured(device, steps)
            self._window = []
            direction = self._stray(ratio, measured)
            family = self._family(self.choice)
            kind = self._by_name[self.choice].kind
            corrected = any(self._family(n) == family for n in self._corrections)
            calibrated = corrected and kind not in self._unmeasured
            if direction and not calibrated:
                self._replan(
                    device, measured_dense=False, ratio=ratio, measured=measured, probe=False
                )
                return
            # Other work on the machine came or went: the plan's compute, and the corrections
            # measured under it, are out of date even when the choice's synchronisation is not.
            direction = direction or self._load_changed(compute)
            if direction and direction == self._strayed:
                self._replan(device, measured_dense=False, ratio=ratio, measured=measured)
            else:
                self._strayed = direction
                if not calibrated:
                    # A window that measured the family as the model predicts calibrates it
                    # as it stands: a later stray is the link changing, and must be confirmed
                    # and probed afresh, not blamed on the model (with the old probe).
                    if not corrected:
                        self._unmeasured |= self._inferred_from(kind)
                    for member in self._candidates:
                        if self._family(member.name) == family:
                            self._corrections.setdefault(member.name, (0.0, 1.0))
                    self._unmeasured.discard(kind)

    def _stray(self, ratio: float, measured: float) -> int:
        """+1 (slower) or -1 (faster) when the window's measured synchronisation strays from
        the plan's by more than replan_tolerance of it and by more than budget of the
        predicted step; 0 otherwise."""
        predicted = self._plan["predicted_sync_s"][self.choice]
        off = measured - predicted
        floor = self.budget * self._plan["predicted_step_s"][self.choice]
        if abs(ratio - 1) <= self.replan_tolerance or abs(off) <= floor:
            return 0
        return 1 if off > 0 else -1

    def _load_changed(self, compute: float) -> int:
        """+1 (slower) or -1 (faster) when the window's compute strays from the plan's by more
        than replan_tolerance of it and by more than budget of the predicted step; 0
        otherwise."""
        planned = self._plan["compute_s"]
        off = compute - planned
        floor = self.budget * self._plan["predicted_step_s"][self.choice]
        if abs(off) <= self.replan_tolerance * planned or abs(off) <= floor:
            return 0
        return 1 if off > 0 else -1

    def _measured(self, device: torch.device, steps: int) -> tuple[float, float, float]:
        """Rank 0's median synchronisation over the window, as a ratio to the plan's
        prediction and in seconds, and its median compute over the window's `steps`, the
        same on every rank."""
        predicted = self._plan["predicted_sync_s"][self.choice]
        measured = statistics.median(self._window)
        ratio = measured / predicted if predicted > 0 else 1.0
        compute = statistics.median(self._compute[-steps:]) if self._compute else 0.0
        shared = torch.tensor([ratio, measured, compute], dtype=torch.float64)
        ratio, measured, compute = self.transport.broadcast(
            shared.to(device), 0, "auto.check"
        ).tolist()
        return ratio, measured, compute

    def _replan(
        self,
        device: torch.device,
        measured_dense: bool,
        ratio: float = 1.0,
        measured: float = 0.0,
        probe: bool = True,
    ) -> None:
        """Probe, predict on rank 0, take rank 0's plan on every rank, switch to its choice.
        measured_dense: the window holds the measured dense steps (the first plan); otherwise
        `measured` is the window's synchronisation under the current choice, `ratio` its
        ratio to the prediction. probe=False reuses this run's last probe where there is one
        (a correction of the model, which a window after that probe asks for, needs no new
        one; every rank has one, or none, alike)."""
        size = self.transport.size
        sparse = [c for c in self._candidates if c.kind == "spardl"]
        numels = list(self._last_numels.values())
        if probe or self._probed is None:
            self._probed = (
                probe_link(self.transport, device, "auto.probe"),
                *local_seconds_per_entry(
                    [c.density for c in sparse],
                    max(numels, default=1),
                    size,
                    device,
                    self._sparse.codec,
                ),
            )
        link, select, casts, coding = self._probed
        local_of = {c.name: s for c, s in zip(sparse, select)}
        local_of.update({c.name: casts for c in self._candidates if c.kind == "dense16"})
        compute = statistics.median(self._compute) if self._compute else 0.0
        corrections = dict(self._corrections)
        model = {
            c.name: sync_seconds(
                c, numels, size, link, local_of.get(c.name, 0.0), self.min_entries, coding
            )
            for c in self._candidates
        }
        dense = sync_seconds(Candidate("dense", "dense"), numels, size, link)
        unmeasured = set(self._unmeasured)
        if measured_dense and self._window and dense > 0:
            # The measured steps ran dense: their all-reduces calibrate the dense candidates.
            fix = _correction(statistics.median(self._window), dense)
            corrections.update({n: fix for n in model if self._family(n) == "dense"})
            unmeasured = self._inferred_from("dense")
        elif not measured_dense:
            # What the model misses for the choice (waiting for the slowest rank, the
            # framework's overhead) is time a step, not per byte: the main job's SparDL
            # steps cost the same at 0.01 and 0.003, where scaling the model's
            # prediction by the measured ratio put them 36% apart. It is alike for the
            # choice's family: the dense ones, or SparDL's densities.
            fix = _correction(measured, model[self.choice])
            family = self._family(self.choice)
            kind = self._by_name[self.choice].kind
            if probe:
                # A confirmed stray: the conditions changed, and the other family's correction
                # was measured under the old ones. Kept, a correction taken during a passing
                # load outlived it (a ResNet-20 run stayed 6 epochs on bfloat16 dense, 1.2x
                # slower, with SparDL's excess of that minute); dropped, the family's next
                # plan is calibrated afresh by its first window.
                corrections = {n: c for n, c in corrections.items() if self._family(n) == family}
                lent = self._inferred_from(kind)
                unmeasured = set(lent)
            else:
                # The model was wrong for the choice's kind alone: a kind of its family with a
                # correction measured on its own steps keeps it (lent back and forth, the two
                # dense kinds could take turns re-planning at every window); the rest borrow.
                own = {self._by_name[n].kind for n in corrections} - self._unmeasured
                lent = self._inferred_from(kind) - own
                unmeasured = (self._unmeasured - {kind}) | lent
            corrections.update({n: fix for n in model if self._by_name[n].kind in lent | {kind}})
        sync = {n: _corrected(model[n], corrections.get(n, (0.0, 1.0))) for n in model}
        sent = {c.name: sync_bytes(c, numels, size, self.min_entries) for c in self._candidates}
        steps = [compute + sync[c.name] for c in self._candidates]
        fixes = [corrections.get(c.name, (math.nan, math.nan)) for c in self._candidates]
        index = choose(steps, [sent[c.name] for c in self._candidates], self.budget)
        sixteen = link.allreduce16 or link.allreduce
        mine = torch.tensor(
            [
                index,
                compute,
                link.p2p.alpha,
                link.p2p.beta,
                link.allreduce.alpha,
                link.allreduce.beta,
                sixteen.alpha,
                sixteen.beta,
                *(sync[c.name] for c in self._candidates),
                *(added for added, _ in fixes),
                *(factor for _, factor in fixes),
            ],
            dtype=torch.float64,
        )
        plan = self.transport.broadcast(mine.to(device), 0, "auto.plan").cpu().tolist()
        self._adopt(plan, sent, ratio)
        self._window, self._strayed, self._unmeasured = [], 0, unmeasured

    def _inferred_from(self, kind: str) -> set[str]:
        """The kinds to which a measurement of `kind` may lend its correction: the other kinds
        of its family among the candidates. The dense family's correction is taken from
        float32's steps or bfloat16's, and the two fit the link apart (bfloat16's all-reduce
        has its own fit, whose slope a fast link leaves noisy), so the one not measured is
        calibrated by its own first window; SparDL's densities are one kind."""
        family = "spardl" if kind == "spardl" else "dense"
        return {
            c.kind for c in self._candidates if c.kind != kind and self._family(c.name) == family
        }

    def _adopt(self, vector: list[float], sent: dict[str, float], ratio: float) -> None:
        """Take rank 0's plan `vector` (see _replan) as this rank's plan and switch to it."""
        count = len(self._candidates)
        names = [c.name for c in self._candidates]
        index, compute = int(vector[0]), vector[1]
        sync = dict(zip(names, vector[8 : 8 + count]))
        added, factors = vector[8 + count : 8 + 2 * count], vector[8 + 2 * count : 8 + 3 * count]
        self._corrections = {
            n: (a, f) for n, a, f in zip(names, added, factors) if not math.isnan(a)
        }
        link = Link(Fit(vector[2], vector[3]), Fit(vector[4], vector[5]), Fit(vector[6], vector[7]))
        chosen = self._candidates[index]
        if self._plan:
            self._replans += 1
        self._plan = {
            "choice": chosen.name,
            "step": self._steps,
            "compute_s": compute,
            "p2p_alpha_s": link.p2p.alpha,
            "p2p_beta_s_per_byte": link.p2p.beta,
            "allreduce_alpha_s": link.allreduce.alpha,
            "allreduce_beta_s_per_byte": link.allreduce.beta,
            "allreduce16_alpha_s": vector[6],
            "allreduce16_beta_s_per_byte": vector[7],
            "link_gbit_per_s": link.gbit_per_s,
            "predicted_sync_s": sync,
            "predicted_step_s": {n: compute + s for n, s in sync.items()},
            "sent_bytes": sent,
            "replans": self._replans,
            "measured_ratio": ratio,
        }
        self._switch(chosen.name)
        if self.transport.rank == 0:
            LOG.info("%s", self.describe(), extra={"auto_plan": self.plan})

    def describe(self) -> str:
        """The plan in one line: the choice, each candidate's predicted step, the link and
        the compute time (what rank 0 logs when it plans)."""
        if not self._plan:
            return f"auto: measuring ({self._steps} of {self.measure_steps} dense steps)"
        p = self._plan
        steps = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in p["predicted_step_s"].items())
        rate = p["link_gbit_per_s"]
        link = "too fast for the probe to time" if math.isinf(rate) else f"{rate:.3g} Gbit/s"
        return (
            f"auto: chose {p['choice']} at step {p['step']} (plan {p['replans'] + 1}); "
            f"predicted steps: {steps}; link {link}, "
            f"{p['p2p_alpha_s'] * 1e6:.0f} us a message; compute {p['compute_s'] * 1e3:.1f} ms"
        )

    def _decision_stats(self) -> dict[str, float]:
        """The plan as numbers for last_stats (once a step: the integrations sum a step's
        tensors' statistics): auto_choice is the chosen candidate's index in the candidates
        (-1 while measuring, dense), auto_density its density."""
        if not self._plan:
            return {"auto_choice": -1.0, "auto_density": 1.0, "auto_replans": 0.0}
        chosen = self._by_name[self.choice]
        return {
            "auto_choice": float(self._candidates.index(chosen)),
            "auto_density": chosen.density,
            "auto_replans": float(self._replans),
            "auto_predicted_step_s": self._plan["predicted_step_s"][self.choice],
            "auto_compute_s": self._plan["compute_s"],
            "auto_link_gbit_per_s": self._plan["link_gbit_per_s"],
        }

    def result_is_finite(self, result: torch.Tensor, name: str) -> bool:
        return self._inner().result_is_finite(result, name)

    def set_density(self, density: float) -> None:
        raise ValueError(
            "communicator 'auto' chooses the density itself; give its candidates "
            "('auto_candidates') instead, or choose a communicator such as 'spardl'"
        )

    def _own_state(self) -> dict[str, Any]:
        # A step closes when the next one begins (_close_step). Saved between steps, the last
        # one counts as closed (its compute is unknown until then), so a resumed run plans and
        # checks at the steps an unbroken run does.
        steps, window, numels = self._steps, list(self._window), self._last_numels
        if self._seen:
            if self._step_is_measured() and self._keeps_window():
                window.append(self._step_sync)
            steps, numels = steps + 1, self._numels
        return {
            "choice": self.choice,
            "steps": steps,
            "plan": _plain(self._plan),
            "compute": list(self._compute),
            "window": window,
            "corrections": {n: list(c) for n, c in self._corrections.items()},
            "unmeasured": sorted(self._unmeasured),
            "strayed": self._strayed,
            "replans": self._replans,
            "numels": dict(numels),
            "spardl": self._sparse._own_state(),
        }

    def _load_own_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        choice = state["choice"]
        if state["plan"] and choice not in self._by_name:
            raise ValueError(
                f"the checkpoint's 'auto' choice {choice!r} is not among this run's "
                f"candidates ({self.candidates})"
            )
        self._steps = int(state["steps"])
        self._plan = {
            k: (float("inf") if k == "link_gbit_per_s" and v is None else v)
            for k, v in state["plan"].items()
        }
        self._compute = list(state["compute"])
        self._window = list(state["window"])
        self._corrections = {
            n: _from_saved(c, self._plan["predicted_sync_s"].get(n, 0.0))
            for n, c in state["corrections"].items()
        }
        self._strayed = int(state.get("strayed", 0))
        self._unmeasured = set(state.get("unmeasured", ()))
        self._replans = int(state["replans"])
        self._sparse._load_own_state(state["spardl"])
        self._probed = None
        if self._plan:
            self._switch(choice)
        else:
            self._measure_dense()
        self._seen, self._step_start, self._step_sync = set(), None, 0.0
        self._numels, self._last_numels = {}, dict(state["numels"])


def _correction(measured: float, model: float) -> tuple[float, float]:
    """(seconds added, factor) that correct `model` to `measured`, within CORRECTION_RANGE of
    the model: above it, the excess is added (time a step, the same for a sparser member of
    the family); below it, the model is scaled (a byte cost less than the probe said)."""
    low, high = CORRECTION_RANGE
    if measured >= model:
        return min(measured - model, (high - 1) * model), 1.0
    return 0.0, max(low, measured / model)


def _corrected(model: float, correction: tuple[float, float]) -> float:
    """`model` scaled by the correction's factor, plus its seconds."""
    added, factor = correction
    return model * factor + added


def _from_saved(saved: Any, predicted: float) -> tuple[float, float]:
    """A checkpoint's correction: [seconds added, factor], or, from checkpoints before the
    seconds, the ratio that scaled the model to the saved plan's `predicted` synchronisation
    (a ratio above 1 becomes the seconds it added there)."""
    if isinstance(saved, (list, tuple)):
        return float(saved[0]), float(saved[1])
    ratio = float(saved)
    if ratio >= 1:
        return predicted * (1 - 1 / ratio), 1.0
    return 0.0, ratio


def _plain(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with infinities as None, so it loads with torch.load(weights_only=True) and
    reads as JSON."""
    return {k: (None if isinstance(v, float) and v == float("inf") else v) for k, v in plan.items()}
