"""FSDP2 with a sparse all-reduce across the replicas (spardl_grace.fsdp.hybrid_shard), on real
fully_shard models: 4 gloo ranks under torchrun, a 2 x 2 mesh (2 "nodes" of 2 ranks)."""
from __future__ import annotations

import pytest
import torch

from spardl_grace.fsdp import _check_mesh


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


def test_a_dcp_checkpoint_mid_run_resumes_bit_identically(launch):
    """torch.distributed.checkpoint saves the model, the optimizer and the HybridSync (each
    rank's residuals under its own key) after 3 of 6 steps; a run built anew that loads it and
    trains the last 3 steps ends with the uninterrupted run's shards, bit for bit."""
    for rank, got in enumerate(launch("gloo", 4, "fsdp_scenarios.dcp_resume")):
        assert got["residual_names"] == ["0", "2", "4"]
        for a, b in zip(got["uninterrupted"], got["resumed"]):
            assert torch.equal(a, b), rank
