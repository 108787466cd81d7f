"""DiLoCo's outer step (experiments.diloco) on real gloo processes under torchrun: with a
constant gradient per rank and an inner SGD of lr 1, each period moves a worker by its own
gradient, so the outer step's move is known in closed form for any outer learning rate and
(Nesterov) momentum, also with SparDL at density 1 averaging it; at a lower density the
outer gradient's mass is conserved through SparDL's residuals. Every rank ends with the same
model. The training CLI refuses outer settings outside their ranges."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, _env

OUTER = [(0.7, 0.9, None), (1.0, 0.0, None), (0.35, 0.0, None), (0.7, 0.5, None),
         (0.7, 0.9, 1.0)]
PERIODS = 3


def outer_steps(transport) -> dict:
    """Entry point for tests/mp_worker.py: per (outer lr, momentum, outer density) of OUTER,
    the parameter after each of PERIODS periods of H = 2 inner steps, starting from 0, with
    the rank's gradient rank + 1 at every inner step; and sparse_outer's record."""
    from experiments.diloco import DiLoCoSync

    out = {"sparse": sparse_outer(transport)}
    for lr, momentum, density in OUTER:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        sync = DiLoCoSync(model, inner, 2, lr, momentum, density, transport)
        after = []
        for step in range(2 * PERIODS):
            model.weight.grad = torch.full_like(model.weight, float(transport.rank + 1))
            sync.step()
            if step % 2 == 1:
                after.append(float(model.weight))
        out[(lr, momentum, density)] = after
    return out


def sparse_outer(transport) -> list[dict]:
    """Per period of H = 2 inner steps (inner SGD lr 1, this rank's own random gradient of 64
    entries), outer lr 1 without momentum and SparDL at density 0.25: the global model before
    and after the outer step, this rank's displacement, its residual before and after."""
    from experiments.diloco import DiLoCoSync

    model = torch.nn.Linear(64, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    sync = DiLoCoSync(model, torch.optim.SGD(model.parameters(), lr=1.0), 2, 1.0, 0.0, 0.25,
                      transport, min_entries=0)
    residuals = sync.sparse.memory.residuals
    grad = torch.randn(1, 64, generator=torch.Generator().manual_seed(transport.rank))
    record = []
    for _ in range(PERIODS):
        before = sync.global_params[0].detach().clone().reshape(-1)
        old = residuals.get("diloco.outer", torch.zeros(64)).clone()
        for _ in range(2):
            model.weight.grad = grad.clone()
            sync.step()
        record.append({"before": before, "after": model.weight.detach().clone().reshape(-1),
                       "delta": 2 * grad.reshape(-1), "old": old,
                       "new": residuals["diloco.outer"].clone(), "bytes": sync.bytes_sent})
    return record


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
    for key in OUTER:
        assert ranks[0][key] == ranks[1][key]
        assert ranks[0][key] == pytest.approx(_expected(*key[:2], 2))
    # lr 1 without momentum is plain averaging: each period moves by the mean displacement, 3
    plain = ranks[0][(1.0, 0.0, None)]
    assert plain == pytest.approx([-3.0, -6.0, -9.0])
    # the paper's outer step moves the third period 0.7 * (1 + 0.9 + 0.9**2 + 0.9**3)x as far
    paper = ranks[0][(0.7, 0.9, None)]
    assert paper[2] - paper[1] == pytest.approx(-3 * 0.7 * (1 + 0.9 + 0.81 + 0.729))
    # SparDL at density 1 averages as the all-reduce does
    assert ranks[0][(0.7, 0.9, 1.0)] == pytest.approx(paper)
    # at 0.25 the displacements plus the old residuals are the averaged move (outer lr 1)
    # times the ranks plus the new residuals; the global models agree; bytes below dense's
    for period in range(PERIODS):
        a, b = (r["sparse"][period] for r in ranks)
        assert torch.equal(a["after"], b["after"])
        moved = a["before"] - a["after"]
        assert moved.count_nonzero() < 64
        assert torch.allclose(a["delta"] + a["old"] + b["delta"] + b["old"],
                              2 * moved + a["new"] + b["new"], atol=1e-5)
    assert 0 < ranks[0]["sparse"][-1]["bytes"] < PERIODS * 4 * 64


@pytest.mark.parametrize("option, value, message", [
    ("--diloco-outer-lr", "0", "--diloco-outer-lr must be > 0 and --diloco-outer-momentum in"),
    ("--diloco-outer-momentum", "1", "--diloco-outer-momentum in [0, 1)"),
    ("--diloco-outer-momentum", "-0.1", "--diloco-outer-momentum in [0, 1)"),
    ("--diloco-outer-density", "0", "--diloco-outer-density must be in (0, 1], got 0.0"),
    ("--diloco-outer-density", "1.5", "--diloco-outer-density must be in (0, 1], got 1.5")])
def test_the_cli_refuses_outer_settings_outside_their_ranges(option, value, message, tmp_path):
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn",
           "--dataset", "digits", "--compression", "--compressor", "diloco", "--max-steps", "1",
           "--out", str(tmp_path), option, value]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
