"""grace_from_params' 'adam_freeze_step' (spardl_grace.frozen_adam): Adam's second moment
frozen after dense steps, so that its update is linear in the sparse, error-fed gradient.
Real ranks are threads of run_local over its in-process transport."""
from __future__ import annotations

import threading

import pytest
import torch

from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.frozen_adam import frozen_step

SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05, "min_entries": 0}


_SEEDING = threading.Lock()  # run_local's ranks are threads sharing torch's generator


def _model(seed: int = 0) -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(t, params: dict, steps: int, freeze: int | None = None, state: dict | None = None,
           first: int = 0, adam=torch.optim.AdamW) -> dict:
    """`steps` steps from `first` of AdamW under DistributedOptimizer on this rank's batches;
    per step the parameters, the synchronised gradient and the second moment."""
    model = _model()
    grc = grace_from_params({**params, **({"adam_freeze_step": freeze} if freeze else {})},
                            transport=t)
    opt = DistributedOptimizer(adam(model.parameters(), lr=0.01, weight_decay=0.1), grc,
                               named_parameters=model.named_parameters())
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_compression_state_dict(state["compression"])
    record = {"params": [], "grads": [], "variance": []}
    for step in range(first, first + steps):
        x, y = _batch(t.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        record["grads"].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        with opt.skip_synchronize():
            opt.step()
        record["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        record["variance"].append(torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1)
                                             for p in model.parameters()]))
    record["state"] = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "compression": opt.compression_state_dict()}
    return record


def test_a_burst_moves_an_entry_as_far_as_the_steps_it_holds():
    """With the variance frozen (and beta1 0, no decay) one step on g1 + g2 moves the
    parameters exactly as far as a step on g1 and one on g2: what error feedback delays
    arrives whole. Adam's own update moves them about one step's length either way."""
    def after(grads, update):
        p = torch.nn.Parameter(torch.zeros(5))
        opt = torch.optim.Adam([p], lr=0.1, betas=(0.0, 0.99))
        p.grad = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0])
        opt.step()  # the dense step whose second moment is frozen
        start = p.detach().clone()
        for g in grads:
            p.grad = g.clone()
            update(opt)
        return p.detach() - start
    g1, g2 = torch.tensor([0.3, -1.0, 0.2, 2.0, 0.0]), torch.tensor([0.3, 0.5, 0.2, 1.0, 4.0])
    assert torch.allclose(after([g1 + g2], frozen_step), after([g1, g2], frozen_step), atol=1e-6)
    adam = after([g1 + g2], lambda o: o.step())
    assert not torch.allclose(adam, after([g1, g2], lambda o: o.step()), atol=1e-3)


def test_frozen_step_is_adamws_update_with_the_old_second_moment():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in ([0.5, 1.0, -1.0], [0.2, -0.4, 0.1]):
        p.grad = torch.tensor(g)
        opt.step()
    m, v = opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()
    before, g = p.detach().clone(), torch.tensor([4.0, 0.0, -0.3])
    p.grad = g
    frozen_step(opt)
    m = 0.9 * m + 0.1 * g
    expected = before * (1 - 0.1 * 0.1) - 0.1 * (m / (1 - 0.9 ** 3)) / (
        (v / (1 - 0.95 ** 2)).sqrt() + 1e-8)
    assert torch.allclose(p.detach(), expected, atol=1e-6)
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)  # frozen
    assert float(opt.state[p]["step"]) == 3 and float(opt.state[p]["variance_frozen_at"]) == 2


def test_under_distributed_optimizer_dense_until_the_freeze_then_sparse_and_frozen():
    """3 ranks, freeze at step 3: the first 3 steps are dense AdamW's bit for bit, the
    second moment never moves after them, later gradients are sparse, every rank holds the
    same parameters, and a run resumed from a checkpoint after step 5 ends bit for bit where
    the straight one does."""
    freeze, steps = 3, 8
    frozen = run_local(3, lambda t: _train(t, SPARDL, steps, freeze))
    dense = run_local(3, lambda t: _train(t, {"compressor": "none", "memory": "none",
                                              "communicator": "dense"}, freeze))
    for rank in frozen:
        for step in range(steps):
            assert torch.equal(rank["params"][step], frozen[0]["params"][step])
    for step in range(freeze):
        assert torch.equal(frozen[0]["params"][step], dense[0]["params"][step])
    for step in range(freeze, steps):
        assert torch.equal(frozen[0]["variance"][step], frozen[0]["variance"][freeze - 1])
        nonzero = int(frozen[0]["grads"][step].count_nonzero())
        assert 0 < nonzero <= 3 * round(0.05 * frozen[0]["grads"][step].numel())
    cut = run_local(3, lambda t: _train(t, SPARDL, 5, freeze))
    resumed = run_local(3, lambda t: _train(t, SPARDL, steps - 5, freeze,
                                            state=cut[t.rank]["state"], first=5))
    for rank in range(3):
        assert torch.equal(resumed[rank]["params"][-1], frozen[rank]["params"][-1])


def test_adam_with_l2_decay_is_continued_too():
    """torch.optim.Adam (weight decay added to the gradient) runs frozen as well; its ranks
    agree."""
    out = run_local(2, lambda t: _train(t, SPARDL, 5, 2, adam=torch.optim.Adam))
    assert torch.equal(out[0]["params"][-1], out[1]["params"][-1])
    assert torch.equal(out[0]["variance"][-1], out[0]["variance"][1])


def test_ranks_that_disagree_on_the_freeze_all_raise():
    def fn(t):
        try:
            _train(t, SPARDL, 4, 2 + t.rank)
        except ValueError as exc:
            return str(exc)
        return None
    errors = run_local(2, fn)
    assert errors[0] == errors[1] and "adam_freeze_step: rank 0 2, rank 1 3" in errors[0], errors


def test_what_cannot_freeze_is_refused_naming_the_way():
    def sgd(t):
        grc = grace_from_params({**SPARDL, "adam_freeze_step": 10}, transport=t)
        return DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), grc)
    with pytest.raises(ValueError, match="freezes the second moment of torch.optim.Adam or "
                                         "AdamW; the optimizer is SGD"):
        run_local(1, sgd)

    def amsgrad(t):
        grc = grace_from_params({**SPARDL, "adam_freeze_step": 10}, transport=t)
        return DistributedOptimizer(torch.optim.Adam(_model().parameters(), amsgrad=True), grc)
    with pytest.raises(ValueError, match="amsgrad=False only"):
        run_local(1, amsgrad)
    with pytest.raises(ValueError, match="communicator 'dense' sends it whole"):
        grace_from_params({"compressor": "none", "memory": "none", "communicator": "dense",
                           "adam_freeze_step": 5}, transport=None)
    with pytest.raises(ValueError, match="adam_freeze_step"):
        grace_from_params({**SPARDL, "adam_freeze_step": -1})


def test_a_negative_dense_warmup_is_refused_with_or_without_the_freeze():
    """The freeze lengthens the dense steps; it must not hide a bad dense_warmup_steps."""
    from spardl_grace import CommHookState

    def fn(t):
        errors = []
        for freeze in (0, 3):
            grc = grace_from_params({**SPARDL, "adam_freeze_step": freeze}, transport=t)
            for build in (lambda: DistributedOptimizer(torch.optim.AdamW(_model().parameters()),
                                                       grc, dense_warmup_steps=-1),
                          lambda: CommHookState(grc, _model(), dense_warmup_steps=-1)):
                with pytest.raises(ValueError, match="dense_warmup_steps must be an int >= 0"):
                    build()
                errors.append(freeze)
        return errors
    assert run_local(1, fn) == [[0, 0, 3, 3]]
