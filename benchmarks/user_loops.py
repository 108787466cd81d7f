"""The loops users write, run again and again: a stress test outside CI for hangs.

    python -m benchmarks.user_loops --runs 20 --json benchmarks/results/user_loops.json

Each job is one of tests/user_loops.py's scenarios on 3 ranks under a real launcher (as
tests/test_user_loops.py runs it once): the user's collectives, barrier and object broadcast
between backward and step; hand-written optimizers under the DDP hook (torchrun only); the
other patterns (evaluation mid-epoch, a GAN, AMP with a GradScaler and clipping, unused
parameters; under torchrun also torch.compile and a user's subgroup). A run passes when every
rank ends with the same parameters; one that has not ended within --timeout seconds is a hang
(its processes are killed). Writes per job and launcher the runs, passes, failures and hangs,
and each run's seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.comm import machine
from benchmarks.launch import ROOT, launch_env, launcher_command

WORKER = ROOT / "tests" / "mp_worker.py"
#: job name: (scenario in tests/user_loops.py, the launchers it runs under)
JOBS = {
    "collectives_between_backward_and_step": ("collectives_between_backward_and_step",
                                              ("gloo", "mpi", "horovod")),
    "handwritten_optimizers_under_the_ddp_hook": ("handwritten_optimizers_under_the_ddp_hook",
                                                  ("gloo",)),
    "more_patterns": ("more_patterns", ("gloo", "mpi", "horovod")),
}
LAUNCHERS = ("gloo", "mpi", "horovod")


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


def run_once(scenario: str, launcher: str, timeout: float) -> dict[str, Any]:
    """One job: 'pass' (every rank's parameters equal), 'fail' (an error exit or ranks that
    differ) or 'hang' (not ended within `timeout`), with its seconds."""
    with tempfile.TemporaryDirectory() as out:
        cmd = launcher_command(launcher, 3, [str(WORKER), launcher, f"user_loops.{scenario}", out])
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
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(3)]
    same = all(torch.equal(r[k]["params"], ranks[0][k]["params"]) for r in ranks for k in ranks[0])
    return {"outcome": "pass" if same else "fail", "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows = []
    for job in args.jobs:
        scenario, launchers = JOBS[job]
        for launcher in (x for x in args.launchers if x in launchers):
            runs = []
            for i in range(args.runs):
                runs.append(run_once(scenario, launcher, args.timeout))
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
