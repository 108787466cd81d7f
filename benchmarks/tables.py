"""The benchmark tables of the docs (docs/results/), as markdown, from the JSON results.

    python -m benchmarks.tables benchmarks/results > benchmarks/results/tables.md
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any


def comm_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"{cfg['workers']} ranks, {result['numel']:,} entries ({cfg['gradient']}), density "
             f"{cfg['density']}, network {cfg['bandwidth'] or 'unshaped loopback'}; link measured "
             f"alpha {result['link']['alpha'] * 1e3:.2f} ms, "
             f"{8 / result['link']['beta'] / 1e6:,.0f} Mbit/s" if result["link"]["beta"] else "",
             "",
             "| algorithm | total s | selection s | comm s | coding s | other s | copies | MB/rank "
             "| vs formula | vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["algorithms"].items():
        vs_formula = f"{r['bytes_vs_formula']:.3f}" if r["bytes_vs_formula"] else "-"
        other = f"{r['other_s']['median']:.3f}" if "other_s" in r else "-"
        copies = f"{r['passes_vs_copy']:.1f}" if "passes_vs_copy" in r else "-"
        lines.append(f"| {name} | {r['total_s']['median']:.3f} | {r['selection_s']['median']:.3f} | "
                     f"{r['comm_s']['median']:.3f} | {r['coding_s']['median']:.3f} | {other} | "
                     f"{copies} | {r['bytes_sent_per_rank'] / 1e6:.3f} | {vs_formula} | "
                     f"{r.get('time_vs_dense', float('nan')):.2f} |")
    copy = [r["copy_s"]["median"] for r in result["algorithms"].values() if "copy_s" in r]
    if copy:
        lines += ["", f"other s: time outside selection, communication and coding; copies: that "
                      f"time in copies of the gradient, timed in the same run (one copy: "
                      f"{statistics.median(copy):.3f} s)."]
    return "\n".join(lines) + "\n"


def simulation_tables(sim: dict[str, Any]) -> str:
    rows = sim["validation"]
    lines = ["Validation (communication seconds, median over steps; replayed: the step's messages "
             "sent again without computation):", "",
             "| network | P | algorithm | measured | replayed | from trace | from schedule |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["bandwidth"] or "", r["algorithm"], r["workers"])):
        replayed = f"{r['measured_replay_s']:.4f}" if r.get("measured_replay_s") else "-"
        lines.append(f"| {r['bandwidth'] or 'loopback'} | {r['workers']} | {r['algorithm']} | "
                     f"{r['measured_comm_s']:.4f} | "
                     f"{replayed} | {r['trace_predicted_s']:.4f} | {r['schedule_predicted_s']:.4f} |")
    rates = dict.fromkeys(r["bandwidth"] for r in rows)
    for (key, what), rate in itertools.product((("trace_error", "against the measured communication"),
                                                ("replay_error", "against the replay")), rates):
        by_alg: dict[str, list[float]] = {}
        for r in rows:
            if r.get(key) is not None and r["bandwidth"] == rate:
                by_alg.setdefault(r["algorithm"], []).append(abs(r[key]))
        if by_alg:
            where = f" at {rate}" if len(rates) > 1 else ""
            lines += ["", f"Median |error| of the trace prediction {what}{where}: " + ", ".join(
                f"{a} {statistics.median(v):.0%}" for a, v in sorted(by_alg.items())) + "; all "
                f"{statistics.median(e for v in by_alg.values() for e in v):.0%}."]
    lines.append("")
    sizes = sim["sizes"]
    lines += [f"Predicted communication seconds, {sim['numel']:,} entries, density {sim['density']}:",
              "", "| network | algorithm | P=16 | P=64 | P=256 | P=1024 |", "|---|---|---|---|---|---|"]
    for net, algs in sim["scaling"].items():
        for name, secs in algs.items():
            lines.append(f"| {net} | {name} | " + " | ".join(
                f"{secs[sizes.index(p)]:.4f}" for p in (16, 64, 256, 1024)) + " |")
    lines += ["", "SparDL against d (teams), predicted seconds:", "",
              "| network | P | " + " | ".join(f"d={d}" for d in (1, 2, 4, 8, 16, 32, 64)) + " |",
              "|---|---|" + "---|" * 7]
    for net, by_p in sim["teams"].items():
        for p, by_d in by_p.items():
            lines.append(f"| {net} | {p} | " + " | ".join(
                f"{by_d[str(d)]:.4f}" for d in (1, 2, 4, 8, 16, 32, 64)) + " |")
    return "\n".join(lines) + "\n"


def codec_table(res: dict[str, Any]) -> str:
    lines = [f"{res['model']} gradient, {res['numel']:,} entries, k = {res['k']:,}, one thread:", "",
             "| codec (index + value) | bytes / uncoded | encode MB/s | decode MB/s | value error |",
             "|---|---|---|---|---|"]
    for name, r in res["configs"].items():
        lines.append(f"| {name} | {r['ratio_to_uncoded']:.3f} | {r['encode_mb_per_s']:.1f} | "
                     f"{r['decode_mb_per_s']:.1f} | {r['relative_error']:.4f} |")
    return "\n".join(lines) + "\n"


def codecs_on_spardl_table(res: dict[str, Any]) -> str:
    lines = ["| index + value codec | bytes / step / rank | vs uncoded | coding ms / step | "
             "result difference, step 0 |", "|---|---|---|---|---|"]
    for r in res["results"]:
        lines.append(f"| {r['codec']} | {r['bytes_per_step_per_rank']:,.0f} | "
                     f"{r['ratio_to_identity']:.2f} | {r['coding_s_per_step'] * 1e3:.0f} | "
                     f"{r['relative_difference_step0']:.4f} |")
    return "\n".join(lines) + "\n"


def kernels_table(res: dict[str, Any]) -> str:
    lines = [f"{res['device_name']} ({res['torch_threads']} thread(s)), {res['numel']:,} entries, "
             f"k = {res['k']:,}, copy bandwidth {res['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s:",
             "", "| kernel | ms | floor ms | vs floor |", "|---|---|---|---|"]
    for name, r in res["kernels"].items():
        lines.append(f"| {name} | {r['seconds'] * 1e3:.2f} | {r['floor_seconds'] * 1e3:.3f} | "
                     f"{r['vs_floor']:.1f} |")
    return "\n".join(lines) + "\n"


def tables(folder: Path) -> str:
    parts = []
    for path in sorted(folder.glob("comm_vgg16_*.json")):
        parts.append(f"### {path.name}\n\n" + comm_table(json.loads(path.read_text())))
    if (folder / "simulation.json").exists():
        parts.append("### simulation.json\n\n" + simulation_tables(
            json.loads((folder / "simulation.json").read_text())))
    if (folder / "codecs_spardl.json").exists():
        parts.append("### codecs_spardl.json\n\n" + codecs_on_spardl_table(
            json.loads((folder / "codecs_spardl.json").read_text())))
    for path in sorted(folder.glob("codec_speed_*.json")):
        parts.append(f"### {path.name}\n\n" + codec_table(json.loads(path.read_text())))
    for path in sorted(folder.glob("kernels_*.json")):
        parts.append(f"### {path.name}\n\n" + kernels_table(json.loads(path.read_text())))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    folder = p.parse_args(argv).folder
    made = tables(folder)
    if not made:
        p.exit(1, f"{p.prog}: no results to tabulate in {folder}: it reads comm_vgg16_*.json, "
                  "simulation.json, codecs_spardl.json, codec_speed_*.json and kernels_*.json "
                  "(name a benchmark's --json after them)\n")
    print(made, end="")


if __name__ == "__main__":
    main()
