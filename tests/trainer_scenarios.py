"""Scenarios for tests/test_trainers.py: Lightning and Accelerate on real ranks (torchrun,
gloo), run by tests/mp_worker.py, which saves each rank's result. The checkpoint directory is
mp_worker's OUTDIR (sys.argv[3]), shared by the ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import spardl_grace
import spardl_grace.accelerate
import spardl_grace.lightning

PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05, "min_entries": 0}  # no floor: the sparse path on a small model
FEATURES, OUTPUTS, SAMPLES, BATCH = 16, 4, 256, 8


def outdir() -> Path:
    return Path(sys.argv[3])


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x @ torch.randn(FEATURES, OUTPUTS, generator=generator)


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, OUTPUTS))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def residual_norm(state: spardl_grace.CommHookState) -> float:
    tensors = [t for t in _tensors(state.state_dict()) if t.is_floating_point()]
    return float(sum(t.double().norm() for t in tensors))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


# ----------------------------------------------------------------------------------- Lightning
def _lightning_module():
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def training_step(self, batch, index):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

    return Regression()


def _fit(transport, epochs: int, callbacks: list, ckpt_path: str | None = None,
         model=None, strategy="ddp"):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    x, y = regression_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model = model or _lightning_module()
    checkpoints = ModelCheckpoint(dirpath=outdir() / "lightning", filename="{epoch}",
                                  save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(accelerator="cpu", devices=transport.size, max_epochs=epochs,
                         strategy=strategy, callbacks=[*callbacks, checkpoints], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=outdir())
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    model.fitted_by = trainer
    return model


def lightning_resume(transport) -> dict:
    """3 epochs straight; the same from the epoch-1 checkpoint with the compression state; and
    from it with the compression state removed; then Lightning's own form (a CommHookState
    given to DDPStrategy and the callback) for one epoch."""
    from lightning.pytorch.strategies import DDPStrategy

    sparse = spardl_grace.lightning.GradientCompression(PARAMS)
    straight = _fit(transport, 3, [sparse])
    ckpt = outdir() / "lightning" / "epoch=1.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    transport.barrier("read")
    resumed = _fit(transport, 3, [spardl_grace.lightning.GradientCompression(PARAMS)], str(ckpt))
    stripped = outdir() / "stripped.ckpt"
    if transport.rank == 0:
        torch.save({k: v for k, v in saved.items() if k != "callbacks"}, stripped)
    transport.barrier("stripped")
    without_state = _fit(transport, 3, [spardl_grace.lightning.GradientCompression(PARAMS)],
                         str(stripped))
    model = _lightning_module()
    state = spardl_grace.CommHookState(PARAMS, model)
    _fit(transport, 1, [spardl_grace.lightning.GradientCompression(state)], model=model,
         strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=spardl_grace.comm_hook))
    return {
        "straight": flat(straight), "resumed": flat(resumed),
        "without_state": flat(without_state),
        "saved_ranks": len(saved["callbacks"][sparse.state_key]["ranks"]),
        "residual_norm": residual_norm(sparse.state),
        "bytes_sent": sparse.state.last_stats["bytes_sent"],
        "logged": {k: float(v) for k, v in straight.fitted_by.logged_metrics.items()
                   if k.startswith("compression/")},
        "lightning_form_steps": state.sync.steps,
        "lightning_form": flat(model),
    }


# ---------------------------------------------------------------------------------- Accelerate
STEPS, SAVE_AT = 24, 10


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = regression_data()
    rows = torch.arange(BATCH) + (step * 2 + rank) * BATCH % (SAMPLES - BATCH)
    return x[rows], y[rows]


def _accelerate_run(first: int, load: bool, register: bool = True, save: bool = False,
                    folder: str = "accelerate", main_only: bool = False,
                    load_first: bool = False) -> tuple[object, torch.nn.Module, object]:
    """Train steps first..STEPS-1 from a fresh model with a new Accelerator (after load_state
    from `folder` when `load`); with `save`, save_state after step SAVE_AT - 1 (on the main
    process alone with `main_only`, as many scripts do; `load_first`: load_state before
    register_comm_hook)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if load_first:
        accelerator.load_state(str(outdir() / folder))
    if register:
        state = spardl_grace.accelerate.register_comm_hook(accelerator, model, PARAMS)
    else:  # the hook by hand: the saved compression state is not read
        state = spardl_grace.CommHookState(PARAMS, model)
        model.register_comm_hook(state, spardl_grace.comm_hook)
    if load and not load_first:
        accelerator.load_state(str(outdir() / folder))
    for step in range(first, STEPS):
        x, y = _batch(step, accelerator.process_index)
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        if save and step == SAVE_AT - 1 and (accelerator.is_main_process or not main_only):
            accelerator.save_state(str(outdir() / folder))
    return accelerator, model, state


def accelerate_resume(transport) -> dict:
    """STEPS steps straight (saving at SAVE_AT); the same resumed from the saved state; resumed
    without the compression state; then the errors for a second hook."""
    import time
    import warnings

    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class MemoryTracker(GeneralTracker):
        """Keeps what it is given."""

        name, requires_logging_directory = "memory", False

        def __init__(self):
            super().__init__()
            self.logged: list[tuple[dict, int | None]] = []

        @property
        def tracker(self):
            return self.logged

        def log(self, values: dict, step: int | None = None, **kwargs):
            self.logged.append((dict(values), step))

    accelerator, straight, state = _accelerate_run(0, load=False, save=True)
    _, resumed, _ = _accelerate_run(SAVE_AT, load=True)
    _, without_state, _ = _accelerate_run(SAVE_AT, load=True, register=False)
    with warnings.catch_warnings(record=True) as loaded_first_warnings:
        warnings.simplefilter("always")
        _, loaded_first, _ = _accelerate_run(SAVE_AT, load=True, load_first=True)
    # saved from the main process alone: no stall; resuming from it raises on every rank
    started = time.monotonic()
    _accelerate_run(0, load=False, save=True, folder="main_only", main_only=True)
    main_only_s = time.monotonic() - started
    try:
        _accelerate_run(SAVE_AT, load=True, folder="main_only")
        main_only = ""
    except ValueError as exc:
        main_only = str(exc)
    # a checkpoint without the compression state (saved with the hook by hand): a warning
    _accelerate_run(0, load=False, register=False, save=True, folder="no_state")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _accelerate_run(SAVE_AT, load=True, folder="no_state")
    try:
        spardl_grace.accelerate.register_comm_hook(accelerator, straight, PARAMS)
        twice = ""
    except ValueError as exc:
        twice = str(exc)
    tracker = MemoryTracker()
    tracked = Accelerator(cpu=True, log_with=[tracker])
    tracked.init_trackers("spardl")
    spardl_grace.accelerate.log_stats(tracked, state, step=STEPS)
    return {"logged": tracker.logged, "straight": flat(straight), "resumed": flat(resumed),
            "without_state": flat(without_state), "residual_norm": residual_norm(state),
            "bytes_sent": state.last_stats["bytes_sent"], "steps": state.sync.steps,
            "distributed_type": str(accelerator.distributed_type), "twice": twice,
            "main_only_s": main_only_s, "main_only": main_only,
            "no_state": [str(w.message) for w in caught if "spardl_grace" in str(w.message)],
            "loaded_first": flat(loaded_first),
            "loaded_first_warnings": [str(w.message) for w in loaded_first_warnings
                                      if "spardl_grace" in str(w.message)]}


def accumulation(transport) -> dict:
    """Two backward passes per optimizer step: with DDP's no_sync on the first (synchronised
    once), without it (ValueError on every rank), inside Accelerate's accumulate() and with
    Lightning's accumulate_grad_batches; then a DDPStrategy that already has another hook
    (ValueError from the callback)."""
    import lightning.pytorch as pl
    from accelerate import Accelerator
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def two_passes(model, optimizer, steps: int, no_sync: bool) -> None:
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(2):
                x, y = _batch(2 * step + micro, transport.rank)
                context = model.no_sync() if no_sync and micro == 0 else torch.enable_grad()
                with context:
                    F.mse_loss(model(x), y).backward()
            optimizer.step()

    model = torch.nn.parallel.DistributedDataParallel(network())
    state = spardl_grace.CommHookState(PARAMS, model)
    model.register_comm_hook(state, spardl_grace.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    two_passes(model, optimizer, 3, no_sync=True)
    with_no_sync = state.sync.steps
    # A step whose result is not finite is skipped, as a GradScaler skips it: the next
    # synchronisation without an optimizer step in between is no accumulation.
    x, y = _batch(100, transport.rank)
    optimizer.zero_grad()
    (F.mse_loss(model(x), y) * float("inf")).backward()
    skipped_finite = state.sync.last_step_finite
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    try:
        two_passes(model, optimizer, 1, no_sync=False)
        without = ""
    except ValueError as exc:
        without = str(exc)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    inner = network()
    prepared, acc_optimizer = accelerator.prepare(
        inner, torch.optim.SGD(inner.parameters(), lr=0.02))
    acc_state = spardl_grace.accelerate.register_comm_hook(accelerator, prepared, PARAMS)
    for step in range(6):
        with accelerator.accumulate(prepared):
            x, y = _batch(step, transport.rank)
            accelerator.backward(F.mse_loss(prepared(x), y))
            acc_optimizer.step()
            acc_optimizer.zero_grad()

    accumulating = spardl_grace.lightning.GradientCompression(PARAMS)
    pl.Trainer(accelerator="cpu", devices=transport.size, logger=False, max_epochs=1,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=outdir(),
               strategy="ddp", accumulate_grad_batches=2, callbacks=[accumulating]).fit(
        _lightning_module(), torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(*regression_data()), batch_size=BATCH))

    lightning_model = _lightning_module()
    try:
        pl.Trainer(accelerator="cpu", devices=transport.size, logger=False, max_epochs=1,
                   enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=outdir(),
                   strategy=DDPStrategy(ddp_comm_state=None,
                                        ddp_comm_hook=default_hooks.allreduce_hook),
                   callbacks=[spardl_grace.lightning.GradientCompression(PARAMS)]).fit(
            lightning_model, torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(*regression_data()), batch_size=BATCH))
        other_hook = ""
    except ValueError as exc:
        other_hook = str(exc)

    # One callback over the fits of two new modules (a hyper-parameter loop): the second fit
    # raised that DDP's bucket held parameters the state did not know.
    reused, states = spardl_grace.lightning.GradientCompression(PARAMS), []
    for _ in range(2):
        pl.Trainer(accelerator="cpu", devices=transport.size, logger=False, max_epochs=1,
                   enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=outdir(), strategy="ddp", callbacks=[reused]).fit(
            _lightning_module(), torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(*regression_data()), batch_size=BATCH))
        states.append(reused.state)

    from accelerate.utils import GradientAccumulationPlugin
    each_batch = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_each_batch=True))
    try:
        spardl_grace.accelerate.register_comm_hook(
            each_batch, each_batch.prepare(network()), PARAMS)
        sync_each_batch = ""
    except ValueError as exc:
        sync_each_batch = str(exc)
    return {"with_no_sync_steps": with_no_sync, "without_no_sync": without,
            "skipped_step_finite": skipped_finite,
            "accelerate_steps": acc_state.sync.steps, "accelerate_model": flat(prepared),
            "lightning_accumulated_steps": accumulating.state.sync.steps,
            "other_hook": other_hook,
            "reused_callback_steps": [s.sync.steps for s in states],
            "reused_callback_new_state": states[0] is not states[1],
            "sync_each_batch": sync_each_batch}
