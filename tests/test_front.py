"""experiments.front: the accuracy-per-byte front's table, dominance verdict and plot, from an
ablation directory laid out as experiments.ablation writes it."""
from __future__ import annotations

import json

from experiments import front


def _run(out, config: str, seed: int, accuracy: float, bytes_run: float, last_epoch: float):
    folder = out / f"{config}-seed{seed}"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({
        "config": config, "seed": seed, "test_accuracy": accuracy, "train_loss": 0.1,
        "bytes_run": bytes_run, "dense_bytes": 1000.0, "train_s": 1.0, "steps": 10}))
    epochs = [{"kind": "epoch", "epoch": e, "step": 5 * (e + 1), "bytes_sent_per_step": b}
              for e, b in enumerate((2 * last_epoch, last_epoch))]
    (folder / "log.jsonl").write_text("\n".join(json.dumps(e) for e in epochs) + "\n")


def test_the_front_reports_means_ranges_and_which_powersgd_points_sparDL_dominates(tmp_path):
    _run(tmp_path, "dense", 0, 0.90, 1000, 1000)
    _run(tmp_path, "powersgd1", 0, 0.85, 100, 50)
    _run(tmp_path, "powersgd1", 1, 0.87, 120, 50)      # mean 0.86 at 110 bytes
    _run(tmp_path, "powersgd4", 0, 0.89, 300, 200)
    _run(tmp_path, "spardl@0.01", 0, 0.86, 110, 20)    # equal bytes, equal mean: dominates
    _run(tmp_path, "spardl@0.01", 1, 0.86, 110, 20)
    _run(tmp_path, "spardl@0.05", 0, 0.895, 301, 90)   # more bytes than powersgd4: does not
    rows = front.main([str(tmp_path)])
    by = {r["config"]: r for r in rows}
    assert by["powersgd1"]["accuracy"] == {"mean": 0.86, "min": 0.85, "max": 0.87}
    assert by["powersgd1"]["bytes_run"] == 110 and by["powersgd1"]["bytes_after_warmup"] == 50
    assert by["spardl@0.05"]["family"] == "spardl" and by["powersgd4"]["family"] == "powersgd"
    assert [r["config"] for r in rows][0] == "dense"  # most bytes first
    verdicts = {v["powersgd"]: v["dominated_by"]
                for v in json.loads((tmp_path / "front.json").read_text())["dominance"]}
    assert verdicts == {"powersgd1": ["spardl@0.01"], "powersgd4": []}
    text = (tmp_path / "front.md").read_text()
    assert "does not dominate" in text and "not final: some configs lack seeds" in text
    assert "| powersgd4 | 1 (partial) |" in text
    assert (tmp_path / "front.png").stat().st_size > 0
