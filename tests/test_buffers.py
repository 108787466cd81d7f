"""Reused buffers: the pool never hands out what someone holds, reuse leaves every result
bit-identical, and the integrations really reuse (no gradient-sized allocation per step)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scenarios
from spardl_grace import DistributedOptimizer, Memory, grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.api import all_finite
from spardl_grace.buffers import BufferPool
from spardl_grace.selection import sparse_nonzero
from spardl_grace.memories.none import NoneMemory
from spardl_grace.memories.residual import ResidualMemory
from spardl_grace.sync import Bucket, GradientSync, per_parameter_stores


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.floats(0.0, 1.0), st.integers(0, 9))
def test_sparse_nonzero_is_torch_nonzero(n, share, offset):
    g = torch.Generator().manual_seed(n * 31 + offset)
    mask = torch.rand(n + offset, generator=g) < share
    view = mask[offset:]  # misaligned views take torch.nonzero's path, aligned the word scan
    assert torch.equal(sparse_nonzero(view), torch.nonzero(view).reshape(-1))


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_the_pool_hands_a_buffer_out_again_only_once_nothing_holds_it():
    pool = BufferPool()
    first = pool.take("a", 100, torch.float32, torch.device("cpu"), slots=2)
    address = storage(first)
    kept = first[10:20]  # a view keeps the storage held
    del first
    second = pool.take("a", 100, torch.float32, torch.device("cpu"), slots=2)
    assert storage(second) != address
    del kept
    third = pool.take("a", 100, torch.float32, torch.device("cpu"), slots=2)
    assert storage(third) == address
    # With every slot held, a new tensor; the held ones are never overwritten.
    third.fill_(1.0)
    fourth = pool.take("a", 100, torch.float32, torch.device("cpu"), slots=2)
    fifth = pool.take("a", 100, torch.float32, torch.device("cpu"), slots=2)
    assert len({storage(t) for t in (second, third, fourth, fifth)}) == 4
    assert torch.equal(third, torch.ones(100))
    # Another size, dtype or purpose never shares a buffer.
    assert storage(pool.take("a", 99, torch.float32, torch.device("cpu"))) not in \
        {storage(t) for t in (second, third, fourth, fifth)}


class _FreshPool(BufferPool):
    """Every take() a new tensor: the algorithms as they ran before their buffers were pooled."""

    def take(self, purpose, numel, dtype, device, slots=1):
        return torch.empty(numel, dtype=dtype, device=device)


@pytest.mark.parametrize("comm,extra", [("spardl", {}), ("spardl", {"teams": 3}),
                                        ("spardl", {"momentum_correction": 0.9}),
                                        ("topka", {}), ("topkdsa", {}), ("gtopk", {}),
                                        ("oktopk", {})])
def test_pooled_buffers_leave_results_and_residuals_bit_identical(comm, extra):
    def fn(t, fresh):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **scenarios.peer_params(comm, 0.05), **extra}, transport=t)
        if fresh:
            grc.pool = grc.memory._pool = _FreshPool()
        sync = GradientSync(grc)
        bucket = Bucket(("a", "b"), (70_001, 29_999))
        g = torch.Generator().manual_seed(5 + t.rank)
        out = []
        for _ in range(5):
            out.append(sync.synchronize(torch.randn(100_000, generator=g), bucket).clone())
            out.extend(grc.memory.residuals[n].clone() for n in bucket.names)
        return out
    pooled, fresh = run_local(3, fn, False), run_local(3, fn, True)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(pooled[r], fresh[r]))


def test_steps_reuse_their_gradient_sized_buffers():
    """SparDL's working copy cycles through two buffers (one is the residual the memory still
    holds), the memory writes the compensated gradient straight into it (no buffer of its own),
    and the optimizer's flat gradient reuses one buffer."""
    def fn(t):
        model = torch.nn.Linear(300, 200)
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 "communicator": "spardl", "compress_ratio": 0.05}, transport=t)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                   named_parameters=model.named_parameters(), overlap=False)
        residuals, flats = set(), set()
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(4, 300)).square().sum().backward()
            opt.synchronize()
            opt.step()
            residuals.add(storage(grc.memory.residuals["weight"]))
            flats.update(storage(b) for b in opt._flat_pool._slots[opt.buckets[0].key])
        return len(residuals), len(flats), dict(grc.memory._pool._slots)
    assert run_local(2, fn) == [(2, 1, {}), (2, 1, {})]


@pytest.mark.parametrize("comm", ["topka", "gaussiank", "topkdsa", "gtopk", "oktopk"])
def test_every_sparse_allreduce_works_in_two_pooled_buffers(comm):
    """As SparDL's: the memory writes the compensated gradient straight into the algorithm's
    working buffer (no buffer of its own), the residual is that buffer, cycling through two,
    and results reused under GradientSync stay in one buffer."""
    def fn(t):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **scenarios.peer_params(comm, 0.05)}, transport=t)
        sync, bucket = GradientSync(grc), Bucket(("a",), (1000,))
        g = torch.Generator().manual_seed(t.rank)
        residuals, results = set(), set()
        for _ in range(6):
            results.add(storage(sync.synchronize(torch.randn(1000, generator=g), bucket)))
            residuals.add(storage(grc.memory.residuals["a"]))
        return len(residuals), len(results), dict(grc.memory._pool._slots)
    assert run_local(2, fn) == [(2, 1, {}), (2, 1, {})]


@pytest.mark.parametrize("comm", ["spardl", "topka", "topkdsa", "gtopk", "oktopk"])
def test_grace_steps_never_overwrite_a_result_the_caller_keeps(comm):
    """Through GRACE's step() every result is the caller's: a result dropped before the next
    step has its buffer reused (no page faults of a fresh gradient-sized tensor), one still
    held keeps its values."""
    def fn(t):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **scenarios.peer_params(comm, 0.05)}, transport=t)
        g = torch.Generator().manual_seed(t.rank)
        kept = grc.step(torch.randn(5000, generator=g), "w")
        copy = kept.clone()
        dropped = set()
        for _ in range(4):
            dropped.add(storage(grc.step(torch.randn(5000, generator=g), "w")))
        pooled = {storage(b) for b in grc.pool._slots["result.w"]}
        return torch.equal(kept, copy), storage(kept) in dropped, len(dropped), dropped <= pooled
    assert run_local(3, fn) == [(True, False, 1, True)] * 3


@pytest.mark.parametrize("comm", ["spardl", "topka", "gtopk", "oktopk", "topkdsa"])
def test_lent_results_are_zeroed_where_written_and_checked_there(comm):
    """With reuse_results, a sparse all-reduce zeroes again only where its last result was
    written; the results are those of fresh zeros (compared with reuse off), and
    result_is_finite() agrees with a full check, also when a rank's gradient holds an inf or
    a NaN."""
    def fn(t, reuse):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **scenarios.peer_params(comm, 0.05)}, transport=t)
        grc.reuse_results = reuse
        g = torch.Generator().manual_seed(t.rank)
        out = []
        for step in range(6):
            grad = torch.randn(20_000, generator=g)
            if t.rank == 1 and step in (2, 4):
                grad[7 * step] = float("inf") if step == 2 else float("nan")
            result = grc.step(grad, "w")
            out.append((result.clone(), grc.result_is_finite(result, "w"), all_finite(result)))
            grc.memory.residuals["w"].nan_to_num_(0.0, 0.0, 0.0)  # go on after the bad steps
        return out
    lent, fresh = run_local(3, fn, True), run_local(3, fn, False)
    for r in range(3):
        for (a, finite, full), (b, _, _) in zip(lent[r], fresh[r]):
            assert torch.equal(a.nan_to_num(0.0, 1.0, -1.0), b.nan_to_num(0.0, 1.0, -1.0))
            assert finite == full
    assert [full for _, _, full in lent[0]][:4] == [True, True, False, True]  # the inf counts


class _UsersMemory(Memory):
    """A memory as a GRACE user writes one: compensate only."""

    def compensate(self, tensor, name):
        return tensor * 2


@pytest.mark.parametrize("memory", [
    lambda: ResidualMemory(), lambda: ResidualMemory(beta=0.5, gamma=2.0),
    lambda: ResidualMemory(momentum_correction=0.9), lambda: ResidualMemory(local_clip_norm=0.1),
    lambda: NoneMemory(), lambda: _UsersMemory()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compensate_into_gives_what_compensate_gives(memory, dtype):
    """Into `out` where the dtype allows (float16 gradients compensate in float32), else the
    result itself; the same bits either way, with and without a residual."""
    plain, into = memory(), memory()
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        grad = torch.randn(6, 5, generator=g).to(dtype)
        expected = plain.compensate(grad, "w")
        out = torch.empty(6, 5)
        got = into.compensate_into(grad, "w", out)
        assert torch.equal(got, expected) and got.dtype == expected.dtype
        assert (got.data_ptr() == out.data_ptr()) == (expected.dtype == torch.float32)
        for m in (plain, into):
            if isinstance(m, ResidualMemory):
                m.store_residual("w", expected.float() * 0.5, expected.float())


def test_a_bucket_of_back_to_back_residuals_is_not_copied():
    def fn(t):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 "communicator": "spardl", "compress_ratio": 0.05}, transport=t)
        sync, bucket = GradientSync(grc), Bucket(("a", "b"), (700, 300))
        sync.synchronize(torch.randn(1000), bucket)
        parts = [grc.memory.residuals[n] for n in bucket.names]
        with per_parameter_stores(grc.memory, bucket):
            whole = grc.memory.residuals[bucket.key]
            joined = whole.data_ptr() == parts[0].data_ptr() \
                and torch.equal(whole, torch.cat(parts))
        # Parts from elsewhere (not one tensor) are concatenated, and the result is the same.
        grc.memory.residuals["a"] = parts[0].clone()
        with per_parameter_stores(grc.memory, bucket):
            copied = grc.memory.residuals[bucket.key]
            concatenated = copied.data_ptr() != parts[0].data_ptr() \
                and torch.equal(copied, torch.cat(parts))
        return joined, concatenated
    assert run_local(2, fn) == [(True, True), (True, True)]
