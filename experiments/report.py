"""Compare training runs of experiments.main_trainer side by side.

    python -m experiments.report experiments/results/resnet20_fmnist

Every sub-folder of the given folder that holds a log.jsonl is one run, named by the folder;
a run packed into FOLDER.tar.xz (testbed.records) counts the same.
Writes summary.json and summary.md (one row per run: final and best test accuracy, bytes sent
per step per rank, compression ratio, samples/s and the split of sync time) and curves.png
(training loss per step, smoothed, and test accuracy per epoch), and prints the table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from testbed.records import Run, read_log, runs_under

COLUMNS = (("run", "run", "{}"), ("epochs", "epochs", "{}"),
           ("final test acc", "final_test_accuracy", "{:.4f}"),
           ("best test acc", "best_test_accuracy", "{:.4f}"),
           ("final train loss", "final_train_loss", "{:.4f}"),
           ("bytes/step/rank", "bytes_sent_per_step", "{:,.0f}"),
           ("vs dense", "compression_ratio", "{:.4f}"),
           ("samples/s", "samples_per_s", "{:.0f}"),
           ("sync s/epoch", "sync_s", "{:.1f}"),
           ("selection s", "selection_s", "{:.1f}"),
           ("comm s", "comm_s", "{:.1f}"))


def read_run(run: Run) -> dict[str, Any]:
    """A run's step losses and epoch records from its log.jsonl."""
    log = read_log(run)
    steps, epochs = log.get("step", []), log.get("epoch", [])
    if not epochs:
        raise ValueError(f"{run} has no finished epoch in its log.jsonl")
    return {"steps": steps, "epochs": epochs}


def summarise(name: str, run: dict[str, Any]) -> dict[str, Any]:
    """One table row; per-epoch figures are means over the run's epochs."""
    epochs = run["epochs"]
    last = epochs[-1]

    def mean(key: str) -> float:
        return sum(float(e.get(key, 0.0)) for e in epochs) / len(epochs)
    return {"run": name, "epochs": len(epochs),
            "final_test_accuracy": last["test_accuracy"],
            "best_test_accuracy": max(e["test_accuracy"] for e in epochs),
            "final_train_loss": last["train_loss"],
            "bytes_sent_per_step": mean("bytes_sent_per_step"),
            "compression_ratio": mean("compression_ratio"),
            "samples_per_s": mean("samples_per_s"), "sync_s": mean("sync_s"),
            "selection_s": mean("selection_s"), "comm_s": mean("comm_s")}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[str, Any]], path: Path, window: int = 25) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        losses = [s["loss"] for s in run["steps"]]
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax_loss.plot([s["step"] for s in run["steps"]], smooth, label=name, linewidth=1)
        ax_acc.plot([e["epoch"] + 1 for e in run["epochs"]],
                    [e["test_accuracy"] for e in run["epochs"]], marker="o", label=name)
    ax_loss.set(xlabel="step", ylabel=f"training loss (mean of {window} logged steps)",
               yscale="log")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(folder: Path) -> list[dict[str, Any]]:
    """Summarise every run under `folder`; writes summary.json, summary.md and curves.png."""
    runs = {run.name: read_run(run) for run in runs_under(folder)}
    if not runs:
        raise SystemExit(f"no run (a folder with log.jsonl, or one packed into FOLDER.tar.xz) "
                         f"under {folder}")
    rows = [summarise(name, run) for name, run in runs.items()]
    (folder / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    (folder / "summary.md").write_text(markdown(rows))
    plot(runs, folder / "curves.png")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    print(markdown(report(args.folder)), end="")


if __name__ == "__main__":
    main()
