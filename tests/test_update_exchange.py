"""grace_from_params' 'exchange': 'update': DistributedOptimizer's ranks step their own
optimizers on their own gradients and apply the average of those steps, synchronised as a
gradient would be (compressed, with error feedback). Ranks are threads of run_local over its
in-process transport, and real processes under torchrun."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from spardl_grace import CommHookState, DistributedOptimizer, grace_from_params
from spardl_grace.fsdp import hybrid_shard
from spardl_grace.transport import run_local

UPDATE = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.1, "min_entries": 0, "exchange": "update"}

_SEEDING = threading.Lock()  # run_local's ranks are threads sharing torch's generator


def _model() -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _residuals(grc, names: list[str]) -> torch.Tensor:
    kept = grc.memory.residuals
    return torch.cat([kept[n].reshape(-1) if n in kept else torch.zeros(size)
                      for n, size in names])


def train(t, params: dict, steps: int, state: dict | None = None, first: int = 0,
          synchronize_first: bool = False) -> dict:
    """`steps` AdamW steps under DistributedOptimizer from `first`. Per step: the rank's own
    AdamW step (from a shadow AdamW fed the same parameters and gradients), the step applied,
    and the residuals before and after. `synchronize_first`: Horovod's pattern for clipping,
    synchronize() and then step() inside skip_synchronize()."""
    model = _model()
    grc = grace_from_params(params, transport=t)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                               grc, named_parameters=model.named_parameters())
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_compression_state_dict(state["compression"])
    shadow = copy.deepcopy(model)
    shadow_opt = torch.optim.AdamW(shadow.parameters(), lr=0.01, weight_decay=0.1)
    shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # loading shares tensors
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    record = {"own": [], "applied": [], "old": [], "new": []}
    for step in range(first, first + steps):
        x, y = _batch(t.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for s, p in zip(shadow.parameters(), model.parameters()):
                s.copy_(p)
                s.grad = p.grad.clone()
        shadow_opt.step()
        before = _flat(model)
        record["old"].append(_residuals(grc, names))
        if synchronize_first:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        record["own"].append(before - _flat(shadow))
        record["applied"].append(before - _flat(model))
        record["new"].append(_residuals(grc, names))
    record["params"] = _flat(model)
    record["state"] = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "compression": opt.compression_state_dict()}
    return record


def test_ranks_apply_the_same_average_of_their_own_steps_and_conserve_its_mass():
    """Every rank ends with the same bits; each step, what the ranks' optimizers asked for
    plus the old residuals equals P times the step applied plus the new residuals; the
    ranks' own steps differ (the optimizer's state is per rank)."""
    size = 3
    runs = run_local(size, train, UPDATE, 6)
    for r in runs[1:]:
        assert torch.equal(r["params"], runs[0]["params"])
        assert all(torch.equal(a, b) for a, b in zip(r["applied"], runs[0]["applied"]))
    assert not torch.equal(runs[0]["own"][0], runs[1]["own"][0])
    for step in range(6):
        asked = sum(r["own"][step] + r["old"][step] for r in runs)
        kept = sum(r["new"][step] for r in runs)
        torch.testing.assert_close(asked, size * runs[0]["applied"][step] + kept,
                                   atol=1e-6, rtol=0)
        assert (runs[0]["applied"][step] != 0).float().mean() < 0.5  # it is sparse


def test_at_density_one_the_step_applied_is_the_average_of_the_ranks_steps():
    runs = run_local(3, train, {**UPDATE, "compress_ratio": 1.0, "wire": "exact"}, 4)
    for step in range(4):
        mean = sum(r["own"][step] for r in runs) / 3
        torch.testing.assert_close(runs[0]["applied"][step], mean, atol=1e-7, rtol=0)
        assert all(not r["new"][step].any() for r in runs)


@pytest.mark.parametrize("freeze", [0, 2])
def test_a_resumed_run_continues_bit_for_bit(freeze):
    """Cut after 3 steps (after the variance froze, with 'adam_freeze_step' 2) and resumed
    from each rank's own optimizer and compression state, the run ends where it would have."""
    params = {**UPDATE, "adam_freeze_step": freeze}
    whole = run_local(2, train, params, 6)
    half = run_local(2, train, params, 3)
    rest = run_local(2, lambda t: train(t, params, 3, half[t.rank]["state"], first=3))
    for rank in range(2):
        assert torch.equal(rest[rank]["params"], whole[rank]["params"])


@pytest.mark.parametrize("freeze", [1, 2])
def test_synchronize_before_step_trains_as_step_alone_across_the_freeze(freeze):
    """synchronize() before step() (to clip the gradient, as Horovod's users do): the W-th
    dense step still ends with AdamW's own update and the exchange of steps starts after it,
    the same bits as step() alone. Before, synchronize() counted the step first: with W = 1
    the first step exchanged a frozen update that had no variance yet (RuntimeError), with
    W = 2 the second step did both, a dense gradient and a compressed update."""
    params = {**UPDATE, "adam_freeze_step": freeze}
    plain = run_local(2, train, params, 4)
    explicit = run_local(2, lambda t: train(t, params, 4, synchronize_first=True))
    for rank in range(2):
        assert torch.equal(explicit[rank]["params"], plain[rank]["params"])
        assert all(torch.equal(a, b) for a, b in zip(explicit[rank]["applied"],
                                                     plain[rank]["applied"]))


def test_ranks_that_disagree_on_the_exchange_all_raise():
    def fn(t):
        params = UPDATE if t.rank == 0 else {**UPDATE, "exchange": "gradient"}
        return train(t, params, 2)

    with pytest.raises(ValueError, match="exchange"):
        run_local(2, fn)


def test_bad_values_and_paths_that_cannot_exchange_updates_are_refused():
    with pytest.raises(ValueError, match="valid choices: gradient, update"):
        grace_from_params({**UPDATE, "exchange": "weights"})
    with pytest.raises(ValueError, match="leave momentum_correction at 0"):
        grace_from_params({**UPDATE, "momentum_correction": 0.9})

    def fn(t):
        grc = grace_from_params(UPDATE, transport=t)
        model = _model()
        with pytest.raises(ValueError, match="the DDP hook does not take"):
            CommHookState(grc, model)
        with pytest.raises(ValueError, match="op must be Average"):
            DistributedOptimizer(torch.optim.AdamW(model.parameters()), grc,
                                 named_parameters=model.named_parameters(),
                                 gradient_predivide_factor=2.0)

    run_local(1, fn)
    with pytest.raises(ValueError, match="FSDP2 does not take"):
        hybrid_shard(_model(), None, UPDATE)


def test_with_the_variance_frozen_density_one_is_the_frozen_adam_of_the_average_gradient():
    """'adam_freeze_step' W with the update exchange: W dense gradient steps (every rank the
    same second moment), then each rank's frozen-variance step, linear in its own momentum: at
    density 1 the average of those steps is the frozen step on the average gradient, which
    the gradient exchange takes (1-bit Adam's update)."""
    exact = {**UPDATE, "compress_ratio": 1.0, "wire": "exact", "adam_freeze_step": 2}
    by_update = run_local(3, train, exact, 5)
    by_gradient = run_local(3, train, {**exact, "exchange": "gradient"}, 5)
    for rank in range(3):
        torch.testing.assert_close(by_update[rank]["params"], by_gradient[rank]["params"],
                                   atol=1e-6, rtol=0)
    plain = run_local(3, train, {**exact, "adam_freeze_step": 0}, 5)
    assert not torch.allclose(plain[0]["params"], by_update[0]["params"], atol=1e-4)
    sparse = run_local(3, train, {**UPDATE, "adam_freeze_step": 2}, 5)
    assert all(torch.equal(r["params"], sparse[0]["params"]) for r in sparse)
    assert all((sparse[0]["applied"][step] != 0).float().mean() == 1 for step in range(2))
    assert all((sparse[0]["applied"][step] != 0).float().mean() < 0.5 for step in range(2, 5))


def torchrun_training(transport) -> dict:
    """Entry point for tests/mp_worker.py."""
    record = train(transport, UPDATE, 5)
    return {"params": record["params"], "applied": torch.stack(record["applied"])}


def test_update_exchange_under_torchrun_keeps_every_rank_identical(launch):
    per_rank = launch("gloo", 2, "test_update_exchange.torchrun_training")
    assert torch.equal(per_rank[0]["params"], per_rank[1]["params"])
    assert torch.equal(per_rank[0]["applied"], per_rank[1]["applied"])
    assert per_rank[0]["applied"].abs().sum() > 0
