"""grace_from_params' 'exchange_period', 'outer_lr' and 'outer_momentum' with 'exchange':
'update': DiLoCo's schedule (H steps of each rank's own optimizer, then the ranks average their
moves and an outer Nesterov SGD moves the shared parameters), and SparseLoCo's when the
communicator is sparse (the moves exchanged with error feedback). Ranks are threads of
run_local over its in-process transport, and real processes under torchrun."""
from __future__ import annotations

import copy

import deepreduce_compat  # noqa: F401  (registers DeepReduce's keys)
import pytest
import torch

from spardl_grace import (
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    grace_from_params,
)
from spardl_grace.transport import run_local
from test_update_exchange import UPDATE, _batch, _flat, _model, _residuals

DILOCO = {**UPDATE, "exchange_period": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
EXACT = {"compress_ratio": 1.0, "wire": "exact"}
# SparseLoCo's cheap entries: DeepReduce's delta-coded indices and QSGD values (stochastic
# rounding), whose error each sender keeps in its residual
CHEAP = {"deepreduce": "both", "index": "delta", "value": "qsgd"}


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train(t, params: dict, steps: int, state: dict | None = None, first: int = 0) -> dict:
    """`steps` AdamW steps under DistributedOptimizer from `first`. Per step: the parameters
    after it, the rank's own AdamW result (a shadow AdamW fed the same parameters and
    gradients) and the residuals before and after it."""
    model = _model()
    grc = grace_from_params(params, transport=t)
    opt = DistributedOptimizer(_adamw(model), grc, named_parameters=model.named_parameters())
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_compression_state_dict(state["compression"])
    shadow = copy.deepcopy(model)
    shadow_opt = _adamw(shadow)
    shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    record: dict = {"after": [], "own": [], "old": [], "new": []}
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, t.rank, step).backward()
        with torch.no_grad():
            for s, p in zip(shadow.parameters(), model.parameters()):
                s.copy_(p)
                s.grad = p.grad.clone()
        shadow_opt.step()
        record["old"].append(_residuals(grc, names))
        opt.step()
        record["own"].append(_flat(shadow))
        record["after"].append(_flat(model))
        record["new"].append(_residuals(grc, names))
    record["state"] = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "compression": opt.compression_state_dict()}
    return record


def diloco_by_hand(size: int, period: int, steps: int, lr: float, momentum: float) -> list:
    """DiLoCo as published, in one process: each rank's AdamW on its own batches, every
    `period` steps the mean of their displacements from the shared parameters as the gradient
    of torch.optim.SGD(nesterov) on those, which every rank then continues from. The shared
    parameters after each outer step."""
    models = [_model() for _ in range(size)]
    inner = [_adamw(m) for m in models]
    shared = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(shared, lr=lr, momentum=momentum, nesterov=momentum > 0)
    after = []
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, inner)):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
        if (step + 1) % period:
            continue
        with torch.no_grad():
            for i, g in enumerate(shared):
                g.grad = sum(g - list(m.parameters())[i] for m in models) / size
            outer.step()
            for m in models:
                for p, g in zip(m.parameters(), shared):
                    p.copy_(g)
        after.append(torch.cat([g.reshape(-1) for g in shared]))
    return after


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0)])
def test_at_density_one_it_is_diloco_with_the_outer_nesterov_step(lr, momentum):
    """Dense and exact, the ranks' parameters after each exchange are DiLoCo's (AdamW inside,
    SGD with Nesterov momentum outside), identical on every rank, and between exchanges each
    rank holds its own."""
    params = {**DILOCO, **EXACT, "outer_lr": lr, "outer_momentum": momentum}
    runs = run_local(3, train, params, 9)
    expected = diloco_by_hand(3, 3, 9, lr, momentum)
    for k, step in enumerate((2, 5, 8)):
        for r in runs:
            assert torch.equal(r["after"][step], runs[0]["after"][step])
            torch.testing.assert_close(r["after"][step], expected[k], atol=2e-6, rtol=0)
    for step in (0, 1, 3, 4, 6, 7):  # local steps: the rank's own AdamW, nothing else
        assert all(torch.equal(r["after"][step], r["own"][step]) for r in runs)
        assert not torch.equal(runs[0]["after"][step], runs[1]["after"][step])


@pytest.mark.parametrize("codec", [{}, CHEAP], ids=["compact", "delta_qsgd"])
def test_sparse_moves_conserve_their_mass_and_keep_the_ranks_identical(codec):
    """SparseLoCo's exchange (outer lr 1, no momentum): at each exchange, the ranks' moves
    since the last one plus their old residuals equal P times the move applied plus the new
    residuals; the move applied is sparse and the same on every rank, also with its entries
    quantised (the rounding stays in the residuals)."""
    params = {**UPDATE, "exchange_period": 2, **codec}
    size, steps = 3, 8
    runs = run_local(size, train, params, steps)
    anchor = _flat(_model())
    for step in range(1, steps, 2):
        moved = [anchor - r["own"][step] for r in runs]
        applied = anchor - runs[0]["after"][step]
        assert all(torch.equal(r["after"][step], runs[0]["after"][step]) for r in runs)
        asked = sum(m + r["old"][step] for m, r in zip(moved, runs))
        kept = sum(r["new"][step] for r in runs)
        torch.testing.assert_close(asked, size * applied + kept, atol=1e-6, rtol=0)
        assert 0 < (applied != 0).float().mean() < 0.5
        anchor = runs[0]["after"][step]
    for step in range(0, steps, 2):  # a local step leaves the residuals as they were
        assert all(torch.equal(r["new"][step], r["old"][step]) for r in runs)


@pytest.mark.parametrize("codec", [{}, CHEAP], ids=["compact", "delta_qsgd"])
def test_a_run_cut_between_exchanges_resumes_bit_for_bit(codec):
    """Cut after 4 steps (one into the second period, with outer momentum) and resumed from
    each rank's checkpoint, the run ends where it would have (QSGD's rounding draws too);
    a checkpoint without the outer state is refused rather than resumed from the wrong
    place."""
    params = {**DILOCO, **codec}
    whole = run_local(2, train, params, 8)
    half = run_local(2, train, params, 4)
    rest = run_local(2, lambda t: train(t, params, 4, half[t.rank]["state"], first=4))
    for rank in range(2):
        assert torch.equal(rest[rank]["after"][-1], whole[rank]["after"][-1])
    plain = run_local(1, train, UPDATE, 1)[0]["state"]
    assert "outer" not in plain["compression"]

    def resume_without(t):
        with pytest.raises(ValueError, match="holds no outer state"):
            train(t, DILOCO, 1, plain)

    run_local(1, resume_without)


def resume_from_root(t, params: dict, state: dict, first: int, steps: int) -> list:
    """Horovod's resume: rank 0 loads the checkpoint, then broadcasts the parameters and the
    optimizer's state; the parameters after each of `steps` steps from `first`."""
    model = _model()
    opt = DistributedOptimizer(_adamw(model), grace_from_params(params, transport=t),
                               named_parameters=model.named_parameters())
    if t.rank == 0:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_compression_state_dict(state["compression"])
    broadcast_parameters(model.state_dict(), 0, t)
    broadcast_optimizer_state(opt, 0, t)
    after = []
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, t.rank, step).backward()
        opt.step()
        after.append(_flat(model))
    return after


def test_ranks_resumed_from_root_take_its_outer_state_and_exchange_in_step():
    """Cut one step into a period and resumed the Horovod way (only rank 0 loads), every rank
    takes rank 0's steps since the exchange and its parameters then: the next exchange comes
    two steps later on every rank and leaves them identical. Without root's outer state the
    others would count a fresh period from the broadcast parameters, and the ranks would
    part."""
    half = run_local(2, train, DILOCO, 4)
    after = run_local(2, lambda t: resume_from_root(t, DILOCO, half[0]["state"], 4, 5))
    assert not torch.equal(after[0][0], after[1][0])  # step 5: local
    assert torch.equal(after[0][1], after[1][1])  # step 6: the exchange
    assert not torch.equal(after[0][2], after[1][2]) and torch.equal(after[0][4], after[1][4])


def test_ranks_that_disagree_on_the_period_all_raise():
    def fn(t):
        return train(t, {**DILOCO, "exchange_period": 2 + t.rank}, 3)

    with pytest.raises(ValueError, match="exchange_period"):
        run_local(2, fn)


def test_bad_values_and_outer_keys_without_the_update_exchange_are_refused():
    for key, value, rule in (("exchange_period", 0, "an int >= 1"),
                             ("exchange_period", 2.0, "an int >= 1"),
                             ("outer_lr", 0, "a number > 0"),
                             ("outer_momentum", 1.0, r"a number in \[0, 1\)")):
        with pytest.raises(ValueError, match=rule):
            grace_from_params({**DILOCO, key: value})
    gradient = {**UPDATE, "exchange": "gradient"}
    with pytest.raises(ValueError, match="exchange_period, outer_lr shape .* 'exchange': 'update'"):
        grace_from_params({**gradient, "exchange_period": 4, "outer_lr": 0.5})
    with pytest.raises(ValueError, match="outer_momentum shape"):
        grace_from_params({"communicator": "auto", "memory": "global_residual",
                           "outer_momentum": 0.9})


def torchrun_training(transport) -> dict:
    """Entry point for tests/mp_worker.py."""
    record = train(transport, DILOCO, 6)
    return {"after": torch.stack(record["after"])}


def test_diloco_under_torchrun_keeps_the_ranks_identical_after_each_exchange(launch):
    per_rank = launch("gloo", 2, "test_outer_exchange.torchrun_training")
    first, second = per_rank[0]["after"], per_rank[1]["after"]
    assert torch.equal(first[2], second[2]) and torch.equal(first[5], second[5])
    assert not torch.equal(first[0], second[0])
