"""experiments.loss_front: the loss-per-byte front of arms from several ablation folders (their
results.json as experiments.ablation writes it), with Welch's verdict against the first arm."""
from __future__ import annotations

import json

import pytest

from experiments import loss_front


def _results(folder, runs: list[tuple[str, int, float, float]]) -> None:
    """FOLDER/results.json with runs (config, seed, test loss, bytes per step)."""
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"runs": [
        {"config": c, "seed": s, "test_loss": loss, "bytes_run": b, "dense_bytes": 1000.0}
        for c, s, loss, b in runs]}))


def test_rows_have_seed_statistics_bytes_and_welch_verdicts_against_the_first_arm(tmp_path):
    """Dense (1.80, 1.82) against a clearly higher sparse arm (worse), a one-seed arm (level:
    no interval) and an overlapping arm (level); the second folder's only config is taken
    without naming it; the plot and the JSON are written."""
    _results(tmp_path / "a", [("dense", 0, 1.80, 1000.0), ("dense", 1, 1.82, 1000.0),
                              ("powersgd4", 0, 1.81, 150.0), ("powersgd4", 1, 1.83, 150.0)])
    _results(tmp_path / "b", [("spardl@0.4+update", s, 1.90 + 0.01 * s, 40.0) for s in range(3)])
    _results(tmp_path / "c", [("diloco2", 0, 1.86, 500.0)])
    out = tmp_path / "front" / "loss"
    rows = loss_front.main([str(out), f"dense={tmp_path / 'a'}:dense",
                            f"sparse={tmp_path / 'b'}", f"one seed={tmp_path / 'c'}",
                            f"PowerSGD 4={tmp_path / 'a'}:powersgd4"])
    by = {r["label"]: r for r in rows}
    assert by["sparse"]["seeds"] == [0, 1, 2] and by["sparse"]["config"] == "spardl@0.4+update"
    assert by["sparse"]["mean"] == pytest.approx(1.91) and by["sparse"]["max"] == pytest.approx(1.92)
    assert by["sparse"]["bytes_run"] == 40.0
    low, high = by["sparse"]["vs_reference"]
    assert 0 < low < 0.1 < high and by["sparse"]["verdict"] == "worse"
    assert by["one seed"]["vs_reference"] is None and by["one seed"]["verdict"] == "level"
    assert by["PowerSGD 4"]["verdict"] == "level"
    assert out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.with_suffix(".json").read_text())[1]["label"] == "sparse"
    table = loss_front.markdown(rows)
    assert "| sparse | 3 | 1.9100 (1.9000..1.9200) | worse (+" in table and "| 1/25.0 |" in table
    assert "| one seed | 1 | 1.8600 (1.8600..1.8600) | no interval (one seed) |" in table


def test_an_arm_it_cannot_find_is_a_usage_error_naming_what_is_there(tmp_path, capsys):
    _results(tmp_path / "a", [("dense", 0, 1.8, 1000.0), ("fp16", 0, 1.8, 500.0)])
    for arm, says in [(f"x={tmp_path / 'a'}", "holds configs dense, fp16"),
                      (f"x={tmp_path / 'a'}:powersgd4", "holds configs dense, fp16"),
                      (f"x={tmp_path / 'missing'}", "no such file"),
                      ("no label", "LABEL=FOLDER[:CONFIG]")]:
        with pytest.raises(SystemExit):
            loss_front.main([str(tmp_path / "out"), arm])
        assert says in capsys.readouterr().err
