"""The loops users write, under every launcher: the library's traffic runs on its own channel,
so the user's collectives, barriers and object broadcasts, wherever they sit in the step,
neither hang the job nor change what it trains."""
from __future__ import annotations

import pytest
import torch

from conftest import run_ranks

LAUNCHERS = ["gloo", "mpi", "horovod"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_user_collectives_between_backward_and_step_neither_hang_nor_change_training(
        launcher, tmp_path):
    """Before the library had its own channel this job hung under torchrun in 2 of 3 runs
    (the loss's all-reduce) and every time (the barrier): the communication thread's
    collectives and the user's met on one process group in different orders."""
    ranks = run_ranks(launcher, 3, "user_loops.collectives_between_backward_and_step", tmp_path,
                      timeout=180)
    plain = ranks[0]["plain"]["params"]
    for pattern in ranks[0]:
        for rank, result in enumerate(ranks):
            assert torch.equal(result[pattern]["params"], plain), (pattern, rank)
            assert result[pattern]["logged"] == ranks[0][pattern]["logged"], (pattern, rank)
    assert ranks[1]["object_broadcast_between_backward_and_step"]["logged"][2] == {"step": 2,
                                                                                  "from": 0}


def test_transports_take_private_groups_over_a_partition_and_refuse_overlapping_ones(tmp_path):
    ranks = run_ranks("gloo", 3, "user_loops.private_channels", tmp_path, timeout=120)
    assert [(r["part_size"], r["part_sum"]) for r in ranks] == [(2, 3.0), (2, 3.0), (1, 3.0)]
    for r in ranks:  # every rank raised, none went on alone
        assert "overlapping groups" in r["refused"] and r["shared_once"] and r["distinct"]


@pytest.mark.parametrize("spec, cuda, device", [
    ("nccl", True, "cuda:1"), ("cpu:gloo,cuda:nccl", True, "cuda:1"), ("gloo", True, "cpu"),
    ("cpu:gloo,cuda:gloo", True, "cpu"), ("cpu:gloo,cuda:nccl", False, "cpu")])
def test_messages_travel_over_nccl_whenever_the_group_sends_cuda_tensors_with_it(spec, cuda,
                                                                                  device):
    """torch's default backend when none is named is 'cpu:gloo,cuda:nccl': CUDA tensors go
    over NCCL there too (the transport took it for a CPU backend). Device choice only: the
    CPU build here has no NCCL to send with."""
    from spardl_grace.transport.torch_dist import comm_device
    assert comm_device(spec, cuda, current=1) == torch.device(device)


def test_handwritten_optimizers_that_write_p_data_train_under_the_ddp_hook(tmp_path):
    ranks = run_ranks("gloo", 3, "user_loops.handwritten_optimizers_under_the_ddp_hook",
                      tmp_path, timeout=180)
    sgd = ranks[0]["sgd"]["params"]
    for r in ranks:
        for name in ("sgd", "subclass", "bare", "bare_zeroed_in_place"):
            assert torch.equal(r[name]["params"], sgd), name
            assert r[name]["steps"] == 6
        assert r["sgd"]["warnings"] == r["subclass"]["warnings"] == r["bare"]["warnings"] == []
        (warning,) = r["bare_zeroed_in_place"]["warnings"]
        assert "p.data" in warning


def test_a_step_skipped_on_purpose_under_the_ddp_hook_is_not_taken_for_accumulation(tmp_path):
    ranks = run_ranks("gloo", 2, "user_loops.a_skipped_step_under_the_ddp_hook", tmp_path,
                      timeout=180)
    for r in ranks:
        for run in ("skipped", "bucket_view"):
            assert "error" not in r[run], r[run]
            assert r[run]["steps"] == 6
            assert torch.equal(r[run]["params"], ranks[0][run]["params"])
        assert torch.equal(r["bucket_view"]["params"], r["skipped"]["params"])
        assert "zero_grad(set_to_none=True)" in r["zeroed_in_place"]["error"]
        assert "synchronised the gradients twice" in r["one_reset"]["error"]


def test_gradients_arriving_on_two_autograd_threads_launch_each_bucket_once():
    """Autograd runs a model on two devices on two threads, and both call the optimizer's
    gradient hook. Only one device is here, so two threads call the hook directly with each
    half of the parameters (each launch held up a millisecond so that they interleave); every
    bucket is launched once, in order, and the ranks agree on what they averaged."""
    import sys
    import threading
    import time

    from spardl_grace import DistributedOptimizer, grace_from_params
    from spardl_grace.transport import run_local

    def fn(transport):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(24)])
        grc = grace_from_params({"communicator": "allreduce", "compressor": "none",
                                 "memory": "none"}, transport=transport)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                   named_parameters=model.named_parameters(),
                                   bucket_cap_mb=0.0005)
        submit = opt._sync.submit

        def slow_submit(*args):  # the other thread runs while a bucket is being launched
            time.sleep(0.001)
            return submit(*args)
        opt._sync.submit = slow_submit
        params = list(model.parameters())
        launched = []
        for trial in range(20):
            for p in params:
                p.grad = torch.full_like(p, float(trial + transport.rank))
            backward_order = params[::-1]  # the last layer's gradients come first
            halves = [backward_order[0::2], backward_order[1::2]]
            threads = [threading.Thread(target=lambda ps: [opt._on_gradient(p) for p in ps],
                                        args=(half,)) for half in halves]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            launched.append(len(opt._pending))
            opt.synchronize()
            assert all(torch.equal(p.grad, torch.full_like(p, trial + 0.5)) for p in params)
            opt.zero_grad()
        return launched, len(opt._slots)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        results = run_local(2, fn)
    finally:
        sys.setswitchinterval(interval)
    for launched, slots in results:
        assert slots > 10 and launched == [slots] * 20


def test_momentum_correction_beside_a_dense_path_is_refused_before_training():
    """Dense steps and dense buckets bypass the memory that holds the momentum: they trained
    with no momentum at all (the optimizer's must be off), silently. Refused at construction,
    by DistributedOptimizer and by the DDP hook's state (given a communicator or its keys)."""
    from spardl_grace import CommHookState, DistributedOptimizer, grace_from_params
    from spardl_grace.transport import run_local
    params = {"communicator": "spardl", "memory": "global_residual", "compressor": "topk",
              "compress_ratio": 0.1, "momentum_correction": 0.9}

    def fn(transport):
        model = torch.nn.Linear(4, 4)
        grc = grace_from_params(dict(params), transport=transport)
        errors = []
        for kwargs in ({"dense_warmup_steps": 2}, {"min_numel": 64}):
            with pytest.raises(ValueError, match="train without momentum") as caught:
                DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                     named_parameters=model.named_parameters(), **kwargs)
            errors.append(str(caught.value))
            with pytest.raises(ValueError, match="density_warmup_steps"):
                CommHookState(dict(params), model, **kwargs)
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                             named_parameters=model.named_parameters())  # no dense path: fine
        return errors

    for errors in run_local(2, fn):
        assert len(errors) == 2


def test_the_hook_given_one_parameter_at_a_time_says_why_it_cannot():
    """DDP's Python reducer (compiled autograd) calls a comm hook with (gradient, parameter);
    a state built with the wrapped module, not the DDP one, is not refused at construction,
    and the hook then raises the same error instead of an AttributeError. No process group
    is needed: the hook refuses before it synchronises anything."""
    from spardl_grace import CommHookState, comm_hook
    from spardl_grace.ddp import PYTHON_REDUCER
    model = torch.nn.Linear(4, 4)
    state = CommHookState({"communicator": "spardl", "memory": "global_residual",
                           "compressor": "topk", "compress_ratio": 0.1}, model)
    with pytest.raises(ValueError) as caught:
        comm_hook(state, (torch.zeros(4, 4), model.weight))
    assert str(caught.value) == PYTHON_REDUCER


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_loops_users_write_train_with_identical_replicas(launcher, tmp_path):
    """Evaluation with all-reduced metrics mid-epoch, a GAN (two models, two optimizers), AMP
    with a GradScaler and clipping, unused parameters (and under torchrun, DDP's
    find_unused_parameters, torch.compile, compiled autograd and a user's own subgroup for
    metrics): every rank ends with the same parameters; compile trains as eager does, and the loops that only add
    the user's own communication end with the plain loop's bits."""
    ranks = run_ranks(launcher, 3, "user_loops.more_patterns", tmp_path, timeout=420)
    for pattern, result in ranks[0].items():
        for rank, other in enumerate(ranks):
            assert torch.equal(other[pattern]["params"], result["params"]), (pattern, rank)
        assert torch.isfinite(result["params"]).all(), pattern
    plain = ranks[0]["plain"]["params"]
    assert torch.equal(ranks[0]["evaluation_mid_epoch"]["params"], plain)
    assert len(ranks[0]["evaluation_mid_epoch"]["logged"]) == 3
    if launcher == "gloo":
        assert torch.equal(ranks[0]["own_subgroup_for_metrics"]["params"], plain)
        assert ranks[0]["own_subgroup_for_metrics"]["logged"] == \
            ranks[1]["own_subgroup_for_metrics"]["logged"]
        assert torch.allclose(ranks[0]["compiled_model"]["params"], plain, atol=1e-5)
        assert torch.allclose(ranks[0]["compiled_autograd"]["params"], plain, atol=1e-5)
        for r in ranks:
            assert r["compiled_autograd"]["captures"] > 0  # the backward was compiled
            assert "python_reducer" in r["compiled_autograd"]["refused"]
            assert "DistributedOptimizer" in r["compiled_autograd"]["refused"]


def test_the_stress_run_counts_passes_and_names_bad_options(tmp_path, capsys):
    """benchmarks.user_loops (outside CI it runs each job 20 times): one run of one job, and
    its refusals."""
    import json

    from benchmarks import user_loops
    out = tmp_path / "stress.json"
    result = user_loops.main(["--runs", "1", "--jobs", "handwritten_optimizers_under_the_ddp_hook",
                              "--launchers", "gloo,mpi", "--json", str(out)])
    assert [(r["job"], r["launcher"], r["pass"]) for r in result["summary"]] == [
        ("handwritten_optimizers_under_the_ddp_hook", "gloo", 1)]  # DDP's hook: torchrun only
    assert json.loads(out.read_text())["summary"] == result["summary"]
    for bad, what in ((["--jobs", "gan"], "unknown job 'gan'"),
                      (["--launchers", "slurm"], "unknown launcher 'slurm'")):
        with pytest.raises(SystemExit):
            user_loops.parse_args(bad)
        assert what in capsys.readouterr().err


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_auto_plans_the_same_on_every_rank_inside_the_loops_users_write(launcher, tmp_path):
    """communicator 'auto' measures, probes the link and broadcasts its plan while the user's
    own collectives, barriers, second optimizer, GradScaler and unused parameters run around
    it: every rank ends with the same parameters, and with the plan fixed (one candidate) the
    user's collectives between backward and step change no bit."""
    ranks = run_ranks(launcher, 3, "user_loops.auto_patterns", tmp_path, timeout=420)
    pinned = ranks[0]["pinned"]
    for result in ranks:
        for pattern in pinned:
            assert torch.equal(result["pinned"][pattern]["params"], pinned["plain"]["params"]), \
                pattern
            assert result["pinned"][pattern]["auto_density"] == 0.05, pattern  # it planned
        for pattern, chosen in ranks[0]["chosen"].items():
            assert torch.equal(result["chosen"][pattern]["params"], chosen["params"]), pattern
            assert torch.isfinite(chosen["params"]).all(), pattern


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_momentum_correction_without_masking_keeps_the_users_sgd_inside_the_loops_users_write(
        launcher, tmp_path):
    """'momentum_masking': False with the user's SGD(momentum=0.9) as built, the user's
    collectives, barriers and object broadcasts between backward and step: every rank ends with
    the same parameters, each pattern with the plain loop's bits, and those differ from the
    masked run's (the key reached the memory under this launcher)."""
    ranks = run_ranks(launcher, 3, "user_loops.momentum_correction_patterns", tmp_path,
                      timeout=240)
    plain = ranks[0]["unmasked"]["plain"]["params"]
    for result in ranks:
        for pattern, got in result["unmasked"].items():
            assert torch.equal(got["params"], plain), pattern
        assert torch.equal(result["masked"]["params"], ranks[0]["masked"]["params"])
    assert torch.isfinite(plain).all()
    assert not torch.equal(plain, ranks[0]["masked"]["params"])


def test_nanogpt_checkpoints_resume_exactly_with_each_ranks_state_and_never_silently_without(
        tmp_path):
    """Before, a resume without the hook's state went on afresh in silence, and rank 0's state
    loaded on every rank trained on with rank 0's residuals counted twice. AdamW on SparDL's
    gradient is also told, once per hook state, that it trains far behind dense."""
    ranks = run_ranks("gloo", 2, "user_loops.nanogpt_checkpoints", tmp_path, timeout=240)
    for r in ranks:
        assert torch.equal(r["own state"]["params"], r["unbroken"])
        assert r["own state"]["warnings"] == [] and r["own state"]["error"] is None
        afresh = r["model+optimizer"]
        assert afresh["error"] is None and not torch.equal(afresh["params"], r["unbroken"])
        assert len(afresh["warnings"]) == 1
        assert "compression state was not restored" in afresh["warnings"][0]
        assert "another rank's compression state" in r["rank 0's state"]["error"]
        for job in ("own state", "model+optimizer"):  # each hook state says it once
            (advice,) = r[job]["adam_advice"]
            assert "AdamW steps on SparDL at density 0.05" in advice
            assert "through the DDP hook" in advice and "'adam_freeze_step'" in advice
    assert torch.equal(ranks[0]["model+optimizer"]["params"], ranks[1]["model+optimizer"]["params"])


def test_auto_keeps_to_dense_under_adamw_and_the_ddp_hook(tmp_path):
    """It chose SparDL's densities on the raw gradient under AdamW (warning that this trains
    far behind dense); now it plans among dense and bfloat16 dense."""
    ranks = run_ranks("gloo", 2, "user_loops.auto_under_adamw_and_the_ddp_hook", tmp_path,
                      timeout=240)
    for r in ranks:
        assert r["candidates"] == "dense,dense16" and r["warnings"] == []
        assert r["choice"] == ranks[0]["choice"] in ("dense", "dense16")
        assert torch.equal(r["params"], ranks[0]["params"])


def test_a_layer_no_rank_uses_keeps_its_residual_under_find_unused_parameters(tmp_path):
    """DDP leaves a parameter no rank used untouched, dropping the hook's result for it: what
    its residual sent each such step was lost (0.2 of a layer used 4 of 12 steps). A rank
    that computed no gradient for a parameter now sends nothing of it and keeps its memory."""
    ranks = run_ranks("gloo", 2, "user_loops.unused_later_under_find_unused_parameters",
                      tmp_path, timeout=240)
    for r in ranks:
        for comm, got in r.items():
            assert got["lost"] < 1e-6 and got["kept"] > 1.0, (comm, got)
            assert torch.equal(got["params"], ranks[0][comm]["params"]), comm


SPARDL_03 = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
             "compress_ratio": 0.3}


def _wrapped_mlp(transport, frozen_first: bool = False):
    """A small model, the same on every rank (ranks are threads: no global seed), its SGD
    and that SGD wrapped; with frozen_first, the first layer's weight frozen before the wrap."""
    from spardl_grace import DistributedOptimizer, grace_from_params
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model[0].weight.requires_grad_(not frozen_first)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DistributedOptimizer(sgd, grace_from_params(dict(SPARDL_03), transport=transport),
                               named_parameters=model.named_parameters())
    return model, sgd, opt


def _loss(model, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def test_gradients_changed_between_backward_and_step_raise_and_horovods_recipe_trains():
    """torch's plain AMP loop (scaler.step unscales .grad in place) and clip_grad_norm_ before
    step() changed gradients already sent: step() wrote the average of the sent (scaled,
    unclipped) gradients over them and stepped on it, silently (a helper's run reached
    parameters of 7.5e10). Now step() raises on every rank, before any gradient is
    overwritten; synchronize(), clip, then step() in skip_synchronize() trains."""
    from spardl_grace.transport import run_local

    def fn(transport):
        out = {}
        model, _, opt = _wrapped_mlp(transport)
        for step in range(2):  # the recipe
            opt.zero_grad()
            _loss(model, transport.rank, step).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            with opt.skip_synchronize():
                opt.step()
        out["recipe"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        before = out["recipe"].clone()
        opt.zero_grad()
        _loss(model, transport.rank, 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # before synchronize()
        try:
            opt.step()
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["untouched"] = torch.equal(
            before, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.zero_grad()
        _loss(model, transport.rank, 3).backward()
        opt.step()  # the next step goes on
        return out

    results = run_local(2, fn)
    for r in results:
        assert "optimizer.synchronize(); scaler.unscale_(optimizer)" in r["error"]
        assert "'2.bias'" in r["error"] and r["untouched"]
        assert torch.equal(r["recipe"], results[0]["recipe"])


def test_a_parameter_unfrozen_after_the_wrap_is_refused_until_wrapped_again():
    """Fine-tuning unfreezes a frozen layer mid-run: nothing synchronised it, and the replicas
    drifted apart in silence (as under Horovod). step() now raises naming it; wrapped again,
    every replica ends alike."""
    import warnings

    from spardl_grace import DistributedOptimizer, grace_from_params
    from spardl_grace.transport import run_local

    def fn(transport):
        model, sgd, opt = _wrapped_mlp(transport, frozen_first=True)
        _loss(model, transport.rank, 0).backward()
        opt.step()
        model[0].weight.requires_grad_(True)
        opt.zero_grad()
        _loss(model, transport.rank, 1).backward()
        try:
            opt.step()
            error = ""
        except ValueError as exc:
            error = str(exc)
        again = DistributedOptimizer(sgd, grace_from_params(dict(SPARDL_03), transport=transport),
                                     named_parameters=model.named_parameters())
        again.zero_grad()
        for step in (2, 3):
            _loss(model, transport.rank, step).backward()
            again.step()
            again.zero_grad()
        return error, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the second wrapper's take-over notice
        results = run_local(2, fn)
    for error, params in results:
        assert "'0.weight' have gradients, but this DistributedOptimizer" in error
        assert torch.equal(params, results[0][1])

