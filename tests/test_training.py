"""Real training on real data with real processes (gloo): SparDL against dense."""
from __future__ import annotations

import json

import pytest

from experiments import compare


@pytest.mark.slow
def test_spardl_trains_to_the_loss_of_dense(tmp_path):
    """4 workers, FashionCNN, 8000 Fashion-MNIST images, 3 epochs, density 0.05.

    Tolerance: SparDL's final training loss within 30% (relative) of dense and its test accuracy
    within 6 points; every run ends with identical replicas. Measured here: loss ratio 1.18
    after 2 epochs and 1.22 after 3. Error feedback delays small coordinates, so sparse training
    lags dense at this early stage; GRACE top-k all-gather, which applies up to P times more
    entries, reached a ratio of 1.08 with the same test accuracy as SparDL."""
    summaries = compare.main(["--density", "0.05", "--epochs", "3", "--train-samples", "8000",
                              "--test-samples", "2000", "--out", str(tmp_path)])
    by_name = {s["algorithm"]: s for s in summaries}
    dense, spardl = by_name["dense"], by_name["spardl"]
    assert dense["identical_replicas"] and spardl["identical_replicas"]
    assert dense["test_accuracy"] > 0.6, "dense training itself must learn"
    assert spardl["final_train_loss"] <= 1.3 * dense["final_train_loss"]
    assert spardl["test_accuracy"] >= dense["test_accuracy"] - 0.06
    assert spardl["bytes_sent_per_step_per_rank"] < 0.25 * dense["bytes_sent_per_step_per_rank"]


def test_main_job_quick_writes_results_and_plot(tmp_path):
    compare.main(["--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["algorithm"] for r in results["results"]] == ["dense", "spardl"]
    assert all(r["identical_replicas"] for r in results["results"])
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
