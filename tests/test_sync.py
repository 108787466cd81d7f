"""GradientSync's asynchronous core: submit() returns a pending torch future while the
communication thread works, results are bit for bit those of synchronize(), a failed bucket
fails the rest of its step at once, and end_step() counts only whole steps. Ranks are threads
(run_local) with a transport that holds every message until the test opens a gate."""
from __future__ import annotations

import threading

import pytest
import torch

import training_scenarios as ts
from spardl_grace import grace_from_params, run_local
from spardl_grace.sync import Bucket, GradientSync

BUCKETS = [Bucket(("a", "b"), (300, 200)), Bucket(("c",), (700,))]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(b.numel, generator=g) for b in BUCKETS]


def _sync(transport, overlap: bool) -> GradientSync:
    return GradientSync(grace_from_params(ts.params_for("spardl", 0.1), transport=transport),
                        overlap=overlap)


def test_submit_is_pending_until_the_exchange_ends_and_equals_synchronize():
    def fn(t):
        gate = threading.Event()
        sync = _sync(ts._GatedTransport(t, gate), overlap=True)
        reference = _sync(t, overlap=False)
        out = []
        for step in range(3):
            futures = [sync.submit(g, b) for g, b in zip(_grads(t.rank, step), BUCKETS)]
            pending = [not f.done() for f in futures]
            gate.set()
            sync.end_step()
            gate.clear()
            expected = [reference.synchronize(g, b) for g, b in zip(_grads(t.rank, step), BUCKETS)]
            reference.end_step()
            out.append((pending, [f.wait() for f in futures], expected))
        return out, sync.steps, sync.last_stats, reference.last_stats

    for steps, count, stats, reference_stats in run_local(3, fn):
        assert count == 3
        for pending, got, expected in steps:
            assert pending == [True, True]
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert stats["bytes_sent"] == reference_stats["bytes_sent"] > 0


def test_without_overlap_submit_returns_a_completed_future():
    def fn(t):
        sync = _sync(t, overlap=False)
        futures = [sync.submit(g, b) for g, b in zip(_grads(t.rank, 0), BUCKETS)]
        done = [f.done() for f in futures]
        sync.end_step()
        return done, sync.asynchronous

    assert all(r == ([True, True], False) for r in run_local(2, fn))


def test_a_failed_bucket_fails_the_rest_of_its_step_at_once_and_the_next_step_works():
    def fn(t):
        sync = _sync(t, overlap=True)
        bad = sync.submit(torch.zeros(3), BUCKETS[0])  # the wrong size for the bucket
        later = sync.submit(_grads(t.rank, 0)[1], BUCKETS[1])
        errors = []
        for future in (bad, later):
            with pytest.raises(ValueError) as caught:
                future.wait()
            errors.append(str(caught.value))
        sync.end_step()
        after_failure = (sync.steps, dict(sync.last_stats))
        futures = [sync.submit(g, b) for g, b in zip(_grads(t.rank, 1), BUCKETS)]
        sync.end_step()
        return errors, after_failure, [f.wait().numel() for f in futures], sync.steps

    for errors, after_failure, numels, steps in run_local(2, fn):
        assert errors[0] == errors[1] and "holds 500 entries, got a buffer of shape (3,)" in errors[0]
        assert after_failure == (0, {})  # the failed step does not count
        assert numels == [500, 700] and steps == 1


@pytest.mark.parametrize("params", [
    ts.params_for("spardl", 0.1),
    {"compressor": "topk", "memory": "residual", "communicator": "allgather",
     "compress_ratio": 0.1},
], ids=["spardl", "grace-allgather"])
def test_send_step_returns_a_real_handle_when_overlapping(params):
    """GRACE's Horovod-style send_step/receive_step: with overlap() the handle is pending while
    the communication thread exchanges, and the results are step()'s, bit for bit."""
    def fn(t):
        gate = threading.Event()
        overlapped = grace_from_params(params, transport=ts._GatedTransport(t, gate))
        plain = grace_from_params(params, transport=t)
        assert overlapped.overlap() is True
        g = torch.Generator().manual_seed(t.rank)
        grads = [torch.randn(600, generator=g) for _ in range(3)]
        sent = [overlapped.send_step(x, f"w{i}") for i, x in enumerate(grads)]
        pending = [not handle.done() for handle, _ in sent]
        gate.set()
        got = [overlapped.receive_step(handle, ctx) for handle, ctx in sent]
        expected = [plain.step(x, f"w{i}") for i, x in enumerate(grads)]
        handle, ctx = plain.send_step(grads[0], "w0")
        return pending, got, expected, handle.done(), overlapped.overlap(False)

    for pending, got, expected, plain_done, still_on in run_local(3, fn):
        assert pending == [True, True, True] and plain_done and not still_on
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_failed_overlapped_step_raises_from_receive_step():
    def fn(t):
        grc = grace_from_params(ts.params_for("spardl", 0.1), transport=t)
        grc.overlap()
        handle, ctx = grc.send_step(torch.randn(10), "w")
        grc.receive_step(handle, ctx)
        bad, ctx = grc.send_step(torch.randn(11), "w")  # another size for the same name
        with pytest.raises(ValueError, match="one name must always carry the same tensor"):
            grc.receive_step(bad, ctx)
        return True

    assert all(run_local(1, fn))
