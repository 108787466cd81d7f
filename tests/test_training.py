"""Real training on real data with real processes (gloo): the main job, and what DGC's
techniques change in SparDL's training."""
from __future__ import annotations

import json

import pytest

from experiments import compare
from testbed import records


def test_main_job_quick_compares_ddp_powersgd_and_spardl(tmp_path):
    """The README's main job in its CI size: torch's DDP in fp32 and with its fp16 hook, torch's
    PowerSGD hook, SparDL and the library's auto on the emulated network (loopback where namespaces cannot be
    made), twice each with seeds 0 and 1 in turns, accuracy against training time, a plot with
    bands and a verdict."""
    runs = compare.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    order = ["ddp", "fp16", "powersgd4", "spardl", "auto"]
    assert [(r["algorithm"], r["seed"]) for r in saved["results"]] == [(a, s) for s in (0, 1) for a in order]
    assert [g["algorithm"] for g in saved["summary"]] == order
    assert all(r["identical_replicas"] for r in runs)
    assert all(r["curve"] and r["steps"] <= 12 for r in runs)
    # A run that reached the target stopped at that evaluation; one that did not ran 12 steps.
    assert all(r["steps"] == (r["steps_to_target"] or 12) for r in runs)
    first = {r["algorithm"]: r for r in runs if r["seed"] == 0}
    # FashionCNN's 18K parameters: SparDL sends the library's floor of 2,048 entries a step on
    # the default compact wire (2 bytes of value and 13 bits of index in blocks of 4,595: 11,136
    # bytes at P = 4 by the cost formula, 2k(P-1)/P entries), an eighth of DDP's 110,268 at most.
    spardl_bytes = first["spardl"]["bytes_per_step_final"]
    assert 11_136 <= spardl_bytes < 0.125 * first["ddp"]["bytes_per_step_final"]
    assert first["powersgd4"]["bytes_per_step_final"] < first["ddp"]["bytes_per_step_final"]
    assert first["fp16"]["bytes_per_step_final"] == first["ddp"]["bytes_per_step_final"] / 2
    assert saved["verdict"] == compare.verdict(compare.group(runs), 0.3)
    # auto measured its 10 dense steps and planned at the 11th: each run says what it chose
    from spardl_grace.planner import DEFAULT_CANDIDATES
    assert all(r["auto_chose"] in DEFAULT_CANDIDATES for r in runs if r["algorithm"] == "auto"
               and r["steps"] > 10)
    assert all(r["auto_chose"] is None for r in runs if r["algorithm"] != "auto")
    # each run is recorded as one packed file that still gives its curve
    packed = records.open_run(tmp_path / "spardl" / "seed1")
    assert packed.packed and not (tmp_path / "spardl" / "seed1" / "log.jsonl").exists()
    curve = [[e["train_s"], e["test_accuracy"]] for e in records.read_log(packed)["eval"]]
    assert curve == next(r["curve"] for r in runs if r["algorithm"] == "spardl" and r["seed"] == 1)
    assert (tmp_path / "accuracy_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_trains_a_text_task(tmp_path):
    """The same comparison on the tweets (an LSTM classifier, sentiment in 3 classes): PyTorch's
    PowerSGD hook on the embedding's and the LSTM's matrices, and SparDL, on loopback."""
    results = compare.main(["--dnn", "lstmimdb", "--dataset", "tweets", "--bandwidth", "none",
                            "--algorithms", "powersgd1,spardl", "--train-samples", "1024",
                            "--test-samples", "200", "--max-epochs", "1", "--max-steps", "6",
                            "--eval-every", "3", "--target-accuracy", "0.3", "--repeats", "1",
                            "--out", str(tmp_path)])
    assert [r["algorithm"] for r in results] == ["powersgd1", "spardl"]
    assert all(r["identical_replicas"] and r["steps"] == (r["steps_to_target"] or 6)
               for r in results)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["dataset"] == "tweets"


def _runs(**times) -> list[dict]:
    return [{"algorithm": name, "label": name, "time_to_target_s": t, "s_per_step": 0.1}
            for name, ts in times.items() for t in ts]


def test_verdict_names_a_winner_only_when_welchs_interval_excludes_zero():
    won = compare.group(_runs(SparDL=[20.0, 21.0, 22.0], PowerSGD=[25.0, 26.0, 30.0],
                              DDP=[None, None, None]))
    said = compare.verdict(won, 0.8)
    # means 21 and 27: difference 6 s, Welch's 95% interval 0.3 to 11.7 s (2.6 degrees of freedom)
    assert said == (
        "SparDL reached 0.80 first (mean 21.0 s, 20.0-22.0 over 3 of 3 runs); PowerSGD took "
        "6.0 s longer on average (95% Welch interval 0.3 to 11.7 s; mean 27.0 s, 25.0-30.0 over "
        "3 of 3 runs); DDP did not reach it within the budget.")
    # ranges that do not overlap are not enough: one more slow PowerSGD run widens the interval
    wide = compare.group(_runs(SparDL=[20.0, 21.0, 22.0], PowerSGD=[23.0, 24.0, 40.0]))
    assert compare.verdict(wide, 0.8).startswith(
        "SparDL and PowerSGD are level in reaching 0.80 (the 95% Welch interval of the "
        "difference, ")
    level = compare.group(_runs(SparDL=[20.0, 24.0, 27.0], PowerSGD=[22.0, 25.0, 26.0]))
    assert "are level in reaching 0.80" in compare.verdict(level, 0.8)
    # A run that missed the target ranks its algorithm after those that always reached it.
    missed = compare.group(_runs(PowerSGD=[10.0, None, 11.0], SparDL=[20.0, 21.0, 22.0]))
    assert compare.verdict(missed, 0.8).startswith("SparDL and PowerSGD are level")
    assert compare.verdict(compare.group(_runs(DDP=[None])), 0.8) == \
        "No run reached test accuracy 0.80 within its budget."
    auto = compare.group([{**r, "auto_chose": "spardl@0.01"} for r in _runs(auto=[20.0, 21.0])])
    assert compare.verdict(auto, 0.8).endswith("The library's auto chose spardl@0.01.")


def test_main_job_names_the_valid_algorithms(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--algorithms", "ddp,bogus"])
    assert "unknown algorithm(s) ['bogus']; valid: ddp, fp16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.parse_args(["--dataset", "cifar"])
    assert "invalid choice: 'cifar'" in capsys.readouterr().err
