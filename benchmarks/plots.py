"""PNG plots of the benchmark results (matplotlib, no display needed).

    python -m benchmarks.plots benchmarks/results

Reads what benchmarks/reproduce.sh writes there and draws, for whichever inputs exist:
  time_vs_workers.png    comm_p{P}_*.json: total and communication time against P
  time_vs_density.png    comm_density*.json: total time against density
  bytes_vs_algorithm.png comm_vgg16_*.json: bytes per rank against the cost formula
  simulated_scaling.png  simulation.json: predicted time up to 1024 workers, per network
  spardl_teams.png       simulation.json: SparDL's predicted time against d
  codecs.png             codec_speed_*.json: size against throughput per codec configuration
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in paths]


def time_vs(results: list[dict[str, Any]], key: str, xlabel: str, path: Path, log_x: bool = False) -> None:
    results = sorted(results, key=lambda r: r["config"][key])
    xs = [r["config"][key] for r in results]
    fig, (ax_total, ax_comm) = plt.subplots(1, 2, figsize=(11, 4))
    for name in results[0]["algorithms"]:
        ax_total.plot(xs, [r["algorithms"][name]["total_s"]["median"] for r in results], marker="o", label=name)
        ax_comm.plot(xs, [r["algorithms"][name]["comm_s"]["median"] for r in results], marker="o", label=name)
    cfg = results[0]
    title = f"{cfg['numel']:,} entries, {cfg['config']['bandwidth'] or 'unshaped'}"
    for ax, what in ((ax_total, "total sync (selection included)"), (ax_comm, "communication")):
        ax.set(xlabel=xlabel, ylabel=f"{what}, s (median)", yscale="log", title=title)
        if log_x:
            ax.set_xscale("log")
    ax_total.legend()
    _save(fig, path)


def bytes_vs_algorithm(result: dict[str, Any], path: Path) -> None:
    names = [n for n, r in result["algorithms"].items() if r["formula_bytes"] is not None]
    measured = [result["algorithms"][n]["bytes_sent_per_rank"] / 1e6 for n in names]
    formula = [result["algorithms"][n]["formula_bytes"] / 1e6 for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured (mean rank)")
    ax.bar([x + 0.2 for x in xs], formula, 0.4, label="cost formula")
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="MB sent per rank per step", yscale="log",
           title=f"{result['numel']:,} entries, {result['config']['workers']} workers, "
                 f"density {result['config']['density']}")
    ax.legend()
    _save(fig, path)


def simulated_scaling(sim: dict[str, Any], path: Path) -> None:
    nets = list(sim["scaling"])
    fig, axes = plt.subplots(1, len(nets), figsize=(5 * len(nets), 4), squeeze=False)
    for ax, net in zip(axes[0], nets):
        for name, secs in sim["scaling"][net].items():
            ax.plot(sim["sizes"], secs, marker=".", label=name)
        ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="predicted communication, s",
               title=net)
    axes[0][0].legend()
    _save(fig, path)


def spardl_teams(sim: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for net, by_p in sim["teams"].items():
        for p, by_d in by_p.items():
            ds = [int(d) for d in by_d]
            ax.plot(ds, list(by_d.values()), marker="o", label=f"P={p}, {net}")
    ax.set(xscale="log", yscale="log", xlabel="teams d", ylabel="predicted communication, s",
           title="SparDL: latency against bandwidth")
    ax.legend(fontsize=7)
    _save(fig, path)


def codecs(results: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(8 * len(results), 5), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = res["configs"]
        for name, r in rows.items():
            speed = 1 / (1 / r["encode_mb_per_s"] + 1 / r["decode_mb_per_s"])
            ax.scatter(speed, r["ratio_to_uncoded"])
            ax.annotate(name, (speed, r["ratio_to_uncoded"]), fontsize=7)
        ax.set(xscale="log", xlabel="encode + decode throughput, MB/s of uncoded payload",
               ylabel="bytes / uncoded bytes",
               title=f"{res['model']}: {res['numel']:,} entries, k = {res['k']:,}")
    _save(fig, path)


def plot_all(folder: Path) -> list[Path]:
    """Every plot whose inputs exist under `folder`; returns the files written."""
    made = []
    by_p = sorted(folder.glob("comm_p*_*.json"))
    if by_p:
        time_vs(_load(by_p), "workers", "workers", folder / "time_vs_workers.png")
        made.append(folder / "time_vs_workers.png")
    by_density = sorted(folder.glob("comm_density*.json"))
    if by_density:
        time_vs(_load(by_density), "density", "density", folder / "time_vs_density.png", log_x=True)
        made.append(folder / "time_vs_density.png")
    for vgg in sorted(folder.glob("comm_vgg16_*.json"))[:1]:
        bytes_vs_algorithm(json.loads(vgg.read_text()), folder / "bytes_vs_algorithm.png")
        made.append(folder / "bytes_vs_algorithm.png")
    sim = folder / "simulation.json"
    if sim.exists():
        data = json.loads(sim.read_text())
        simulated_scaling(data, folder / "simulated_scaling.png")
        spardl_teams(data, folder / "spardl_teams.png")
        made += [folder / "simulated_scaling.png", folder / "spardl_teams.png"]
    codec_files = sorted(folder.glob("codec_speed_*.json"))
    if codec_files:
        codecs(_load(codec_files), folder / "codecs.png")
        made.append(folder / "codecs.png")
    return made


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    folder = p.parse_args(argv).folder
    made = plot_all(folder)
    if not made:
        p.exit(1, f"{p.prog}: no results to plot in {folder}: it reads {READS} (name a "
                  "benchmark's --json after them)\n")
    for path in made:
        print(path)


#: the result files plot_all reads, as the benchmarks guide names them
READS = ("comm_p*_*.json, comm_density*.json, comm_vgg16_*.json, simulation.json and "
         "codec_speed_*.json")


if __name__ == "__main__":
    main()
