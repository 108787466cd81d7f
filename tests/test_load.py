"""The load burst (testbed.load): busy processes for a stretch of steps, asked for as STEP:STEPS
by the training CLI and benchmarks.train_step, started by rank 0 alone and never left spinning."""
from __future__ import annotations

import pytest
import torch

from experiments import cli, main_trainer
from spardl_grace.transport import run_local
from testbed.load import LoadBurst, load_burst


def test_a_burst_is_asked_for_as_step_and_steps():
    assert load_burst("100:60") == (100, 60)
    assert load_burst("0:1") == (0, 1)
    for bad, message in (("100", "STEP:STEPS"), ("a:5", "STEP:STEPS"), ("1:2:3", "STEP:STEPS"),
                         ("-1:5", ">= 0"), ("5:0", "STEPS >= 1")):
        with pytest.raises(ValueError, match=message):
            load_burst(bad)


def test_the_busy_processes_run_for_the_bursts_steps_only():
    burst = LoadBurst(2, 2, processes=2)
    for step in (0, 1):
        burst.at_step(step)
        assert not burst.running
    burst.at_step(2)
    started = list(burst._running)
    assert len(started) == 2 and all(p.poll() is None for p in started)
    burst.at_step(3)
    assert burst._running == started  # not started twice
    burst.at_step(4)
    assert not burst.running and all(p.returncode is not None for p in started)
    burst.stop()  # idempotent


def test_the_options_are_checked_where_they_are_given(tmp_path, capsys):
    from benchmarks import train_step

    args = cli.parse_args(["--load-burst", "100:60", "--out", str(tmp_path)])
    assert args.load_burst == (100, 60)
    with pytest.raises(SystemExit):
        cli.parse_args(["--load-burst", "100", "--out", str(tmp_path)])
    assert "--load-burst: expected STEP:STEPS" in capsys.readouterr().err
    assert train_step.parse_args(["--load-burst", "5:3", "--steps", "30"]).load_burst == "5:3"
    with pytest.raises(SystemExit):
        train_step.parse_args(["--load-burst", "30:3", "--steps", "30"])
    assert "within the run's 30 steps" in capsys.readouterr().err


@pytest.mark.parametrize("burst,running_at_end", [("1:1", False), ("2:10", True)])
def test_rank_0_alone_runs_the_burst_and_the_run_leaves_nothing_spinning(
        tmp_path, monkeypatch, burst, running_at_end):
    """Two workers, 3 steps: one burst (rank 0's), its processes started at its step; killed at
    its end, or by the run's end when the burst outlasts the run."""
    made: list[LoadBurst] = []
    seen: list[tuple[int, bool]] = []

    class Spy(LoadBurst):
        def __init__(self, *a):
            super().__init__(*a, processes=1)
            made.append(self)

        def at_step(self, step):
            super().at_step(step)
            seen.append((step, self.running))
            self.started = getattr(self, "started", []) + list(self._running)

    monkeypatch.setattr(main_trainer, "LoadBurst", Spy)
    args = cli.parse_args([
        "--dnn", "fashioncnn", "--dataset", "digits", "--batch-size", "16", "--max-epochs", "1",
        "--max-steps", "3", "--compression", "--compressor", "spardl", "--out", str(tmp_path),
        "--load-burst", burst])
    run_local(2, lambda t: main_trainer.train(args, t))
    assert len(made) == 1
    start, steps = load_burst(burst)
    assert seen == [(s, start <= s < start + steps) for s in range(3)]
    assert seen[-1][1] == running_at_end
    assert made[0].started and all(p.returncode is not None for p in made[0].started)
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
