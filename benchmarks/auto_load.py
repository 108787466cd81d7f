"""'communicator': 'auto' through a passing load: does it come back to its choice once other
work on the machine has gone? From benchmarks.train_step results run with --load-burst:

    python -m benchmarks.train_step --dnn resnet20 --batch-size 32 --algorithms auto \
      --bandwidths 100mbit --steps 400 --skip 12 --load-burst 120:100 --json A.json
    python -m benchmarks.auto_load FIX=A.json[,A2.json...] REVERTED=B.json[,...]

Per run (each file, each network, each repeat): auto's plans (step: choice), its median step
before the burst (the timed steps up to its start), during it, and after it, and the ratio
of after to before: a run that comes back to its choice ends near 1 whatever the machine's
speed that day, one that stays on a choice made under the load ends above. Per arm (a label
and its files: a commit, say), the mean of those ratios; the first two arms compared by
Welch's 95% interval over their runs' ratios (each run one sample).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.auto_check import repeats
from spardl_grace.planner import DEFAULT_CANDIDATES
from testbed.load import load_burst
from testbed.stats import welch


def runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each auto run of one train_step result with --load-burst: network, plans [(step,
    choice)], median step before, during and after the burst, and after / before."""
    config = result["config"]
    if not config.get("load_burst"):
        raise ValueError("not a run with --load-burst: nothing passed through it")
    start, steps = load_burst(config["load_burst"])
    skip, end = config["skip"], start + steps
    out = []
    for network, rows in result["networks"].items():
        if "auto" not in rows:
            continue
        for run in repeats(rows["auto"]):
            times = run["step_times"]
            if not skip < start < end < skip + len(times):
                raise ValueError(f"the burst (steps {start}..{end - 1}) must lie within the "
                                 f"timed steps {skip}..{skip + len(times) - 1}")

            def median(a: int, b: int, times: list[float] = times) -> float:
                return statistics.median(times[a - skip:b - skip])

            before, after = median(skip, start), median(end, skip + len(times))
            out.append({"network": network, "plans": plans(run["auto_steps"]),
                        "before_s": before, "during_s": median(start, end), "after_s": after,
                        "after_over_before": after / before})
    return out


def plans(auto_steps: list[dict[str, float]]) -> list[tuple[int, str]]:
    """(step, choice) at each plan: the steps where the re-plan count rose, and the first."""
    out, count = [], None
    for s in auto_steps:
        if s["choice"] >= 0 and s["replans"] != count:
            out.append((int(s["step"]), DEFAULT_CANDIDATES[int(s["choice"])]))
            count = s["replans"]
    return out


def compare(arms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm, its runs and the mean of their after / before; the first two arms' difference
    of means (second minus first) with Welch's 95% interval, and which comes back better
    ('level' when the interval holds zero, or too few runs)."""
    summary: dict[str, Any] = {
        label: {"runs": got, "mean_after_over_before":
                statistics.fmean(r["after_over_before"] for r in got)}
        for label, got in arms.items()}
    labels = list(arms)
    if len(labels) >= 2:
        first, second = ([r["after_over_before"] for r in arms[n]] for n in labels[:2])
        interval = welch(second, first)  # a higher ratio: slower after the burst
        verdict = "level" if interval is None else {
            "better": f"{labels[0]} comes back better", "worse": f"{labels[1]} comes back better"
        }.get(interval.verdict, "level")
        summary["comparison"] = {
            "arms": labels[:2], "difference": statistics.fmean(second) - statistics.fmean(first),
            "interval": None if interval is None else [interval.low, interval.high],
            "verdict": verdict}
    return summary


def table(summary: dict[str, Any]) -> str:
    """The runs as a markdown table, then the comparison in one line."""
    lines = ["| arm | link | auto's plans (step: choice) | before s/step | during | after | "
             "after / before |", "|---|---|---|---|---|---|---|"]
    for label, arm in summary.items():
        if label == "comparison":
            continue
        for r in arm["runs"]:
            shown = "; ".join(f"{s}: {c}" for s, c in r["plans"])
            lines.append(f"| {label} | {r['network']} | {shown} | {r['before_s']:.3f} | "
                         f"{r['during_s']:.3f} | {r['after_s']:.3f} | "
                         f"{r['after_over_before']:.3f} |")
    if "comparison" in summary:
        c = summary["comparison"]
        interval = ("no interval: fewer than two runs an arm" if c["interval"] is None else
                    "95% interval {:+.3f}..{:+.3f}".format(*c["interval"]))
        lines += ["", f"{c['arms'][1]} - {c['arms'][0]}, after / before: {c['difference']:+.3f} "
                      f"({interval}): {c['verdict']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+", metavar="LABEL=FILE[,FILE...]",
                   help="an arm's label and its train_step results (--load-burst runs)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = p.parse_args(argv)
    arms = {}
    for arm in args.arms:
        label, sep, files = arm.partition("=")
        if not sep or not label or not files:
            p.error(f"expected LABEL=FILE[,FILE...], got {arm!r}")
        try:
            arms[label] = [r for f in files.split(",") for r in runs(json.loads(Path(f).read_text()))]
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"{label}: {exc}")
    summary = compare(arms)
    print(table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
