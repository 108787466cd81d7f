"""GradientSync's asynchronous core: submit() returns a pending torch future while the
communication thread works, results are bit for bit those of synchronize(), a failed bucket
fails the rest of its step at once, and end_step() counts only whole steps. Ranks are threads
(run_local) with a transport that holds every message until the test opens a gate."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

import training_scenarios as ts
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.sync import Bucket, GradientSync
from spardl_grace.transport import TransportTimeout
from spardl_grace.transport.base import QueuedOp

BUCKETS = [Bucket(("a", "b"), (300, 200)), Bucket(("c",), (700,))]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(b.numel, generator=g) for b in BUCKETS]


def _sync(transport, overlap: bool) -> GradientSync:
    return GradientSync(grace_from_params(ts.params_for("spardl", 0.1), transport=transport),
                        overlap=overlap)


def _gated_step(sync, reference, gate, rank, step):
    """One step submitted to `sync` while the gate holds its messages, then opened; the
    futures' pending flags on return, their results, and `reference`'s synchronize()."""
    futures = [sync.submit(g.clone(), b) for g, b in zip(_grads(rank, step), BUCKETS)]
    pending = [not f.done() for f in futures]
    gate.set()
    sync.end_step()
    gate.clear()
    expected = [reference.synchronize(g, b) for g, b in zip(_grads(rank, step), BUCKETS)]
    reference.end_step()
    return pending, [f.wait() for f in futures], expected


def test_submit_is_pending_until_the_exchange_ends_and_equals_synchronize():
    def fn(t):
        gate = threading.Event()
        sync = _sync(ts._GatedTransport(t, gate), overlap=True)
        reference = _sync(t, overlap=False)
        out = []
        for step in range(3):
            out.append(_gated_step(sync, reference, gate, t.rank, step))
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


class _QueuingTransport(ts._GatedTransport):
    """Queues all-reduces as a backend does (torch.distributed's gloo): one worker per rank
    runs them in order once the gate is open; wait() gives up after `timeout` seconds. Other
    messages go straight through."""

    queues_collectives = True

    def __init__(self, inner, gate: threading.Event, timeout: float = 60):
        super().__init__(inner, gate)
        self.timeout = timeout
        self.callers: set[str] = set()
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def _hold(self) -> None:
        self.threads.add(threading.current_thread().name)

    def _work(self) -> None:
        while True:
            tensor, name, future, done = self.jobs.get()
            self.gate.wait(120)
            try:
                tensor.copy_(self.inner.allreduce(tensor, name))
                future.set_result(tensor)
            except BaseException as exc:
                future.set_exception(exc)
            done.set()

    def allreduce_async_(self, tensor, name):
        self.callers.add(threading.current_thread().name)
        future, done = torch.futures.Future(), threading.Event()
        self.jobs.put((tensor, name, future, done))

        def wait():
            if not done.wait(self.timeout):
                raise TransportTimeout(f"rank {self.rank}: '{name}' timed out")
        return QueuedOp(future, wait)


DENSE = {"compressor": "none", "memory": "none", "communicator": "dense"}


@pytest.mark.parametrize("params,warmup", [(DENSE, 0), (ts.params_for("spardl", 0.1), 2)],
                         ids=["dense", "spardl-dense-warm-up"])
def test_dense_steps_are_queued_in_the_backend_with_the_same_bits(params, warmup):
    """Where the transport queues collectives, a step whose buckets are all dense averages
    queues each bucket's all-reduce from the submitting thread (pending until the backend runs
    it) instead of using the communication thread; after SparDL's dense warm-up the thread
    takes over. Results are bit for bit those of the unqueued path."""
    def fn(t):
        gate = threading.Event()
        queuing = _QueuingTransport(t, gate)
        sync = GradientSync(grace_from_params(params, transport=queuing), warmup, overlap=True)
        reference = GradientSync(grace_from_params(params, transport=t), warmup, overlap=False)
        out = []
        for step in range(4):
            out.append((*_gated_step(sync, reference, gate, t.rank, step),
                        sync.last_stats["comm_s"]))
        return out, queuing.callers, queuing.threads

    for steps, callers, threads in run_local(3, fn):
        queued_steps = 4 if warmup == 0 else warmup
        for step, (pending, got, expected, comm_s) in enumerate(steps):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            if step < queued_steps:
                assert pending == [True, True] and comm_s == 0
        assert len(callers) == 1 and not any(c.startswith("spardl-comm") for c in callers)
        # The thread communicates only in SparDL's sparse steps.
        assert any(name.startswith("spardl-comm") for name in threads) == (warmup > 0)


def test_a_queued_all_reduce_that_never_completes_times_out_and_drops_the_step():
    """A peer that never joins a queued all-reduce: the step's futures fail with
    TransportTimeout within the transport's timeout, not a hang, and the step does not count."""
    def fn(t):
        gate = threading.Event()
        sync = GradientSync(grace_from_params(DENSE, transport=_QueuingTransport(t, gate, 0.5)),
                            overlap=True)
        futures = [sync.submit(g, b) for g, b in zip(_grads(t.rank, 0), BUCKETS)]
        started = time.monotonic()
        sync.end_step()
        waited = time.monotonic() - started
        errors = []
        for future in futures:
            with pytest.raises(TransportTimeout) as caught:
                future.wait()
            errors.append(str(caught.value))
        gate.set()  # the backend runs them late: the futures keep their errors
        return errors, waited, sync.steps

    for errors, waited, steps in run_local(2, fn):
        assert all("timed out" in e for e in errors) and len(errors) == 2
        assert waited < 30 and steps == 0
