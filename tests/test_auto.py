"""'communicator': 'auto': the choice on synthetic link and compute figures (every branch of
spardl_grace.planner), bytes on the wire against its formulas, and the synchronizer over real
ranks (run_local's threads, torchrun's processes): every rank takes rank 0's plan, the re-plan
trigger fires when synchronisation strays from the prediction, mass is conserved through every
candidate, a checkpoint resumes bit for bit, and bad values are refused naming the valid ones.

The plan itself depends on measured times, so tests that need one fixed outcome offer a single
candidate or replace the measurement with figures of their own."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from spardl_grace import CommHookState, DistributedOptimizer, grace_from_params
from spardl_grace.communicators import auto as auto_module
from spardl_grace.communicators.auto import Auto
from spardl_grace.communicators.dense import Dense16
from spardl_grace.memories import GlobalResidualMemory
from spardl_grace.planner import (
    DEFAULT_CANDIDATES,
    Candidate,
    Fit,
    Link,
    choose,
    parse_candidate,
    parse_candidates,
    sync_bytes,
    sync_seconds,
)
from spardl_grace.transport import run_local

AUTO = {"communicator": "auto", "memory": "global_residual", "auto_measure_steps": 3,
        "auto_replan_window": 4, "min_entries": 0}
NUMELS = (200_000, 3_000, 50_000)

# ------------------------------------------------------------------ the planner, pure


def test_candidate_names_parse_and_bad_ones_name_the_valid_forms():
    assert parse_candidate("dense") == Candidate("dense", "dense", 1.0)
    assert parse_candidate("dense16").kind == "dense16"
    assert parse_candidate("spardl@0.003") == Candidate("spardl@0.003", "spardl", 0.003)
    assert parse_candidate("spardl@1e-3").density == 0.001
    for bad in ("spardl@1", "spardl@0", "spardl", "topk@0.01", "", 0.01, None):
        with pytest.raises(ValueError, match="'dense', 'dense16' or 'spardl@D'"):
            parse_candidate(bad)
    assert [c.name for c in parse_candidates(list(DEFAULT_CANDIDATES))] == list(DEFAULT_CANDIDATES)
    with pytest.raises(ValueError, match="twice"):
        parse_candidates(["dense", "dense"])
    with pytest.raises(ValueError, match="at least one"):
        parse_candidates([])
    with pytest.raises(ValueError, match="list of candidate names"):
        parse_candidates("dense")


def test_least_squares_recovers_a_line_and_keeps_both_terms_non_negative():
    fit = Fit.least_squares([(b, 1e-4 + 8e-8 * b) for b in (1e3, 1e5, 1e6)])
    assert fit.alpha == pytest.approx(1e-4) and fit.beta == pytest.approx(8e-8)
    flat = Fit.least_squares([(1e3, 2e-3), (1e6, 1e-3)])  # slower small messages: noise
    assert flat == Fit(1.5e-3, 0.0)
    steep = Fit.least_squares([(1e3, 0.0), (1e6, 1e-2), (2e6, 2.2e-2)])  # negative intercept
    assert steep.alpha == 0.0 and steep.beta > 0
    with pytest.raises(ValueError):
        Fit.least_squares([])


def _link(gbit: float, latency: float) -> Link:
    beta = 8 / (gbit * 1e9)
    return Link(Fit(latency, beta), Fit(2 * latency, beta))


def _predicted(compute: float, link: Link, numels=NUMELS, size=4, select=0.0):
    candidates = parse_candidates(list(DEFAULT_CANDIDATES))
    steps = [compute + sync_seconds(c, numels, size, link, select if c.kind == "spardl" else 0)
             for c in candidates]
    sent = [sync_bytes(c, numels, size, 0) for c in candidates]
    return [c.name for c in candidates], steps, sent


@pytest.mark.parametrize("compute, gbit, select, expected", [
    (10.0, 0.1, 0.0, "dense"),           # compute dwarfs every candidate's synchronisation
    (0.01, 100.0, 0.0, "dense"),         # a fast link: dense is as fast as any
    (0.2, 1.0, 0.0, "dense16"),          # half the bytes brings dense within 5% of the fastest
    (0.0, 0.1, 0.0, "spardl@0.001"),     # a slow link, nothing else: the most compressed
    (0.05, 0.1, 0.0, "spardl@0.01"),     # compute brings 0.01 within 5% of 0.001
    (0.09, 0.1, 0.0, "spardl@0.03"),     # more compute, a denser choice
    (0.0, 0.1, 1e-6, "dense16"),         # selection costs more than the bytes it saves
])
def test_the_choice_on_synthetic_link_and_compute_figures(compute, gbit, select, expected):
    names, steps, sent = _predicted(compute, _link(gbit, 1e-4), select=select)
    assert names[choose(steps, sent, 0.05)] == expected


def test_dense16s_casts_and_a_slow_16_bit_sum_are_part_of_its_prediction():
    numels, dense16 = [14_700_000], parse_candidate("dense16")
    fast = Link(Fit(1e-4, 1e-10), Fit(1e-4, 1e-10))  # 10 Gbit-ish, 16-bit sums as fast
    dense = sync_seconds(parse_candidate("dense"), numels, 4, fast)
    assert sync_seconds(dense16, numels, 4, fast) < dense
    # 10 ns an entry of casts on this machine: 0.15 s a step, more than the bytes it saves
    assert sync_seconds(dense16, numels, 4, fast, 1e-8) > dense
    slow_sum = Link(fast.p2p, fast.allreduce, Fit(1e-4, 4e-10))  # bfloat16 summed 4x slower
    assert sync_seconds(dense16, numels, 4, slow_sum) > dense


def test_a_probed_bfloat16_slope_below_float32s_is_taken_as_float32s():
    """The probe's fits on a fast link resolve a byte's cost poorly; a bfloat16 all-reduce
    fitted cheaper per byte than float32's (VGG-16 at loopback: 1.2e-9 against 6.5e-9 s/B)
    made a plan take bfloat16 dense at 0.69 s a step, which ran 1.34 s."""
    p2p, f32 = Fit(1e-3, 1e-9), Fit(3e-3, 6.5e-9)
    noisy = Link.measured(p2p, f32, Fit(8.7e-3, 1.2e-9))
    assert noisy.allreduce16 == Fit(8.7e-3, 6.5e-9) and (noisy.p2p, noisy.allreduce) == (p2p, f32)
    slower = Link.measured(p2p, f32, Fit(4e-3, 9e-9))  # a 16-bit sum slower than float32's
    assert slower.allreduce16 == Fit(4e-3, 9e-9)
    numels, dense, dense16 = [14_700_000], parse_candidate("dense"), parse_candidate("dense16")
    # half the bytes at no less a cost per byte: never below half of dense's per-byte time
    assert sync_seconds(dense16, numels, 4, noisy) >= (
        sync_seconds(dense, numels, 4, noisy) - f32.alpha) / 2


def test_spardls_coding_per_kept_entry_is_part_of_its_prediction():
    """SparDL's work per entry it keeps (encode, take out, decode, add in) grows with the
    density: on a fast link it is what makes a denser SparDL slower (VGG-16 at loopback on 2
    cores: 0.1 ran 0.66 s a step slower than 0.01 for 9 MB more on a 6 Gbit/s link)."""
    from spardl_grace.planner import spardl_coded_entries

    # P = 4, one team: 3 Spar-Reduce-Scatter messages and 3 final pieces of k_b = 25 each
    assert spardl_coded_entries(1000, 4, 0.1) == 25 * (3 + 3)
    assert spardl_coded_entries(1000, 4, 1e-9) == 1 * (3 + 3)  # at least one entry a block
    numels, fast = [14_700_000], _link(10.0, 1e-5)
    dense, sparse = parse_candidate("dense"), parse_candidate("spardl@0.1")
    without = sync_seconds(sparse, numels, 4, fast)
    coded = spardl_coded_entries(14_700_000, 4, 0.1)
    assert sync_seconds(sparse, numels, 4, fast, coding_s_per_entry=1e-6) == pytest.approx(
        without + 1e-6 * coded)
    assert without < sync_seconds(dense, numels, 4, fast)  # bytes alone: SparDL wins
    assert sync_seconds(sparse, numels, 4, fast, coding_s_per_entry=1e-6) > \
        sync_seconds(dense, numels, 4, fast)  # with 1 us a kept entry it loses
    assert sync_seconds(dense, numels, 4, fast, coding_s_per_entry=1e-6) == \
        sync_seconds(dense, numels, 4, fast)  # the dense ones code nothing


def test_the_local_work_is_timed_per_entry_of_the_tensor_and_per_kept_entry():
    from spardl_grace.communicators.auto import local_seconds_per_entry
    from spardl_grace.compact import CompactCodec

    for numel in (1, 50_000):
        select, casts, coding = local_seconds_per_entry(
            [0.1, 0.01], numel, 4, torch.device("cpu"), CompactCodec())
        assert len(select) == 2 and all(s > 0 for s in select)
        assert casts > 0 and coding > 0


def test_choose_takes_the_least_compression_within_the_budget_and_refuses_a_bad_budget():
    steps, sent = [1.10, 1.04, 1.00], [100.0, 50.0, 1.0]
    assert choose(steps, sent, 0.05) == 1
    assert choose(steps, sent, 0.10) == 0
    assert choose(steps, sent, 0.01) == 2
    assert choose([1.0, 1.0], [5.0, 5.0], 0.05) == 0  # a tie: candidate order
    for budget in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            choose(steps, sent, budget)
    with pytest.raises(ValueError):
        choose([1.0], [1.0, 2.0], 0.05)


def test_one_rank_predicts_no_synchronisation():
    for c in parse_candidates(list(DEFAULT_CANDIDATES)):
        assert sync_seconds(c, NUMELS, 1, _link(1, 1e-4)) == 0 == sync_bytes(c, NUMELS, 1, 0)


# ------------------------------------------------------------------ bytes on the wire


@pytest.mark.parametrize("name", ["dense", "dense16", "spardl@0.01", "spardl@0.1"])
@pytest.mark.parametrize("size", [3, 4])
def test_bytes_sent_match_the_planner_formula(name, size):
    n = 10_007

    def work(t):
        grc = Auto(GlobalResidualMemory(), t, candidates=[name], measure_steps=2,
                   replan_window=0, min_entries=0)
        sent = []
        for step in range(4):
            torch.manual_seed(100 * t.rank + step)
            grc.step(torch.randn(n), "w")
            sent.append(grc.last_stats["bytes_sent"])
        return grc.choice, sent

    for choice, sent in run_local(size, work):
        assert choice == name
        assert sent[-1] == sync_bytes(parse_candidate(name), [n], size, 0)


# ------------------------------------------------------------------ the synchronizer


def _steps(t, params: dict, steps: int, state: dict | None = None, first: int = 0) -> dict:
    grc = grace_from_params(params, t)
    if state is not None:
        grc.load_state_dict(state)
    record = {"results": [], "choices": [], "stats": [], "old": [], "new": [], "grads": []}
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + t.rank)
        results = []
        for i, n in enumerate(NUMELS):
            grad = torch.randn(n, generator=g)
            old = grc.memory.residuals.get(f"p{i}", torch.zeros(n)).clone()
            results.append(grc.step(grad, f"p{i}").clone())
            if i == 0:
                record["stats"].append(dict(grc.last_stats))
            record["old"].append(old)
            record["new"].append(grc.memory.residuals.get(f"p{i}", torch.zeros(n)).clone())
            record["grads"].append(grad)
        record["results"].append(torch.cat(results))
        record["choices"].append(grc.choice)
    record["state"] = grc.state_dict()
    record["plan"] = grc.plan
    record["replans"] = grc._replans
    return record


def test_every_rank_takes_rank_zeros_plan_even_when_its_own_figures_differ(monkeypatch):
    def per_rank(transport, device, name):  # each rank measures a very different link
        return _link(0.01 * 100 ** transport.rank, 1e-4 * (1 + transport.rank))

    monkeypatch.setattr(auto_module, "probe_link", per_rank)
    ranks = run_local(4, _steps, {**AUTO, "auto_replan_window": 0}, 8)
    for r in ranks[1:]:
        assert r["choices"] == ranks[0]["choices"]
        assert r["plan"] == ranks[0]["plan"]
        assert all(torch.equal(a, b) for a, b in zip(r["results"], ranks[0]["results"]))
    assert ranks[0]["choices"][:3] == ["dense"] * 3
    assert ranks[0]["plan"]["step"] == 3
    assert set(ranks[0]["plan"]["predicted_step_s"]) == set(DEFAULT_CANDIDATES)
    assert ranks[0]["stats"][3]["auto_choice"] == DEFAULT_CANDIDATES.index(ranks[0]["choices"][3])
    assert "auto_link_gbit_per_s" in ranks[0]["stats"][3]


@pytest.mark.parametrize("candidate", ["dense", "dense16", "spardl@0.01"])
def test_mass_is_conserved_through_every_candidate(candidate):
    ranks = run_local(4, _steps, {**AUTO, "auto_candidates": [candidate]}, 5)
    per_step = len(NUMELS)
    for step in range(5):
        for i, n in enumerate(NUMELS):
            k = step * per_step + i
            start = sum(NUMELS[:i])
            result = ranks[0]["results"][step][start:start + n]
            before = sum(r["grads"][k].double() + r["old"][k].double() for r in ranks)
            after = 4 * result.double() + sum(r["new"][k].double() for r in ranks)
            # dense16's sum of the ranks' bfloat16 contributions rounds at about 2**-8 of
            # its terms, unkept (each rank's own rounding is kept: the Dense16 test below)
            tol = float(before.abs().max()) * 2 ** -6 if candidate == "dense16" else 1e-5
            assert torch.allclose(before, after, atol=tol, rtol=0), (candidate, step, i)


def _momentum_steps(t, candidates: list, steps: int, switch: dict | None = None) -> dict:
    """`steps` steps of auto with momentum correction 0.9 (the plan at step 3), the gradient
    written into one buffer each step (as DDP's buckets and in-place loops do), switched to
    `switch[step]` before that step (as a re-plan switches): per step, the result, and this
    rank's gradient, residual and velocity before and after."""
    grc = grace_from_params({**AUTO, "auto_candidates": candidates, "momentum_correction": 0.9,
                             "auto_replan_window": 0}, t)
    n = NUMELS[0]
    buffer = torch.empty(n)
    record: dict = {"results": [], "grads": [], "old": [], "new": [], "old_u": [], "new_u": []}
    for step in range(steps):
        if switch and step in switch:
            grc._switch(switch[step])
        grad = torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + t.rank))
        record["old"].append(grc.memory.residuals.get("w", torch.zeros(n)).clone())
        record["old_u"].append(grc.memory.velocities.get("w", torch.zeros(n)).clone())
        record["results"].append(grc.step(buffer.copy_(grad), "w").clone())
        record["grads"].append(grad)
        record["new"].append(grc.memory.residuals["w"].clone())
        record["new_u"].append(grc.memory.velocities["w"].clone())
    record["choice"] = grc.choice
    return record


def test_momentum_correction_keeps_the_velocity_on_dense_steps_and_masks_it_on_spardls():
    """With momentum correction, auto's dense steps are synchronous SGD with momentum (each
    result the ranks' mean velocity, u <- 0.9 u + g, nothing masked), its SparDL steps mask the
    velocity where the result was applied, bfloat16 dense's steps keep it whole, and mass is
    conserved through all three with the velocity in place of the gradient: measured dense
    (steps 0-2), the plan's choice (3), SparDL (4-5), dense again (6-7), bfloat16 dense (8)."""
    dense = run_local(4, _momentum_steps, ["dense"], 6)
    velocities = [torch.zeros(NUMELS[0]) for _ in dense]
    for step in range(6):
        for u, r in zip(velocities, dense):
            u.mul_(0.9).add_(r["grads"][step])
        mean = sum(v.double() for v in velocities) / 4
        assert torch.allclose(dense[0]["results"][step].double(), mean, atol=1e-5, rtol=0), step
        for u, r in zip(velocities, dense):
            assert torch.allclose(r["new_u"][step], u, atol=1e-5, rtol=0), step
    # step 3 runs the plan's own choice (timed, so unasserted); the switches come after it
    mixed = run_local(4, _momentum_steps, ["spardl@0.01", "dense", "dense16"], 9,
                      {4: "spardl@0.01", 6: "dense", 8: "dense16"})
    for step in range(9):
        result = mixed[0]["results"][step]
        applied = result != 0
        for r in mixed:
            u, old_u, g = r["new_u"][step], r["old_u"][step], r["grads"][step]
            fresh = torch.add(g, old_u, alpha=0.9)  # u <- 0.9 u + g
            assert torch.equal(u[~applied], fresh[~applied]), step
            if step in (4, 5):  # SparDL's: masked where applied
                assert 0 < int(applied.sum()) < NUMELS[0] // 10
                assert bool((u[applied] == 0).all()), step
            elif step != 3:  # dense: (nearly) every entry applied, the velocity whole all the same
                assert torch.equal(u, fresh), step
        before = sum(r["old"][step].double() + 0.9 * r["old_u"][step].double()
                     + r["grads"][step].double() for r in mixed)
        after = 4 * result.double() + sum(r["new"][step].double() for r in mixed)
        # bfloat16 dense's sum rounds at about 2**-8 of its terms, unkept
        tol = float(before.abs().max()) * 2 ** -6 if step in (3, 8) else 1e-5
        assert torch.allclose(before, after, atol=tol, rtol=0), step


def _sgd_momentum_run(t, corrected: bool) -> torch.Tensor:
    """Eight steps of SGD(momentum=0.9) on this rank's batches of a small model: through
    DistributedOptimizer with auto (dense only) and momentum correction, or with the ranks'
    mean gradient summed by hand; the parameters after them."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    init = torch.Generator().manual_seed(0)  # the ranks are threads: not the global generator
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if corrected:
        grc = grace_from_params({**AUTO, "auto_candidates": ["dense"],
                                 "momentum_correction": 0.9}, t)
        opt = DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())
        return _train_eight_steps(model, opt, t.rank)

    class MeanGradient(torch.optim.Optimizer):
        def __init__(self) -> None:  # only what _train_eight_steps calls
            self.param_groups = sgd.param_groups

        def zero_grad(self, set_to_none: bool = True) -> None:
            sgd.zero_grad()

        def step(self, closure=None) -> None:
            for i, p in enumerate(model.parameters()):
                p.grad = t.allreduce(p.grad.clone(), f"g{i}") / t.size
            sgd.step()

    return _train_eight_steps(model, MeanGradient(), t.rank)


def test_auto_with_momentum_correction_on_dense_steps_trains_as_sgd_with_momentum():
    """The user's SGD(momentum=0.9) through DistributedOptimizer with auto and momentum
    correction, on dense steps (measured and chosen), trains as SGD with momentum on the
    ranks' mean gradient: the memory holds the momentum and never masks it there."""
    corrected = run_local(2, _sgd_momentum_run, True)
    reference = run_local(2, _sgd_momentum_run, False)
    assert torch.equal(corrected[0], corrected[1])
    assert torch.allclose(corrected[0], reference[0], atol=1e-5, rtol=0)


def test_a_changed_link_triggers_a_replan_at_the_end_of_the_window(monkeypatch):
    state = {"slow": False}
    real = Auto._inner

    class Slowed:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def synchronize(self, tensor, name):
            if state["slow"]:
                threading.Event().wait(0.05)
            return self.inner.synchronize(tensor, name)

    monkeypatch.setattr(Auto, "_inner", lambda self: Slowed(real(self)))

    def work(t):
        grc = grace_from_params({**AUTO, "auto_candidates": ["spardl@0.01"]}, t)
        replans = []
        for step in range(16):
            if step == 8 and t.rank == 0:
                state["slow"] = True
            for i, n in enumerate(NUMELS):
                grc.step(torch.ones(n) * (t.rank + step), f"p{i}")
            replans.append(grc._replans)
        return replans

    ranks = run_local(4, work)
    # Planned at step 3; the first window ends at step 7, whose check may re-plan at once,
    # correcting the model for this machine. The link slowed from step 8 on strays at 11's
    # check: that re-plans at once if 7's did not (the model still uncorrected), otherwise
    # the half window to 13 confirms it.
    replans = ranks[0]
    changes = [step for step in range(1, 16) if replans[step] != replans[step - 1]]
    assert set(changes) <= {7, 11, 13, 15} and ({11, 13} & set(changes))
    assert replans[:7] == [0] * 7
    assert all(r == replans for r in ranks)


PLANNED = {"choice": "spardl@0.01", "compute_s": 1.0,
           "predicted_sync_s": {"dense": 1.0, "spardl@0.01": 0.1},
           "predicted_step_s": {"dense": 2.0, "spardl@0.01": 1.1}}


def _dense_and_spardl(t) -> Auto:
    """Auto choosing between dense and SparDL at 0.01, planning after 2 steps, every 4."""
    return Auto(GlobalResidualMemory(), t, candidates=["dense", "spardl@0.01"], measure_steps=2,
                replan_window=4, min_entries=0)


def _planned(t, corrections: dict) -> Auto:
    """_dense_and_spardl with PLANNED's plan on SparDL and `corrections` as its own."""
    grc = _dense_and_spardl(t)
    grc._plan = dict(PLANNED)
    grc._switch("spardl@0.01")
    grc._corrections = dict(corrections)
    return grc


def _checks(t, corrections: dict, windows: list, probes: list | None = None
            ) -> list[tuple[int, int, bool]]:
    """A plan predicting SparDL's synchronisation at 0.1 s of a 1.1-s step, 1 s of it compute
    (so the budget's floor, 0.055 s, is above the tolerance's 0.025 s of synchronisation and
    below its 0.25 s of compute); each window's synchronisation seconds (and compute, when a
    window is a (seconds, compute) pair; else the plan's) put in place before a step's check.
    Per window: re-plans so far, which way the window strayed, whether it was checked (the
    check empties it). Each re-plan's probe goes into `probes`."""
    grc = _planned(t, corrections)
    replans = probes if probes is not None else []

    def replan(device, measured_dense, ratio=1.0, measured=0.0, probe=True):
        replans.append(probe)
        grc._strayed = 0

    grc._replan = replan
    out = []
    for window in windows:
        sync, compute = window if isinstance(window, tuple) else (window, 1.0)
        grc._window, grc._compute = list(sync), [compute] * len(sync)
        grc._plan_or_check(torch.device("cpu"))
        out.append((len(replans), grc._strayed, not grc._window))
    return out


CALIBRATED = {"spardl@0.01": (0.02, 1.0)}


@pytest.mark.parametrize("corrections, windows, expected", [
    # within the tolerance, or past it but within the budget's share of the step: no stray
    (CALIBRATED, [[0.12] * 4, [0.14] * 4, [0.07] * 4], [(0, 0, True)] * 3),
    # a stray on a calibrated model waits for half a window straying the same way
    (CALIBRATED, [[0.2] * 4, [0.2] * 2], [(0, 1, True), (1, 0, True)]),
    (CALIBRATED, [[0.0] * 4, [0.01] * 2], [(0, -1, True), (1, 0, True)]),
    # the other way, or back within the prediction: no re-plan
    (CALIBRATED, [[0.2] * 4, [0.0] * 2, [0.0] * 2], [(0, 1, True), (0, -1, True), (1, 0, True)]),
    (CALIBRATED, [[0.2] * 4, [0.1] * 2, [0.2] * 2], [(0, 1, True), (0, 0, True), (0, 0, False)]),
    # the window's median decides: one slow step in four is not a stray
    (CALIBRATED, [[0.1, 0.1, 0.1, 5.0]], [(0, 0, True)]),
    # not yet due: a short window waits
    (CALIBRATED, [[0.2] * 3], [(0, 0, False)]),
    # a model no measurement of the choice's family has corrected re-plans at the first stray
    ({}, [[0.2] * 4], [(1, 0, True)]),
    ({"dense": (0.3, 1.0)}, [[0.0] * 4], [(1, 0, True)]),
    # a first window that measures the model right calibrates it: a later stray (the link
    # changed) waits for confirmation, as on a corrected model
    ({}, [[0.1] * 4, [0.2] * 4, [0.2] * 2], [(0, 0, True), (0, 1, True), (1, 0, True)]),
    # compute that strays past the tolerance and the budget's floor (load came or went), with
    # the choice's synchronisation as predicted: a stray awaiting confirmation, either way
    (CALIBRATED, [([0.1] * 4, 0.6), ([0.1] * 2, 0.6)], [(0, -1, True), (1, 0, True)]),
    (CALIBRATED, [([0.1] * 4, 1.5), ([0.1] * 2, 1.4)], [(0, 1, True), (1, 0, True)]),
    # confirmed by the synchronisation straying the same way (both: the machine slowed)
    (CALIBRATED, [([0.1] * 4, 1.5), [0.2] * 2], [(0, 1, True), (1, 0, True)]),
    # within the tolerance; or a passing spike, back by the confirming window: no re-plan
    (CALIBRATED, [([0.1] * 4, 0.8), ([0.1] * 4, 1.2)], [(0, 0, True), (0, 0, True)]),
    (CALIBRATED, [([0.1] * 4, 0.6), ([0.1] * 2, 1.0)], [(0, -1, True), (0, 0, True)]),
    # a family not yet measured: the compute's stray does not re-plan at once, and the window
    # (its synchronisation as predicted) calibrates the family
    ({}, [([0.1] * 4, 0.6), ([0.1] * 2, 0.6)], [(0, -1, True), (1, 0, True)]),
])
def test_the_replan_trigger_on_synthetic_windows(corrections, windows, expected):
    for got in run_local(2, _checks, corrections, windows):
        assert got == expected


def test_a_replan_for_a_change_of_load_probes_afresh_and_drops_the_other_familys_correction(
        monkeypatch):
    """A run that planned under a passing load (its compute 1 s a step) measures 0.6 s once the
    load has gone, while its choice's synchronisation still matches the prediction: the
    confirmed stray re-plans with a fresh probe, on the new compute, and without the other
    family's correction, which was measured under the load."""
    def probes_of(t) -> list[bool]:
        probes: list[bool] = []
        _checks(t, CALIBRATED, [([0.1] * 4, 0.6), ([0.1] * 2, 0.6)], probes)
        return probes

    assert run_local(2, probes_of) == [[True], [True]]
    link = _link(0.1, 1e-4)
    monkeypatch.setattr(auto_module, "probe_link", lambda transport, device, name: link)
    monkeypatch.setattr(auto_module, "local_seconds_per_entry",
                        lambda densities, numel, size, device, codec:
                        ([0.0] * len(densities), 0.0, 0.0))

    def work(t):
        grc = _planned(t, {"dense": (0.5, 1.0), "spardl@0.01": (0.0, 1.0)})
        grc._last_numels = dict(zip("abc", NUMELS))
        for compute in (0.6, 0.6):
            due = grc.replan_window // 2 if grc._strayed else grc.replan_window
            predicted = grc.plan["predicted_sync_s"][grc.choice]
            grc._window, grc._compute = [predicted] * due, [compute] * due
            grc._plan_or_check(torch.device("cpu"))
        return grc.plan, grc._corrections, grc._replans

    for plan, corrections, replans in run_local(2, work):
        assert replans == 1 and plan["compute_s"] == pytest.approx(0.6)
        assert "dense" not in corrections and "spardl@0.01" in corrections


def test_a_window_that_measures_the_model_right_keeps_it_and_marks_its_family_measured():
    def work(t):
        grc = _planned(t, {"dense": (0.3, 1.0)})
        grc._window = [0.1] * 4
        grc._plan_or_check(torch.device("cpu"))
        return grc._corrections

    for corrections in run_local(2, work):
        assert corrections == {"dense": (0.3, 1.0), "spardl@0.01": (0.0, 1.0)}


@pytest.mark.parametrize("probe", [False, True], ids=["calibrating", "confirmed_stray"])
@pytest.mark.parametrize("times", [3.0, 0.5])
def test_a_replan_corrects_the_family_of_the_choice(monkeypatch, times, probe):
    """Above the model, what it misses is time a step (waiting for the slowest rank, the
    framework's overhead), alike at every density: the measured excess of the choice is added
    to each SparDL density's prediction. Below it, a byte cost less than the probe said: each
    prediction is scaled by the ratio. The dense ones keep their own correction when the
    window calibrates SparDL's model, and lose it after a confirmed stray (the conditions it
    was measured under changed), so their next plan calibrates them afresh."""
    link = _link(0.1, 1e-4)
    monkeypatch.setattr(auto_module, "probe_link", lambda transport, device, name: link)
    monkeypatch.setattr(auto_module, "local_seconds_per_entry",
                        lambda densities, numel, size, device, codec:
                        ([0.0] * len(densities), 0.0, 0.0))
    names = ["dense", "spardl@0.1", "spardl@0.01", "spardl@0.001"]
    model = {n: sync_seconds(parse_candidate(n), NUMELS, 2, link, 0.0, 0, 0.0) for n in names}
    measured = times * model["spardl@0.01"]

    def work(t):
        grc = Auto(GlobalResidualMemory(), t, candidates=names, measure_steps=2,
                   replan_window=4, min_entries=0)
        grc._plan = {"choice": "spardl@0.01"}
        grc._switch("spardl@0.01")
        grc._corrections = {"dense": (0.5, 1.0)}
        grc._last_numels = dict(zip("abc", NUMELS))
        grc._compute = [0.05]
        grc._replan(torch.device("cpu"), measured_dense=False, ratio=times, measured=measured,
                    probe=probe)
        return grc.plan, grc._corrections

    excess = measured - model["spardl@0.01"]
    for plan, corrections in run_local(2, work):
        sync = plan["predicted_sync_s"]
        if probe:
            assert sync["dense"] == pytest.approx(model["dense"]) and "dense" not in corrections
        else:
            assert sync["dense"] == pytest.approx(model["dense"] + 0.5)
            assert corrections["dense"] == (0.5, 1.0)
        assert sync["spardl@0.01"] == pytest.approx(measured)
        for n in names[1:]:
            if times > 1:
                assert sync[n] == pytest.approx(model[n] + excess)
                assert corrections[n] == pytest.approx((excess, 1.0))
            else:
                assert sync[n] == pytest.approx(model[n] * times)
                assert corrections[n] == (0.0, times)


def _counted_probes(monkeypatch, link: Link) -> list[int]:
    """Every probe finds `link` and SparDL's local work free; the list gets the rank of each
    probe taken."""
    probes: list[int] = []

    def probe(transport, device, name):
        probes.append(transport.rank)
        return link

    monkeypatch.setattr(auto_module, "probe_link", probe)
    monkeypatch.setattr(auto_module, "local_seconds_per_entry",
                        lambda densities, numel, size, device, codec:
                        ([0.0] * len(densities), 0.0, 0.0))
    return probes


def test_the_models_first_correction_reuses_the_plans_probe_and_a_confirmed_stray_probes(
        monkeypatch):
    probes = _counted_probes(monkeypatch, _link(0.1, 1e-4))

    def work(t):
        grc = _dense_and_spardl(t)
        grc._last_numels = dict(zip("abc", NUMELS))
        grc._steps, grc._compute, grc._window = 2, [0.05], [1.0, 1.0]
        grc._plan_or_check(torch.device("cpu"))  # the first plan (dense steps measured): probes
        counts = [probes.count(t.rank)]
        choice = grc.choice
        for times, steps in ((5, 4), (3, 4), (3, 2)):
            predicted = grc.plan["predicted_sync_s"][grc.choice]
            grc._window = [predicted * times] * steps
            grc._plan_or_check(torch.device("cpu"))
            counts.append(probes.count(t.rank))
        return choice, counts, grc._replans

    ranks = run_local(2, work, timeout=60)
    choice, counts, replans = ranks[0]
    assert choice == "spardl@0.01"
    # first plan: one probe; the uncorrected stray re-plans without one; the next stray
    # awaits confirmation; the confirmed one probes again
    assert counts == [1, 1, 1, 2] and replans == 2
    assert all(r[1] == counts for r in ranks)


@pytest.mark.parametrize("times", [3.0, 1.0], ids=["strays", "as_predicted"])
def test_bfloat16_dense_after_float32s_measuring_steps_is_calibrated_by_its_own_first_window(
        monkeypatch, times):
    """The measuring steps run float32 dense, and their correction is lent to bfloat16 dense,
    whose all-reduce has a fit of its own (VGG-16 at loopback: a noisy bfloat16 slope put it
    at 0.69 s a step where it ran 1.34 s). Its first window calibrates it as SparDL's first
    does: a stray re-plans at once, on the plan's probe, correcting bfloat16 dense alone
    (float32's correction was measured on its own steps); a window as predicted keeps the
    lent correction, and a later stray awaits confirmation."""
    probes = _counted_probes(monkeypatch, _link(1.0, 1e-4))

    def work(t):
        grc = Auto(GlobalResidualMemory(), t, candidates=["dense", "dense16"], measure_steps=2,
                   replan_window=4, min_entries=0)
        grc._last_numels = dict(zip("abc", NUMELS))
        dense = sync_seconds(parse_candidate("dense"), NUMELS, 2, _link(1.0, 1e-4))
        grc._steps, grc._compute, grc._window = 2, [0.01], [2 * dense] * 2
        grc._plan_or_check(torch.device("cpu"))
        resumed = Auto(GlobalResidualMemory(), t, candidates=["dense", "dense16"],
                       measure_steps=2, replan_window=4, min_entries=0)
        resumed._load_own_state(torch.load(_saved(grc._own_state()), weights_only=True))
        first = (grc.choice, dict(grc._corrections), set(resumed._unmeasured))
        predicted = grc.plan["predicted_sync_s"]["dense16"]
        grc._window = [predicted * times] * 4
        grc._plan_or_check(torch.device("cpu"))
        after = (grc._replans, grc._strayed, probes.count(t.rank), set(grc._unmeasured),
                 dict(grc._corrections))
        grc._window = [grc.plan["predicted_sync_s"][grc.choice] * 3] * 4
        grc._plan_or_check(torch.device("cpu"))
        return first, after, (grc._replans, grc._strayed)

    for first, after, later in run_local(2, work, timeout=60):
        choice, lent, unmeasured = first
        assert choice == "dense16" and unmeasured == {"dense16"}
        assert lent["dense"] == lent["dense16"] and lent["dense"][0] > 0
        replans, strayed, probed, unmeasured, corrections = after
        assert probed == 1  # the first plan's probe; a calibrating re-plan takes none
        if times > 1:  # float32's own correction stays: no turns taken between the two
            assert (replans, strayed, unmeasured) == (1, 0, set())
            assert corrections["dense16"] != lent["dense16"]
            assert corrections["dense"] == lent["dense"]
        else:
            assert (replans, strayed, unmeasured, corrections) == (0, 0, set(), lent)
            assert later == (0, 1)  # calibrated now: a stray awaits confirmation


@pytest.mark.parametrize("probe", [False, True], ids=["calibrating", "confirmed_stray"])
def test_a_sparse_replan_leaves_the_dense_kinds_marks_as_they_are_or_drops_them_with_them(
        monkeypatch, probe):
    """bfloat16 dense's correction lent by float32's measuring steps stays lent through a
    calibrating re-plan of SparDL's family (its first window is still due); a confirmed stray
    drops the dense family's corrections, and with them the mark."""
    _counted_probes(monkeypatch, _link(0.1, 1e-4))

    def work(t):
        grc = Auto(GlobalResidualMemory(), t, candidates=["dense", "dense16", "spardl@0.01"],
                   measure_steps=2, replan_window=4, min_entries=0)
        grc._plan = {"choice": "spardl@0.01"}
        grc._switch("spardl@0.01")
        grc._corrections = {"dense": (0.5, 1.0), "dense16": (0.5, 1.0)}
        grc._unmeasured = {"dense16"}
        grc._last_numels, grc._compute = dict(zip("abc", NUMELS)), [0.05]
        grc._replan(torch.device("cpu"), measured_dense=False, ratio=3.0, measured=1.0,
                    probe=probe)
        return grc._unmeasured, set(grc._corrections)

    for unmeasured, corrected in run_local(2, work):
        if probe:
            assert (unmeasured, corrected) == (set(), {"spardl@0.01"})
        else:
            assert (unmeasured, corrected) == ({"dense16"}, {"dense", "dense16", "spardl@0.01"})


def test_a_dense_window_that_calibrates_the_family_as_predicted_lends_to_the_other_kind():
    """With no correction in the dense family (dropped by a confirmed stray, say), a float32
    window as predicted calibrates the family as it stands, and bfloat16 dense, not measured,
    is left to its own first window."""
    def work(t):
        grc = Auto(GlobalResidualMemory(), t, candidates=["dense", "dense16"], measure_steps=2,
                   replan_window=4, min_entries=0)
        grc._plan = {"choice": "dense", "compute_s": 1.0,
                     "predicted_sync_s": {"dense": 0.1, "dense16": 0.1},
                     "predicted_step_s": {"dense": 1.1, "dense16": 1.1}}
        grc._switch("dense")
        grc._window, grc._compute = [0.1] * 4, [1.0] * 4
        grc._plan_or_check(torch.device("cpu"))
        return grc._unmeasured, grc._corrections, grc._replans

    for unmeasured, corrections, replans in run_local(2, work):
        assert replans == 0 and unmeasured == {"dense16"}
        assert corrections == {"dense": (0.0, 1.0), "dense16": (0.0, 1.0)}


def test_the_correction_keeps_the_measured_prediction_within_its_range_of_the_model():
    from spardl_grace.communicators.auto import CORRECTION_RANGE, _corrected, _correction

    low, high = CORRECTION_RANGE
    assert _correction(0.3, 0.1) == (pytest.approx(0.2), 1.0)
    assert _correction(100.0, 0.1) == (pytest.approx((high - 1) * 0.1), 1.0)  # a wild window
    assert _correction(0.05, 0.1) == (0.0, 0.5)
    assert _correction(0.0, 0.1) == (0.0, low)
    assert _correction(0.2, 0.0) == (0.0, 1.0)  # no model to correct: calibrated, unchanged
    assert _corrected(0.01, (0.2, 1.0)) == pytest.approx(0.21)  # a sparser one: no upper bound
    assert _corrected(0.01, (0.0, 0.5)) == pytest.approx(0.005)


@pytest.mark.parametrize("split", [5, 2])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_resumed_run_continues_bit_for_bit(split, momentum):
    """Saved after the plan (step 5) or while measuring (step 2: dense, which is not among
    the candidates), with and without momentum correction (whose velocity is masked after
    SparDL's steps only)."""
    params = {**AUTO, "auto_candidates": ["spardl@0.01"], "momentum_correction": momentum}
    whole = run_local(4, _steps, params, 10)
    first = run_local(4, _steps, params, split)
    rest = run_local(4, lambda t: _steps(t, params, 10 - split, first[t.rank]["state"], split))
    for w, f, r in zip(whole, first, rest):
        resumed = f["results"] + r["results"]
        assert all(torch.equal(a, b) for a, b in zip(w["results"], resumed))
        assert r["choices"] == w["choices"][split:]
    state = torch.load(_saved(first[0]["state"]), weights_only=True)["communicator"]
    planned = split > AUTO["auto_measure_steps"]
    assert state["choice"] == ("spardl@0.01" if planned else "dense")
    assert bool(state["plan"]) == planned
    assert {"corrections", "strayed", "unmeasured"} <= set(state)
    # the last step counts as closed: an unbroken run holds these when its next step begins
    # (the steps measured since the plan, or since step 1 while measuring)
    assert state["steps"] == split
    assert state["numels"] == {f"p{i}": n for i, n in enumerate(NUMELS)}
    assert len(state["window"]) == (split - AUTO["auto_measure_steps"] if planned else split - 1)


def test_a_checkpoint_with_the_older_ratio_corrections_resumes_with_them_converted():
    """Before a correction added seconds, it was a ratio that scaled the model; the saved
    plan's prediction is the model scaled by it, so a ratio above 1 converts into the seconds
    it added there, and one below 1 stays a factor."""
    params = {**AUTO, "auto_candidates": ["dense", "dense16", "spardl@0.01"]}

    def work(t):
        state = _steps(t, params, 6)["state"]
        own = dict(state["communicator"])
        own["corrections"] = {"dense": 4.0, "dense16": 0.5}
        own.pop("strayed")
        grc = grace_from_params(params, t)
        grc.load_state_dict({**state, "communicator": own})
        kept = {k: grc.plan[k] for k in ("choice", "step", "predicted_sync_s")}
        return kept == {k: own["plan"][k] for k in kept} and grc.choice == own["choice"], \
            grc._corrections, own["plan"]["predicted_sync_s"]

    for same_plan, corrections, predicted in run_local(2, work):
        assert same_plan
        assert corrections["dense"] == pytest.approx((predicted["dense"] * 0.75, 1.0))
        assert corrections["dense16"] == (0.0, 0.5)
        assert set(corrections) == {"dense", "dense16"}


def test_a_run_resumed_while_a_stray_awaits_confirmation_confirms_it_after_half_a_window():
    def work(t):
        grc = _planned(t, CALIBRATED)
        grc._window = [0.2] * 4
        grc._plan_or_check(torch.device("cpu"))
        saved = grc._own_state()
        resumed = _dense_and_spardl(t)
        resumed._load_own_state(saved)
        replans = []
        resumed._replan = lambda device, measured_dense, ratio=1.0, measured=0.0, probe=True: \
            replans.append(measured)
        resumed._window = [0.2] * 2
        resumed._plan_or_check(torch.device("cpu"))
        return saved["strayed"], resumed._corrections, replans

    for strayed, corrections, replans in run_local(2, work):
        assert strayed == 1 and corrections == CALIBRATED and replans == [pytest.approx(0.2)]


def _saved(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_ranks_that_disagree_on_auto_settings_all_raise():
    def work(t):
        grc = grace_from_params({**AUTO, "auto_budget": 0.05 if t.rank else 0.1}, t)
        try:
            grc.step(torch.ones(10), "w")
        except ValueError as exc:
            return str(exc)
        return "no error"

    for message in run_local(3, work):
        assert "budget" in message and "disagree" in message


@pytest.mark.parametrize("params, match", [
    ({"auto_candidates": ["dense", "topk@0.01"]}, "'dense', 'dense16' or 'spardl@D'"),
    ({"auto_candidates": "dense"}, "list of candidate names"),
    ({"auto_budget": 0}, r"auto_budget must be a number in \(0, 1\]"),
    ({"auto_budget": 1.5}, r"auto_budget must be a number in \(0, 1\]"),
    ({"auto_measure_steps": 1}, "auto_measure_steps must be an int >= 2"),
    ({"auto_replan_window": -1}, "auto_replan_window must be an int >= 0"),
    ({"auto_replan_tolerance": 0}, "auto_replan_tolerance must be a number > 0"),
    ({"compress_ratio": 0.01}, "chooses the density itself"),
    ({"density_warmup_steps": 10}, "chooses the density itself"),
    ({"momentum_correction": 0.9, "memory": "none"}, "option of memory"),
    ({"local_clip_norm": 1.0, "memory": "none"}, "option of memory"),
    ({"momentum_correction": 0.9, "dense_warmup_steps": 5}, "leave dense_warmup_steps at 0"),
    ({"exchange": "update"}, "leave 'exchange' at 'gradient'"),
    ({"memory": "dgc"}, "needs memory in"),
    ({"compressor": "qsgd"}, "use compressor 'none'"),
    ({"wire": "exact"}, "'wire'"),
])
def test_bad_values_are_refused_naming_the_valid_ones(params, match):
    with pytest.raises(ValueError, match=match):
        grace_from_params({**AUTO, **params}, run_local(1, lambda t: t)[0])


def test_auto_keys_with_another_communicator_are_refused():
    with pytest.raises(ValueError, match="configure communicator 'auto'"):
        grace_from_params({"communicator": "spardl", "compressor": "topk",
                           "memory": "global_residual", "auto_budget": 0.1},
                          run_local(1, lambda t: t)[0])


def test_dense16_sends_two_bytes_an_entry_and_keeps_its_rounding_as_residual():
    def work(t):
        grc = Dense16(GlobalResidualMemory(), t)
        x = torch.randn(1000, generator=torch.Generator().manual_seed(t.rank)) * 1e3
        return x, grc.step(x, "w"), grc.memory.residuals["w"], grc.last_stats["bytes_sent"]

    ranks = run_local(4, work)
    exact = sum(x for x, _, _, _ in ranks) / 4
    assert all(torch.equal(r, ranks[0][1]) for _, r, _, _ in ranks)
    # the sum of the ranks' bfloat16 contributions rounds at about 2**-8 of its terms
    assert torch.allclose(ranks[0][1], exact, rtol=0, atol=float(exact.abs().max()) * 2 ** -6)
    for x, _, residual, sent in ranks:
        assert sent == 2 * 1000 * 2 * 3 // 4
        assert torch.equal(residual, x - (x / 4).bfloat16().float() * 4)


def test_the_plan_reads_as_one_line_and_in_the_log(caplog):
    caplog.set_level("INFO", logger="spardl_grace.auto")
    ranks = run_local(2, _steps, AUTO, 4)
    lines = [r.getMessage() for r in caplog.records if r.name == "spardl_grace.auto"]
    assert len(lines) == 1 and lines[0].startswith(f"auto: chose {ranks[0]['choices'][3]}")
    assert "Gbit/s" in lines[0] and "compute" in lines[0]


# ------------------------------------------------------------------ the integrations


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def _train_eight_steps(model: torch.nn.Module, opt, rank: int) -> torch.Tensor:
    """Eight steps on this rank's own batches; the parameters after them, flat."""
    for step in range(8):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def torchrun_auto(transport) -> dict:
    """Entry point for tests/mp_worker.py: DistributedOptimizer and the DDP hook with 'auto'
    (real gloo processes), 8 steps each; the plan is made at step 3."""
    import torch.distributed as dist

    params = {**AUTO, "auto_replan_window": 0}
    out = {}
    model = _tiny_model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                               grace_from_params(params, transport),
                               named_parameters=model.named_parameters())
    out["optimizer"] = _train_eight_steps(model, opt, dist.get_rank())
    out["optimizer_choice"] = opt.grace.choice
    model = torch.nn.parallel.DistributedDataParallel(_tiny_model())
    state = CommHookState(params, model)
    model.register_comm_hook(state, __import__("spardl_grace").comm_hook)
    out["hook"] = _train_eight_steps(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     dist.get_rank())
    out["hook_choice"] = state.sync.grace.choice
    out["hook_stats"] = state.stats_to_log()
    return out


def test_auto_under_torchrun_with_the_optimizer_and_the_ddp_hook(launch):
    per_rank = launch("gloo", 2, "test_auto.torchrun_auto")
    a, b = per_rank
    assert torch.equal(a["optimizer"], b["optimizer"]) and torch.equal(a["hook"], b["hook"])
    assert a["optimizer_choice"] == b["optimizer_choice"] in DEFAULT_CANDIDATES
    assert a["hook_choice"] == b["hook_choice"] in DEFAULT_CANDIDATES
    assert a["hook_stats"]["compression/auto_choice"] == DEFAULT_CANDIDATES.index(a["hook_choice"])
    assert math.isfinite(a["hook_stats"]["compression/auto_predicted_step_s"])


def torchrun_auto_momentum(transport) -> dict:
    """Entry point for tests/mp_worker.py: the DDP hook with 'auto' and momentum correction
    0.9 under the user's SGD(momentum=0.9), real gloo processes, 8 steps each: auto with dense
    only, plain DDP (no hook) as the reference, and auto held to SparDL after its measured
    dense steps (its single candidate); the parameters after each, and each auto run's
    velocities."""
    import torch.distributed as dist

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    out = {}
    model = torch.nn.parallel.DistributedDataParallel(_tiny_model())
    out["reference"] = _train_eight_steps(model, sgd(model), dist.get_rank())
    for name, candidates in (("dense", ["dense"]), ("spardl", ["spardl@0.01"])):
        model = torch.nn.parallel.DistributedDataParallel(_tiny_model())
        state = CommHookState({**AUTO, "auto_candidates": candidates, "auto_replan_window": 0,
                               "momentum_correction": 0.9}, model)
        model.register_comm_hook(state, __import__("spardl_grace").comm_hook)
        out[name] = _train_eight_steps(model, sgd(model), dist.get_rank())
        out[f"{name}_choice"] = state.sync.grace.choice
        out[f"{name}_velocities"] = torch.cat(
            [u.reshape(-1) for u in state.sync.grace.memory.velocities.values()])
    return out


def test_auto_with_momentum_correction_under_torchrun_and_the_ddp_hook(launch):
    """Through DDP's hook (whose bucket buffers DDP reuses every step) auto's dense steps with
    momentum correction train as plain DDP with SGD momentum; held to SparDL after its
    measured dense steps, the ranks stay bit-identical and the velocity is zero at a few of
    its entries (masked where SparDL's last step applied it), where dense's is zero at none."""
    a, b = launch("gloo", 2, "test_auto.torchrun_auto_momentum")
    assert a["dense_choice"] == "dense" and a["spardl_choice"] == "spardl@0.01"
    for name in ("reference", "dense", "spardl"):
        assert torch.equal(a[name], b[name]), name
    assert torch.allclose(a["dense"], a["reference"], atol=1e-5, rtol=0)
    zero = a["spardl_velocities"] == 0
    assert 0 < int(zero.sum()) < zero.numel() // 5  # masked where applied, about 1% a step
    assert bool((a["dense_velocities"] != 0).all())


def test_the_check_of_auto_against_the_fixed_choices_names_each_verdict():
    from benchmarks.auto_check import check, table

    def row(times, choice=None):
        return {"step_times": times, **({"auto_plan": {"auto_choice": choice}} if choice else {})}

    steady = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98]
    result = {"networks": {
        "met": {"auto": row([t * 1.0 for t in steady], 2), "fixed_dense": row(steady),
                "fixed_spardl@0.01": row([t * 2 for t in steady])},
        "missed": {"auto": row([t * 1.3 for t in steady], 4), "fixed_dense": row(steady),
                   "ddp": row([t * 1.3 for t in steady])},
        "undecided": {"auto": row([1.0, 1.2, 0.9, 1.1], 1), "fixed_dense": row(steady)},
    }}
    checked = check(result, 1.05)
    assert checked["met"]["within_target"] == "met"
    assert checked["met"]["fastest_fixed"] == "fixed_dense"
    assert checked["met"]["auto_chose"] == DEFAULT_CANDIDATES[2]
    assert checked["missed"]["within_target"] == "missed"
    assert checked["missed"]["versus_fastest"] == "slower"
    assert checked["undecided"]["within_target"] == "undecided"
    assert checked["undecided"]["versus_fastest"] == "level"
    assert checked["missed"]["baselines"]["ddp"]["auto_is"] == "level"
    assert checked["met"]["baselines"] == {}
    assert table(checked).count("\n") == 10
    with pytest.raises(ValueError, match="no fixed_CANDIDATE"):
        check({"networks": {"x": {"auto": row(steady), "ddp": row(steady)}}})


def test_the_check_of_a_link_change_compares_before_it_and_after_the_replan():
    """Steps 2..13 timed, the link slowed at step 6, auto re-planned at step 8 (from
    candidate 2 to 4): before the change auto equals the fixed row, between the change and the
    re-plan it is slow (left out of both windows), after it as fast as the other fixed row."""
    from benchmarks.auto_check import check, replan_after, table

    steps = [{"step": s, "choice": -1 if s < 2 else 2 if s < 8 else 4,
              "replans": 0.0 if s < 8 else 1.0} for s in range(14)]
    fast, slow = [1.0, 1.01, 0.99, 1.0], [2.0, 2.02, 1.98, 2.0]
    auto = fast + [3.0, 3.0, 3.0] + [2.0, 2.01, 1.99, 2.0, 2.0]
    result = {"config": {"skip": 2, "bandwidth_change": "6:100mbit"}, "networks": {"1gbit": {
        "auto": {"step_times": auto, "auto_steps": steps},
        "fixed_spardl@0.01": {"step_times": fast + [2.5] * 8},
        "fixed_spardl@0.001": {"step_times": [1.2] * 4 + [2.0, 2.0, 2.0] + slow + [2.0]}}}}
    assert replan_after(steps, 6) == 8 and replan_after(steps, 9) is None
    checked = check(result, 1.05)
    before, after = checked["1gbit before step 6"], checked["100mbit after the re-plan"]
    assert before["fastest_fixed"] == "fixed_spardl@0.01" and before["auto_chose"] == \
        DEFAULT_CANDIDATES[2] and before["versus_fastest"] == "level"
    assert after["fastest_fixed"] == "fixed_spardl@0.001" and after["auto_chose"] == \
        DEFAULT_CANDIDATES[4] and after["steps_to_replan"] == 2 and after["within_target"] == "met"
    assert "re-planned at step 8, 2 steps after the link changed" in table(checked)
    result["networks"]["1gbit"]["auto"]["auto_steps"] = [{**s, "replans": 0.0} for s in steps]
    kept = check(result, 1.05)["100mbit after step 6"]
    assert kept["replanned_at"] is None and kept["fastest_fixed"] == "fixed_spardl@0.001"
    assert kept["ratio_of_means"] > 1.15  # the slow steps before the re-plan count now


def test_the_check_of_interleaved_repeats_takes_each_repeats_mean_as_one_sample():
    """With train_step --repeats, a verdict's samples are the repeats' means (independent
    runs), not the steps: three repeats whose steps are tight but whose means scatter with the
    machine's drift leave 'auto within 1.05x' undecided, where pooling the steps would call
    it met. A link change is compared per repeat, after each repeat's own re-plan."""
    from benchmarks.auto_check import check, table

    def run(level, choice=2):
        return {"step_times": [level, level * 1.001, level * 0.999],
                "auto_steps": [{"step": s, "choice": choice, "replans": 1.0} for s in range(5)]}

    drift = (1.0, 1.3, 0.8)
    rows = {"auto": {"repeats": [run(d * 1.01) for d in drift]},
            "fixed_dense": {"repeats": [run(d * 1.0) for d in drift]},
            "ddp": {"repeats": [run(d * 1.2) for d in drift]}}
    for name, row in rows.items():
        row["step_times"] = [t for r in row["repeats"] for t in r["step_times"]]
    checked = check({"networks": {"1gbit": rows}}, 1.05)["1gbit"]
    assert checked["unit"] == "repeat" and checked["within_target"] == "undecided"
    assert checked["versus_fastest"] == "level" and checked["auto_chose"] == DEFAULT_CANDIDATES[2]
    assert checked["ratio_of_means"] == pytest.approx(1.01)
    assert checked["baselines"]["ddp"]["ratio_of_means"] == pytest.approx(1.01 / 1.2)
    # one run per arm: every step a sample, and the same drift-free steps say 'met'
    single = {n: {"step_times": r["repeats"][0]["step_times"]} for n, r in rows.items()}
    alone = check({"networks": {"1gbit": single}}, 1.05)["1gbit"]
    assert alone["unit"] == "step" and alone["within_target"] == "met"

    # a link change at step 6 (skip 2): repeat 0 re-planned at step 8, repeat 1 at step 10
    def changed(replan):
        return {"step_times": [1.0] * 4 + [3.0] * (replan + 1 - 6) + [2.0] * (13 - replan),
                "auto_steps": [{"step": s, "choice": 2 if s < replan else 4,
                                "replans": 0.0 if s < replan else 1.0} for s in range(14)]}

    auto = {"repeats": [changed(8), changed(10)]}
    fixed = {"repeats": [{"step_times": [1.0] * 4 + [2.0] * 8}] * 2}
    result = {"config": {"skip": 2, "bandwidth_change": "6:100mbit"},
              "networks": {"1gbit": {"auto": auto, "fixed_spardl@0.001": fixed}}}
    after = check(result, 1.05)["100mbit after the re-plan"]
    assert after["replanned_at"] == [8, 10] and after["steps_to_replan"] == [2, 4]
    assert after["auto_chose"] == DEFAULT_CANDIDATES[4] and after["ratio_of_means"] == 1.0
    assert "at step 8 (2 steps after the change), at step 10 (4 steps after the change)" \
        in table(check(result, 1.05))


def test_the_check_sets_auto_s_prediction_for_each_candidate_beside_its_run_alone():
    """model_error: the plan in force at the end of each auto repeat, averaged over the
    repeats, against each candidate's measured mean step alone; rows without a plan of that
    candidate and results without plans are left out."""
    from benchmarks.auto_check import model_error, model_table

    def plan(dense, sparse):
        return {"predicted_step_s": {"dense": dense, "spardl@0.01": sparse}}

    auto = {"repeats": [{"auto_plans": [plan(9.0, 9.0), plan(2.0, 1.0)]},
                        {"auto_plans": [plan(2.2, 1.2)]}], "step_times": [1.0]}
    rows = {"auto": auto, "fixed_dense": {"step_times": [2.1, 2.1]},
            "fixed_spardl@0.01": {"step_times": [1.5, 1.7]},
            "fixed_spardl@0.001": {"step_times": [1.0]}, "ddp": {"step_times": [1.0]}}
    errors = model_error({"networks": {"1gbit": rows, "old": {"auto": {"step_times": [1.0]}}}})
    assert set(errors) == {"1gbit"} and set(errors["1gbit"]) == {"dense", "spardl@0.01"}
    sparse = errors["1gbit"]["spardl@0.01"]
    assert sparse["predicted_s"] == pytest.approx(1.1) and sparse["measured_s"] == pytest.approx(1.6)
    assert sparse["measured_over_predicted"] == pytest.approx(1.6 / 1.1)
    assert errors["1gbit"]["dense"]["measured_over_predicted"] == pytest.approx(1.0)
    assert "| 1gbit | spardl@0.01 | 1.100 | 1.600 | 1.455 |" in model_table(errors)


def test_auto_between_fsdp2_replicas_keeps_them_identical(launch):
    per_rank = launch("gloo", 4, "fsdp_scenarios.auto_between_replicas")
    for shard in (0, 1):
        a, b = per_rank[shard], per_rank[2 + shard]  # the two replicas of one shard
        assert a["choice"] == b["choice"] in DEFAULT_CANDIDATES and a["plan"] == b["plan"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_a_link_that_changes_mid_run_is_asked_for_as_step_and_rate():
    from experiments.cli import parse_args
    from testbed.netem import reshape_own_link

    args = parse_args(["--bandwidth", "1gbit", "--bandwidth-change", "40:100mbit"])
    assert args.bandwidth_change == (40, "100mbit")
    for bad in (["--bandwidth", "1gbit", "--bandwidth-change", "x:100mbit"],
                ["--bandwidth", "1gbit", "--bandwidth-change", "40:fast"],
                ["--bandwidth-change", "40:100mbit"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(RuntimeError, match="not on an emulated network"):
        reshape_own_link("100mbit")
