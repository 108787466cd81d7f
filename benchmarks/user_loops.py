"""The loops users write, run again and again: a stress test outside CI for hangs.

    python -m benchmarks.user_loops --runs 20 --json benchmarks/results/user_loops.json

Each job is one of the tests' scenarios under a real launcher (as tests/test_user_loops.py,
test_fsdp.py and test_trainers.py run it once): the user's collectives, barrier and object
broadcast between backward and step; hand-written optimizers under the DDP hook (torchrun
only); the other patterns (evaluation mid-epoch, a GAN, AMP with a GradScaler and clipping,
unused parameters; under torchrun also torch.compile and a user's subgroup); FSDP2 with
torchtitan's settings (4 ranks); Accelerate's save_state from every rank and from the main
process alone, and Lightning's checkpoint resume (2 ranks, torchrun); uneven shards inside
join_uneven_inputs, and torch's Join with the DDP hook (torchrun). A run passes when it
ends and what the ranks saved passes the job's check (the same parameters on every rank, or
the test's equalities); one that has not ended within --timeout seconds is a hang (its
processes are killed). Writes per job and launcher the runs, passes, failures and hangs, and
each run's seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.comm import machine
from benchmarks.launch import ROOT, launch_env, launcher_command

WORKER = ROOT / "tests" / "mp_worker.py"


def _same_params(ranks: list[dict]) -> bool:
    return all(torch.equal(r[k]["params"], ranks[0][k]["params"]) for r in ranks for k in ranks[0])


def _hsdps_gradients(ranks: list[dict]) -> bool:
    return all(torch.equal(h, n) for got in ranks for case in ("one", "accumulated")
               for h, n in zip(got[case]["hybrid"], got[case]["native"]))


def _resumed_bit_for_bit(ranks: list[dict]) -> bool:
    return all(torch.equal(r["straight"], ranks[0]["straight"])
               and torch.equal(r["straight"], r["resumed"]) for r in ranks)


def _accelerate(ranks: list[dict]) -> bool:
    return _resumed_bit_for_bit(ranks) and all(
        "missing: ranks [1]" in r["main_only"] for r in ranks)


def _nanogpt_checkpoints(ranks: list[dict]) -> bool:
    return all(
        torch.equal(r["own state"]["params"], r["unbroken"])
        and not r["own state"]["warnings"]
        and len(r["model+optimizer"]["warnings"]) == 1
        and "another rank's compression state" in (r["rank 0's state"]["error"] or "")
        for r in ranks
    )


def _torchtitan_user_patterns(ranks: list[dict]) -> bool:
    return all(
        all(torch.equal(h, n) for who in ("every rank", "rank 0")
            for h, n in zip(got[who]["hybrid"], got[who]["native"]))
        and len(got["resumed, ShardSync left out"]) == 1
        and not got["resumed, ShardSync kept"]
        and "saved under another sharding" in got.get("other layout", "")
        for got in ranks
    )


def same_values(a: Any, b: Any) -> bool:
    """Equal values, tensors bit for bit, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_values(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


def _uneven_shards(ranks: list[dict]) -> bool:
    return all(
        same_values(r["joined"][k], r["padded"][k])
        and same_values(r["joined"][k], ranks[0]["joined"][k])
        for r in ranks for k in ("params", "optimizer")
    ) and all(same_values(r["joined"]["compression"], r["padded"]["compression"]) for r in ranks)


def _uneven_shards_ddp_join(ranks: list[dict]) -> bool:
    return all(
        same_values(r["joined"][k], r["padded"][k]) and same_values(r[run][k], ranks[0][run][k])
        and not r[run]["warnings"]
        for r in ranks for k in ("params", "momentum") for run in ("joined", "empty_first")
    )


@dataclass(frozen=True)
class Job:
    """A scenario (MODULE.FUNCTION of tests/), its ranks, the launchers it runs under and
    the check that what every rank saved must pass."""
    scenario: str
    ranks: int
    launchers: tuple[str, ...]
    check: Callable[[list[dict]], bool]


ALL = ("gloo", "mpi", "horovod")
JOBS = {
    "collectives_between_backward_and_step": Job(
        "user_loops.collectives_between_backward_and_step", 3, ALL, _same_params),
    "handwritten_optimizers_under_the_ddp_hook": Job(
        "user_loops.handwritten_optimizers_under_the_ddp_hook", 3, ("gloo",), _same_params),
    "more_patterns": Job("user_loops.more_patterns", 3, ALL, _same_params),
    "fsdp2_with_torchtitans_settings": Job(
        "fsdp_scenarios.torchtitan_settings_equal_native_hsdp", 4, ("gloo",), _hsdps_gradients),
    "accelerate_save_state_and_main_process_save": Job(
        "trainer_scenarios.accelerate_resume", 2, ("gloo",), _accelerate),
    "lightning_checkpoint_resume": Job(
        "trainer_scenarios.lightning_resume", 2, ("gloo",), _resumed_bit_for_bit),
    "nanogpt_checkpoints": Job(
        "user_loops.nanogpt_checkpoints", 2, ("gloo",), _nanogpt_checkpoints),
    "fsdp2_torchtitan_user_patterns": Job(
        "fsdp_scenarios.user_patterns", 4, ("gloo",), _torchtitan_user_patterns),
    "uneven_shards": Job("uneven_scenarios.joined_and_padded", 3, ALL, _uneven_shards),
    "uneven_shards_ddp_join": Job(
        "uneven_scenarios.ddp_join", 3, ("gloo",), _uneven_shards_ddp_join),
}
LAUNCHERS = ALL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="runs of each job under each launcher")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated of {', '.join(JOBS)}")
    p.add_argument("--launchers", default=",".join(LAUNCHERS),
                   help=f"comma-separated of {', '.join(LAUNCHERS)} (gloo: torchrun)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is a hang")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.jobs = [j for j in args.jobs.split(",") if j]
    args.launchers = [x for x in args.launchers.split(",") if x]
    for given, valid, what in ((args.jobs, JOBS, "job"), (args.launchers, LAUNCHERS, "launcher")):
        bad = [g for g in given if g not in valid]
        if bad:
            p.error(f"unknown {what} {bad[0]!r}; valid choices: {', '.join(valid)}")
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return args


def run_once(job: Job, launcher: str, timeout: float) -> dict[str, Any]:
    """One run: 'pass' (ended, and the ranks' results pass the job's check), 'fail' (an error
    exit or a failed check) or 'hang' (not ended within `timeout`), with its seconds."""
    with tempfile.TemporaryDirectory() as out:
        cmd = launcher_command(launcher, job.ranks, [str(WORKER), launcher, job.scenario, out])
        started = time.monotonic()
        with subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                return {"outcome": "hang", "seconds": timeout}
        seconds = time.monotonic() - started
        if proc.returncode:
            return {"outcome": "fail", "seconds": seconds, "tail": output[-2000:]}
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
                 for r in range(job.ranks)]
    return {"outcome": "pass" if job.check(ranks) else "fail", "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows = []
    for job in args.jobs:
        for launcher in (x for x in args.launchers if x in JOBS[job].launchers):
            runs = []
            for i in range(args.runs):
                runs.append(run_once(JOBS[job], launcher, args.timeout))
                print(f"{job} {launcher} run {i + 1}: {runs[-1]['outcome']} "
                      f"({runs[-1]['seconds']:.1f} s)", flush=True)
            rows.append({"job": job, "launcher": launcher, "runs": len(runs),
                         **{k: sum(r["outcome"] == k for r in runs) for k in ("pass", "fail", "hang")},
                         "max_s": max(r["seconds"] for r in runs), "trials": runs})
    result = {"machine": machine(), "config": vars(args), "summary": [
        {k: v for k, v in r.items() if k != "trials"} for r in rows], "rows": rows}
    print(f"{'job':<44}{'launcher':<10}{'runs':>5}{'pass':>6}{'fail':>6}{'hang':>6}{'max s':>8}")
    for r in rows:
        print(f"{r['job']:<44}{r['launcher']:<10}{r['runs']:>5}{r['pass']:>6}{r['fail']:>6}"
              f"{r['hang']:>6}{r['max_s']:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
