"""The loss-per-byte front of runs recorded in several ablation folders: one point per arm,
final validation loss (mean; bars min..max over its seeds) against bytes sent per step and
worker over the whole run, with Welch's 95% interval of each arm's difference from the
reference arm's mean (testbed.stats).

    python -m experiments.loss_front experiments/results/transformer_front \\
        dense=experiments/results/front_transformer_update_frozen_cpu:dense \\
        "PowerSGD rank 4=experiments/results/front_transformer_update_frozen_cpu:powersgd4" \\
        "SparDL every 4 steps, coded=experiments/results/diloco_outer_cpu/grace_h4_d0.4_deltaqsgd"

Each arm is LABEL=FOLDER[:CONFIG]: the runs of CONFIG in FOLDER/results.json (the folder's
only config when CONFIG is left out). The first arm is the reference. Writes OUT.png and
OUT.json (the rows: label, folder, config, seeds, losses, mean, min, max, bytes per step,
interval against the reference) and prints a markdown table of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from experiments.front import plot_points
from testbed.stats import welch


def parse_arm(text: str) -> tuple[str, Path, str | None]:
    """LABEL=FOLDER[:CONFIG] as (label, folder, config or None); ValueError naming the form."""
    label, sep, where = text.partition("=")
    if not sep or not label or not where:
        raise ValueError(f"an arm is LABEL=FOLDER[:CONFIG], got {text!r}")
    folder, _, config = where.partition(":")
    return label, Path(folder), config or None


def load_arm(label: str, folder: Path, config: str | None) -> dict[str, Any]:
    """The row of one arm from FOLDER/results.json; ValueError naming the folder's configs
    when CONFIG is not among them (or is left out where there are several)."""
    path = folder / "results.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (an ablation folder holds results.json)")
    runs = json.loads(path.read_text())["runs"]
    configs = list(dict.fromkeys(r["config"] for r in runs))
    if config is None and len(configs) == 1:
        config = configs[0]
    if config not in configs:
        raise ValueError(f"{label}: {folder} holds configs {', '.join(configs)}; "
                         f"name one as {folder}:CONFIG")
    mine = sorted((r for r in runs if r["config"] == config), key=lambda r: r["seed"])
    losses = [r["test_loss"] for r in mine]
    return {"label": label, "folder": str(folder), "config": config,
            "seeds": [r["seed"] for r in mine], "losses": losses,
            "mean": statistics.fmean(losses), "min": min(losses), "max": max(losses),
            "bytes_run": statistics.fmean(r["bytes_run"] for r in mine),
            "dense_bytes": mine[0]["dense_bytes"]}


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its Welch interval against the first row's losses (None with fewer than
    two seeds on either side) and the verdict: 'worse' (higher loss), 'better' or 'level'."""
    reference = rows[0]["losses"]
    for row in rows:
        interval = welch(row["losses"], reference)
        row["vs_reference"] = None if interval is None else [interval.low, interval.high]
        verdict = "level" if interval is None else interval.verdict
        row["verdict"] = {"better": "worse", "worse": "better"}.get(verdict, verdict)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the docs' table: seeds, loss mean (min..max), the verdict and interval
    against the reference (a one-seed arm has none: level by the rule, not a finding), bytes."""
    head = rows[0]["label"]
    lines = [f"| arm | seeds | validation loss | vs {head} (95% interval) | bytes/step, whole run |"
             " vs dense's |", "|---|---|---|---|---|---|"]
    for r in rows:
        against = ("" if r is rows[0] else "no interval (one seed)" if r["vs_reference"] is None
                   else f"{r['verdict']} ({r['vs_reference'][0]:+.3f}..{r['vs_reference'][1]:+.3f})")
        lines.append(f"| {r['label']} | {len(r['seeds'])} | {r['mean']:.4f} ({r['min']:.4f}.."
                     f"{r['max']:.4f}) | {against} | {r['bytes_run']:,.0f} | "
                     f"1/{r['dense_bytes'] / r['bytes_run']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plot_points([(r["bytes_run"], r["mean"], r["min"], r["max"],
                  f"{r['label']} ({len(r['seeds'])})", None) for r in rows],
                path, title, "final validation loss (mean; bars: min..max over seeds)")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="OUT: writes OUT.png and OUT.json")
    p.add_argument("arms", nargs="+", metavar="LABEL=FOLDER[:CONFIG]",
                   help="the arms, the reference first")
    p.add_argument("--title", default="validation loss per byte")
    args = p.parse_args(argv)
    try:
        rows = compare([load_arm(*parse_arm(a)) for a in args.arms])
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"), args.title)
    print(markdown(rows), end="")
    return rows


if __name__ == "__main__":
    main()
