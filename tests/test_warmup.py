"""The library's density schedule for the sparse all-reduces: the density warm-up
(spardl_grace.warmup, grace_from_params' density_warmup_steps: DGC's stages in equal parts over
each name's first steps) and the floor on entries a step (min_entries). The counts every sparse
all-reduce then sends, a checkpoint round trip that continues the schedule bit for bit, ranks
that disagree on it (or stand in different stages) raising at once, and the keys' refusals."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_checks import check_consistent_and_conserving, run_steps
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.registry import SPARSE_ALLREDUCES
from spardl_grace.selection import count_for_ratio
from spardl_grace.warmup import warmup_density, warmup_stages

# No floor: these tests follow the density schedule on tensors of a few thousand entries.
SPARSE = {"compressor": "topk", "memory": "global_residual", "compress_ratio": 0.01,
          "min_entries": 0}


def test_dgc_stages_above_the_target():
    assert warmup_stages(0.25, 0.01) == [0.25, 0.0625, 0.015625]
    assert warmup_stages(0.25, 0.001) == [0.25, 0.0625, 0.015625, 0.00390625]
    assert warmup_stages(0.0625, 0.01) == [0.0625, 0.015625]
    assert warmup_stages(0.01, 0.01) == []
    assert [warmup_density(s, 6, 0.25, 0.01) for s in range(8)] == \
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    assert warmup_density(0, 0, 0.25, 0.01) == 0.01


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 5000), st.floats(1e-4, 1.0), st.floats(1e-4, 1.0))
def test_the_schedule_falls_in_equal_stages_to_the_target(steps, start, target):
    """Densities never rise, end at the target after `steps` steps, and every stage lasts
    floor or ceil of steps / stages steps."""
    densities = [warmup_density(s, steps, start, target) for s in range(steps + 2)]
    assert all(a >= b for a, b in zip(densities, densities[1:]))
    assert densities[-1] == densities[-2] == target
    stages = warmup_stages(start, target)
    if stages and steps >= len(stages):
        lengths = [densities[:steps].count(d) for d in stages]
        assert set(lengths) <= {steps // len(stages), math.ceil(steps / len(stages))}
        assert sum(lengths) == steps


@pytest.mark.parametrize("comm", [c for c in SPARSE_ALLREDUCES if c != "gaussiank"])
def test_every_sparse_allreduce_sends_the_stages_counts_and_conserves(comm):
    """TopkA selects exactly k = ceil(n * density) a step: the counts follow the stages; every
    exact-count algorithm conserves mass and agrees across ranks through the stage changes."""
    per_rank = run_steps(4, {"communicator": comm, "compress_ratio": 0.01,
                             "density_warmup_steps": 6}, 4000, steps=8)
    check_consistent_and_conserving(per_rank, 4)
    if comm == "topka":
        sent = [r["stats"]["gather_entries"] for r in per_rank[0]]
        assert sent == [count_for_ratio(4000, warmup_density(s, 6, 0.25, 0.01)) for s in range(8)]


def _steps_with(params, grads, t, state=None, first=0):
    grc = grace_from_params({**SPARSE, "communicator": "spardl", **params}, transport=t)
    if state is not None:
        grc.load_state_dict(state)
    out = [grc.step(g.clone(), "w") for g in grads[first:]]
    return out, grc.state_dict()


def test_a_checkpoint_round_trip_continues_the_schedule_bit_for_bit():
    """Stopped after 3 of 8 steps (inside the warm-up) and resumed from state_dict in a new
    synchronizer: the remaining steps equal those of a run never stopped."""
    params = {"density_warmup_steps": 6}

    def fn(t):
        g = torch.Generator().manual_seed(t.rank)
        grads = [torch.randn(3000, generator=g) for _ in range(8)]
        whole, _ = _steps_with(params, grads, t)
        _, saved = _steps_with(params, grads[:3], t)
        resumed, _ = _steps_with(params, grads, t, state=saved, first=3)
        return whole[3:], resumed
    for whole, resumed in run_local(3, fn):
        assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("key,unit", [("density_warmup_steps", 10), ("min_entries", 100)])
def test_ranks_with_different_schedules_all_raise_naming_the_setting(key, unit):
    """A warm-up length or a floor that differs between ranks: both raise, naming it."""
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl", key: unit * (t.rank + 1)},
                                transport=t)
        return _error(lambda: grc.step(torch.randn(1000), "w"))
    errors = run_local(2, fn)
    assert errors[0] == errors[1]
    assert f"communicator.{key}: rank 0 {unit}, rank 1 {2 * unit}" in errors[0]


def test_ranks_in_different_stages_raise_at_once():
    """One rank resumed from another step: at its first step the ranks send different
    densities, and both raise naming it instead of exchanging messages of different sizes."""
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl", "density_warmup_steps": 6},
                                transport=t)
        if t.rank == 1:
            grc.load_state_dict({"communicator": {"steps": {"w": 2}}})
        return _error(lambda: grc.step(torch.randn(1000), "w"))
    errors = run_local(2, fn)
    assert errors[0] == errors[1] and "step_density: rank 0 0.25, rank 1 0.0625" in errors[0]


def test_the_warmup_keys_are_refused_where_there_is_no_density_to_warm():
    from spardl_grace.transport.local import LocalTransport
    one = LocalTransport.world(1)[0]
    with pytest.raises(ValueError, match="set the density of the sparse all-reduces"):
        grace_from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                           "density_warmup_steps": 100}, transport=one)
    with pytest.raises(ValueError, match="density_warmup_steps must be an int >= 0"):
        grace_from_params({**SPARSE, "communicator": "spardl", "density_warmup_steps": -1},
                          transport=one)
    with pytest.raises(ValueError, match="density_warmup_start must be"):
        grace_from_params({**SPARSE, "communicator": "spardl", "density_warmup_start": 0},
                          transport=one)
    grc = grace_from_params({**SPARSE, "communicator": "topka", "density_warmup_steps": 40,
                             "density_warmup_start": 0.0625}, transport=one)
    assert (grc.density_warmup_steps, grc.density_warmup_start) == (40, 0.0625)
    assert grc.density_at(0) == 0.0625 and grc.density_at(39) == 0.015625 and grc.density_at(40) == 0.01


@pytest.mark.parametrize("comm", [c for c in SPARSE_ALLREDUCES if c != "gaussiank"])
def test_the_floor_raises_a_small_tensors_count_and_conserves(comm):
    """min_entries 100 on 2,000 entries at density 0.01 (20 entries): TopkA selects exactly
    100 a step; every exact-count algorithm conserves mass and agrees across ranks."""
    per_rank = run_steps(4, {"communicator": comm, "compress_ratio": 0.01, "min_entries": 100},
                         2000, steps=3)
    check_consistent_and_conserving(per_rank, 4)
    if comm == "topka":
        assert [r["stats"]["gather_entries"] for r in per_rank[0]] == [100, 100, 100]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**7), st.integers(0, 5000), st.floats(1e-4, 1.0), st.integers(0, 30))
def test_the_floor_is_exact_and_leaves_large_tensors_alone(numel, floor, density, step):
    """count_for_ratio at the floored density is max(the schedule's count, min(numel, floor)):
    exactly the floor where it binds, never one short by rounding."""
    from spardl_grace.transport.local import LocalTransport
    grc = grace_from_params({**SPARSE, "communicator": "topka", "compress_ratio": density,
                             "min_entries": floor, "density_warmup_steps": 20},
                            transport=LocalTransport.world(1)[0])
    scheduled = count_for_ratio(numel, warmup_density(step, 20, 0.25, density))
    assert count_for_ratio(numel, grc.density_at(step, numel)) == max(scheduled, min(numel, floor))
    assert grc.density_at(step) == warmup_density(step, 20, 0.25, density)


def test_spardl_sends_the_floors_entries_in_its_blocks():
    """SparDL at density 0.01 on 4,000 entries over 4 workers: 10 entries per block of 1,000
    without a floor; with min_entries 400, 100 per block (the density rounds per block), and
    the wire carries the cost formula's 8 bytes x 2k(P-1)/P more for the 360 more entries."""
    plain = run_steps(4, {"communicator": "spardl", "compress_ratio": 0.01, "wire": "exact"},
                      4000, steps=2)
    floored = run_steps(4, {"communicator": "spardl", "compress_ratio": 0.01, "wire": "exact",
                            "min_entries": 400}, 4000, steps=2)
    check_consistent_and_conserving(floored, 4)
    grc = floored[0][0]["grc"]
    assert grc.block_layout(4000, grc.density_at(0, 4000)) == (1000, 100)
    assert grc.block_layout(4000, plain[0][0]["grc"].density_at(0, 4000)) == (1000, 10)
    extra = floored[0][1]["stats"]["bytes_sent"] - plain[0][1]["stats"]["bytes_sent"]
    assert extra == 8 * 2 * (400 - 40) * 3 // 4


def test_the_default_floor_sends_a_small_model_2048_entries_and_a_large_one_its_density():
    """grace_from_params' default (DEFAULT_MIN_ENTRIES): TopkA on 18,378 entries (FashionCNN)
    at density 0.01 sends 2,048 a step, not 183; on 300,000 entries 3,000."""
    from spardl_grace.api import DEFAULT_MIN_ENTRIES
    assert DEFAULT_MIN_ENTRIES == 2048
    for n, sent in ((18_378, 2048), (300_000, 3000)):
        per_rank = run_steps(2, {"communicator": "topka", "compress_ratio": 0.01,
                                 "min_entries": DEFAULT_MIN_ENTRIES}, n, steps=1)
        assert per_rank[0][0]["stats"]["gather_entries"] == sent
    from spardl_grace.transport.local import LocalTransport
    one = grace_from_params({"compressor": "topk", "memory": "global_residual",
                             "communicator": "spardl"}, transport=LocalTransport.world(1)[0])
    assert one.min_entries == DEFAULT_MIN_ENTRIES


def test_the_floor_key_is_checked_and_refused_where_there_is_no_density():
    from spardl_grace.transport.local import LocalTransport
    one = LocalTransport.world(1)[0]
    with pytest.raises(ValueError, match="set the density of the sparse all-reduces"):
        grace_from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                           "min_entries": 1000}, transport=one)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_entries"):
            grace_from_params({**SPARSE, "communicator": "spardl", "min_entries": bad},
                              transport=one)
