"""The peer sparse all-reduces (dense, topka, topkdsa, gtopk, oktopk, gaussiank): consistency,
conservation, dense equivalence, bytes against the cost formulas, real transports."""
from __future__ import annotations

import math

import pytest
import torch

import scenarios
from sparse_checks import (algorithm_messages, check_consistent_and_conserving,
                           check_exact_dense_average, run_steps, sent_bytes)
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.buffers import Scratch
from spardl_grace.communicators.collectives import global_kth_magnitude
from spardl_grace.communicators.exchange import Exchange
from spardl_grace.selection import topk_abs
from spardl_grace.sync import Bucket, GradientSync
from spardl_grace.payload import frame_overhead
from spardl_grace.transport import CountingTransport

PEERS = scenarios.PEERS
SPARSE_PEERS = [p for p in PEERS if p != "dense"]


# ------------------------------------------------------------ consistency and conservation
@pytest.mark.parametrize("comm", PEERS)
@pytest.mark.parametrize("size", range(1, 13))
def test_identical_results_and_conservation(comm, size):
    for n in (0, 1, 2 * size + 1, 997):
        per_rank = run_steps(size, scenarios.peer_params(comm, 0.05), n, steps=4)
        check_consistent_and_conserving(per_rank, size)


@pytest.mark.parametrize("comm", PEERS)
@pytest.mark.parametrize("size", [1, 3, 4, 5, 8])
def test_density_one_is_exactly_the_dense_average(comm, size):
    per_rank = run_steps(size, scenarios.peer_params(comm, 1.0), 301, integer_valued=True)
    check_exact_dense_average(per_rank, size)


@pytest.mark.parametrize("comm", [*SPARSE_PEERS, "spardl"])
def test_a_nan_gradient_reaches_every_ranks_result(comm):
    """A NaN with no inf beside it on one rank, which no threshold comparison passes, is
    selected as torch.topk ranks it (first), through the prefilter of a large tensor and
    through Ok-Topk's reused thresholds alike: every rank's result is non-finite and
    result_is_finite says so, so a GradScaler skips the step instead of the NaN hiding in a
    residual for good."""
    n = 1 << 17

    def fn(t):
        params = {"compressor": "topk", "memory": "global_residual",
                  **scenarios.peer_params(comm, 0.01)}
        grc = grace_from_params(params, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        finite = []
        for step in range(4):
            grad = torch.randn(n, generator=g)
            if step == 2 and t.rank == 1:
                grad[12345] = float("nan")
            result = grc.step(grad, "w")
            finite.append((bool(torch.isfinite(result).all()), grc.result_is_finite(result, "w")))
        return finite
    for finite in run_local(3, fn):
        assert finite == [(True, True), (True, True), (False, False), (False, False)]


# ------------------------------------------------------------------- bytes vs cost formulas
@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_dense_bytes_are_the_ring_allreduce_volume(size):
    n = 1000
    for records in run_steps(size, scenarios.peer_params("dense", 0.01), n, counting=True):
        for rec in records:
            assert sent_bytes(rec) == rec["stats"]["bytes_sent"] == 2 * 4 * n * (size - 1) // size


@pytest.mark.parametrize("comm", ["topka", "gaussiank"])
@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_topka_bytes_are_2k_words_to_each_peer(comm, size):
    n, rho = 1000, 0.05
    k = math.floor(n * rho)
    for records in run_steps(size, scenarios.peer_params(comm, rho, "exact"), n, counting=True):
        for rec in records:
            entries = rec["stats"]["gather_entries"]
            if comm == "topka":
                assert entries == k
            assert sent_bytes(rec) == rec["stats"]["bytes_sent"] == 8 * entries * (size - 1)


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_topkdsa_bytes_match_the_formula(size):
    n, rho = 1200, 0.05
    k = math.floor(n * rho)
    region = math.ceil(n / size)
    for records in run_steps(size, scenarios.peer_params("topkdsa", rho, "exact"), n, counting=True):
        for rec in records:
            stats = rec["stats"]
            # Reduce-scatter: our top-k entries outside our own region, 2 words each.
            assert stats["reduce_payload_bytes"] == 8 * stats["reduce_entries"] <= 8 * k
            # All-gather: our reduced region, sparse or dense, whichever is smaller.
            nnz = stats["gather_entries"]
            assert stats["gather_payload_bytes"] == (size - 1) * min(8 * nnz, 4 * region)
            assert sent_bytes(rec) == stats["bytes_sent"]


@pytest.mark.parametrize("size", [2, 4, 5])
def test_topkdsa_lower_bound_with_identical_supports_and_fill_in(size):
    n, rho = 1200, 0.05
    k = math.floor(n * rho)
    shared = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = [[shared] * 2 for _ in range(size)]
    per_rank = run_steps(size, scenarios.peer_params("topkdsa", rho, "exact"), steps=1, grads=grads,
                         counting=True)
    words = sum(r[0]["stats"]["bytes_sent"] for r in per_rank) / 4 / size
    assert words == pytest.approx(4 * k * (size - 1) / size)  # every support is the same
    # At density 0.5 the summed supports fill the regions: the all-gather goes dense.
    per_rank = run_steps(size, scenarios.peer_params("topkdsa", 0.5, "exact"), n, steps=1,
                         counting=True)
    region = math.ceil(n / size)
    assert all(r[0]["stats"]["gather_payload_bytes"] == 4 * region * (size - 1) for r in per_rank)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_gtopk_bytes_match_the_formula_for_any_p(size):
    n, rho = 1000, 0.05
    k = math.floor(n * rho)
    p = 1 << (size.bit_length() - 1)
    rounds = p.bit_length() - 1
    extra = size - p
    final_message = 8 * k + math.ceil(k / 8) + frame_overhead(2)
    for rank, records in enumerate(run_steps(size, scenarios.peer_params("gtopk", rho, "exact"), n,
                                             counting=True)):
        for rec in records:
            if rank >= p:
                expected = {"fold": 8 * k, "merge": 0, "final": 0}
            else:
                expected = {"fold": 0, "merge": 8 * k * rounds,
                            "final": final_message if rank < extra else 0}
            assert {ph: sent_bytes(rec, {ph}) for ph in expected} == expected
            assert sent_bytes(rec) == rec["stats"]["bytes_sent"]


@pytest.mark.parametrize("size", [2, 3, 5, 6, 7, 8])
def test_gtopk_messages_are_one_round_trip_each_with_the_identity_codec(size):
    """Every set gTop-k sends holds exactly k entries (the fold, each merge, the final set with
    its bitmask), so receivers know the size and no size travels first; with a DeepReduce codec
    the sizes vary and do travel."""
    def fn(t, params):
        counting = CountingTransport(t)
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 **scenarios.peer_params("gtopk", 0.05), **params},
                                transport=counting)
        grc.step(torch.randn(1000, generator=torch.Generator().manual_seed(t.rank)), "w")
        return counting.round_trips, sum(1 for m in counting.messages if m.op == "send")
    assert all(trips == sends for trips, sends in run_local(size, fn, {}))
    coded = run_local(size, fn, {"deepreduce": "index", "index": "delta"})
    assert all(trips > sends for trips, sends in coded)


@pytest.mark.parametrize("size", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("regime", ["exact", "stationary", "error_feedback"])
def test_oktopk_payload_within_6k_words(size, regime):
    """The 6k(P-1)/P bound assumes thresholds that select about k entries. It holds on every
    rank when they are recomputed every step, or reused on a stationary gradient distribution;
    with error feedback building residuals from zero (magnitudes grow for many steps after a
    recomputation) it holds on average, per-rank imbalance taking single ranks up to ~15% over.
    Measured means are about 4k(P-1)/P in all three regimes."""
    n, rho, steps = 4000, 0.02, 12
    k = math.floor(n * rho)
    params = scenarios.peer_params("oktopk", rho)
    params.update({"exact": {"oktopk_threshold_interval": 1},
                   "stationary": {"memory": "none", "oktopk_threshold_interval": 32,
                                  "oktopk_region_interval": 64},
                   "error_feedback": {"oktopk_threshold_interval": 32,
                                      "oktopk_region_interval": 64}}[regime])

    def fn(t):
        transport = CountingTransport(t)
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual", **params},
                                transport=transport)
        g = torch.Generator().manual_seed(t.rank)
        out = []
        for _ in range(steps):
            transport.reset()
            grc.step(torch.randn(n, generator=g), "w")
            out.append({"messages": algorithm_messages(transport), "stats": dict(grc.last_stats)})
        return out
    records = [rec for per_rank in run_local(size, fn) for rec in per_rank]
    words = [sent_bytes(rec, {"reduce", "gather"}) / 4 for rec in records]
    bound = 6 * k * (size - 1) / size
    assert (max(words) if regime != "error_feedback" else sum(words) / len(words)) <= bound
    for rec in records:
        assert sent_bytes(rec) == rec["stats"]["bytes_sent"]
        # Threshold checks, the radix select and the region all-reduce: small, independent of k.
        assert sent_bytes(rec, {"threshold", "regions"}) <= 2 * 8 * (2 + 8 * 16 + size)


# ------------------------------------------------------------------------------ gTop-k
def test_gtopk_exact_rule_keeps_a_contribution_dropped_mid_way():
    """P = 4, k = 1. Round 0 merges {0: 5} (rank 0) with {1: 6} (rank 1) and drops index 0;
    ranks 2 and 3 merge {0: 4} and {0: 3} into {0: 7}, which wins round 1. Index 0 is finally
    selected, but without rank 0's 5: the paper's rule zeroes it anyway (mass lost); the exact
    rule gives it back to rank 0."""
    grads = [[torch.tensor([5.0, 0, 0])], [torch.tensor([0.0, 6, 0])],
             [torch.tensor([4.0, 0, 0])], [torch.tensor([3.0, 0, 0])]]
    for rule, rank0_residual in [("exact", [5.0, 0, 0]), ("paper", [0.0, 0, 0])]:
        params = {"communicator": "gtopk", "compress_ratio": 0.34, "gtopk_residual": rule}
        per_rank = run_steps(4, params, steps=1, grads=grads)
        assert torch.equal(per_rank[0][0]["result"], torch.tensor([7 / 4, 0, 0]))
        assert per_rank[0][0]["residual"].tolist() == rank0_residual
        compensated = sum(r[0]["compensated"] for r in per_rank)
        kept = sum(r[0]["residual"] for r in per_rank)
        lost = float((compensated - 4 * per_rank[0][0]["result"] - kept).sum())
        assert lost == (0.0 if rule == "exact" else 5.0)


@pytest.mark.parametrize("size", [3, 5, 6, 7])
def test_gtopk_selects_the_global_top_k_when_supports_are_shared(size):
    """With identical gradients no merge ever drops a partial sum, so gTop-k must find the
    exact global top-k of the sum (the reference code fails outright for these P)."""
    n, rho = 500, 0.04
    k = math.floor(n * rho)
    shared = torch.randn(n, generator=torch.Generator().manual_seed(11))
    per_rank = run_steps(size, {"communicator": "gtopk", "compress_ratio": rho, "wire": "exact"},
                         steps=1,
                         grads=[[shared] for _ in range(size)])
    result = per_rank[0][0]["result"]
    expected = torch.zeros(n)
    top = torch.topk(shared.abs(), k).indices
    expected[top] = shared[top]  # the sum of P copies, divided by P
    assert torch.allclose(result, expected, atol=1e-6)
    check_consistent_and_conserving(per_rank, size)


# ------------------------------------------------------------------------------ Ok-Topk
def test_oktopk_exact_thresholds_select_exactly_k():
    """Recomputing both thresholds every step (tau = 1) selects exactly k entries globally
    (random floats have no ties)."""
    n, rho, size = 2000, 0.03, 4
    k = math.floor(n * rho)
    params = {"communicator": "oktopk", "compress_ratio": rho, "oktopk_threshold_interval": 1,
              "wire": "exact"}
    for step in range(4):
        counts = [torch.count_nonzero(r[step]["result"]) for r in run_steps(size, params, n, steps=4)]
        assert all(c == k for c in counts)


def test_oktopk_balanced_regions_follow_a_skewed_gradient():
    """Large entries only in the first 5% of the tensor: equal regions would send nearly every
    entry to rank 0. The recomputed boundaries split the selected entries about evenly."""
    n, rho, size = 8000, 0.02, 4
    def skewed(rank, step):
        g = torch.Generator().manual_seed(100 * rank + step)
        grad = torch.randn(n, generator=g) * 0.01
        grad[: n // 20] += torch.randn(n // 20, generator=g) * 10
        return grad
    grads = [[skewed(r, s) for s in range(6)] for r in range(size)]
    params = {"communicator": "oktopk", "compress_ratio": rho, "oktopk_threshold_interval": 3,
              "oktopk_region_interval": 2}
    per_rank = run_steps(size, params, steps=6, grads=grads)
    check_consistent_and_conserving(per_rank, size)
    offsets = per_rank[0][-1]["grc"].region_offsets("w")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and offsets[-1] == n and all(length >= 0 for length in lengths)
    assert offsets[-2] < n // 20, f"regions {offsets} ignore where the large entries are"
    for step in range(6):
        owned = [r[step]["stats"]["gather_entries"] for r in per_rank]
        assert max(owned) <= 2.5 * (sum(owned) / size), f"step {step}: unbalanced {owned}"


def test_oktopk_dense_warmup():
    n, size = 300, 3
    params = {"communicator": "oktopk", "compress_ratio": 0.01, "oktopk_warmup_steps": 2}
    per_rank = run_steps(size, params, n, steps=3, integer_valued=True)
    for step in range(2):
        total = sum(r[step]["compensated"] for r in per_rank)
        assert torch.equal(per_rank[0][step]["result"] * size, total)
        assert per_rank[0][step]["stats"]["dense_entries"] == n
    assert torch.count_nonzero(per_rank[0][2]["result"]) < n // 10


def test_oktopk_resumes_bit_identically_from_a_checkpoint(tmp_path):
    n, size = 1000, 3
    params = {"memory": "global_residual", "compressor": "topk", "communicator": "oktopk",
              "compress_ratio": 0.05, "oktopk_threshold_interval": 3, "oktopk_region_interval": 2}

    def grads(rank):
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(n, generator=g) for _ in range(6)]

    def fn(t):
        straight = grace_from_params(params, transport=t)
        expected = [straight.step(x, "w") for x in grads(t.rank)]
        first = grace_from_params(params, transport=t)
        for x in grads(t.rank)[:3]:
            first.step(x, "w")
        path = tmp_path / f"rank{t.rank}.pt"
        torch.save(first.state_dict(), path)
        resumed = grace_from_params(params, transport=t)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        got = [resumed.step(x, "w") for x in grads(t.rank)[3:]]
        return all(torch.equal(a, b) for a, b in zip(expected[3:], got))
    assert run_local(size, fn) == [True] * size


# ------------------------------------------------------------------- radix select, params
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_global_kth_magnitude_is_exact(dtype):
    size = 3
    pieces = [torch.randn(50 + 7 * r, generator=torch.Generator().manual_seed(r)).to(dtype)
              for r in range(size)]
    everything = torch.cat(pieces).abs()

    def kth(t, k):
        ex = Exchange(t, "x")
        with ex.phase("threshold"):
            return global_kth_magnitude(ex, pieces[t.rank], k)
    for k in (1, 2, 17, everything.numel()):
        expected = torch.sort(everything, descending=True).values[k - 1]
        got = run_local(size, kth, k)
        assert all(g.dtype == dtype and g == expected for g in got), (k, got, expected)
    got = run_local(size, kth, everything.numel() + 1)
    assert all(g == 0 for g in got)


@pytest.mark.parametrize("params,match", [
    ({"communicator": "gtopk", "gtopk_residual": "tree"}, "gtopk_residual rule 'tree'.*exact, paper"),
    ({"communicator": "oktopk", "oktopk_warmup_steps": -1}, "oktopk_warmup_steps must be an int >= 0"),
    ({"communicator": "oktopk", "oktopk_threshold_interval": 0}, "oktopk_threshold_interval must be"),
    ({"communicator": "oktopk", "oktopk_local_scale": 1.0}, "oktopk_local_scale must be a number > 1"),
    ({"communicator": "dense", "compressor": "qsgd"}, "communicator 'dense' sends the uncompressed"),
    ({"communicator": "topkdsa", "compressor": "randomk"}, "use compressor 'topk'"),
    ({"communicator": "topka", "memory": "dgc"}, "needs memory in"),
    ({"communicator": "gtopkk"}, "unknown communicator 'gtopkk'.*gtopk.*oktopk.*topka.*topkdsa"),
])
def test_bad_peer_params_raise(params, match):
    with pytest.raises(ValueError, match=match):
        run_local(1, lambda t: grace_from_params({"compressor": "topk", "memory": "global_residual",
                                                  **params}, transport=t))


# ------------------------------------------------------------------------ real transports
@pytest.mark.parametrize("backend,size", [("gloo", 3), ("gloo", 4), ("mpi", 3), ("horovod-gloo", 3)])
def test_peers_on_real_transports(launch, backend, size):
    results = launch(backend, size, "peer_steps")
    local = run_local(size, scenarios.peer_steps)[0]
    for i, first in enumerate(results[0]):
        records = [r[i] for r in results]
        assert all(torch.equal(r["result"], first["result"]) for r in records), first["case"]
        compensated = sum(r["grad"] + r["old_residual"] for r in records)
        kept = sum(r["residual"] for r in records)
        assert torch.allclose(compensated, size * first["result"] + kept, atol=1e-4), first["case"]
        assert torch.allclose(first["result"], local[i]["result"], atol=1e-6), first["case"]


# ------------------------------------------------------------- reused selection buffers
class _FreshScratch(Scratch):
    """Every get() a new tensor: selection as it ran before its buffers were reused."""

    def get(self, purpose, numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)


@pytest.mark.parametrize("comm", ["spardl", "topka", "topkdsa", "gtopk"])
def test_reused_selection_buffers_leave_results_bit_identical(comm):
    """Large enough for the prefiltered top-k (whose magnitudes and mask go to the scratch
    buffers), with sizes that change between names: the same bits as fresh buffers."""
    def fn(t, fresh):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **scenarios.peer_params(comm, 0.01)}, transport=t)
        if fresh:
            grc.scratch = _FreshScratch()
        g = torch.Generator().manual_seed(7 + t.rank)
        return [grc.step(torch.randn(n, generator=g), name)
                for _ in range(3) for name, n in (("a", 300_001), ("b", 150_000))]
    reused = run_local(3, fn, False)
    fresh = run_local(3, fn, True)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(reused[r], fresh[r]))


def test_topk_abs_with_scratch_is_topk_abs():
    scratch, g = Scratch(), torch.Generator().manual_seed(0)
    for n, k in ((100_000, 1000), (70_000, 9000), (200_000, 10), (1000, 5)):
        x = torch.randn(n, generator=g)
        assert torch.equal(topk_abs(x, k, scratch), topk_abs(x, k))
        assert torch.equal(torch.sort(topk_abs(x, k)).values,
                           torch.sort(torch.topk(x.abs(), k).indices).values)


def test_results_are_new_tensors_unless_the_caller_consumes_them():
    """GRACE's loop may keep a result; DistributedOptimizer and the DDP hook copy it first,
    so GradientSync lets the communicator return the same buffer each step."""
    def fn(t):
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "communicator": "spardl", "compress_ratio": 0.1}, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        first = grc.step(torch.randn(1000, generator=g), "w")
        kept = first.clone()
        second = grc.step(torch.randn(1000, generator=g), "w")
        assert torch.equal(first, kept) and first.data_ptr() != second.data_ptr()
        GradientSync(grc)
        third = grc.step(torch.randn(1000, generator=g), "w")
        fourth = grc.step(torch.randn(1000, generator=g), "w")
        return third.data_ptr() == fourth.data_ptr()
    assert run_local(2, fn) == [True, True]


@pytest.mark.parametrize("comm", ["spardl", "topka", "topkdsa", "gtopk", "oktopk"])
def test_reused_result_buffers_leave_results_bit_identical(comm):
    def fn(t, reuse):
        sync = GradientSync(grace_from_params({"memory": "global_residual", "compressor": "topk",
                                               **scenarios.peer_params(comm, 0.05)}, transport=t))
        sync.grace.reuse_results = reuse
        bucket = Bucket(("a", "b"), (700, 301))
        g = torch.Generator().manual_seed(3 + t.rank)
        return [sync.synchronize(torch.randn(1001, generator=g), bucket).clone() for _ in range(4)]
    reused, fresh = run_local(3, fn, True), run_local(3, fn, False)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(reused[r], fresh[r]))
