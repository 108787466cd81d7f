"""benchmarks.auto_load: auto's plans and its step before, during and after a load burst, per
run, and two arms compared by Welch over their runs' after / before ratios."""
from __future__ import annotations

import pytest

from benchmarks import auto_load
from spardl_grace.planner import DEFAULT_CANDIDATES

SPARDL, DENSE16 = DEFAULT_CANDIDATES.index("spardl@0.03"), DEFAULT_CANDIDATES.index("dense16")


def _run(after: float, back: bool) -> dict:
    """16 steps, 2 skipped, a burst over steps 6..9: SparDL, dense16 from step 7, and back to
    SparDL at step 12 when `back`; 0.3 s a step before, 0.6 during, `after` after."""
    choices = [-1] * 2 + [SPARDL] * 5 + [DENSE16] * 5 + [SPARDL if back else DENSE16] * 4
    replans = [0] * 7 + [1] * 5 + [2] * 4
    steps = [{"step": s, "choice": float(c), "replans": float(r)}
             for s, (c, r) in enumerate(zip(choices, replans))]
    times = [0.3] * 4 + [0.6] * 4 + [after] * 6
    return {"step_times": times, "auto_steps": steps}


def _result(*runs: dict) -> dict:
    auto = runs[0] if len(runs) == 1 else {"repeats": list(runs)}
    return {"config": {"skip": 2, "load_burst": "6:4"}, "networks": {"100mbit": {"auto": auto}}}


def test_a_run_gives_its_plans_and_its_step_around_the_burst():
    (run,) = auto_load.runs(_result(_run(0.33, back=True)))
    assert run["plans"] == [(2, "spardl@0.03"), (7, "dense16"), (12, "spardl@0.03")]
    assert (run["before_s"], run["during_s"], run["after_s"]) == (0.3, 0.6, 0.33)
    assert run["after_over_before"] == pytest.approx(1.1)


def test_the_arm_that_comes_back_is_named_only_when_the_interval_excludes_zero():
    back = auto_load.runs(_result(*(_run(t, True) for t in (0.30, 0.31, 0.29))))
    stays = auto_load.runs(_result(*(_run(t, False) for t in (0.36, 0.37, 0.35))))
    summary = auto_load.compare({"fix": back, "reverted": stays})
    c = summary["comparison"]
    assert c["verdict"] == "fix comes back better"
    assert c["difference"] == pytest.approx(0.2) and 0 < c["interval"][0] < c["interval"][1]
    assert auto_load.compare({"a": stays, "b": back})["comparison"]["verdict"] == \
        "b comes back better"
    noisy = auto_load.runs(_result(*(_run(t, False) for t in (0.2, 0.45, 0.3))))
    assert auto_load.compare({"fix": back, "noisy": noisy})["comparison"]["verdict"] == "level"
    one = auto_load.compare({"fix": back[:1], "reverted": stays[:1]})["comparison"]
    assert one["interval"] is None and one["verdict"] == "level"
    assert "fewer than two runs an arm" in auto_load.table({**summary, "comparison": one})


def test_runs_without_a_burst_in_their_timed_steps_are_refused(tmp_path, capsys):
    plain = _result(_run(0.3, True))
    del plain["config"]["load_burst"]
    with pytest.raises(ValueError, match="--load-burst"):
        auto_load.runs(plain)
    late = _result(_run(0.3, True))
    late["config"]["load_burst"] = "12:10"
    with pytest.raises(ValueError, match="within the timed steps 2..15"):
        auto_load.runs(late)
    with pytest.raises(SystemExit):
        auto_load.main(["fix"])
    assert "LABEL=FILE" in capsys.readouterr().err
