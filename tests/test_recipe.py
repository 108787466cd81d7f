"""The training CLI's optimiser recipes (experiments.recipe) and the transformer they train."""
from __future__ import annotations

import math

import pytest
import torch

from experiments import cli, recipe
from testbed.models import build_model


def _args(*extra: str):
    return cli.parse_args(["--dnn", "transformer", "--dataset", "wikipedia-chars",
                                    "--max-epochs", "2", *extra])


def test_adamw_recipe_decays_matrices_only_and_keeps_torchtitans_betas():
    args = _args("--optimizer", "adamw", "--lr", "3e-3")
    model = build_model("transformer", 128, 128)
    optimizer = recipe.make_optimizer(args, model)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert decayed["betas"] == (0.9, 0.95) and args.lr_schedule == "cosine"
    sgd = recipe.make_optimizer(_args(), model)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["weight_decay"] == 1e-4
    corrected = recipe.make_optimizer(_args("--compression", "--momentum-correction", "0.9"), model)
    assert corrected.param_groups[0]["momentum"] == 0.0
    assert corrected.param_groups[0]["weight_decay"] == pytest.approx(1e-3)


def test_cosine_schedule_warms_up_from_zero_and_ends_at_a_tenth():
    args = _args("--optimizer", "adamw", "--warmup-epochs", "0.5")
    steps = 10  # per epoch: 5 warm-up steps, then 15 of cosine
    factors = [recipe.lr_factor(s, steps, args, world=4) for s in range(20)]
    assert factors[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert factors[5] == 1.0 and all(a > b for a, b in zip(factors[5:], factors[6:]))
    assert recipe.lr_factor(20, steps, args, 4) == pytest.approx(0.1)
    middle = recipe.lr_factor(5 + 7, steps, args, 4)
    assert middle == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))


def test_step_schedule_is_the_cnn_recipes():
    args = _args("--warmup-epochs", "1", "--lr-decay", "1.5")
    assert recipe.lr_factor(0, 10, args, world=4) == 0.25  # lr/P
    assert recipe.lr_factor(10, 10, args, world=4) == 1.0
    assert recipe.lr_factor(15, 10, args, world=4) == pytest.approx(0.1)


@pytest.mark.parametrize("extra,message", [
    (["--optimizer", "adamw", "--compression", "--momentum-correction", "0.9"],
     "--momentum-correction is DGC's for SGD's momentum"),
    (["--optimizer", "adamw", "--lr-decay", "1"], "--lr-decay belongs to --lr-schedule step"),
    (["--clip-norm", "0"], "--clip-norm > 0"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
])
def test_recipes_that_cannot_run_are_refused(capsys, extra, message):
    with pytest.raises(SystemExit):
        _args(*extra)
    assert message in capsys.readouterr().err


def test_the_transformer_is_causal_and_refuses_a_longer_sequence():
    """Changing the last token changes no earlier position's logits (the mask holds)."""
    torch.manual_seed(0)
    model = build_model("transformer", 128, 128).eval()
    ids = torch.randint(0, 128, (2, 64))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 128
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])
    with pytest.raises(ValueError, match="exceed the context of 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def test_clipping_bounds_the_global_norm():
    model = build_model("transformer", 128, 128)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    recipe.clip(model, 1.0)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert norm == pytest.approx(1.0, rel=1e-5)


def test_adam_freeze_step_reaches_the_library_and_is_refused_where_it_cannot_act(capsys):
    args = _args("--optimizer", "adamw", "--compression", "--adam-freeze-step", "50")
    assert cli.grace_params(args)["adam_freeze_step"] == 50
    for extra in (["--compression", "--adam-freeze-step", "50"],  # sgd
                  ["--optimizer", "adamw", "--compression", "--fsdp", "hybrid", "--nworkers", "4",
                   "--adam-freeze-step", "5"],
                  ["--optimizer", "adamw", "--compression", "--compressor", "torch_powersgd",
                   "--adam-freeze-step", "5"]):
        with pytest.raises(SystemExit):
            _args(*extra)
        assert "--adam-freeze-step N (N >= 1) freezes AdamW's second moment" in capsys.readouterr().err


def test_exchange_update_reaches_the_library_and_is_refused_where_it_cannot_act(capsys):
    args = _args("--optimizer", "adamw", "--compression", "--exchange", "update")
    assert cli.grace_params(args)["exchange"] == "update"
    assert "exchange" not in cli.grace_params(_args("--compression"))
    for extra in (["--exchange", "update"],  # no compression: DDP's own all-reduce
                  ["--compression", "--ddp-hook", "--exchange", "update"],
                  ["--compression", "--fsdp", "hybrid", "--nworkers", "4", "--exchange", "update"],
                  ["--compression", "--compressor", "torch_powersgd", "--exchange", "update"],
                  ["--compression", "--momentum-correction", "0.9", "--exchange", "update"]):
        with pytest.raises(SystemExit):
            _args(*extra)
        assert "--exchange update synchronises each rank's optimizer step" in capsys.readouterr().err
