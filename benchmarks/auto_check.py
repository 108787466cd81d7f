"""'communicator': 'auto' against the fixed choices it picks from, in one benchmarks.train_step
result (issue 63's verification):

    python -m benchmarks.train_step --dnn resnet20 --algorithms auto,fixed_dense,... --json R
    python -m benchmarks.auto_check R [--target 1.05]

For each link rate: auto's median step and what it chose, the fastest of its candidates run
alone (the rows named fixed_CANDIDATE, by mean step) and auto's ratio to it, and two verdicts by Welch's 95% interval over the timed
steps: auto against the fastest ('faster', 'slower' or 'level'), and whether auto's mean step
is within `target` times the fastest's ('met' when the interval of mean(auto) - target *
mean(fastest) lies below zero, 'missed' when above, 'undecided' otherwise). Steps of one run
are not independent draws (a slow stretch of the machine spans several), so an interval
here is narrower than the truth; the verdicts say so by their name only. The other rows
(PyTorch's DDP and its hooks) are compared with auto the same way, as 'baselines'.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from spardl_grace.planner import DEFAULT_CANDIDATES
from testbed.stats import welch


def check(result: dict[str, Any], target: float = 1.05) -> dict[str, dict[str, Any]]:
    """Per network of `result` (benchmarks.train_step's JSON, with 'auto' and fixed rows), the
    comparison described in the module docstring."""
    out = {}
    for network, rows in result["networks"].items():
        if "auto" not in rows:
            continue
        auto = rows["auto"]["step_times"]
        fixed = {n: r["step_times"] for n, r in rows.items() if n.startswith("fixed_")}
        if not fixed:
            raise ValueError(f"{network}: no fixed_CANDIDATE rows to compare auto with")
        best = min(fixed, key=lambda n: statistics.fmean(fixed[n]))
        within = welch(auto, [target * t for t in fixed[best]])
        plan = rows["auto"].get("auto_plan", {})
        choice = int(plan.get("auto_choice", -1))
        out[network] = {
            "auto_median_s": statistics.median(auto),
            "auto_chose": DEFAULT_CANDIDATES[choice] if choice >= 0 else "measuring",
            "fastest_fixed": best,
            "fastest_median_s": statistics.median(fixed[best]),
            "ratio_of_means": statistics.fmean(auto) / statistics.fmean(fixed[best]),
            "versus_fastest": _versus(fixed[best], auto)["auto_is"],
            "within_target": ("missed" if within.low > 0 else "met" if within.high < 0
                              else "undecided") if within else "undecided",
            "target": target,
            "baselines": {
                n: _versus(r["step_times"], auto)
                for n, r in rows.items() if n != "auto" and not n.startswith("fixed_")
            },
        }
    return out


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
    names = sorted({n for c in checked.values() for n in c["baselines"]})
    if names:
        lines += ["", "| link | " + " | ".join(f"auto / {n}" for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for network, c in checked.items():
            cells = [f"{b['ratio_of_means']:.3f} ({b['auto_is']})" if (b := c["baselines"].get(n))
                     else "-" for n in names]
            lines.append(f"| {network} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="benchmarks.train_step's --json")
    p.add_argument("--target", type=float, default=1.05)
    args = p.parse_args(argv)
    checked = check(json.loads(args.result.read_text()), args.target)
    print(table(checked))
    return checked


if __name__ == "__main__":
    main()
