"""Real training on real data with real processes (gloo): the main job, and what DGC's
techniques change in SparDL's training."""
from __future__ import annotations

import json

import pytest

from experiments import compare


def test_main_job_quick_compares_ddp_powersgd_and_spardl(tmp_path):
    """The README's main job in its CI size: torch's DDP, torch's PowerSGD hook and SparDL on
    the emulated network (loopback where namespaces cannot be made), accuracy against training
    time, a plot and a verdict."""
    results = compare.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["algorithm"] for r in saved["results"]] == ["ddp", "powersgd4", "spardl"]
    by_name = {r["algorithm"]: r for r in results}
    assert all(r["identical_replicas"] for r in results)
    assert all(len(r["curve"]) == 2 and r["steps"] == 12 for r in results)
    assert by_name["spardl"]["bytes_per_step_final"] < 0.05 * by_name["ddp"]["bytes_per_step_final"]
    assert by_name["powersgd4"]["bytes_per_step_final"] < by_name["ddp"]["bytes_per_step_final"]
    assert saved["verdict"] == compare.verdict(results, 0.3)
    assert (tmp_path / "accuracy_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_trains_a_text_task(tmp_path):
    """The same comparison on the tweets (an LSTM classifier, sentiment in 3 classes): PyTorch's
    PowerSGD hook on the embedding's and the LSTM's matrices, and SparDL, on loopback."""
    results = compare.main(["--dnn", "lstmimdb", "--dataset", "tweets", "--bandwidth", "none",
                            "--algorithms", "powersgd1,spardl", "--train-samples", "1024",
                            "--test-samples", "200", "--max-epochs", "1", "--max-steps", "6",
                            "--eval-every", "3", "--target-accuracy", "0.3",
                            "--out", str(tmp_path)])
    assert [r["algorithm"] for r in results] == ["powersgd1", "spardl"]
    assert all(r["identical_replicas"] and r["steps"] == 6 for r in results)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["dataset"] == "tweets"


def test_verdict_says_who_won_plainly():
    runs = [{"label": "SparDL", "time_to_target_s": 30.0}, {"label": "PowerSGD", "time_to_target_s": 20.0},
            {"label": "DDP", "time_to_target_s": None}]
    assert compare.verdict(runs, 0.8) == ("PowerSGD reached 0.80 first, after 20.0 s; SparDL took "
                                          "1.50x as long; DDP did not reach it within the budget.")
    assert compare.verdict(runs[2:], 0.8) == "No run reached test accuracy 0.80 within its budget."


def test_main_job_names_the_valid_algorithms(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--algorithms", "ddp,bogus"])
    assert "unknown algorithm(s) ['bogus']; valid: ddp, fp16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.parse_args(["--dataset", "cifar"])
    assert "invalid choice: 'cifar'" in capsys.readouterr().err
