"""DGC's momentum correction and local gradient clipping as options of the global-residual
memory: what they conserve, what masking clears, dense behaviour at density 1, validation,
composition with the optimizer, checkpoints, and a training run where they matter."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scenarios
from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.transport import run_local

SPARSE = ["spardl", *(p for p in scenarios.PEERS if p != "dense")]


def run_mc(size, comm, density, m, n, steps, clip=None, teams=1, wire=None, masking=True):
    """Per rank, per step: old residual, old velocity, gradient, result, new residual and
    velocity, with momentum correction m on `comm` (on the default wire or `wire`)."""
    def fn(t):
        params = {**scenarios.peer_params(comm, density, wire), "memory": "global_residual",
                  "compressor": "topk", "momentum_correction": m, "local_clip_norm": clip,
                  "momentum_masking": masking}
        if comm == "spardl":
            params["teams"] = teams
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(77 + t.rank)
        records = []
        for _ in range(steps):
            grad = torch.randn(n, generator=g)
            zeros = torch.zeros(n)
            old_r = grc.memory.residuals.get("w", zeros).clone()
            old_u = grc.memory.velocities.get("w", zeros).clone()
            result = grc.step(grad, "w")
            records.append({"grad": grad, "old_r": old_r, "old_u": old_u, "result": result,
                            "r": grc.memory.residuals["w"].clone(),
                            "u": grc.memory.velocities["w"].clone()})
        return records
    return run_local(size, fn)


def check_momentum_correction(per_rank, size, m, masking=True):
    for step in range(len(per_rank[0])):
        result = per_rank[0][step]["result"]
        for rank in range(1, size):
            assert torch.equal(per_rank[rank][step]["result"], result)
        entered = sum(r[step]["old_r"] + m * r[step]["old_u"] + r[step]["grad"] for r in per_rank)
        kept = sum(r[step]["r"] for r in per_rank)
        assert torch.allclose(entered, size * result + kept, atol=1e-4), f"step {step}"
        applied = result != 0 if masking else torch.zeros_like(result, dtype=torch.bool)
        for r in per_rank:
            velocity = m * r[step]["old_u"] + r[step]["grad"]
            assert torch.count_nonzero(r[step]["u"][applied]) == 0
            assert torch.allclose(r[step]["u"][~applied], velocity[~applied], atol=1e-6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(comm=st.sampled_from(SPARSE), size=st.integers(1, 6), n=st.integers(0, 400),
       density=st.sampled_from([0.01, 0.05, 0.3]), m=st.sampled_from([0.5, 0.9, 0.99]))
def test_momentum_correction_conserves_and_masks_applied_entries(comm, size, n, density, m):
    check_momentum_correction(run_mc(size, comm, density, m, n, steps=3), size, m)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(comm=st.sampled_from(SPARSE), size=st.integers(1, 6), n=st.integers(0, 400),
       density=st.sampled_from([0.01, 0.3]), m=st.sampled_from([0.5, 0.9]))
def test_without_masking_the_velocity_is_kept_everywhere_and_mass_is_conserved(
        comm, size, n, density, m):
    check_momentum_correction(run_mc(size, comm, density, m, n, steps=3, masking=False),
                              size, m, masking=False)


@pytest.mark.parametrize("teams", [2, 3])
def test_momentum_correction_with_spardl_teams(teams):
    check_momentum_correction(run_mc(6, "spardl", 0.05, 0.9, 500, steps=4, teams=teams), 6, 0.9)


@pytest.mark.parametrize("comm", ["spardl", *scenarios.PEERS])
def test_density_one_applies_every_velocity_and_keeps_none(comm):
    """At density 1 every entry is applied, so masking clears the whole velocity: DGC then
    reduces to synchronous SGD without momentum (the documented composition). On the exact
    wire: the compact one sends bfloat16 values and keeps the rest in the residual."""
    per_rank = run_mc(4, comm, 1.0, 0.9, 300, steps=3, wire="exact")
    for step in range(3):
        grads = sum(r[step]["grad"] for r in per_rank)
        assert torch.allclose(per_rank[0][step]["result"] * 4, grads, atol=1e-5)
        for r in per_rank:
            assert torch.count_nonzero(r[step]["u"]) == 0
            assert torch.count_nonzero(r[step]["r"]) == 0


@pytest.mark.parametrize("comm", ["spardl", "topka"])
def test_density_one_without_masking_sends_the_average_velocity(comm):
    """momentum_masking=False at density 1: each step sends the ranks' mean velocity
    u = m*u + g, which is what synchronous SGD with momentum applies; nothing stays behind."""
    per_rank = run_mc(4, comm, 1.0, 0.9, 300, steps=4, wire="exact", masking=False)
    velocities = [torch.zeros(300) for _ in per_rank]
    for step in range(4):
        for w, r in enumerate(per_rank):
            velocities[w] = 0.9 * velocities[w] + r[step]["grad"]
            assert torch.allclose(r[step]["u"], velocities[w], atol=1e-6)
            assert torch.count_nonzero(r[step]["r"]) == 0
        assert torch.allclose(per_rank[0][step]["result"] * 4, sum(velocities), atol=1e-5)


def test_momentum_zero_is_plain_global_residuals_bit_for_bit():
    def fn(t, params):
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(5 + t.rank)
        return [grc.step(torch.randn(1000, generator=g), "w") for _ in range(4)]
    base = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
            "compress_ratio": 0.02}
    plain = run_local(4, fn, base)
    explicit = run_local(4, fn, {**base, "momentum_correction": 0.0, "local_clip_norm": None})
    for a, b in zip(plain, explicit):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("size", [1, 4])
def test_local_clipping_bounds_each_workers_gradient(size):
    clip = 2.0

    def fn(t):
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "communicator": "dense", "local_clip_norm": clip}, transport=t)
        big = torch.full((100,), 10.0) * (t.rank + 1)
        small = torch.full((100,), 1e-4)
        return grc.step(big, "big"), grc.step(small, "small")
    for big, small in run_local(size, fn):
        # every worker's gradient is clipped to norm clip/sqrt(P), keeping its direction
        assert torch.allclose(big, torch.full((100,), clip / math.sqrt(size) / 10.0), atol=1e-6)
        assert torch.equal(small, torch.full((100,), 1e-4))


@pytest.mark.parametrize("bad, message", [
    ({"momentum_correction": 1.0}, "momentum_correction must be a number in [0, 1)"),
    ({"momentum_correction": -0.1}, "momentum_correction must be"),
    ({"momentum_correction": True}, "momentum_correction must be"),
    ({"local_clip_norm": 0}, "local_clip_norm must be None (off) or a number > 0"),
    ({"local_clip_norm": "1"}, "local_clip_norm must be"),
    ({"communicator": "allgather", "memory": "residual", "momentum_correction": 0.9},
     "momentum_correction is an option of memory"),
    ({"memory": "none", "momentum_correction": 0.9}, "momentum_correction is an option of memory"),
    ({"communicator": "allgather", "memory": "residual", "local_clip_norm": 1.0},
     "local_clip_norm is an option of memory"),
    ({"momentum_masking": False}, "momentum_masking=False keeps the velocity of momentum "
     "correction, which is off"),
    ({"momentum_correction": 0.9, "momentum_masking": 0}, "momentum_masking must be True or False"),
])
def test_bad_settings_name_the_valid_choices(bad, message):
    params = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl", **bad}
    with pytest.raises(ValueError) as err:
        run_local(1, lambda t: grace_from_params(params, transport=t))
    assert message in str(err.value)


MC_PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
             "compress_ratio": 0.1, "momentum_correction": 0.9, "min_entries": 0}


def _mc_run(t, make_optimizer, steps: int = 5, params: dict = MC_PARAMS) -> dict:
    """`steps` steps of DistributedOptimizer with `params` (momentum correction 0.9) on this
    rank's data; the parameters, the optimizer's groups after the run, and its state's keys."""
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(6, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    grc = grace_from_params(params, transport=t)
    opt = DistributedOptimizer(make_optimizer(model.parameters()), grc,
                               named_parameters=model.named_parameters())
    data = torch.Generator().manual_seed(100 + t.rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=data)).pow(2).sum().backward()
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups],
            "state": [sorted(opt.state[p]) for p in model.parameters()],
            "nesterov": getattr(grc.memory, "nesterov", False)}


def test_the_users_sgd_keeps_its_momentum_which_the_memory_takes_over():
    """SGD(momentum=0.9, weight_decay=1e-3) as the user built it trains bit for bit as DGC's
    recipe (SGD without momentum, weight decay 1e-3 / (1 - 0.9)); its groups still say
    momentum 0.9 and weight decay 1e-3 afterwards, and it keeps no momentum buffer of its own."""
    users = run_local(2, lambda t: _mc_run(t, lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, weight_decay=1e-3)))
    dgcs = run_local(2, lambda t: _mc_run(t, lambda p: torch.optim.SGD(
        p, lr=0.05, weight_decay=1e-3 / (1 - 0.9))))
    for user, dgc in zip(users, dgcs):
        assert torch.equal(user["params"], dgc["params"])
        assert user["groups"][0]["momentum"] == 0.9 and user["groups"][0]["weight_decay"] == 1e-3
        assert user["state"] == [[], []] and not user["nesterov"]
    assert torch.equal(users[0]["params"], users[1]["params"])


def test_nesterov_runs_dgcs_nesterov_variant():
    """nesterov=True: the memory synchronises g + m*u (not u); the ranks agree, and the run
    differs from plain momentum's."""
    nesterov = run_local(2, lambda t: _mc_run(t, lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True)))
    plain = run_local(2, lambda t: _mc_run(t, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)))
    assert nesterov[0]["nesterov"] and torch.equal(nesterov[0]["params"], nesterov[1]["params"])
    assert not torch.equal(nesterov[0]["params"], plain[0]["params"])
    assert nesterov[0]["groups"][0]["nesterov"] is True


@pytest.mark.parametrize("masking, dense_momentum", [(False, 0.9), (True, 0.0)])
def test_at_density_one_the_users_sgd_trains_as_dense_sgd_with_or_without_momentum(
        masking, dense_momentum):
    """SGD(momentum=0.9) under momentum correction at density 1 (exact wire): without masking
    it trains as dense synchronous SGD with momentum 0.9; with DGC's masking, as dense SGD
    without momentum (the velocity is cleared wherever a result is applied, so everywhere)."""
    mc = {**MC_PARAMS, "compress_ratio": 1.0, "wire": "exact", "momentum_masking": masking}
    dense = {"compressor": "none", "memory": "none", "communicator": "dense"}
    def trained(params, momentum):
        return [r["params"] for r in run_local(2, lambda t: _mc_run(
            t, lambda p: torch.optim.SGD(p, lr=0.05, momentum=momentum), params=params))]
    got = trained(mc, 0.9)
    assert torch.equal(got[0], got[1])
    assert torch.allclose(got[0], trained(dense, dense_momentum)[0], atol=1e-5)
    assert not torch.allclose(got[0], trained(dense, 0.9 - dense_momentum)[0], atol=1e-3)


def test_the_nesterov_memory_sends_gradient_plus_m_times_the_new_velocity():
    def fn(t):
        grc = grace_from_params({**MC_PARAMS, "compress_ratio": 1.0, "wire": "exact"}, transport=t)
        grc.memory.nesterov = True
        g1, g2 = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([0.5, 1.0, -1.0, 2.0])
        first = grc.step(g1.clone(), "w")  # u = g1, sent g1 + 0.9 g1; all applied, u masked
        second = grc.step(g2.clone(), "w")
        return first, second, g1, g2
    first, second, g1, g2 = run_local(1, fn)[0]
    assert torch.allclose(first, 1.9 * g1) and torch.allclose(second, 1.9 * g2)


@pytest.mark.parametrize("make,message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5), "which is 0.5 with dampening 0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "with dampening 0.1"),
    (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9), "RMSprop has momentum 0.9 of its own"),
])
def test_a_momentum_the_memory_cannot_stand_in_for_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        run_local(1, lambda t: _mc_run(t, make, steps=1))


@pytest.mark.parametrize("masking", [True, False])
def test_velocities_survive_a_checkpoint_and_resume_bit_identically(masking):
    params = {"compressor": "topk", "memory": "global_residual", "communicator": "topka",
              "compress_ratio": 0.05, "momentum_correction": 0.9, "momentum_masking": masking}

    def fn(t, stop):
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(11 + t.rank)
        grads = [torch.randn(500, generator=g) for _ in range(6)]
        out = []
        for i, grad in enumerate(grads):
            if i == stop:
                state = grc.state_dict()
                grc = grace_from_params(params, transport=t)
                grc.load_state_dict(state)
            out.append(grc.step(grad, "w"))
        return out
    straight = run_local(3, fn, -1)
    resumed = run_local(3, fn, 3)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
