"""Predict every algorithm's communication time at any scale from measured traces.

    python -m benchmarks.simulate benchmarks/results/comm_p*_1gbit.json \\
        --numel 14700000 --density 0.01 --json benchmarks/results/simulation.json

Input: benchmarks.comm results (each holds rank 0's message trace, every rank's step
statistics, the link's measured alpha and beta, and probes of every op kind at the run's P).
Output:
* validation: per input file and algorithm, the measured communication time (comm_s's median)
  against the alpha-beta prediction from the recorded trace and from the synthesized schedule
  (benchmarks.costmodel.synthesize, calibrated on the inputs), with the relative errors. The
  network of each run has an alpha and beta per op kind fitted to its probes
  (costmodel.fit_kind); `single_pair_error` is the trace's error with the link's one pair for
  every kind instead, as the model had it before the probes; `replay_error` is the trace's
  error against the replayed trace (benchmarks.comm's replay_rank0_s, rank 0's time to send
  the same messages again with no computation between them; replay_s, the fastest rank's,
  in runs recorded before it), which isolates the network model from the waits for peers
  still computing that comm_s also holds;
* scaling: the predicted time of every algorithm for P = 2 .. --max-workers under each network
  model (the measured link, a 10 Gbit cluster and a hierarchical 8-ranks-per-node cluster);
* teams: SparDL's time against d (teams) at 256 and 1024 workers.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import costmodel
from benchmarks.costmodel import Network
from testbed.netem import burst_bytes, rate_bits_per_s
from spardl_grace.transport.counting import Message


def measured_network(result: dict[str, Any]) -> Network:
    """A benchmarks.comm run's network: its link's alpha and beta, with a pair per op kind
    fitted to the run's probes (all-reduces as gloo's ring) and, on an emulated network, the
    tbf bucket of its links as the burst. The probes are the slowest rank's where the run
    recorded them (`probes_slowest`): a step ends with its slowest rank, the rank the
    validation compares with; the fastest rank's time per op leaves out the skew between
    ranks that each op of a chain passes on, so fits to it predicted chains of many small
    exchanges (SparDL's) too fast. Older runs have the fastest rank's only; runs recorded
    before the probes have the link's pair only."""
    link, size = result["link"], result["config"]["workers"]
    probes = result.get("probes_slowest") or result.get("probes")
    if not probes:
        return Network(alpha=link["alpha"], beta=link["beta"])
    rate = result["config"].get("bandwidth")
    burst = burst_bytes(rate_bits_per_s(rate)) if rate else 0
    per_kind = {kind: costmodel.fit_kind([(costmodel.probe_op(kind, nbytes, size), size, seconds)
                                          for nbytes, seconds in samples], burst, link["beta"])
                for kind, samples in probes.items()}
    return Network(alpha=link["alpha"], beta=link["beta"], per_kind=per_kind, allreduce="ring",
                   burst=burst)


def networks(measured: Network) -> dict[str, Network]:
    """The network models predictions are made for. Only the first is measured (its alpha and
    beta per op kind, without the emulator's tbf bucket: a cluster's links have none, and
    at scale ops follow each other too closely to refill one); the others are assumed
    figures for common clusters (stated in the docs, results/communication.md)."""
    return {
        "measured link": replace(measured, burst=0.0),
        "10 Gbit, alpha 20 us": Network.from_bandwidth(10, 20e-6),
        "8 per node (100 GB/s, 5 us) + 25 Gbit, 20 us": Network(
            alpha=20e-6, beta=8 / 25e9, ranks_per_node=8, alpha_intra=5e-6, beta_intra=1 / 100e9),
    }


def load(paths: list[Path]) -> list[dict[str, Any]]:
    return [dict(json.loads(p.read_text()), path=str(p)) for p in paths]


def calibration_records(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    records: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        size, teams = res["config"]["workers"], res["config"]["teams"]
        for name, alg in res["algorithms"].items():
            if name not in costmodel.ALGORITHMS:
                continue  # PyTorch's hooks: no trace of messages to model
            records.setdefault(name, []).extend(
                {"size": size, "teams": teams, "stats": s} for rank in alg["stats"] for s in rank)
    return records


def validate(results: list[dict[str, Any]], cal_by_density: dict) -> list[dict[str, Any]]:
    """Measured against predicted communication seconds for every input run. Besides rank 0's
    trace and schedule against comm_s and rank 0's replay (as before), the step's time: the
    slowest rank's replay (`replay_max_s`, in runs that record it) against the slowest rank's
    predicted time (every rank's synthesized ops), under the run's own network and under the
    network of the run at P = 2 with the same rate (as projections to large P use it)."""
    p2_nets = {r["config"]["bandwidth"]: measured_network(r) for r in results
               if r["config"]["workers"] == 2}
    rows = []
    for res in results:
        cfg = res["config"]
        size, numel = cfg["workers"], res["numel"]
        net = measured_network(res)
        single = Network(alpha=res["link"]["alpha"], beta=res["link"]["beta"])
        cal = cal_by_density[(numel, cfg["density"])]
        p2_net = p2_nets.get(cfg["bandwidth"])
        for name, alg in res["algorithms"].items():
            if name not in costmodel.ALGORITHMS:
                continue
            trace = costmodel.ops_from_messages([Message(*m) for m in alg["messages_rank0"]], size)
            from_trace = costmodel.predict_seconds(trace, 0, size, net)
            single_pair = costmodel.predict_seconds(trace, 0, size, single)
            per_rank = [costmodel.synthesize(name, numel, size, cfg["density"], cfg["teams"], cal,
                                             rank=r) for r in range(size)]
            from_schedule = costmodel.predict_seconds(per_rank[0], 0, size, net)
            slowest = max(costmodel.predict_seconds(ops, r, size, net) for r, ops in enumerate(per_rank))
            slowest_p2 = max(costmodel.predict_seconds(ops, r, size, p2_net)
                             for r, ops in enumerate(per_rank)) if p2_net else None
            measured = alg["comm_s"]["median"]
            # Rank 0's own replay where recorded (its trace is the one modelled); older runs
            # kept only the fastest rank's, which for gTop-k at P not a power of two and
            # TopkDSA is a rank that does less than rank 0.
            replayed = alg.get("replay_rank0_s", alg.get("replay_s", {})).get("median")
            step = alg.get("replay_max_s", {}).get("median")
            rows.append({"file": Path(res["path"]).name, "workers": size, "numel": numel,
                         "density": cfg["density"], "bandwidth": cfg["bandwidth"], "algorithm": name,
                         "measured_comm_s": measured, "measured_total_s": alg["total_s"]["median"],
                         "trace_predicted_s": from_trace, "schedule_predicted_s": from_schedule,
                         "trace_error": from_trace / measured - 1 if measured else None,
                         "schedule_error": from_schedule / measured - 1 if measured else None,
                         "single_pair_error": single_pair / measured - 1 if measured else None,
                         "measured_replay_s": replayed,
                         "replay_error": from_trace / replayed - 1 if replayed else None,
                         "measured_step_s": step, "step_predicted_s": slowest,
                         "step_error": slowest / step - 1 if step else None,
                         "step_predicted_from_p2_s": slowest_p2,
                         "step_error_from_p2": slowest_p2 / step - 1 if step and slowest_p2 else None})
    return rows


def errors_by_algorithm(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Per rate and algorithm, the errors `key` of the rows that have one: how many, the
    median of their magnitudes and their signed mean (a bias shows in the second); an
    unshaped network's rows under 'unshaped'."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rate in dict.fromkeys(r["bandwidth"] for r in rows):
        label = rate or "unshaped"
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            errs = [r[key] for r in rows
                    if r["bandwidth"] == rate and r["algorithm"] == name and r.get(key) is not None]
            if errs:
                out.setdefault(label, {})[name] = {"n": len(errs),
                                                  "median_abs": statistics.median(map(abs, errs)),
                                                  "signed_mean": statistics.fmean(errs),
                                                  "min": min(errs), "max": max(errs)}
    return out


def error_band(errors: dict[str, dict[str, dict[str, Any]]], name: str) -> tuple[float, float]:
    """(lowest, highest) relative error (predicted / measured - 1) of algorithm `name` over
    every rate of a validation's errors_by_algorithm: a prediction t stands for a measured time
    in [t / (1 + highest), t / (1 + lowest)]."""
    known = [e for algs in errors.values() for n, e in algs.items() if n == name]
    if not known:
        raise ValueError(f"the validation has no errors for {name}")
    return min(e["min"] for e in known), max(e["max"] for e in known)


def _signed(errors: dict[str, dict[str, dict[str, Any]]], name: str) -> float:
    """Algorithm `name`'s signed mean error over every rate, weighted by each rate's runs."""
    known = [e for algs in errors.values() for n, e in algs.items() if n == name]
    return sum(e["signed_mean"] * e["n"] for e in known) / sum(e["n"] for e in known)


def projection_ranges(scaled: dict[str, dict[str, list[float]]],
                      teams: dict[str, dict[str, dict[str, float]]], sizes: list[int],
                      errors: dict[str, dict[str, dict[str, Any]]],
                      at: tuple[int, ...] = (256, 1024), max_teams: int = 64) -> dict[str, Any]:
    """Per network and P in `at`: each algorithm's predicted seconds as the range its
    validation errors allow (error_band), and gTop-k's time over SparDL's at its best d (up to
    `max_teams`, the docs' table): as predicted, corrected by each one's signed mean error
    (the bias), and the range from gTop-k's slowest over SparDL's fastest to the other way
    round. The errors come from validation at small P on this machine and are applied
    unchanged at large P: they say how far the model missed where it was checked, not a bound
    at 1024 workers."""
    out: dict[str, Any] = {}
    for net_name, algs in scaled.items():
        out[net_name] = {}
        for p in at:
            i = sizes.index(p)
            ranges: dict[str, list[float] | None] = {}
            for name, secs in algs.items():
                try:
                    low, high = error_band(errors, name)
                except ValueError:  # not validated (dense): no range
                    ranges[name] = None
                    continue
                ranges[name] = [secs[i] / (1 + high), secs[i] / (1 + low)]
            best_d, best = min(((d, t) for d, t in teams[net_name][str(p)].items()
                                if int(d) <= max_teams), key=lambda kv: kv[1])
            s_low, s_high = error_band(errors, "spardl")
            spardl = [best / (1 + s_high), best / (1 + s_low)]
            gtopk = ranges["gtopk"]
            assert gtopk is not None
            point = algs["gtopk"][i] / best
            out[net_name][str(p)] = {
                "seconds": ranges, "spardl_best_d": int(best_d), "spardl_best": spardl,
                "gtopk_over_spardl_point": point,
                "gtopk_over_spardl_bias_corrected": point * (1 + _signed(errors, "spardl"))
                / (1 + _signed(errors, "gtopk")),
                "gtopk_over_spardl": [gtopk[0] / spardl[1], gtopk[1] / spardl[0]]}
    return out


def _median_abs(errors) -> float | None:
    known = [abs(e) for e in errors if e is not None]
    return statistics.median(known) if known else None


def scaling(numel: int, density: float, cal: costmodel.Calibration, nets: dict[str, Network],
            sizes: list[int]) -> dict[str, dict[str, list[float]]]:
    """Predicted seconds per network, algorithm and P (SparDL with d = 1)."""
    return {net_name: {name: [costmodel.predict_seconds(
                costmodel.synthesize(name, numel, p, density, 1, cal), 0, p, net) for p in sizes]
            for name in costmodel.ALGORITHMS} for net_name, net in nets.items()}


def teams_sweep(numel: int, density: float, cal: costmodel.Calibration, nets: dict[str, Network],
                sizes: tuple[int, ...] = (256, 1024)) -> dict[str, dict[str, dict[str, float]]]:
    """SparDL's predicted seconds per network, P and d (powers of two dividing P)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for net_name, net in nets.items():
        out[net_name] = {}
        for p in sizes:
            ds = [d for d in (2 ** i for i in range(p.bit_length())) if p % d == 0]
            out[net_name][str(p)] = {str(d): costmodel.predict_seconds(
                costmodel.synthesize("spardl", numel, p, density, d, cal), 0, p, net) for d in ds}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="benchmarks.comm JSON files")
    p.add_argument("--numel", type=int, default=14_700_000, help="gradient size to predict for")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--max-workers", type=int, default=1024)
    p.add_argument("--validate-only", action="store_true",
                   help="the validation alone (runs of several sizes and densities; no projections)")
    p.add_argument("--error-bands", type=Path, default=None,
                   help="a validation's JSON (--validate-only's): give the projections at 256 "
                        "and 1024 workers the ranges its per-algorithm step errors allow")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = load(args.results)
    records = calibration_records(results)
    cal_by_density = {}
    for res in results:
        key = (res["numel"], res["config"]["density"])
        if key not in cal_by_density:
            same = [r for r in results if (r["numel"], r["config"]["density"]) == key]
            cal_by_density[key] = costmodel.calibrate(calibration_records(same), *key)
    rows = validate(results, cal_by_density)
    cal = costmodel.calibrate(records, results[0]["numel"], results[0]["config"]["density"])
    nets = networks(measured_network(results[0]))
    sizes = [2 ** i for i in range(1, args.max_workers.bit_length()) if 2 ** i <= args.max_workers]
    sizes = sorted(set(sizes) | {3, 6, 12, 24, 48, 96})
    out = {"inputs": [r["path"] for r in results], "numel": args.numel, "density": args.density,
           "calibration": vars(cal), "link": results[0]["link"],
           "networks": {k: vars(v) for k, v in nets.items()},
           "validation": rows,
           "validation_error": {
               "trace_median_abs": statistics.median(abs(r["trace_error"]) for r in rows),
               "schedule_median_abs": statistics.median(abs(r["schedule_error"]) for r in rows),
               "single_pair_median_abs": statistics.median(abs(r["single_pair_error"])
                                                           for r in rows),
               "replay_median_abs": _median_abs(r["replay_error"] for r in rows),
               "replay_median_abs_by_bandwidth": {
                   rate: _median_abs(r["replay_error"] for r in rows if r["bandwidth"] == rate)
                   for rate in dict.fromkeys(r["bandwidth"] for r in rows)},
               "step_by_algorithm": errors_by_algorithm(rows, "step_error"),
               "step_from_p2_by_algorithm": errors_by_algorithm(rows, "step_error_from_p2"),
               "replay_by_algorithm": errors_by_algorithm(rows, "replay_error")},
           "sizes": sizes}
    if not args.validate_only:
        out["scaling"] = scaling(args.numel, args.density, cal, nets, sizes)
        out["teams"] = teams_sweep(args.numel, args.density, cal, nets)
        if args.error_bands:
            validation = json.loads(args.error_bands.read_text())
            out["error_bands_from"] = str(args.error_bands)
            out["projection_ranges"] = projection_ranges(
                out["scaling"], out["teams"], sizes,
                validation["validation_error"]["step_by_algorithm"])
    print(f"{'file':28s} {'P':>3s} {'algorithm':9s} {'measured':>9s} {'replayed':>9s} "
          f"{'trace':>9s} {'schedule':>9s}")
    for r in rows:
        replayed = f"{r['measured_replay_s']:9.4f}" if r["measured_replay_s"] else f"{'-':>9s}"
        print(f"{r['file'][:28]:28s} {r['workers']:3d} {r['algorithm']:9s} {r['measured_comm_s']:9.4f} "
              f"{replayed} {r['trace_predicted_s']:9.4f} {r['schedule_predicted_s']:9.4f}")
    err = out["validation_error"]
    print(f"median |error| against comm_s: trace {err['trace_median_abs']:.1%}, schedule "
          f"{err['schedule_median_abs']:.1%}, one alpha-beta pair for every op kind "
          f"{err['single_pair_median_abs']:.1%}")
    if err["replay_median_abs"] is not None:
        print(f"median |error| of the trace against its replay: {err['replay_median_abs']:.1%}"
              + "".join(f"; {rate} {e:.1%}" for rate, e in
                        err["replay_median_abs_by_bandwidth"].items() if e is not None))
    for key, label in (("step_by_algorithm", "the step (slowest rank) against its replay"),
                       ("step_from_p2_by_algorithm", "the step, with the network of the P = 2 run")):
        if err[key]:
            print(f"\n{label}: median |error| / signed mean per algorithm")
            for rate, algs in err[key].items():
                print(f"  {rate}: " + "; ".join(f"{a} {e['median_abs']:.1%} / {e['signed_mean']:+.1%}"
                                               for a, e in algs.items()))
    for net_name, algs in out.get("scaling", {}).items():
        print(f"\n{net_name}: predicted seconds at P = 256 / 1024")
        for name, secs in algs.items():
            print(f"  {name:9s} {secs[sizes.index(256)]:9.4f} {secs[sizes.index(1024)]:9.4f}")
    for net_name, by_p in out.get("projection_ranges", {}).items():
        for p, r in by_p.items():
            low, high = r["gtopk_over_spardl"]
            print(f"{net_name}, P = {p}: gTop-k / SparDL (d = {r['spardl_best_d']}) "
                  f"{r['gtopk_over_spardl_point']:.1f}x predicted, "
                  f"{r['gtopk_over_spardl_bias_corrected']:.1f}x without the validation's "
                  f"bias, {low:.1f}x to {high:.1f}x within its errors")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
