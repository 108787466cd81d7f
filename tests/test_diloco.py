"""DiLoCo's outer step (experiments.diloco) on real gloo processes under torchrun: with a
constant gradient per rank and an inner SGD of lr 1, each period moves a worker by its own
gradient, so the outer step's move is known in closed form for any outer learning rate and
(Nesterov) momentum, and every rank ends with the same model. The training CLI refuses outer
settings outside their ranges."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, _env

OUTER = [(0.7, 0.9), (1.0, 0.0), (0.35, 0.0), (0.7, 0.5)]
PERIODS = 3


def outer_steps(transport) -> dict:
    """Entry point for tests/mp_worker.py: per (outer lr, momentum) of OUTER, the parameter
    after each of PERIODS periods of H = 2 inner steps, starting from 0, with the rank's
    gradient rank + 1 at every inner step."""
    from experiments.diloco import DiLoCoSync

    out = {}
    for lr, momentum in OUTER:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        sync = DiLoCoSync(model, inner, 2, lr, momentum)
        after = []
        for step in range(2 * PERIODS):
            model.weight.grad = torch.full_like(model.weight, float(transport.rank + 1))
            sync.step()
            if step % 2 == 1:
                after.append(float(model.weight))
        out[(lr, momentum)] = after
    return out


def _expected(lr: float, momentum: float, size: int) -> list[float]:
    """torch's Nesterov SGD on the averaged displacement (H steps of the mean gradient)."""
    d = 2 * sum(r + 1 for r in range(size)) / size
    w, buf, after = 0.0, None, []
    for _ in range(PERIODS):
        buf = d if buf is None else momentum * buf + d
        w -= lr * (d + momentum * buf if momentum else d)
        after.append(w)
    return after


def test_the_outer_step_moves_by_the_outer_sgd_on_the_averaged_displacement(launch):
    ranks = launch("gloo", 2, "test_diloco.outer_steps")
    for lr, momentum in OUTER:
        assert ranks[0][(lr, momentum)] == ranks[1][(lr, momentum)]
        assert ranks[0][(lr, momentum)] == pytest.approx(_expected(lr, momentum, 2))
    # lr 1 without momentum is plain averaging: each period moves by the mean displacement, 3
    plain = ranks[0][(1.0, 0.0)]
    assert plain == pytest.approx([-3.0, -6.0, -9.0])
    # the paper's outer step moves the third period 0.7 * (1 + 0.9 + 0.9**2 + 0.9**3)x as far
    paper = ranks[0][(0.7, 0.9)]
    assert paper[2] - paper[1] == pytest.approx(-3 * 0.7 * (1 + 0.9 + 0.81 + 0.729))


@pytest.mark.parametrize("option, value", [("--diloco-outer-lr", "0"),
                                           ("--diloco-outer-momentum", "1"),
                                           ("--diloco-outer-momentum", "-0.1")])
def test_the_cli_refuses_outer_settings_outside_their_ranges(option, value, tmp_path):
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn",
           "--dataset", "digits", "--compression", "--compressor", "diloco", "--max-steps", "1",
           "--out", str(tmp_path), option, value]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--diloco-outer-lr must be > 0 and --diloco-outer-momentum in [0, 1)" in proc.stderr
