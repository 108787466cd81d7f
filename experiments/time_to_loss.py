"""Time to a validation loss on emulated links, from a language model's ablation (issue 62's
transformer front) and measured step times:

    python -m experiments.time_to_loss experiments/results/front_transformer_gpu \
      --step-times STEP_TIMES.json[,MORE.json] --target-step 1000,500

Reads OUT/CONFIG-seedS/ (experiments.ablation's finished runs; their evaluations every
--eval-every steps: validation loss and the window's bytes per step) and, per target, writes
a table: the steps each config's mean curve over its seeds needed to reach dense's mean
validation loss at that step, times its steady-state step time at each link rate of the
step-time files (benchmarks.train_step JSONs of these configs, their 'networks' merged; dense
is looked up as 'ddp', what a user runs), plus the wire time of the bytes its warm-up or dense
start sent beyond the steady state's (experiments.front.time_to_target). Writes
OUT/time_to_loss.md and OUT/time_to_loss.json (the step-time files as given, and each
target's result) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments.front import Curve, mean_curve, time_table, time_to_target, whole_numbers
from testbed.records import read_log, runs_under


def loss_curves(out: Path) -> dict[str, list[Curve]]:
    """Per config, each finished run's (step, validation loss, bytes per step of the window)
    at its evaluations, in the order the runs are found."""
    curves: dict[str, list[Curve]] = {}
    for record in runs_under(out, "run.json"):
        config = json.loads(record.read_text("run.json"))["config"]
        evals = {e["step"]: e for e in read_log(record)["eval"]}  # a resumed run's last
        curves.setdefault(config, []).append(
            [(step, e["test_loss"], e["bytes_sent_per_step"]) for step, e in sorted(evals.items())])
    return curves


def merged_step_times(paths: list[Path]) -> dict[str, Any]:
    """One step-time table from several benchmarks.train_step JSONs: their rows per link rate
    together; ValueError if two files time the same config at the same rate."""
    networks: dict[str, dict[str, Any]] = {}
    for path in paths:
        for rate, rows in json.loads(path.read_text())["networks"].items():
            mine = networks.setdefault(rate, {})
            twice = sorted(set(mine) & set(rows))
            if twice:
                raise ValueError(f"{path} times {', '.join(twice)} at {rate} again")
            mine.update(rows)
    return {"networks": networks}


def time_to_loss(curves: dict[str, list[Curve]], step_times: dict[str, Any],
                 target_step: int) -> dict[str, Any]:
    """Dense's mean validation loss at `target_step` and, per config, the steps and seconds
    to reach it (experiments.front.time_to_target)."""
    if "dense" not in curves:
        raise ValueError("no finished dense run: the target is dense's loss")
    dense = {step: loss for step, loss, _ in mean_curve(curves["dense"])}
    if target_step not in dense:
        raise ValueError(f"dense's mean curve has no evaluation at step {target_step}; "
                         f"it has {', '.join(map(str, dense))}")
    target = dense[target_step]
    return {"target_step": target_step, "target_loss": target,
            "configs": time_to_target(curves, step_times, lambda loss: loss <= target)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the ablation's output directory")
    p.add_argument("--step-times", required=True,
                   help="benchmarks.train_step JSONs of these configs, comma-separated")
    p.add_argument("--target-step", default="1000",
                   help="the target is dense's mean validation loss at this step; several, "
                        "comma-separated, give a table each")
    p.add_argument("--provenance", default=None,
                   help="the line written under each table (the docs' 'Recorded DATE, "
                        "MACHINE: `COMMAND` -> `RESULT`')")
    args = p.parse_args(argv)
    targets = whole_numbers(p, "--target-step", args.target_step, "steps")
    out = Path(args.out)
    curves = loss_curves(out)
    if not curves:
        raise SystemExit(f"no finished run (CONFIG-seedS/run.json) under {out}")
    paths = [s for s in args.step_times.split(",") if s]
    step_times = merged_step_times([Path(s) for s in paths])
    results = [time_to_loss(curves, step_times, t) for t in targets]
    rates = list(step_times["networks"])
    text = "\n".join(
        time_table(f"Time to dense's mean validation loss at step {r['target_step']} "
                   f"({r['target_loss']:.4f}):", r["configs"], rates, args.provenance)
        for r in results)
    (out / "time_to_loss.md").write_text(text)
    (out / "time_to_loss.json").write_text(json.dumps({"step_times": paths, "results": results},
                                                      indent=1))
    print(text)
    return results


if __name__ == "__main__":
    main()
