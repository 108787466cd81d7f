"""The accuracy-per-byte front (issue 39) from an ablation's runs: a table, a verdict, a plot.

    python -m experiments.front experiments/results/front_resnet20_cpu

Reads OUT/CONFIG-seedS/ (run.json and log.jsonl of experiments.ablation's runs, finished ones
only) and writes OUT/front.md (the table and the verdict), OUT/front.json and
OUT/front.png: final test accuracy (mean, error bar min..max over the seeds) against
megabytes sent per step and worker over the whole run, one point per config. Bytes after the
warm-up are the last epoch's bytes per step (SparDL's after its density warm-up, PowerSGD's
and post-local SGD's after their start).

The verdict is the issue's test of dominance by the project's rule (testbed.stats): for every
PowerSGD point, the SparDL points that send no more bytes per step (whole run) are 'better'
when the 95% Welch interval of the difference of their seed means is above zero, 'level' when
it holds zero (or either has one seed), 'worse' below. SparDL dominates when every PowerSGD
point has a better SparDL point; it is level or better when every one has a better or level
one. Configs with fewer seeds than the most any config has are marked. The verdict is final
once the rows it rests on have them all: every PowerSGD point, and then, if SparDL dominates,
one dominating SparDL point per PowerSGD point; if it does not, every SparDL point (any of
them could still come to dominate). Other configs (dense, DDP's fp16 hook, post-local SGD) do
not enter it.

With --step-times (a benchmarks.train_step JSON whose algorithms are these configs; 'dense'
is looked up as 'ddp', what a user runs) it adds the time to accuracy at each of its link
rates: the steps a config's mean curve over its seeds needed to reach dense's mean accuracy
after --target-epoch epochs (evaluated once an epoch; several targets, a table each), times
its steady-state step time, plus the wire time of the bytes its warm-up (PowerSGD's dense
start, SparDL's density warm-up) sent beyond the steady state's, epoch by epoch.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testbed.netem import rate_bits_per_s
from testbed.records import read_log, runs_under
from testbed.stats import welch


def family(config: str) -> str:
    """'spardl', 'topka', 'powersgd', 'postlocal', 'fp16' or 'dense' for an ablation config."""
    head = config.split("@")[0].split("+")[0]
    for name in ("powersgd", "postlocal"):
        if head.startswith(name):
            return name
    return head


def load_runs(out: Path) -> list[dict[str, Any]]:
    """Every finished run under `out`, with its last epoch's bytes per step and its epochs
    ((step, test accuracy, bytes per step), the last record of each epoch) added."""
    runs = []
    for record in runs_under(out, "run.json"):
        run = json.loads(record.read_text("run.json"))
        epochs = {e["epoch"]: e for e in read_log(record)["epoch"]}
        run["epochs"] = [(e["step"], e["test_accuracy"], e["bytes_sent_per_step"])
                         for _, e in sorted(epochs.items())]
        run["bytes_after_warmup"] = run["epochs"][-1][2] if epochs else None
        runs.append(run)
    return runs


Curve = list[tuple[int, float, float]]  # (step, metric, bytes per step of the window ending there)


def mean_curve(curves: list[Curve]) -> Curve:
    """(step, mean metric, mean bytes per step) at each point the curves share (one config's
    runs, evaluated at the same steps), up to the shortest."""
    points = min(len(c) for c in curves)
    return [(curves[0][i][0], statistics.fmean(c[i][1] for c in curves),
             statistics.fmean(c[i][2] for c in curves)) for i in range(points)]


def time_to_target(curves: dict[str, list[Curve]], step_times: dict[str, Any],
                   reached: Callable[[float], bool]) -> dict[str, Any]:
    """Per config: the steps at the first point of its mean curve where `reached(metric)`, and
    per link rate of `step_times` (benchmarks.train_step's JSON; dense looked up as 'ddp') the
    seconds: those steps times the steady-state step, plus the wire time of the bytes each
    window up to there sent beyond the last window's (the warm-up's, the dense start's)."""
    rows = {}
    for config, runs in curves.items():
        curve = mean_curve(runs)
        hit = next((i for i, (_, value, _) in enumerate(curve) if reached(value)), None)
        row: dict[str, Any] = {"steps": curve[hit][0] if hit is not None else None}
        measured = "ddp" if config == "dense" else config
        for rate, algorithms in step_times["networks"].items():
            step = algorithms.get(measured)
            if step is None or hit is None:
                row[rate] = None
                continue
            steady, previous, extra = curve[-1][2], 0, 0.0
            for step_at, _, sent in curve[: hit + 1]:
                extra += max(0.0, sent - steady) * (step_at - previous) * 8 / rate_bits_per_s(rate)
                previous = step_at
            row[rate] = {"step_s": step["step_s"],
                         "seconds": row["steps"] * step["step_s"] + extra,
                         "warmup_wire_s": extra}
        rows[config] = row
    return rows


def time_to_accuracy(runs: list[dict[str, Any]], step_times: dict[str, Any],
                     target_epoch: int) -> dict[str, Any]:
    """Per config: the steps its mean curve needed to reach dense's mean accuracy after
    `target_epoch` epochs, and per link rate the seconds (see the module docstring)."""
    curves: dict[str, list[Curve]] = {}
    for run in runs:
        curves.setdefault(run["config"], []).append(run["epochs"])
    target = mean_curve(curves["dense"])[target_epoch - 1][1]
    return {"target_epoch": target_epoch, "target_accuracy": target,
            "configs": time_to_target(curves, step_times, lambda acc: acc >= target)}


def time_markdown(result: dict[str, Any], rates: list[str], provenance: str | None = None) -> str:
    return time_table(f"Time to dense's mean accuracy after {result['target_epoch']} epochs "
                      f"({result['target_accuracy']:.4f}):", result["configs"], rates, provenance)


def time_table(title: str, rows: dict[str, Any], rates: list[str],
               provenance: str | None = None) -> str:
    """`title`, then a table of time_to_target's rows (steps, and per rate the step time and
    seconds), then `provenance`."""
    lines = [title, "",
             "| config | steps | " + " | ".join(f"{r} s/step | {r} seconds" for r in rates) + " |",
             "|---|---|" + "---|---|" * len(rates)]
    for config, row in rows.items():
        cells = []
        for rate in rates:
            t = row[rate]
            cells += ([f"{t['step_s']:.3f}", f"{t['seconds']:,.0f}"] if t else ["-", "-"])
        steps = f"{row['steps']:,}" if row["steps"] is not None else "not reached"
        lines.append(f"| {config} | {steps} | " + " | ".join(cells) + " |")
    if provenance:
        lines += ["", provenance]
    return "\n".join(lines) + "\n"


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per config: accuracy mean/min/max, bytes per step whole run and after warm-up
    (means over seeds), seeds."""
    rows = []
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        accuracy = [r["test_accuracy"] for r in mine]
        rows.append({
            "config": config, "family": family(config), "seeds": sorted(r["seed"] for r in mine),
            "accuracy": {"mean": statistics.fmean(accuracy), "min": min(accuracy),
                         "max": max(accuracy), "values": accuracy},
            "bytes_run": statistics.fmean(r["bytes_run"] for r in mine),
            "bytes_after_warmup": statistics.fmean(r["bytes_after_warmup"] for r in mine),
            "dense_bytes": mine[0]["dense_bytes"]})
    return sorted(rows, key=lambda r: -r["bytes_run"])


def dominance(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each PowerSGD row, the SparDL rows that send no more bytes (whole run) by the rule's
    verdict on their accuracy against it: 'dominated_by' (better), 'level', and each one's
    Welch interval of the difference in points (None with one seed)."""
    sparse = [r for r in rows if r["family"] == "spardl"]
    out = []
    for p in (r for r in rows if r["family"] == "powersgd"):
        found: dict[str, list[str]] = {"better": [], "level": [], "worse": []}
        intervals = {}
        for s in sparse:
            if s["bytes_run"] > p["bytes_run"]:
                continue
            interval = welch(s["accuracy"]["values"], p["accuracy"]["values"])
            found[interval.verdict if interval else "level"].append(s["config"])
            intervals[s["config"]] = None if interval is None else [
                100 * interval.low, 100 * interval.high]
        out.append({"powersgd": p["config"], "dominated_by": found["better"],
                    "level": found["level"], "intervals_points": intervals})
    return out


def verdict_final(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> bool:
    """True once more seeds of the configs lacking some cannot change the verdict (see the
    module docstring); False while a row the verdict rests on has fewer seeds than the most."""
    most = max(len(r["seeds"]) for r in rows)
    complete = {r["config"] for r in rows if len(r["seeds"]) == most}
    if any(r["family"] == "powersgd" and r["config"] not in complete for r in rows):
        return False
    if all(v["dominated_by"] for v in verdicts):
        return all(complete.intersection(v["dominated_by"]) for v in verdicts)
    return all(r["config"] in complete for r in rows if r["family"] == "spardl")


def markdown(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]], final: bool,
             provenance: str | None = None) -> str:
    most = max(len(r["seeds"]) for r in rows)
    dense = next((r for r in rows if r["config"] == "dense"), None)
    lines = ["| config | seeds | test accuracy, mean (min..max) | vs dense, points | "
             "bytes/step, whole run | after warm-up | vs dense (whole run) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = r["accuracy"]
        gap = (f"{100 * (acc['mean'] - dense['accuracy']['mean']):+.2f}" if dense else "-")
        partial = "" if len(r["seeds"]) == most else " (partial)"
        lines.append(
            f"| {r['config']} | {len(r['seeds'])}{partial} | {acc['mean']:.4f} "
            f"({acc['min']:.4f}..{acc['max']:.4f}) | {gap} | {r['bytes_run']:,.0f} | "
            f"{r['bytes_after_warmup']:,.0f} | 1/{r['dense_bytes'] / r['bytes_run']:.1f} |")
    lines.append("")
    if provenance:
        lines += [provenance, ""]
    for v in verdicts:
        def named(configs: list[str]) -> str:
            return ", ".join(f"{c} ({_interval(v['intervals_points'][c])})" for c in configs) \
                or "no SparDL point"
        lines.append(f"- {v['powersgd']}: at no more bytes, more accurate: "
                     f"{named(v['dominated_by'])}; level: {named(v['level'])}.")
    caveat = "" if final else " (not final: points it rests on lack seeds)"
    if all(v["dominated_by"] for v in verdicts):
        said = "dominates PowerSGD's points"
    elif all(v["dominated_by"] or v["level"] for v in verdicts):
        said = "is level with or above every PowerSGD point at no more bytes, but does not dominate"
    else:
        said = "does not dominate PowerSGD's points"
    lines.append(f"- SparDL {said} on these runs{caveat}. Better or worse only where the 95% "
                 "Welch interval of the difference of seed means excludes zero; otherwise level.")
    return "\n".join(lines) + "\n"


def _interval(points: list[float] | None) -> str:
    return "one seed" if points is None else f"{points[0]:+.2f}..{points[1]:+.2f} points"


Point = tuple[float, float, float, float, str, str | None]  # bytes, mean, min, max, label, colour


def plot_points(points: list[Point], path: Path, title: str, ylabel: str) -> None:
    """One error bar (min..max about the mean) per point against MB per step (log scale),
    each labelled, saved as a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for x, mean, low, high, label, colour in points:
        ax.errorbar(x / 1e6, mean, yerr=[[mean - low], [high - mean]], fmt="o", capsize=3,
                    color=colour)
        ax.annotate(label, (x / 1e6, mean), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per step and worker (whole run, log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    colours = {"dense": "black", "fp16": "grey", "powersgd": "tab:red", "postlocal": "tab:purple",
               "spardl": "tab:blue", "topka": "tab:green"}
    plot_points([(r["bytes_run"], r["accuracy"]["mean"], r["accuracy"]["min"],
                  r["accuracy"]["max"], f"{r['config']} ({len(r['seeds'])})",
                  colours.get(r["family"], "tab:orange")) for r in rows],
                path, title, "final test accuracy (mean; bars: min..max over seeds)")


def whole_numbers(p: argparse.ArgumentParser, option: str, value: str, unit: str) -> list[int]:
    """The comma-separated whole numbers `value` of `option`; p.error naming the form
    otherwise."""
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        p.error(f"{option} takes whole {unit}, comma-separated, got {value!r}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the ablation's output directory")
    p.add_argument("--title", default="accuracy per byte")
    p.add_argument("--step-times", default=None,
                   help="a benchmarks.train_step JSON of these configs: add time to accuracy")
    p.add_argument("--target-epoch", default="6",
                   help="the target is dense's mean accuracy after this many epochs; several, "
                        "comma-separated, give a table each")
    p.add_argument("--provenance", default=None,
                   help="the line written under the front's table (the docs' 'Recorded DATE, "
                        "MACHINE: `COMMAND` -> `RESULT`')")
    p.add_argument("--step-times-provenance", default=None,
                   help="the line written under the time-to-accuracy table")
    args = p.parse_args(argv)
    targets = whole_numbers(p, "--target-epoch", args.target_epoch, "epochs")
    out = Path(args.out)
    runs = load_runs(out)
    if not runs:
        raise SystemExit(f"no finished run (CONFIG-seedS/run.json) under {out}")
    rows = summarise(runs)
    verdicts = dominance(rows)
    final = verdict_final(rows, verdicts)
    text = markdown(rows, verdicts, final, args.provenance)
    report: dict[str, Any] = {"rows": rows, "dominance": verdicts, "verdict_final": final}
    if args.step_times:
        step_times = json.loads(Path(args.step_times).read_text())
        report["time_to_accuracy"] = [time_to_accuracy(runs, step_times, t) for t in targets]
        for result in report["time_to_accuracy"]:
            text += "\n" + time_markdown(result, list(step_times["networks"]),
                                         args.step_times_provenance)
    (out / "front.md").write_text(text)
    (out / "front.json").write_text(json.dumps(report, indent=1))
    plot(rows, out / "front.png", args.title)
    print(text)
    return rows


if __name__ == "__main__":
    main()
