"""Ranks that disagree (sizes, dtypes, settings, algorithms, bucket layouts) fail at once with a
ValueError on every rank that names the field and each rank's value; ranks that agree pay one
8-byte all-gather per name, only on its first step and when its fingerprint changes."""
from __future__ import annotations

import time

import pytest
import torch

from spardl_grace import grace_from_params
from spardl_grace.registry import COMMUNICATORS
from spardl_grace.transport import CountingTransport, run_local
from spardl_grace.sync import Bucket, GradientSync

SPARSE = {"compressor": "topk", "memory": "global_residual", "compress_ratio": 0.01}


def params_for(communicator: str, **overrides) -> dict:
    if communicator == "dense":
        return {"compressor": "none", "memory": "none", "communicator": "dense", **overrides}
    if communicator in ("allreduce", "allgather", "broadcast"):
        return {"compressor": "topk" if communicator == "allgather" else "none",
                "memory": "none", "communicator": communicator, "compress_ratio": 0.01, **overrides}
    if communicator == "auto":  # chooses its density itself, so it takes no compress_ratio
        return {"compressor": "topk", "memory": "global_residual", "communicator": "auto",
                **overrides}
    return {**SPARSE, "communicator": communicator, **overrides}


def error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("communicator", sorted(COMMUNICATORS))
def test_every_communicator_refuses_tensors_of_different_sizes_on_every_rank(communicator):
    """The issue's case: 10,000, 10,037 and 10,074 entries under one name."""
    def fn(t):
        grc = grace_from_params(params_for(communicator), transport=t)
        return error_of(lambda: grc.step(torch.randn(10_000 + 37 * t.rank), "w"))
    errors = run_local(3, fn)
    assert all(e == errors[0] for e in errors), errors
    assert "disagree on 'w'" in errors[0]
    assert "numel: rank 0 10000, rank 1 10037, rank 2 10074" in errors[0]


@pytest.mark.parametrize("what,overrides,field", [
    ("density", lambda r: {"compress_ratio": 0.01 * (r + 1)}, "communicator.density: rank 0 0.01, rank 1 0.02"),
    ("algorithm", lambda r: {"communicator": ("spardl", "topka")[r]}, 'communicator.class: rank 0 "SparDL", rank 1 "TopkA"'),
    ("teams", lambda r: {"teams": r + 1} if r == 0 else {"teams": 2}, "communicator.teams: rank 0 1, rank 1 2"),
    ("memory", lambda r: {"memory": ("global_residual", "none")[r]}, 'memory.class: rank 0 "GlobalResidualMemory", rank 1 "NoneMemory"'),
    ("wire", lambda r: {"wire": ("exact", "compact")[r]}, 'communicator.codec.class: rank 0 "IdentityCodec", rank 1 "CompactCodec"'),
    ("masking", lambda r: {"momentum_correction": 0.9, "momentum_masking": r == 0}, "memory.momentum_masking: rank 0 true, rank 1 false"),
])
def test_ranks_with_different_settings_all_raise_naming_the_setting(what, overrides, field):
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl", **overrides(t.rank)}, transport=t)
        return error_of(lambda: grc.step(torch.randn(1000), "w"))
    errors = run_local(2, fn)
    assert errors[0] == errors[1] and field in errors[0], errors


def test_ranks_with_different_dtypes_raise_naming_the_dtype():
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl"}, transport=t)
        dtype = (torch.float32, torch.float64)[t.rank]
        return error_of(lambda: grc.step(torch.randn(1000, dtype=dtype), "w"))
    errors = run_local(2, fn)
    assert 'dtype: rank 0 "torch.float32", rank 1 "torch.float64"' in errors[0] and errors[0] == errors[1]


def test_agreement_costs_one_small_allgather_per_new_name_and_per_change():
    def fn(t):
        counting = CountingTransport(t)
        grc = grace_from_params({**SPARSE, "communicator": "spardl"}, transport=counting)
        checks = []
        for name, density in (("w", None), ("w", None), ("b", None), ("w", 0.02), ("w", None)):
            if density:
                grc.set_density(density)
            counting.reset()
            grc.step(torch.randn(1000), name)
            checks.append([(m.op, m.bytes_sent) for m in counting.messages if m.name.startswith("agree.")])
        return checks
    for checks in run_local(3, fn):
        once = [("allgather", 8 * 2)]  # 8 bytes to each of the 2 others
        assert checks == [once, [], once, once, []]


def test_a_failed_agreement_loses_no_state_and_the_ranks_can_go_on():
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl"}, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        grc.step(torch.randn(1000, generator=g), "w")
        before = grc.memory.residuals["w"].clone()
        error = error_of(lambda: grc.step(torch.randn(1000 + t.rank), "v"))
        kept = torch.equal(grc.memory.residuals["w"], before) and "v" not in grc.memory.residuals
        return error is not None, kept, grc.step(torch.randn(1000, generator=g), "w")
    results = run_local(2, fn)
    assert all(raised and kept for raised, kept, _ in results)
    assert torch.equal(results[0][2], results[1][2])


def test_a_change_on_one_rank_only_fails_in_the_transport_not_silently():
    """Only the rank whose fingerprint changed checks again; the other is already in the
    algorithm's exchange, so the transport reports the mismatch (the local transport at once,
    gloo, MPI and Horovod by their timeout): never a wrong result."""
    from spardl_grace.transport import TransportError

    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl"}, transport=t)
        grc.step(torch.randn(1000), "w")
        try:
            grc.step(torch.randn(1000 + t.rank), "w")
        except TransportError as exc:
            return str(exc)
        return None
    assert all(e and "different sequences of operations" in e for e in run_local(2, fn))


def test_bucket_layouts_must_match_across_ranks():
    """Same parameter names and total size, but the entries split differently."""
    def fn(t):
        grc = grace_from_params({**SPARSE, "communicator": "spardl"}, transport=t)
        bucket = Bucket(("a", "b"), ((400, 600), (600, 400))[t.rank])
        return error_of(lambda: GradientSync(grc).synchronize(torch.randn(1000), bucket))
    errors = run_local(2, fn)
    assert errors[0] == errors[1] and "the layout of bucket" in errors[0]
    assert "numels: rank 0 [400, 600], rank 1 [600, 400]" in errors[0]


# A scenario run by tests/mp_worker.py on real processes: each disagreement in turn, on the same
# transport (an agreement that fails leaves the ranks in step).
def disagreements(transport) -> list[tuple[str | None, float]]:
    rank, out = transport.rank, []
    cases = [
        ({}, torch.randn(10_000 + 37 * rank)),
        ({}, torch.randn(1000, dtype=(torch.float32, torch.float64)[rank % 2])),
        ({"compress_ratio": 0.01 * (rank + 1)}, torch.randn(1000)),
        ({"communicator": ("spardl", "topka", "gtopk")[rank % 3]}, torch.randn(1000)),
    ]
    for i, (overrides, tensor) in enumerate(cases):
        grc = grace_from_params({**SPARSE, "communicator": "spardl", **overrides}, transport=transport)
        start = time.perf_counter()
        out.append((error_of(lambda: grc.step(tensor, f"case{i}")), time.perf_counter() - start))
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi", "horovod-gloo"])
def test_disagreeing_ranks_fail_at_once_under_real_launchers(launch, backend):
    per_rank = launch(backend, 3, "test_agreement.disagreements")
    fields = ["numel: rank 0 10000, rank 1 10037, rank 2 10074",
              'dtype: rank 0 "torch.float32", rank 1 "torch.float64", rank 2 "torch.float32"',
              "communicator.density: rank 0 0.01, rank 1 0.02, rank 2 0.03",
              'communicator.class: rank 0 "SparDL", rank 1 "TopkA", rank 2 "GTopk"']
    for case, field in enumerate(fields):
        errors = [rank[case][0] for rank in per_rank]
        assert all(e == errors[0] for e in errors) and field in errors[0], errors
        # At once, not by the transport's timeout (60 s in tests/mp_worker.py).
        assert max(rank[case][1] for rank in per_rank) < 30


def test_a_disagreement_names_the_jobs_ranks_on_a_subgroup():
    """On one dimension of an FSDP2 mesh the communicator's ranks are not the job's: the
    message named ranks 0 and 1 of the replicas where the processes were the job's 2 and 3."""
    from spardl_grace.agreement import agree

    def fn(t):
        t.global_rank = lambda r: 2 + r
        with pytest.raises(ValueError) as raised:
            agree(CountingTransport(t), "a setting", {"density": 0.01 * (1 + t.rank)})
        return str(raised.value)

    for message in run_local(2, fn):
        assert "density: rank 2 0.01, rank 3 0.02" in message
