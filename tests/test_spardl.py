"""SparDL: schedule, Global Residual Collection, Spar-All-Gather, bytes, real transports, training."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scenarios
from sparse_checks import check_consistent_and_conserving, check_exact_dense_average, run_steps
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.communicators.schedules import bruck_rounds, srs_schedule
from spardl_grace.payload import frame_overhead
from spardl_grace.transport import CountingTransport


# ---------------------------------------------------------------- the schedules, symbolically
def simulate_srs(m: int) -> list[list[Counter]]:
    """held[w][b]: multiset of original contributions worker w holds for block b at the end."""
    held = [[Counter({w: 1}) for _ in range(m)] for w in range(m)]
    for rnd in srs_schedule(m):
        for b in range(rnd.blocks):
            sent = {}
            for w in range(m):
                block = (w + rnd.distance + b) % m
                sent[w] = (block, held[w][block])
                held[w][block] = Counter()
            for w in range(m):
                block, contribution = sent[(w - rnd.distance) % m]
                assert block == (w + b) % m, "receiver and sender disagree on the block"
                held[w][block] += contribution
    return held


def check_srs(m: int) -> None:
    rounds = srs_schedule(m)
    assert sum(r.blocks for r in rounds) == m - 1
    assert len(rounds) == (math.ceil(math.log2(m)) if m > 1 else 0)
    held = simulate_srs(m)
    everyone = Counter(range(m))
    for w in range(m):
        assert held[w][w] == everyone, f"m={m}: owner {w} got {held[w][w]}"
        assert all(not held[w][b] for b in range(m) if b != w), f"m={m}: leftovers at {w}"


@pytest.mark.parametrize("m", range(1, 41))
def test_srs_every_contribution_lands_exactly_once(m):
    check_srs(m)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=41, max_value=300))
def test_srs_schedule_property_large(m):
    check_srs(m)


def test_srs_schedule_matches_the_paper_examples():
    def shape(m):
        return [r.blocks for r in srs_schedule(m)], [r.distance for r in srs_schedule(m)]
    assert shape(4) == ([2, 1], [2, 1])
    assert shape(6) == ([2, 2, 1], [4, 2, 1])
    assert shape(9) == ([1, 4, 2, 1], [8, 4, 2, 1])


@given(st.integers(min_value=1, max_value=200))
def test_bruck_rounds_deliver_every_piece(g):
    held = [[j] for j in range(g)]
    for distance, count in bruck_rounds(g):
        sent = [h[:count] for h in held]
        held = [h + sent[(j + distance) % g] for j, h in enumerate(held)]
    assert all(h == [(j + i) % g for i in range(g)] for j, h in enumerate(held))
    assert len(bruck_rounds(g)) == math.ceil(math.log2(g)) if g > 1 else True


# ------------------------------------------------------------------------- running SparDL
def run_spardl(size, n, rho, teams=1, steps=3, integer_valued=False, counting=False,
               wire="compact"):
    params = {"communicator": "spardl", "compress_ratio": rho, "teams": teams, "wire": wire}
    return run_steps(size, params, n, steps, integer_valued, counting)


CONSERVATION_CASES = [(size, d, n) for size in range(1, 13)
                      for d in sorted({1, size} | {d for d in (2, 3) if size % d == 0})
                      for n in (0, 1, 2 * size + 1, 997)]


@pytest.mark.parametrize("size,teams,n", CONSERVATION_CASES)
def test_conservation_and_identical_results(size, teams, n):
    check_consistent_and_conserving(run_spardl(size, n, 0.05, teams), size)


@pytest.mark.parametrize("size,teams,codec", [
    (1, 1, {}), (3, 1, {}), (4, 1, {}), (4, 2, {}), (6, 3, {}), (5, 5, {}), (7, 1, {}),
    (4, 1, {"deepreduce": "both", "index": "bloom", "value": "polyfit"}),
    (4, 2, {"deepreduce": "value", "value": "fp16"})])
def test_the_residual_is_exactly_the_compensated_gradient_wherever_nothing_was_selected(
        size, teams, codec):
    """Global Residual Collection keeps D only at the selected positions: everywhere else the
    residual must be the compensated gradient to the bit (SparDL puts back only the entries
    it wrote into D during the step, so a write it forgot would show here)."""
    per_rank = run_steps(size, {"communicator": "spardl", "compress_ratio": 0.03, "teams": teams,
                                **codec}, 1001, steps=3)
    for records in per_rank:
        for rec in records:
            untouched = rec["result"] == 0
            assert untouched.sum() < 1001
            assert torch.equal(rec["residual"][untouched], rec["compensated"][untouched])


@pytest.mark.parametrize("wire", ["exact", "compact"])
@pytest.mark.parametrize("size,teams", [(1, 1), (3, 1), (4, 2), (6, 3), (5, 5), (8, 1)])
def test_density_one_is_exactly_the_dense_average(size, teams, wire):
    """Small integers are bfloat16 values too, so the compact wire sends them unrounded."""
    per_rank = run_spardl(size, 301, 1.0, teams, integer_valued=True, wire=wire)
    check_exact_dense_average(per_rank, size)


@pytest.mark.parametrize("size", [2, 3, 6, 7])
def test_srs_messages_carry_exactly_kb_entries_and_bytes_match_the_formula(size):
    n, rho = 1000, 0.05
    per_rank = run_spardl(size, n, rho, counting=True, wire="exact")
    block = math.ceil(n / size)
    kb = math.floor(block * rho)
    for records in per_rank:
        for rec in records:
            srs = [m for m in rec["messages"] if m.phase == "srs" and m.op == "send"]
            assert len(srs) == size - 1
            assert all(m.bytes_sent == 8 * kb for m in srs)
            sag = [m for m in rec["messages"] if m.phase == "sag" and m.op == "send"]
            assert len(sag) == math.ceil(math.log2(size))
            payload = sum(m.bytes_sent for m in srs + sag) - sum(frame_overhead(c) for _, c in bruck_rounds(size))
            k = kb * size
            assert payload == 4 * 4 * k * (size - 1) / size  # 4k(P-1)/P words of 4 bytes
            sent_total = sum(m.bytes_sent for m in rec["messages"])
            assert sent_total == rec["stats"]["bytes_sent"]


@pytest.mark.parametrize("size,teams", [(4, 2), (6, 2), (6, 3), (8, 4), (6, 6)])
def test_bytes_with_teams_match_the_formula(size, teams):
    n, rho = 1200, 0.05
    per_rank = run_spardl(size, n, rho, teams, steps=4, counting=True, wire="exact")
    m = size // teams
    block = math.ceil(n / m)
    kb = math.floor(block * rho)
    for records in per_rank:
        for rec in records:
            stats = rec["stats"]
            assert stats["srs_payload_bytes"] == 8 * kb * (m - 1)
            h = stats["cross_entries"]
            assert math.ceil(kb / teams) <= h <= kb
            assert stats["cross_payload_bytes"] == 8 * h * (teams - 1)
            # The final blocks hold at most k_b entries each, exactly k_b when the union is full.
            assert stats["sag_payload_bytes"] <= 8 * kb * (m - 1)
            words = (stats["srs_payload_bytes"] + stats["cross_payload_bytes"]
                     + stats["sag_payload_bytes"]) / 4
            k = kb * m
            assert words <= 4 * k * (size - teams) / size + 2 * h * (teams - 1)
            assert sum(msg.bytes_sent for msg in rec["messages"]) == stats["bytes_sent"]


def test_adaptive_h_moves_towards_a_full_union():
    def fn(t):
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "communicator": "spardl", "compress_ratio": 0.1, "teams": 4,
                                 "min_entries": 0}, transport=t)
        shared = torch.randn(400, generator=torch.Generator().manual_seed(5))
        hs = []
        for _ in range(6):
            grc.step(shared.clone(), "w")  # identical gradients: the d pieces overlap fully
            hs.append(grc.h_for("w", 400))
        return hs
    hs = run_local(4, fn)[0]
    kb = math.floor(400 * 0.1)
    assert hs[0] > math.ceil(kb / 4) and hs[-1] == kb  # overlap pushes h up to k_b


@pytest.mark.parametrize("backend,size", [("gloo", 3), ("gloo", 4), ("mpi", 3), ("horovod-gloo", 3)])
def test_spardl_on_real_transports(launch, backend, size):
    results = launch(backend, size, "spardl_steps")
    for i in range(len(results[0])):
        records = [r[i] for r in results]
        n, rho, d = records[0]["case"]
        assert all(torch.equal(r["result"], records[0]["result"]) for r in records), records[0]["case"]
        compensated = sum(r["grad"] + r["old_residual"] for r in records)
        kept = sum(r["residual"] for r in records)
        assert torch.allclose(compensated, size * records[0]["result"] + kept, atol=1e-4)
    local = run_local(size, scenarios.spardl_steps)
    for a, b in zip(results[0], local[0]):
        assert torch.allclose(a["result"], b["result"], atol=1e-6)


def test_grace_dist_loop_with_spardl_matches_dense_at_density_one():
    def fn(t, comm):
        params = {"communicator": comm} if comm == "allreduce" else {
            "compressor": "topk", "memory": "global_residual", "communicator": "spardl",
            "compress_ratio": 1.0, "teams": 2, "wire": "exact"}
        return scenarios.train_tiny(grace_from_params(params, transport=t), t.rank)
    dense, sparse = run_local(4, fn, "allreduce")[0], run_local(4, fn, "spardl")[0]
    for a, b in zip(dense, sparse):
        assert torch.allclose(a, b, atol=1e-6)


def test_bad_teams_and_density_raise():
    def fn(t):
        for params, match in [({"teams": 4}, "teams must divide the number of workers"),
                              ({"compress_ratio": 0.0}, "compress_ratio must be")]:
            with pytest.raises(ValueError, match=match):
                grace_from_params({"compressor": "topk", "memory": "global_residual",
                                   "communicator": "spardl", **params}, transport=t)
        return True
    assert run_local(6, fn) == [True] * 6


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_every_message_is_one_round_trip_with_fixed_size_messages(size):
    """Identity codec, one team: every SRS message and Bruck piece has a size the receiver
    knows (k_b entries), so a step's round trips equal its messages, P - 1 + ceil(log2 P).
    With cross-team merging the final pieces vary and with a DeepReduce codec every message
    does: those sizes travel first."""
    def fn(t, params):
        counting = CountingTransport(t)
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "communicator": "spardl", "compress_ratio": 0.02, **params},
                                transport=counting)
        g = torch.Generator().manual_seed(t.rank)
        grc.step(torch.randn(1000, generator=g), "w")
        sends = sum(1 for m in counting.messages if m.op == "send")
        phases = {m.name.split(".")[0] for m in counting.messages if m.op == "send"}
        return counting.round_trips, sends, phases
    for trips, sends, _ in run_local(size, fn, {}):
        assert sends == size - 1 + math.ceil(math.log2(size))
        assert trips == sends
    for trips, sends, _ in run_local(size, fn, {"deepreduce": "index", "index": "delta"}):
        assert trips == 2 * sends
    if size % 2 == 0:
        for trips, sends, _ in run_local(size, fn, {"teams": 2}):
            m = size // 2
            sag = math.ceil(math.log2(m))
            assert trips == sends + sag  # the SAG pieces after a cross-team merge vary in size
