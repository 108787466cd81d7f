"""FSDP2 with sparse gradient traffic, on real fully_shard models, 4 gloo ranks under torchrun:
a sparse all-reduce across the replicas (spardl_grace.fsdp.hybrid_shard, a 2 x 2 mesh of 2
"nodes" of 2 ranks), and SparDL's Spar-Reduce-Scatter as FSDP's reduce-scatter (flat_shard)."""
from __future__ import annotations

import pytest
import torch

from spardl_grace.fsdp import _check_mesh, flat_shard, hybrid_shard


def test_density_one_equals_fsdps_native_hsdp(launch):
    """SparDL at density 1 across the replicas gives FSDP's own HSDP gradient shards, bit for
    bit on integer-valued data (every partial sum exact, the averages over 2 and 2 replicas
    powers of two)."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.dense_density_equals_native_hsdp")):
        for hybrid, native in zip(got["hybrid"], got["native"]):
            assert torch.equal(hybrid, native), rank


def test_hybrid_sparse_steps_conserve_mass_per_unit_and_replicas_agree(launch):
    """Density 0.1, three steps: for every unit and shard, the two replicas' inputs plus their
    old residuals equal 2 x the result plus their new residuals; both replicas get the same
    result and hold the same parameter shards after each step."""
    per_rank = launch("gloo", 4, "fsdp_scenarios.conserving_steps")
    for shard in (0, 1):
        replicas = [per_rank[shard], per_rank[2 + shard]]
        names = [n for n, steps in replicas[0]["records"].items() if steps]
        assert names == ["0", "2", "4"]  # the Linear layers; the root holds no parameter
        for name in names:
            steps = [r["records"][name] for r in replicas]
            assert len(steps[0]) == 3
            for a, b in zip(*steps):
                assert torch.equal(a["result"], b["result"]), name
                total = a["given"] + a["old"] + b["given"] + b["old"]
                assert torch.allclose(total, 2 * a["result"] + a["new"] + b["new"], atol=1e-5)
                assert 0 < int((a["result"] != 0).sum()) < a["result"].numel()
        for a, b in zip(replicas[0]["params"], replicas[1]["params"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Mesh:
    def __init__(self, ndim, names):
        self.ndim, self.mesh_dim_names = ndim, names


@pytest.mark.parametrize("mesh", [_Mesh(1, ("shard",)), _Mesh(2, ("dp", "shard")), _Mesh(2, None)])
def test_a_mesh_without_the_two_named_dimensions_is_refused(mesh):
    with pytest.raises(ValueError, match="2-D device mesh with dimensions named 'replicate'"):
        _check_mesh(mesh, "replicate", "shard")


@pytest.mark.parametrize("mode", ["hybrid", "flat"])
def test_a_dcp_checkpoint_mid_run_resumes_bit_identically(launch, mode):
    """torch.distributed.checkpoint saves the model, the optimizer and the ShardSync (each
    rank's residuals under its own key) after 3 of 6 steps; a run built anew that loads it and
    trains the last 3 steps ends with the uninterrupted run's shards, bit for bit."""
    scenario = "dcp_resume" if mode == "hybrid" else "flat_dcp_resume"
    for rank, got in enumerate(launch("gloo", 4, f"fsdp_scenarios.{scenario}")):
        assert got["residual_names"] == ["0", "2", "4"]
        for a, b in zip(got["uninterrupted"], got["resumed"]):
            assert torch.equal(a, b), rank


def test_flat_density_one_equals_fsdps_own_reduce_scatter(launch):
    """SparDL's reduce-scatter at density 1 gives FSDP's own gradient shards, bit for bit on
    integer-valued data, under FSDP's AVG and under forced SUM. With reduce_dtype bfloat16 on
    real data, both it and FSDP's own bfloat16 reduce-scatter are within bfloat16's rounding of
    the float32 reduction (the inputs are rounded to bfloat16 on each rank either way)."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.flat_density_one_equals_native_fsdp")):
        for case in ("avg", "sum"):
            for flat, native in zip(got[case]["flat"], got[case]["native"]):
                assert torch.equal(flat, native), (rank, case)
        bf16 = got["bf16"]
        for flat, native, exact in zip(bf16["flat"], bf16["native"], bf16["fp32"]):
            assert flat.dtype == native.dtype == torch.float32
            scale = 2 ** -7 * exact.abs().max().item()
            assert torch.allclose(flat, exact, rtol=2 ** -7, atol=scale), rank
            assert torch.allclose(native, exact, rtol=2 ** -7, atol=scale), rank


def test_flat_sparse_steps_conserve_mass_per_unit(launch):
    """Density 0.1, three steps, 4 ranks: for every unit, the ranks' inputs plus their old
    residuals equal the concatenated shards (times 4: FSDP averages) plus their new residuals;
    each rank keeps no residual in its own block, and sends about 3 x 10% of its input."""
    per_rank = launch("gloo", 4, "fsdp_scenarios.flat_conserving_steps")
    names = [n for n, steps in per_rank[0]["records"].items() if steps]
    assert names == ["0", "2", "4"]
    for name in names:
        for step in range(3):
            recs = [r["records"][name][step] for r in per_rank]
            total = sum(r["given"] + r["old"] for r in recs)
            shards = torch.cat([4 * r["shard"] for r in recs])
            assert torch.allclose(total, shards + sum(r["new"] for r in recs), atol=1e-4), name
            for rank, r in enumerate(recs):
                assert not r["new"].view(4, -1)[rank].any()
                assert (r["new"] != 0).sum() > 0
    for r in per_rank:
        assert r["bytes_sent"] > 0


def test_flat_honours_fsdps_divide_factor(launch):
    """It refused set_gradient_divide_factor (FSDP's PREMUL_SUM); now the shard is the sum
    times the factor FSDP asks for, on every rank."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.flat_divide_factor")):
        for factor2, avg in zip(got["factor2"], got["avg"]):
            assert torch.equal(factor2, 2 * avg), rank


def test_torchtitans_fsdp_settings_give_hsdps_gradients(launch):
    """torchtitan's settings (divide factor 1, force-sum, its ModuleDict of blocks as units,
    the all-reduce deferred to the last micro-batch): hybrid_shard's gradient shards are HSDP's
    bit for bit at density 1 on integer data. Before, they were half of HSDP's (the replicas
    were averaged where HSDP sums), the deferral was ignored (a sparse sync per micro-batch),
    and the ModuleDict was refused."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.torchtitan_settings_equal_native_hsdp")):
        for case in ("one", "accumulated"):
            for hybrid, native in zip(got[case]["hybrid"], got[case]["native"]):
                assert torch.equal(hybrid, native), (rank, case)
        # one sparse sync per unit and step either way: the deferred micro-batch sent nothing
        assert got["accumulated"]["bytes_sent"] == got["one"]["bytes_sent"] > 0


def test_momentum_correction_takes_the_users_sgd_momentum_over(launch):
    """The user's SGD(momentum=0.9) under hybrid_shard with momentum correction trains bit for
    bit as DGC's recipe (momentum 0, decay scaled): the momentum is applied once, by the
    memory (before, FSDP2 left the SGD's on: twice, silently); the groups stay as built. The
    same without DGC's masking ('momentum_masking': False), which trains otherwise."""
    for got in launch("gloo", 4, "fsdp_scenarios.momentum_taken_over"):
        for suffix in ("", "_unmasked"):
            for users, dgc in zip(got["users" + suffix], got["dgc" + suffix]):
                assert torch.equal(users, dgc), suffix
            assert got[f"users{suffix}_group"] == (0.9, 1e-3)
        assert any(not torch.equal(a, b) for a, b in zip(got["users"], got["users_unmasked"]))


def test_flat_shard_refuses_another_communicator_and_a_2d_mesh():
    """Refused before any collective, so no process group is needed; hybrid_shard refuses the
    frozen variance and PowerSGD too."""
    with pytest.raises(ValueError, match="1-D device mesh"):
        flat_shard(torch.nn.Linear(2, 2), {**_SPARDL, "compress_ratio": 0.1}, mesh=_Mesh(2, ("a", "b")))
    for bad in ({"communicator": "topka"}, {"teams": 2}):
        with pytest.raises(ValueError, match="choose communicator 'spardl' with teams 1"):
            flat_shard(torch.nn.Linear(2, 2), {**_SPARDL, "compress_ratio": 0.1, **bad})
    frozen = {**_SPARDL, "compress_ratio": 0.1, "adam_freeze_step": 5}
    for shard in (lambda: flat_shard(torch.nn.Linear(2, 2), frozen),
                  lambda: hybrid_shard(torch.nn.Linear(2, 2), _Mesh(2, ("replicate", "shard")), frozen)):
        with pytest.raises(ValueError, match="needs dense steps to estimate Adam's second moment"):
            shard()
    with pytest.raises(ValueError, match="'powersgd' approximates each parameter's"):
        hybrid_shard(torch.nn.Linear(2, 2), _Mesh(2, ("replicate", "shard")),  # a flat shard
                     {"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce"})


_SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl"}


def test_torchtitans_model_layout_unused_blocks_and_dcp_resumes_as_users_write_them(launch):
    """Found by trying FSDP2 as a torchtitan user: each of these raised or resumed afresh in
    silence before (see fsdp_scenarios.user_patterns). AdamW on SparDL's gradient is told,
    once per ShardSync, that it trains far behind dense."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.user_patterns", timeout=400)):
        assert got["units"] == ["<root>", "inp", "layers.0", "layers.1", "layers.2", "out"]
        for who in ("every rank", "rank 0"):
            for a, b in zip(got[who]["hybrid"], got[who]["native"]):
                assert torch.equal(a, b), (rank, who)
        assert all(torch.isfinite(p).all() for p in got["flat"])
        (warned,) = got["resumed, ShardSync left out"]
        assert "compression state was not restored" in warned and "ShardSync" in warned
        assert got["resumed, ShardSync kept"] == []
        for kept in ("kept", "left out"):  # AdamW on SparDL's gradient: told once, after
            (advice,) = got[f"Adam advice, ShardSync {kept}"]  # DCP's creating step
            assert "AdamW steps on SparDL at density 0.1" in advice and "FSDP2" in advice
        assert "saved under another sharding" in got["other layout"]


def test_momentum_correction_refuses_adams_first_moment():
    """Adam keeps its momentum as betas[0]: momentum correction went on beside it unasked."""
    from spardl_grace.momentum import taken_over_groups
    adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="AdamW has momentum 0.9 of its own"):
        taken_over_groups(adamw, 0.9)


def test_tied_weights_nested_units_and_blocks_sharded_already(launch):
    """Tied weights with the default units raised FSDP's 'shared parameter' error at the first
    forward; units given outer first raised DeviceMesh's 'overlapping meshes'; blocks the user
    had fully_shard'ed were left out of the synchronisation between replicas in silence (the
    nodes drifted apart); an optimizer built before the sharding held the replaced parameters
    and trained nothing in silence, and now its first step raises."""
    for got in launch("gloo", 4, "fsdp_scenarios.setup_patterns"):
        assert got["tied, default units"] == ["body", "<root>"]
        assert "units 'embed' and 'head' share a parameter (tied weights)" in \
            got["tied, both in units"]
        assert got["nested, outer first"] == ["0.0", "0", "<root>"]
        assert "0, 2 are fully_shard'ed already" in got["blocks sharded already"]
        hybrid, flat = got["optimizer built before"]
        assert "holds the parameters the model had before hybrid_shard" in hybrid
        assert "Build the optimizer after flat_shard" in flat
        assert got["optimizer built after moves"] == [True, True]


def test_a_step_on_parameters_a_sharding_replaced_raises_and_the_mark_goes_with_them():
    """The mark a sharding leaves on the parameters it replaced: any optimizer holding one
    raises before its step changes anything; the others step; a freed parameter's mark goes."""
    from spardl_grace import step_hooks
    old, kept = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    step_hooks.mark_replaced(old.parameters(), "hybrid_shard")
    stale = torch.optim.SGD([*kept.parameters(), *old.parameters()], lr=0.1)
    fine = torch.optim.SGD(kept.parameters(), lr=0.1)
    kept(torch.ones(1, 3)).sum().backward()
    before = [p.clone() for p in kept.parameters()]
    with pytest.raises(RuntimeError, match="before hybrid_shard, which fully_shard replaced"):
        stale.step()
    assert all(torch.equal(a, b) for a, b in zip(before, kept.parameters()))
    fine.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, kept.parameters()))
    marked = {id(p) for p in old.parameters()}
    del stale, old
    assert not marked & set(step_hooks._REPLACED)
