"""The integrations: DistributedOptimizer (Horovod-style), the DDP comm hook, launchers,
checkpoint and resume, mixed precision, and a worker dying mid-training."""
from __future__ import annotations

import multiprocessing as mp
import time
import warnings

import pytest
import torch

import training_scenarios as ts
from spardl_grace import DistributedOptimizer, broadcast_parameters, grace_from_params
from spardl_grace.transport import TransportError, run_local
from spardl_grace.sync import Bucket, GradientSync


def assert_identical(per_rank: list[torch.Tensor]) -> None:
    for rank, t in enumerate(per_rank):
        assert torch.equal(t, per_rank[0]), f"rank {rank} differs from rank 0"


def assert_loss_falls(losses: torch.Tensor) -> None:
    assert losses[-5:].mean() < 0.8 * losses[:5].mean(), losses.tolist()


# ------------------------------------------------------------------- DistributedOptimizer
@pytest.mark.parametrize("algorithm", sorted(ts.ALGORITHMS))
def test_optimizer_trains_identical_replicas_local(algorithm):
    results = run_local(3, lambda t: ts.optimizer_training(t, (algorithm,))[algorithm])
    assert_identical([r["params"] for r in results])
    for r in results:
        assert_loss_falls(r["losses"])


def test_wrapped_optimizer_is_still_the_users_optimizer():
    def fn(t):
        model = ts.mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = DistributedOptimizer(sgd, grace_from_params(ts.params_for("spardl"), transport=t),
                                   named_parameters=model.named_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ts.train(model, opt, t.rank, t.size, 4)
        for _ in range(4):
            scheduler.step()
        plain = torch.optim.SGD(ts.mlp().parameters(), lr=1.0, momentum=0.9)
        plain.load_state_dict(opt.state_dict())
        return isinstance(opt, torch.optim.SGD), opt.param_groups[0]["lr"], plain.param_groups[0]["lr"]
    for is_sgd, lr, loaded_lr in run_local(2, fn):
        assert is_sgd and lr == pytest.approx(0.025) and loaded_lr == pytest.approx(0.025)


def test_a_scheduler_built_before_the_wrap_steps_the_synchronised_optimizer():
    """torch's LRScheduler replaces optimizer.step on the instance to record that it stepped;
    copied into the wrapper, that step shadowed the wrapper's and stepped the plain optimizer,
    unsynchronised (the next zero_grad then said step() had not been called). Built on the
    plain optimizer before the wrap or after it, or on the wrapper, the scheduler steps with a
    synchronised step, to the same bits, and torch does not warn that the scheduler stepped
    before the optimizer."""
    import warnings

    def fn(t, where):
        model = ts.mlp()
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if where == "plain, before the wrap":
            scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda k: 1 / (1 + k))
        opt = DistributedOptimizer(adamw, grace_from_params(ts.params_for("spardl"), transport=t),
                                   named_parameters=model.named_parameters())
        if where != "plain, before the wrap":
            on = adamw if where == "plain, after the wrap" else opt
            scheduler = torch.optim.lr_scheduler.LambdaLR(on, lambda k: 1 / (1 + k))
        for x, y in ts.batches(t.rank, t.size, 3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            scheduler.step()
        return opt._sync.steps, opt.param_groups[0]["lr"], ts.flat_params(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {where: run_local(2, fn, where) for where in
                ("plain, before the wrap", "plain, after the wrap", "the wrapper")}
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    reference = runs["the wrapper"][0][2]
    for where, ranks in runs.items():
        for steps, lr, params in ranks:
            assert (steps, lr) == (3, pytest.approx(1e-3 / 4)), where
            assert torch.equal(params, reference), where


def test_a_step_replaced_on_the_optimizer_instance_is_refused():
    def fn(t):
        sgd = torch.optim.SGD(ts.mlp().parameters(), lr=0.1)
        sgd.step = lambda closure=None: None
        with pytest.raises(TypeError, match="step was replaced on the instance"):
            DistributedOptimizer(sgd, grace_from_params(ts.params_for("spardl"), transport=t))

    run_local(1, fn)


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.01, 1e-6])
def test_spardl_at_density_one_gives_the_exact_average_for_any_bucketing(bucket_cap_mb):
    """rho = 1 selects everything: synchronize() must write exactly the average into every
    .grad and leave no residual, whatever the bucketing (1e-6 MB: one bucket per parameter).
    Integer-valued gradients make every partial sum exact, in any order."""
    def fn(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl", 1.0), transport=t),
                                bucket_cap_mb=bucket_cap_mb)
        g = torch.Generator().manual_seed(t.rank)
        grads = [torch.randint(-50, 50, p.shape, generator=g).float() for p in model.parameters()]
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad.clone()
        opt.synchronize()
        residual = sum(float(r.abs().sum()) for r in opt.grace.memory.residuals.values())
        return grads, [p.grad for p in model.parameters()], residual, len(opt.buckets)
    results = run_local(4, fn)
    for i in range(4):
        average = sum(r[0][i] for r in results) / 4
        for r in results:
            assert torch.equal(r[1][i], average)
    assert all(r[2] == 0 for r in results)
    assert results[0][3] == {None: 1, 0.01: 2, 1e-6: 4}[bucket_cap_mb]


@pytest.mark.parametrize("algorithm", ["spardl", "topka"])
def test_last_stats_sum_the_steps_buckets(algorithm):
    """With one bucket per parameter, last_stats after a step counts the bytes of all four
    buckets, during the dense warm-up step as after it: exactly the bytes the transport
    carried for the algorithm in that step."""
    from sparse_checks import algorithm_messages
    from spardl_grace.transport import CountingTransport

    def fn(t):
        counting = CountingTransport(t)
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for(algorithm), transport=counting),
                                bucket_cap_mb=1e-6, dense_warmup_steps=1)
        out = []
        for x, y in ts.batches(t.rank, t.size, 3):
            counting.reset()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            out.append((opt.last_stats["bytes_sent"], sum(m.bytes_sent for m in algorithm_messages(counting))))
        return len(opt.buckets), out
    for buckets, steps in run_local(3, fn):
        assert buckets == 4
        for reported, carried in steps:
            assert reported == carried > 0


def test_backward_passes_per_step_accumulates_then_rejects_an_extra_pass():
    def fn(t, passes):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params({"compressor": "none", "communicator": "dense"},
                                                         transport=t),
                                backward_passes_per_step=passes)
        (x, y), = ts.batches(t.rank, t.size, 1, batch=64)
        opt.zero_grad()
        halves = [(x[:32], y[:32]), (x[32:], y[32:])] if passes == 2 else [(x, y)]
        for xs, ys in halves:
            (torch.nn.functional.cross_entropy(model(xs), ys, reduction="sum") / 64).backward()
        opt.step()
        if passes == 2:
            opt.zero_grad()
            for xs, ys in halves + halves[:1]:
                try:
                    torch.nn.functional.cross_entropy(model(xs), ys).backward()
                except RuntimeError as exc:
                    assert "backward_passes_per_step" in str(exc)
                    break
            else:
                raise AssertionError("a third backward pass was accepted")
        return ts.flat_params(model)
    accumulated = run_local(2, lambda t: fn(t, 2))
    single = run_local(2, lambda t: fn(t, 1))
    assert torch.allclose(accumulated[0], single[0], atol=1e-6)


def test_synchronize_clip_then_skip_synchronize():
    def fn(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        for x, y in ts.batches(t.rank, t.size, 3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            with opt.skip_synchronize():
                opt.step()
        norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        return ts.flat_params(model), float(norm), opt.compression_state_dict()["steps"]
    results = run_local(3, fn)
    assert_identical([r[0] for r in results])
    assert all(r[1] == pytest.approx(0.01, rel=1e-4) and r[2] == 3 for r in results)


def test_a_step_skipped_after_synchronize_leaves_the_next_step_synchronised():
    """A loss-spike guard: synchronize(), look at the averaged norm, skip the update. The next
    step() warned SYNCHRONIZED_TWICE and stepped on each rank's own gradient (the replicas
    drifted apart); it synchronises now, and ends where a run that never did that ends."""
    def fn(t, guard):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        for i, (x, y) in enumerate(ts.batches(t.rank, t.size, 4)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if i == 1:
                opt.synchronize()
                if guard:
                    continue
                with opt.skip_synchronize():
                    opt.step()
                continue
            opt.step()
        return ts.flat_params(model)

    with warnings.catch_warnings(record=True) as caught:  # here: the ranks are threads
        warnings.simplefilter("always")
        guarded = run_local(2, lambda t: fn(t, True))
    assert_identical(guarded)
    assert [str(w.message) for w in caught if "synchronize" in str(w.message)] == []
    assert not torch.equal(guarded[0], run_local(2, lambda t: fn(t, False))[0])  # one fewer


def test_step_inside_skip_synchronize_before_synchronize_raises():
    """Each rank stepped on its own clipped gradient, and the next backward failed with
    'zero_grad() was called after backward()'."""
    def fn(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        (x, y), = ts.batches(t.rank, t.size, 1)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = ts.flat_params(model)
        with opt.skip_synchronize(), pytest.raises(RuntimeError, match=r"synchronize\(\) first"):
            opt.step()
        assert torch.equal(ts.flat_params(model), before)
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        return ts.flat_params(model)

    assert_identical(run_local(2, fn))


def test_zero_grad_while_gradients_are_in_flight_raises():
    def fn(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        (x, y), = ts.batches(t.rank, t.size, 1)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(RuntimeError, match="zero_grad"):
            opt.zero_grad()
        opt.step()
        return True
    assert all(run_local(2, fn))


def test_a_parameter_unused_on_one_rank_does_not_deadlock():
    """Rank 0 never uses `extra`: its bucket never fills there, and synchronize sends zeros
    for it, in the same bucket order as the ranks that did use it."""
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = ts.mlp()
            self.extra = torch.nn.Linear(784, 10)
            torch.nn.init.constant_(self.extra.weight, 0.01)
            torch.nn.init.zeros_(self.extra.bias)

        def forward(self, x, use_extra):
            return self.body(x) + (self.extra(x) if use_extra else 0)

    def fn(t):
        model = Branchy()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t),
                                bucket_cap_mb=0.05)
        for x, y in ts.batches(t.rank, t.size, 4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, t.rank != 0), y).backward()
            opt.step()
        return ts.flat_params(model)
    assert_identical(run_local(3, fn))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"grace": "spardl"}, TypeError, "must be a grace communicator"),
    ({"named_parameters": [("a", None)]}, ValueError, "does not name"),
    ({"named_parameters": "dup"}, ValueError, "duplicate names"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
    ({"dense_warmup_steps": -1}, ValueError, "dense_warmup_steps"),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    def fn(t):
        model = ts.mlp()
        args = {"grace": grace_from_params(ts.params_for("spardl"), transport=t),
                "named_parameters": model.named_parameters(), **kwargs}
        if args["named_parameters"] == "dup":
            args["named_parameters"] = [("w", p) for p in model.parameters()]
        with pytest.raises(error, match=match):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **args)
        return True
    assert all(run_local(1, fn))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_keep_float32_residuals(dtype):
    def fn(t):
        model = ts.mlp(dtype)
        grc = grace_from_params(ts.params_for("spardl"), transport=t)
        losses = ts.train(model, ts.make_optimizer(model, grc), t.rank, t.size, 20)
        residual_dtypes = {r.dtype for r in grc.memory.residuals.values()}
        grad_dtypes = {p.grad.dtype for p in model.parameters()}
        return ts.flat_params(model), torch.tensor(losses), residual_dtypes, grad_dtypes
    results = run_local(3, fn)
    assert_identical([r[0] for r in results])
    for _, losses, residual_dtypes, grad_dtypes in results:
        assert residual_dtypes == {torch.float32} and grad_dtypes == {dtype}
        assert_loss_falls(losses)


@pytest.mark.parametrize("algorithm", ["spardl", "topka", "gtopk", "oktopk"])
def test_grad_scaler_overflow_skips_the_step_and_keeps_the_residuals(algorithm):
    """Horovod's AMP recipe: synchronize, unscale_, clip, step inside skip_synchronize. At
    step 2 rank 1's loss overflows: every rank gets a non-finite average, the scaler skips
    the step on every rank, and the residuals stay as they were (these algorithms check the
    result's finiteness where it is non-zero only)."""
    def fn(t):
        model = ts.mlp()
        grc = grace_from_params(ts.params_for(algorithm), transport=t)
        opt = ts.make_optimizer(model, grc)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        record = []
        for step, (x, y) in enumerate(ts.batches(t.rank, t.size, 5)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if step == 2 and t.rank == 1:
                loss = loss * float("inf")
            before = {n: r.clone() for n, r in grc.memory.residuals.items()}
            params_before = ts.flat_params(model)
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            same_residuals = before.keys() == grc.memory.residuals.keys() and all(
                torch.equal(before[n], grc.memory.residuals[n]) for n in before)
            record.append((torch.equal(params_before, ts.flat_params(model)), same_residuals))
        finite = all(bool(torch.isfinite(r).all()) for r in grc.memory.residuals.values())
        return ts.flat_params(model), record, finite
    results = run_local(3, fn)
    assert_identical([r[0] for r in results])
    for _, record, finite in results:
        assert [skipped for skipped, _ in record] == [False, False, True, False, False]
        assert record[2][1] and not record[3][1]  # kept at the overflow, updated afterwards
        assert finite


# ------------------------------------------------------------------- checkpoint and resume
RESUME_CASES = {
    "spardl": ts.params_for("spardl"),
    "oktopk": ts.params_for("oktopk"),
    "gtopk": ts.params_for("gtopk"),
    "randomk-allgather": {"compressor": "randomk", "memory": "residual", "communicator": "allgather",
                          "compress_ratio": 0.05},
    "dgc": {"compressor": "dgc", "memory": "dgc", "communicator": "allgather", "compress_ratio": 0.05},
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_from_a_checkpoint_is_bit_identical(case, tmp_path):
    """Train 6 steps; against it, train 3, save model, optimizer and compression state per
    rank, build everything afresh, load (weights_only=True) and train 3 more."""
    params = RESUME_CASES[case]

    def fresh(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(params, transport=t), dense_warmup_steps=1)
        return model, opt

    def uninterrupted(t):
        model, opt = fresh(t)
        ts.train(model, opt, t.rank, t.size, 6)
        return ts.flat_params(model)

    def resumed(t):
        model, opt = fresh(t)
        ts.train(model, opt, t.rank, t.size, 3)
        path = tmp_path / f"rank{t.rank}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "compression": opt.compression_state_dict()}, path)
        model, opt = fresh(t)
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        opt.load_compression_state_dict(saved["compression"])
        ts.train(model, opt, t.rank, t.size, 3, start=3)
        return ts.flat_params(model)

    expected = run_local(3, uninterrupted)
    got = run_local(3, resumed)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_resuming_with_another_world_size_fails_loudly():
    def save(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        ts.train(model, opt, t.rank, t.size, 2)
        return opt.compression_state_dict()
    state = run_local(2, save)[0]

    def load(t):
        model = ts.mlp()
        opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=t))
        with pytest.raises(ValueError, match="2 workers"):
            opt.load_compression_state_dict(state)
        return True
    assert all(run_local(3, load))


# ------------------------------------------------------ residuals across a change of buckets
def test_residuals_follow_parameters_when_buckets_change():
    """Step 1 with buckets [a, b] and [c], step 2 with one bucket [c, b, a] (DDP's rebuild
    does this). Conservation at step 2, per parameter: the gradients plus the residuals left
    by step 1 equal P times the result plus the new residuals."""
    names, numels = ("a", "b", "c"), (5, 40, 11)
    size = 3

    def fn(t):
        sync = GradientSync(grace_from_params(ts.params_for("spardl", 0.2), transport=t))
        g = torch.Generator().manual_seed(t.rank)
        grads = {n: torch.randn(k, generator=g) for n, k in zip(names, numels)}
        sync.synchronize(torch.cat([grads["a"], grads["b"]]), Bucket(("a", "b"), (5, 40)))
        sync.synchronize(grads["c"], Bucket(("c",), (11,)))
        residuals = sync.grace.memory.residuals
        old = {n: residuals[n].clone() for n in names}
        new_grads = {n: torch.randn(k, generator=g) for n, k in zip(names, numels)}
        bucket = Bucket(("c", "b", "a"), (11, 40, 5))
        result = sync.synchronize(torch.cat([new_grads[n] for n in bucket.names]), bucket)
        parts = dict(zip(bucket.names, torch.split(result, bucket.numels)))
        return old, new_grads, parts, {n: residuals[n].clone() for n in names}, sorted(residuals)
    results = run_local(size, fn)
    for name in names:
        assert_identical([r[2][name] for r in results])
        before = sum(r[1][name] + r[0][name] for r in results)
        after = size * results[0][2][name] + sum(r[3][name] for r in results)
        assert torch.allclose(before, after, atol=1e-5), name
    assert results[0][4] == list(names)  # stored per parameter, no bucket keys left behind


@pytest.mark.parametrize("as_key", [False, True])
def test_dense_warmup_and_small_buckets_are_sent_dense(as_key):
    """The dense warm-up given to GradientSync (DistributedOptimizer's, the DDP hook's
    argument) or as grace_from_params' 'dense_warmup_steps' key: the same steps go dense."""
    def fn(t):
        params = {**ts.params_for("spardl", 0.1), **({"dense_warmup_steps": 1} if as_key else {})}
        sync = GradientSync(grace_from_params(params, transport=t),
                            dense_warmup_steps=0 if as_key else 1, min_numel=50)
        g = torch.Generator().manual_seed(t.rank)
        small, large = Bucket(("s",), (49,)), Bucket(("l",), (200,))
        out = []
        for _ in range(2):
            x, y = torch.randn(49, generator=g), torch.randn(200, generator=g)
            out.append((x, y, sync.synchronize(x, small), sync.synchronize(y, large)))
            sync.end_step()
        return out
    results = run_local(2, fn)
    for step in range(2):
        xs = sum(r[step][0] for r in results) / 2
        ys = sum(r[step][1] for r in results) / 2
        assert torch.equal(results[0][step][2], xs)  # small bucket: dense on every step
        large_dense = torch.equal(results[0][step][3], ys)
        assert large_dense == (step == 0)  # large bucket: dense only in warm-up


def test_the_dense_warmup_given_twice_differently_is_refused():
    def fn(t):
        grc = grace_from_params({**ts.params_for("spardl", 0.1), "dense_warmup_steps": 2},
                                transport=t)
        GradientSync(grc, dense_warmup_steps=2)  # the same: fine
        with pytest.raises(ValueError, match="give one of them"):
            GradientSync(grc, dense_warmup_steps=3)
    run_local(1, fn)


# ------------------------------------------------------------------- real launchers
@pytest.mark.parametrize("backend,size", [("horovod-gloo", 3), ("horovod-mpi", 2), ("gloo", 3),
                                          ("mpi", 3)])
def test_optimizer_under_real_launchers(launch, backend, size):
    """horovodrun --gloo -np 3, horovodrun --mpi -np 2, torchrun --nproc-per-node 3, mpirun
    -np 3: SparDL, gTop-k, Ok-Topk and TopkA train with identical replicas and falling loss."""
    results = launch(backend, size, "training_scenarios.optimizer_training", timeout=400)
    for algorithm in ts.ALGORITHMS:
        assert_identical([r[algorithm]["params"] for r in results])
        for r in results:
            assert_loss_falls(r[algorithm]["losses"])


def test_ddp_comm_hook_matches_the_optimizer_under_torchrun(launch):
    results = launch("gloo", 3, "training_scenarios.ddp_matches_optimizer")
    assert_identical([r["ddp"] for r in results])
    for r in results:
        assert torch.equal(r["ddp"], r["optimizer"])
        assert torch.equal(r["ddp_losses"], r["losses"])
        assert r["residual_names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_the_ddp_hook_takes_the_users_sgd_momentum_over_as_the_optimizer_does(launch):
    """Momentum correction with SGD(momentum=0.9) as the user built it: the hook's run is the
    DistributedOptimizer's bit for bit (before, the hook left the SGD's momentum on and the
    momentum was applied twice, silently); the SGD's groups are as built and it holds no
    momentum buffer; nesterov, which the memory must know from the first backward, is
    refused under the hook. The same with 'momentum_masking': False, which trains otherwise;
    and stepped with a closure (Lightning's way), the same bits."""
    for r in launch("gloo", 2, "training_scenarios.ddp_momentum_correction"):
        for suffix in ("", "_unmasked"):
            assert torch.equal(r[f"ddp{suffix}"], r[f"optimizer{suffix}"]), suffix
            assert torch.equal(r[f"closure{suffix}"], r[f"ddp{suffix}"]), suffix
            assert r[f"group{suffix}"] == (0.9, 1e-3, False) and r[f"buffers{suffix}"] == 0
        assert not torch.equal(r["ddp"], r["ddp_unmasked"])
        assert "use spardl_grace.DistributedOptimizer, or nesterov=False" in r["nesterov"]


def test_the_ddp_hook_runs_adams_frozen_update_as_the_optimizer_does(launch):
    """'adam_freeze_step' 3 with the user's AdamW under the DDP hook: dense for 3 steps, then
    the frozen update run before AdamW's own step, which the hidden gradients make a no-op: bit
    for bit DistributedOptimizer's run; the gradients are back after the step; an SGD is
    refused at its first step. Stepped with a closure (Lightning's automatic optimisation), the
    frozen update ran before the closure, on the previous step's gradients, and AdamW's own
    step then ran too on the closure's: the ranks diverged; now the same bits, one update a
    step."""
    for r in launch("gloo", 2, "training_scenarios.ddp_frozen_adam"):
        assert torch.equal(r["ddp"], r["optimizer"])
        assert torch.equal(r["closure"], r["ddp"]) and r["closure_steps"] == 8
        assert r["frozen_at"] == 3 and r["grads_kept"]
        assert "the optimizer is SGD" in r["sgd"]


def test_ddp_comm_hook_overlaps_backward_under_torchrun(launch):
    """The hook returns a pending future and a communication thread finishes it, on several
    DDP buckets with an unused parameter; the model is bit for bit the one the hook gives
    when it communicates before returning."""
    results = launch("gloo", 3, "training_scenarios.ddp_overlap")
    for overlap in (True, False):
        assert_identical([r[overlap]["params"] for r in results])
    for r in results:
        assert torch.equal(r[True]["params"], r[False]["params"])
        assert torch.equal(r[True]["losses"], r[False]["losses"])
        calls = r[True]["calls"]
        assert sum(last for last, _ in calls) == 8 and len(calls) > 8  # several buckets a step
        assert calls[0] == (False, False)  # the first bucket's future was pending on return
        assert all(done for last, done in calls if last)  # the last waits for the whole step
        assert r[True]["threads"] == ["spardl-ddp-comm_0"]
        assert all(done for _, done in r[False]["calls"])
        assert r[True]["steps"] == r[False]["steps"] == 8


def test_dense_steps_queue_their_all_reduces_in_gloo_with_the_same_bits(launch):
    """With overlap, a dense step's all-reduces are queued in gloo as DDP queues its own (no
    communication thread, so comm_s is not measured), through DistributedOptimizer and the
    DDP hook alike; the models are bit for bit those of the unqueued path."""
    results = launch("gloo", 3, "training_scenarios.queued_dense")
    for overlap in (True, False):
        for path in ("optimizer", "hook"):
            assert_identical([r[overlap][path] for r in results])
    for r in results:
        assert r[True]["buckets"] > 1
        for path in ("optimizer", "hook"):
            assert torch.equal(r[True][path], r[False][path])
            queued, unqueued = r[True][f"{path}_stats"], r[False][f"{path}_stats"]
            assert queued["comm_s"] == 0 < unqueued["comm_s"]
            assert queued["bytes_sent"] == unqueued["bytes_sent"] > 0


def _dying_rank(rank: int, init_file: str, queue) -> None:
    import torch.distributed as dist
    from datetime import timedelta
    from spardl_grace.transport.torch_dist import TorchDistTransport
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=20))
    transport = TorchDistTransport(timeout=5)
    model = ts.mlp()
    opt = ts.make_optimizer(model, grace_from_params(ts.params_for("spardl"), transport=transport))
    start = None
    try:
        for step, (x, y) in enumerate(ts.batches(rank, 3, 10)):
            if step == 3:
                if rank == 2:
                    import os
                    os._exit(0)  # dies without a word, mid-training
                start = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        queue.put((rank, "no error", 0.0))
    except TransportError as exc:
        queue.put((rank, type(exc).__name__, time.monotonic() - start))


def test_a_rank_dying_mid_training_makes_the_others_fail_within_the_timeout(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dying_rank, args=(r, str(tmp_path / "init"), queue))
             for r in range(3)]
    for p in procs:
        p.start()
    reports = sorted(queue.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert [r[0] for r in reports] == [0, 1]
    for _, kind, seconds in reports:
        assert kind in ("TransportError", "TransportTimeout"), kind
        assert seconds < 30


def test_broadcast_parameters_copies_root_into_every_rank():
    def fn(t):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.fill_(t.rank)
            model.bias.fill_(-t.rank)
        broadcast_parameters(model.state_dict(), root_rank=1, transport=t)
        return ts.flat_params(model)
    for r in run_local(3, fn):
        assert torch.equal(r, torch.tensor([1.0] * 6 + [-1.0] * 2))


# ------------------------------------------------------------------- a Horovod user's script
def horovod_defaults_small(transport) -> dict:
    """experiments.horovod_defaults at CI size (2,048 images): Horovod's own optimizer, then
    spardl_grace.DistributedOptimizer with the library's defaults (needs horovodrun)."""
    import horovod.torch as hvd

    from experiments import horovod_defaults
    args = horovod_defaults.parse_args(["--dnn", "fashioncnn", "--train-samples", "2048",
                                        "--test-samples", "1000"])
    return {kind: horovod_defaults.train(args, kind, hvd) for kind in ("horovod", "spardl")}


def test_a_horovod_users_script_with_the_librarys_defaults(launch):
    """Under horovodrun --gloo on 2 ranks both optimizers learn (well above the 0.1 of chance
    on 1,000 test images after 32 steps), every rank ends with the same model (the same
    accuracy), and SparDL at its defaults sends the floor: FashionCNN's 18,378 parameters at
    density 0.01 would be 183 entries a step, the default min_entries makes them 2,048, 1,024
    a message at P = 2, each on the default compact wire 2 bytes of value and 14 bits of
    index (blocks of 9,189), and the all-gather's 8 bytes of framing (about a tenth of
    Horovod's 73,512)."""
    results = launch("horovod-gloo", 2, "test_integration.horovod_defaults_small", timeout=400)
    assert results[0] == results[1]
    horovod, spardl = results[0]["horovod"], results[0]["spardl"]
    assert horovod["steps"] == spardl["steps"] == 32
    assert horovod["test_accuracy"] > 0.25 and spardl["test_accuracy"] > 0.25
    assert spardl["bytes_per_step"] == 2 * (1024 * 2 + 1024 * 14 // 8) + 8
    assert horovod["bytes_per_step"] == 4 * 18_378
