"""GRACE communicators and grace_from_params: consistency, conservation, validation."""
from __future__ import annotations

import pytest
import torch

import scenarios
from spardl_grace import grace_from_params
from spardl_grace.registry import resolve_params
from spardl_grace.transport import run_local
from spardl_grace.communicators import Allgather, Broadcast

def assert_identical_replicas(results):
    for key, params in results[0].items():
        for rank, other in enumerate(results[1:], 1):
            for a, b in zip(params, other[key]):
                assert torch.equal(a, b), f"{key}: rank {rank} differs from rank 0"


@pytest.mark.parametrize("size", range(1, 9))
def test_grace_loop_gives_identical_replicas_local(size):
    results = run_local(size, scenarios.grace_training)
    assert_identical_replicas(results)
    assert set(results[0]) == {"/".join(c) for c in scenarios.GRACE_CONFIGS}


@pytest.mark.parametrize("backend,size", [("gloo", 2), ("gloo", 4), ("mpi", 3)])
def test_grace_loop_gives_identical_replicas_multiprocess(launch, backend, size):
    results = launch(backend, size, "grace_training")
    assert_identical_replicas(results)
    # Same model as the in-process run, up to the order in which the backend sums floats.
    local = run_local(size, scenarios.grace_training)[0]
    for key in ("none/none/allreduce", "topk/global_residual/spardl", "topk/residual/allgather"):
        for a, b in zip(results[0][key], local[key]):
            assert torch.allclose(a, b, atol=1e-5), key


def step_all(size, params, n=300, steps=3):
    """Run grc.step for a few steps; return per-rank lists of (input+old residual, result, residual)."""
    def fn(t):
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        out = []
        for _ in range(steps):
            grad = torch.randn(n, generator=g)
            memory = getattr(grc.memory, "residuals", {})
            compensated = grad + memory.get("w", torch.zeros(n))
            result = grc.step(grad, "w")
            out.append((compensated, result, getattr(grc.memory, "residuals", {}).get("w")))
        return out
    return run_local(size, fn)


# fp16 all-reduce sums half-precision values on the wire: that rounding happens after the
# memory recorded its residual, so conservation holds only to fp16 precision there.
@pytest.mark.parametrize("comp,comm,atol", [("topk", "allgather", 1e-5), ("threshold", "allgather", 1e-5),
                                            ("randomk", "allreduce", 1e-5), ("qsgd", "allgather", 1e-5),
                                            ("onebit", "broadcast", 1e-5), ("natural", "allgather", 1e-5),
                                            ("terngrad", "allgather", 1e-5), ("fp16", "allreduce", 1e-2)])
def test_residual_memory_conserves_mass(comp, comm, atol):
    size = 4
    results = step_all(size, {"compressor": comp, "memory": "residual", "communicator": comm,
                              "compress_ratio": 0.05, "threshold": 1.0})
    for step in range(3):
        compensated = sum(r[step][0] for r in results)
        kept = sum(r[step][2] for r in results)
        result = results[0][step][1]
        assert all(torch.equal(r[step][1], result) for r in results)
        assert torch.allclose(compensated, size * result + kept, atol=atol)


def test_uncompressed_communicators_give_the_dense_average():
    for comm in ("allreduce", "allgather", "broadcast"):
        results = step_all(3, {"communicator": comm}, steps=1)
        total = sum(r[0][0] for r in results)
        assert torch.allclose(results[0][0][1], total / 3, atol=1e-6), comm


def test_broadcast_matches_allgather_bit_for_bit():
    def fn(t, cls):
        grc = grace_from_params({"compressor": "topk", "memory": "residual",
                                 "communicator": "allgather", "compress_ratio": 0.1}, transport=t)
        comm = cls(grc.compressor, grc.memory, t)
        return comm.step(torch.randn(100, generator=torch.Generator().manual_seed(t.rank)), "w")
    assert torch.equal(run_local(3, fn, Allgather)[0], run_local(3, fn, Broadcast)[0])


def test_sign_majority_vote_is_not_averaged():
    results = step_all(3, {"compressor": "signsgd", "communicator": "allgather"}, steps=1)
    assert set(results[0][0][1].unique().tolist()) <= {-1.0, 1.0}


@pytest.mark.parametrize("params,match", [
    ({"compressor": "topkk"}, "unknown compressor 'topkk'; valid choices: dgc, efsignsgd"),
    ({"memory": "resid"}, "unknown memory 'resid'; valid choices: dgc, efsignsgd"),
    ({"communicator": "ring"}, "unknown communicator 'ring'; valid choices: allgather"),
    ({"compress_ratio": 0}, r"compress_ratio must be a number in \(0, 1\]"),
    ({"compress_ratio": 1.5}, r"compress_ratio must be a number in \(0, 1\]"),
    ({"quantum_num": 0}, "quantum_num must be an int"),
    ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
    ({"compresion_ratio": 0.1}, r"unknown parameter\(s\) \['compresion_ratio'\]"),
    ({"compressor": "topk"}, "use 'allgather' for 'topk'"),
    ({"compressor": "qsgd", "communicator": "spardl"}, "use compressor 'topk'"),
    ({"compressor": "topk", "memory": "dgc", "communicator": "spardl"}, "needs memory in"),
    ({"memory": "global_residual", "compressor": "topk", "communicator": "allgather"},
     "with communicator 'allgather' use 'residual'"),
    ({"compressor": "powersgd", "communicator": "allreduce"}, "go together"),
    # alone, efsignsgd's compressor sent 1/lr times the gradient, its memory lr times it
    ({"compressor": "efsignsgd", "communicator": "allgather"},
     "compressor 'efsignsgd' and memory 'efsignsgd' go together .*1/lr"),
    ({"compressor": "topk", "memory": "efsignsgd", "communicator": "allgather"},
     "got compressor 'topk', memory 'efsignsgd'"),
    ({"compressor": "signsgd", "memory": "dgc", "communicator": "allgather"}, "masks sent indices"),
    ({"compress_ratio": 0.1, "density": 0.2}, "alias"),
])
def test_bad_params_raise_value_error_naming_choices(params, match):
    with pytest.raises(ValueError, match=match):
        resolve_params(params)


def test_defaults_follow_grace():
    p = resolve_params({})
    assert (p["compressor"], p["memory"], p["communicator"]) == ("none", "none", "allreduce")
    assert p["compress_ratio"] == 0.01 and p["quantum_num"] == 127 and p["threshold"] == 0.01
    assert resolve_params({"compressor": "dgc", "communicator": "allgather"})["compress_ratio"] == 0.3
    assert resolve_params({"density": 0.05})["compress_ratio"] == 0.05


def test_world_size_and_teams_are_checked_against_the_transport():
    def fn(t):
        with pytest.raises(ValueError, match="world_size 3 does not match"):
            grace_from_params({"world_size": 3}, transport=t)
        with pytest.raises(ValueError, match=r"teams must divide .* choose one of \[1, 2, 4\]"):
            grace_from_params({"compressor": "topk", "memory": "global_residual",
                               "communicator": "spardl", "teams": 3}, transport=t)
        return True
    assert run_local(4, fn) == [True] * 4


def test_communicator_state_dict_loads_with_weights_only(tmp_path):
    def fn(t):
        params = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
                  "compress_ratio": 0.1, "teams": 2}
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        grads = [torch.randn(64, generator=g) for _ in range(4)]
        for grad in grads[:2]:
            grc.step(grad, "w")
        path = tmp_path / f"r{t.rank}.pt"
        torch.save(grc.state_dict(), path)
        uninterrupted = [grc.step(grad, "w") for grad in grads[2:]]
        resumed = grace_from_params(params, transport=t)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        again = [resumed.step(grad, "w") for grad in grads[2:]]
        return all(torch.equal(a, b) for a, b in zip(uninterrupted, again))
    assert run_local(4, fn) == [True] * 4


def test_loading_state_from_another_world_size_fails_loudly():
    state = run_local(2, lambda t: grace_from_params({}, transport=t).state_dict())[0]
    def fn(t):
        with pytest.raises(ValueError, match="written by 2 workers, this run has 3"):
            grace_from_params({}, transport=t).load_state_dict(state)
        return True
    assert run_local(3, fn) == [True] * 3


def test_residuals_another_memory_cannot_take_are_refused_not_dropped():
    """A SparDL state with residuals loaded into QSGD over allgather (memory none) or dense
    dropped them in silence; into GRACE's residual memory the first step raised about a
    shape. Another density, teams or sparse all-reduce on the same memory loads as before."""
    spardl = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
              "compress_ratio": 0.1, "min_entries": 0}

    def fn(t):
        grc = grace_from_params(spardl, transport=t)
        grc.step(torch.randn(64, generator=torch.Generator().manual_seed(t.rank)), "w")
        state, said = grc.state_dict(), []
        for other in ({"compressor": "qsgd", "memory": "none", "communicator": "allgather"},
                      {"communicator": "dense"},
                      {"compressor": "topk", "memory": "residual", "communicator": "allgather"}):
            with pytest.raises(ValueError) as caught:
                grace_from_params(other, transport=t).load_state_dict(state)
            said.append(str(caught.value))
        for same_memory in ({**spardl, "compress_ratio": 0.3}, {**spardl, "communicator": "topka"},
                            {"compressor": "none", "memory": "global_residual",
                             "communicator": "dense"}):
            grace_from_params(same_memory, transport=t).load_state_dict(state)
        fresh = grace_from_params(spardl, transport=t).state_dict()  # no residual: nothing lost
        grace_from_params({"communicator": "dense"}, transport=t).load_state_dict(fresh)
        return said

    for said in run_local(2, fn):
        assert all("saved by SparDL with GlobalResidualMemory" in s for s in said)
        assert "this run's Allgather with NoneMemory cannot take its residuals" in said[0]
        assert "Dense with NoneMemory" in said[1] and "Allgather with ResidualMemory" in said[2]


@pytest.mark.parametrize("params", [
    {"compressor": "topk", "memory": "global_residual", "communicator": "spardl", "min_entries": 0},
    {"compressor": "topk", "memory": "residual", "communicator": "allgather"},
])
def test_set_density_changes_what_the_next_step_sends(params):
    def fn(t):
        grc = grace_from_params({**params, "compress_ratio": 0.01}, transport=t)
        grad = torch.randn(4000, generator=torch.Generator().manual_seed(t.rank))
        before = torch.count_nonzero(grc.step(grad.clone(), "w"))
        grc.set_density(0.1)
        after = torch.count_nonzero(grc.step(grad.clone(), "w"))
        return int(before), int(after)
    for before, after in run_local(2, fn):
        assert after >= 8 * before > 0


def test_set_density_rejects_bad_values_and_dense_communicators():
    def fn(t):
        sparse = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                    "communicator": "spardl", "compress_ratio": 0.1}, transport=t)
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            sparse.set_density(0)
        dense = grace_from_params({"compressor": "none", "memory": "none",
                                   "communicator": "allreduce"}, transport=t)
        with pytest.raises(ValueError, match="no density to set"):
            dense.set_density(0.1)
    run_local(1, fn)
