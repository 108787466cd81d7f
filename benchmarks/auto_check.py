"""'communicator': 'auto' against the fixed choices it picks from, in one benchmarks.train_step
result (issue 63's verification):

    python -m benchmarks.train_step --dnn resnet20 --algorithms auto,fixed_dense,... --json R
    python -m benchmarks.auto_check R [--target 1.05]

A run with --bandwidth-change STEP:RATE is compared twice per link: over the timed steps
before STEP, and over those after auto's re-plan (the step it re-planned at is reported), or
over every step from STEP on when auto did not re-plan.

For each link rate: auto's median step and what it chose, the fastest of its candidates run
alone (the rows named fixed_CANDIDATE, by mean step) and auto's ratio to it, and two verdicts by
Welch's 95% interval: auto against the fastest ('faster', 'slower' or 'level'), and whether
auto's mean step is within `target` times the fastest's ('met' when the interval of mean(auto)
- target * mean(fastest) lies below zero, 'missed' when above, 'undecided' otherwise). The
other rows (PyTorch's DDP and its hooks) are compared with auto the same way, as 'baselines'.
Where the result holds auto's plans, a second table sets what auto predicted for each
candidate beside the candidate's measured step alone: where the model errs, and toward which.

What a verdict's samples are: with train_step's --repeats R >= 2 (the arms interleaved), each
repeat's mean step is one sample, R per arm: repeats are independent runs, and drift of the
machine falls on every arm alike. With one run per arm, each timed step is a sample; steps of
one run are not independent draws (a slow stretch of the machine spans several), so that
interval is narrower than the truth, and the result says which unit it used ('unit').
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from spardl_grace.planner import DEFAULT_CANDIDATES
from testbed.netem import rate_change
from testbed.stats import welch


def check(result: dict[str, Any], target: float = 1.05) -> dict[str, dict[str, Any]]:
    """Per network of `result` (benchmarks.train_step's JSON, with 'auto' and fixed rows), the
    comparison described in the module docstring over every timed step; when the run changed
    its link (--bandwidth-change STEP:RATE), two comparisons per network instead, the steps
    before STEP and those after auto's re-plan, with when it re-planned (per repeat)."""
    out = {}
    config = result.get("config", {})
    skip, change = config.get("skip", 0), config.get("bandwidth_change")
    for network, rows in result["networks"].items():
        if "auto" not in rows:
            continue
        count = len(repeats(rows["auto"]))
        if change is None:
            out[network] = _compare(rows, target, [slice(None)] * count)
            continue
        step, rate = rate_change(change)
        replans = [replan_after(r["auto_steps"], step) for r in repeats(rows["auto"])]
        out[f"{network} before step {step}"] = _compare(rows, target,
                                                         [slice(0, step - skip)] * count)
        if all(r is None for r in replans):  # no re-plan: the choice from before, every step after
            out[f"{rate} after step {step}"] = {
                **_compare(rows, target, [slice(step - skip, None)] * count),
                "replanned_at": None}
            continue
        after = [slice((step if r is None else r + 1) - skip, None) for r in replans]
        when = replans[0] if count == 1 else replans
        out[f"{rate} after the re-plan"] = {
            **_compare(rows, target, after), "replanned_at": when,
            "steps_to_replan": when - step if count == 1 else
            [None if r is None else r - step for r in replans]}
    return out


def repeats(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's runs: its 'repeats' (train_step --repeats R >= 2), or the row itself."""
    return row.get("repeats", [row])


def replan_after(auto_steps: list[dict[str, float]], step: int) -> int | None:
    """The first step at or after `step` whose re-plan count exceeds the one before `step`
    (auto re-planned there), or None."""
    before = max((s["replans"] for s in auto_steps if s["step"] < step), default=0.0)
    return next((int(s["step"]) for s in auto_steps
                 if s["step"] >= step and s["replans"] > before), None)


def _samples(row: dict[str, Any], steps: list[slice], unit: str) -> list[float]:
    """A row's samples over its timed steps `steps` (one slice per repeat): each step
    ('step') or each repeat's mean ('repeat')."""
    parts = [r["step_times"][s] for r, s in zip(repeats(row), steps, strict=True)]
    if unit == "repeat":
        return [statistics.fmean(p) for p in parts]
    return [t for p in parts for t in p]


def _compare(rows: dict[str, Any], target: float, steps: list[slice]) -> dict[str, Any]:
    """auto against the fastest fixed row and the baselines over the timed steps `steps` (a
    slice per repeat: indices into each repeat's step_times, the same for every row)."""
    unit = "repeat" if len(steps) > 1 else "step"
    auto = _samples(rows["auto"], steps, unit)
    fixed = {n: _samples(r, steps, unit) for n, r in rows.items() if n.startswith("fixed_")}
    if not fixed:
        raise ValueError("no fixed_CANDIDATE rows to compare auto with")
    best = min(fixed, key=lambda n: statistics.fmean(fixed[n]))
    within = welch(auto, [target * t for t in fixed[best]])
    choices = [int(_choice_at_end(r, s)) for r, s in zip(repeats(rows["auto"]), steps)]
    names = [DEFAULT_CANDIDATES[c] if c >= 0 else "measuring" for c in choices]
    steps_of = {n: _samples(r, steps, "step") for n, r in rows.items()}
    mean_auto = statistics.fmean(steps_of["auto"])
    return {
        "unit": unit,
        "auto_median_s": statistics.median(steps_of["auto"]),
        "auto_chose": names[0] if len(set(names)) == 1 else ", ".join(names),
        "fastest_fixed": best,
        "fastest_median_s": statistics.median(steps_of[best]),
        "ratio_of_means": mean_auto / statistics.fmean(steps_of[best]),
        "versus_fastest": _versus(fixed[best], auto)["auto_is"],
        "within_target": ("missed" if within.low > 0 else "met" if within.high < 0
                          else "undecided") if within else "undecided",
        "target": target,
        "baselines": {
            n: {**_versus(_samples(r, steps, unit), auto),
                "ratio_of_means": mean_auto / statistics.fmean(steps_of[n])}
            for n, r in rows.items() if n != "auto" and not n.startswith("fixed_")
        },
    }


def _choice_at_end(auto: dict[str, Any], steps: slice) -> float:
    """auto's choice at the last of its timed steps `steps` in one run: from its per-step
    records (whose last len(step_times) are the timed steps), or the run's last plan in
    results older than those records."""
    if "auto_steps" not in auto:
        return auto.get("auto_plan", {}).get("auto_choice", -1)
    timed = auto["auto_steps"][-len(auto["step_times"]):]
    return timed[steps][-1]["choice"]


def _versus(other: list[float], auto: list[float]) -> dict[str, Any]:
    """auto against another row: the ratio of their means and the Welch verdict for auto."""
    interval = welch(other, auto)
    verdict = "level" if interval is None else interval.verdict
    return {"ratio_of_means": statistics.fmean(auto) / statistics.fmean(other),
            "auto_is": {"better": "faster", "worse": "slower"}.get(verdict, "level")}


def table(checked: dict[str, dict[str, Any]]) -> str:
    """The comparison as a markdown table."""
    lines = ["| link | auto chose | auto s/step | fastest fixed | its s/step | auto / fastest "
             "(means) | vs fastest | within target |", "|---|---|---|---|---|---|---|---|"]
    for network, c in checked.items():
        lines.append(f"| {network} | {c['auto_chose']} | {c['auto_median_s']:.3f} | "
                     f"{c['fastest_fixed']} | {c['fastest_median_s']:.3f} | "
                     f"{c['ratio_of_means']:.3f} | {c['versus_fastest']} | "
                     f"{c['within_target']} ({c['target']}x) |")
    for network, c in checked.items():
        if "replanned_at" in c:
            lines += ["", f"{network}: auto {_replans(c)}"]
    names = sorted({n for c in checked.values() for n in c["baselines"]})
    if names:
        lines += ["", "| link | " + " | ".join(f"auto / {n}" for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for network, c in checked.items():
            cells = [f"{b['ratio_of_means']:.3f} ({b['auto_is']})" if (b := c["baselines"].get(n))
                     else "-" for n in names]
            lines.append(f"| {network} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_error(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per network, each candidate run alone (its fixed_CANDIDATE row) against what auto
    predicted for it: the predicted step of the plan in force at the end of each auto run
    (its last 'plan' record; results recorded before train_step kept them have none and are
    left out), averaged over the repeats, the candidate's measured mean step over its timed
    steps, and their ratio (above 1: the model was optimistic about that candidate)."""
    out = {}
    for network, rows in result["networks"].items():
        plans = [r["auto_plans"][-1] for r in repeats(rows.get("auto", {}))
                 if r.get("auto_plans")]
        if not plans:
            continue
        errors = {}
        for name, row in rows.items():
            candidate = name.removeprefix("fixed_")
            if name == candidate or not all(candidate in p["predicted_step_s"] for p in plans):
                continue
            predicted = statistics.fmean(p["predicted_step_s"][candidate] for p in plans)
            measured = statistics.fmean(row["step_times"])
            errors[candidate] = {"predicted_s": predicted, "measured_s": measured,
                                 "measured_over_predicted": measured / predicted}
        out[network] = errors
    return out


def model_table(errors: dict[str, dict[str, dict[str, float]]]) -> str:
    """model_error's figures as a markdown table."""
    lines = ["| link | candidate | auto predicted s/step | measured alone s/step (mean) | "
             "measured / predicted |", "|---|---|---|---|---|"]
    for network, rows in errors.items():
        lines += [f"| {network} | {name} | {e['predicted_s']:.3f} | {e['measured_s']:.3f} | "
                  f"{e['measured_over_predicted']:.3f} |" for name, e in rows.items()]
    return "\n".join(lines)


def _replans(c: dict[str, Any]) -> str:
    """When auto re-planned after the link changed, in words (each repeat's, if several)."""
    if c["replanned_at"] is None:
        return "never re-planned after the link changed"
    if isinstance(c["replanned_at"], int):
        return (f"re-planned at step {c['replanned_at']}, {c['steps_to_replan']} steps after "
                "the link changed")
    return "re-planned " + ", ".join(
        "never" if at is None else f"at step {at} ({late} steps after the change)"
        for at, late in zip(c["replanned_at"], c["steps_to_replan"])) + " in the repeats"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="benchmarks.train_step's --json")
    p.add_argument("--target", type=float, default=1.05)
    args = p.parse_args(argv)
    result = json.loads(args.result.read_text())
    checked = check(result, args.target)
    print(table(checked))
    errors = model_error(result)
    if any(errors.values()):
        print("\nauto's model against each candidate run alone:\n\n" + model_table(errors))
    return checked


if __name__ == "__main__":
    main()
