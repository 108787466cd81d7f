"""PyTorch Lightning and Hugging Face Accelerate (spardl_grace.lightning, .accelerate): the
hook inside the trainers' own DDP, identical replicas, bit-identical resume from the trainers'
own checkpoints, and clear errors for what cannot work. Real trainers on 2 gloo ranks under
torchrun (tests/trainer_scenarios.py)."""
from __future__ import annotations

import pytest
import torch

import spardl_grace
import spardl_grace.accelerate
import spardl_grace.lightning
from trainer_scenarios import PARAMS, network

DENSE_BYTES = 4 * sum(p.numel() for p in network().parameters())


def _same_on_every_rank(results: list[dict], keys: list[str]) -> None:
    for key in keys:
        for other in results[1:]:
            assert torch.equal(results[0][key], other[key]), f"{key} differs between ranks"


def test_lightning_resumes_bit_identically_from_its_own_checkpoint(launch):
    """The callback registers the hook on Lightning's DDP (also on the CPU, where
    DDPStrategy ignores ddp_comm_hook), puts both ranks' compression state in the checkpoint,
    and a fit resumed from the epoch-1 checkpoint ends bit for bit where the straight run did;
    with the compression state removed from the checkpoint it does not (so the state is what
    makes it identical). Lightning's own form (DDPStrategy(ddp_comm_state=...)) trains too."""
    results = launch("gloo", 2, "trainer_scenarios.lightning_resume", timeout=300)
    _same_on_every_rank(results, ["straight", "resumed", "without_state", "lightning_form"])
    r = results[0]
    assert torch.equal(r["straight"], r["resumed"])
    assert not torch.equal(r["straight"], r["without_state"])
    assert r["saved_ranks"] == 2
    assert r["residual_norm"] > 0
    assert 0 < r["bytes_sent"] < 0.5 * DENSE_BYTES  # sparse messages, not DDP's all-reduce
    assert r["lightning_form_steps"] == 16  # 256 samples / 2 ranks / batch 8: one epoch
    # the last step's statistics reached the trainer's logged metrics
    assert r["logged"]["compression/bytes_sent"] == r["bytes_sent"]
    assert {"compression/selection_s", "compression/comm_s"} <= set(r["logged"])


def test_accelerate_resumes_bit_identically_from_save_state(launch):
    """register_comm_hook after prepare: save_state writes each rank's compression state, and
    load_state continues bit for bit; loading without it does not; a save from the main
    process alone neither stalls nor resumes silently (every rank raises); a checkpoint
    without the state warns, and so does a load_state before register_comm_hook (once, naming
    the order: the warning said to save the state, which was saved); a second hook is
    refused."""
    results = launch("gloo", 2, "trainer_scenarios.accelerate_resume", timeout=300)
    _same_on_every_rank(results, ["straight", "resumed", "without_state"])
    r = results[0]
    assert r["distributed_type"] == "DistributedType.MULTI_CPU"
    assert torch.equal(r["straight"], r["resumed"])
    assert not torch.equal(r["straight"], r["without_state"])
    assert r["residual_norm"] > 0 and r["steps"] == 24
    assert 0 < r["bytes_sent"] < 0.5 * DENSE_BYTES
    assert "already has a communication hook" in r["twice"]
    # log_stats: the state's last statistics reach the main process's trackers, at the step
    (logged, step), = r["logged"]
    assert step == 24 and logged["compression/bytes_sent"] == r["bytes_sent"]
    assert all(not other["logged"] for other in results[1:])  # trackers log on the main process
    for r in results:
        # saving from the main process alone stalled 313 s and ended in TransportTimeout (the
        # state's gather was a collective); now it saves rank 0's file, and resuming raises
        assert r["main_only_s"] < 60
        assert "missing: ranks [1]" in r["main_only"] and "is_main_process" in r["main_only"]
        assert len(r["no_state"]) == 1 and "holds no compression state" in r["no_state"][0]
        # load_state before register_comm_hook: fresh residuals, one warning naming the order
        assert not torch.equal(r["loaded_first"], r["straight"])
        (warning,) = r["loaded_first_warnings"]
        assert "Register the hook right after accelerator.prepare, then call load_state" in warning


def test_gradient_accumulation_needs_no_sync(launch):
    """With no_sync (by hand, Accelerate's accumulate(), Lightning's accumulate_grad_batches)
    two backward passes synchronise once; a step skipped for a non-finite result (as a
    GradScaler skips it) is no accumulation; without no_sync every rank raises, naming the
    fix; a DDPStrategy with another hook is refused by the callback; one callback serves two
    modules' fits; Accelerate's sync_each_batch is refused, naming it."""
    results = launch("gloo", 2, "trainer_scenarios.accumulation", timeout=300)
    _same_on_every_rank(results, ["accelerate_model"])
    for r in results:
        assert r["with_no_sync_steps"] == 3
        assert r["skipped_step_finite"] is False  # and the step after it did not raise
        assert "no_sync()" in r["without_no_sync"]
        assert r["accelerate_steps"] == 3
        assert r["lightning_accumulated_steps"] == 8
        assert "already has a communication hook (allreduce_hook)" in r["other_hook"]
        assert r["reused_callback_new_state"] and r["reused_callback_steps"][1] > 0
        assert "sync_each_batch=True" in r["sync_each_batch"]


def test_lightning_refuses_a_strategy_that_is_not_ddp(tmp_path):
    """One process (SingleDeviceStrategy): ValueError naming strategy='ddp', before training."""
    import lightning.pytorch as pl
    from trainer_scenarios import _lightning_module, regression_data
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path,
                         callbacks=[spardl_grace.lightning.GradientCompression(PARAMS)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*regression_data()))
    with pytest.raises(ValueError, match="SingleDeviceStrategy: use strategy='ddp'"):
        trainer.fit(_lightning_module(), loader)


def test_bad_parameters_fail_when_the_callback_or_state_is_built():
    with pytest.raises(ValueError, match="compress_ratio"):
        spardl_grace.lightning.GradientCompression({**PARAMS, "compress_ratio": 2.0})
    with pytest.raises(ValueError, match="communicator"):
        spardl_grace.CommHookState({**PARAMS, "communicator": "nope"}, network())
    with pytest.raises(TypeError, match="CommHookState"):
        spardl_grace.lightning.GradientCompression("spardl")


def test_accelerate_refuses_a_model_that_is_not_ddp():
    """One process: prepare leaves the model as it is, and the error names what is needed."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(network())
    with pytest.raises(ValueError, match="not the DistributedDataParallel module"):
        spardl_grace.accelerate.register_comm_hook(accelerator, model, PARAMS)


def test_a_lightning_checkpoint_of_another_number_of_ranks_says_how_to_resume_without_it():
    from spardl_grace.trainers import FORMAT, AllRanksState
    from spardl_grace.transport import run_local

    def fn(transport):
        state = spardl_grace.CommHookState(
            spardl_grace.grace_from_params(dict(PARAMS), transport), network())
        with pytest.raises(ValueError, match="saved by 2 ranks; this run has 1") as raised:
            AllRanksState(state, spardl_grace.lightning._WITHOUT_IT).load_state_dict(
                {"format": FORMAT, "world_size": 2, "ranks": [{}, {}]})
        return str(raised.value)

    (message,) = run_local(1, fn)
    assert "delete the GradientCompression callback's entry under the checkpoint's" in message
