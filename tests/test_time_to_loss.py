"""experiments.time_to_loss: steps and seconds to dense's validation loss, from an ablation
directory laid out as experiments.ablation writes it and benchmarks.train_step's step times."""
from __future__ import annotations

import json

import pytest

from experiments import time_to_loss


def _run(out, config: str, seed: int, losses: list[float], window_bytes: list[float]) -> None:
    """A finished run evaluated every 100 steps."""
    folder = out / f"{config}-seed{seed}"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"config": config, "seed": seed}))
    evals = [{"kind": "eval", "step": 100 * (i + 1), "test_loss": loss, "bytes_sent_per_step": b}
             for i, (loss, b) in enumerate(zip(losses, window_bytes))]
    (folder / "log.jsonl").write_text("\n".join(json.dumps(e) for e in evals) + "\n")


def _steps(path, rate: str, **rows: float) -> None:
    path.write_text(json.dumps({"networks": {rate: {k: {"step_s": v} for k, v in rows.items()}}}))


def test_time_to_dense_loss_uses_the_mean_curve_step_times_and_the_dense_starts_bytes(tmp_path):
    """Dense's mean loss at step 300 is 2.0 (seeds 1.9 and 2.1). The frozen-variance arm's mean
    curve (two seeds) first reaches it at step 300, after a dense start of 100 steps whose
    bytes beyond its steady state's cost wire time at the rate; PowerSGD never does; at the
    earlier target (step 100, 3.0) PowerSGD is there at once. Step times come from two files,
    merged; dense is timed as DDP."""
    dense, sparse = 1000.0, 10.0
    _run(tmp_path, "dense", 0, [2.9, 2.4, 1.9], [dense] * 3)
    _run(tmp_path, "dense", 1, [3.1, 2.6, 2.1], [dense] * 3)
    for seed, last in ((0, 1.9), (1, 2.05)):
        _run(tmp_path, "spardl@0.01+adamfreeze", seed, [3.5, 2.5, last], [dense, sparse, sparse])
    _run(tmp_path, "powersgd4", 0, [2.8, 2.3, 2.2], [50.0] * 3)
    _steps(tmp_path / "a.json", "100mbit", ddp=1.0, powersgd4=0.4)
    _steps(tmp_path / "b.json", "100mbit", **{"spardl@0.01+adamfreeze": 0.5})
    results = time_to_loss.main([str(tmp_path), "--target-step", "300,100", "--step-times",
                                 f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}",
                                 "--provenance", "Recorded X"])
    at_300, at_100 = results
    assert at_300["target_loss"] == pytest.approx(2.0)
    rows = at_300["configs"]
    assert rows["dense"]["steps"] == 300 and rows["dense"]["100mbit"]["seconds"] == 300.0
    extra = (dense - sparse) * 100 * 8 / 100e6
    assert rows["spardl@0.01+adamfreeze"]["steps"] == 300
    assert rows["spardl@0.01+adamfreeze"]["100mbit"] == {
        "step_s": 0.5, "seconds": pytest.approx(300 * 0.5 + extra), "warmup_wire_s": extra}
    assert rows["powersgd4"] == {"steps": None, "100mbit": None}
    assert at_100["target_loss"] == pytest.approx(3.0)
    assert at_100["configs"]["powersgd4"]["steps"] == 100
    assert at_100["configs"]["spardl@0.01+adamfreeze"]["steps"] == 200
    text = (tmp_path / "time_to_loss.md").read_text()
    first, second = text.split("Time to dense's mean validation loss at step ")[1:]
    assert first.startswith("300 (2.0000):")
    assert "| powersgd4 | not reached | - | - |\n" in first
    assert "| powersgd4 | 100 | 0.400 | 40 |\n" in second
    for table in (first, second):  # each table is followed by its provenance line
        assert table.rstrip().endswith(" |\n\nRecorded X")
    assert json.loads((tmp_path / "time_to_loss.json").read_text()) == {
        "step_times": [str(tmp_path / "a.json"), str(tmp_path / "b.json")],
        "results": json.loads(json.dumps(results))}


def test_a_resumed_runs_repeated_evaluations_count_once(tmp_path):
    _run(tmp_path, "dense", 0, [3.0, 2.0], [8.0, 8.0])
    log = tmp_path / "dense-seed0" / "log.jsonl"
    log.write_text(log.read_text() + json.dumps(
        {"kind": "eval", "step": 200, "test_loss": 1.5, "bytes_sent_per_step": 8.0}) + "\n")
    assert time_to_loss.loss_curves(tmp_path) == {"dense": [[(100, 3.0, 8.0), (200, 1.5, 8.0)]]}


def test_bad_targets_and_step_times_timed_twice_are_refused_naming_the_problem(tmp_path):
    _run(tmp_path, "dense", 0, [3.0, 2.0], [8.0, 8.0])
    _steps(tmp_path / "a.json", "1gbit", ddp=1.0)
    with pytest.raises(ValueError, match="no evaluation at step 150; it has 100, 200"):
        time_to_loss.main([str(tmp_path), "--step-times", str(tmp_path / "a.json"),
                           "--target-step", "150"])
    with pytest.raises(ValueError, match="times ddp at 1gbit again"):
        time_to_loss.merged_step_times([tmp_path / "a.json", tmp_path / "a.json"])
    with pytest.raises(SystemExit):
        time_to_loss.main([str(tmp_path), "--step-times", str(tmp_path / "a.json"),
                           "--target-step", "late"])
    with pytest.raises(ValueError, match="no finished dense run"):
        time_to_loss.time_to_loss({"powersgd4": [[(100, 2.0, 1.0)]]}, {"networks": {}}, 100)
