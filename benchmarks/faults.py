"""Fault injection: one rank of a real training run is killed (SIGKILL) or frozen (SIGSTOP)
at a random moment, under torchrun, mpirun and horovodrun, and the run must end on its own
with an error, never hang.

    python -m benchmarks.faults --trials 3 --json benchmarks/results/faults.json

Each trial launches the training CLI (SparDL, FashionCNN on the digits set, 2 ranks, a
transport timeout of --timeout seconds) under the launcher, waits a random time, then signals
a randomly chosen rank. It records how long the launcher took to end after the fault, its exit
status, and whether a surviving rank raised TransportError or TransportTimeout (the library
noticed) or the launcher ended the job first (it noticed a dead child before any collective
could). A trial that has not ended within the timeout + --grace seconds counts as a hang; the
whole process group is then killed. Beside the launcher's end, the first surviving rank's exit
is timed: torchrun gives a frozen rank 30 s to obey SIGTERM before it sends SIGKILL, so its
runs end that much after the library noticed.

    python -m benchmarks.faults --restart --trials 10 --json benchmarks/results/faults_restart.json

--restart: the run must instead finish. The trainer runs with --resume auto and a checkpoint
every --checkpoint-every steps; one rank is killed (SIGKILL) at a random moment; torchrun
restarts its workers itself (--max-restarts 1), while mpirun and horovodrun, which have no
restarts of their own, are run again with the same command once, as a scheduler's requeue or
a shell loop would. Recorded per trial: whether the job finished, the steps lost (the steps
done when the rank was killed less the step the job resumed from: at most the checkpoint
interval), and whether the final parameters are bit-identical to those of the same command
run without a fault.
"""
from __future__ import annotations

import argparse
import os
import sys
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.comm import machine, write_json
from benchmarks.launch import ROOT, launch_env, launcher_command

BACKENDS = {"torchrun": "gloo", "mpirun": "mpi", "horovodrun": "horovod-gloo"}
LAUNCHERS = tuple(BACKENDS)
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
TRAINER = "experiments.main_trainer"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help=f"comma-separated of {', '.join(LAUNCHERS)}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated of {', '.join(FAULTS)}")
    p.add_argument("--trials", type=int, default=3, help="trials per launcher and fault")
    p.add_argument("--timeout", type=float, default=5.0, help="the transport's timeout, seconds")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds after the timeout before a run that has not ended is a hang")
    p.add_argument("--delay", default="2,6", help="the fault comes MIN,MAX seconds after the ranks start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true",
                   help="kill a rank and check that the job finishes from its checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=10, help="--restart's interval, steps")
    p.add_argument("--at-step", default=None,
                   help="--restart only: the fault comes when rank 0 has logged a step between MIN,MAX "
                        "(instead of --delay seconds), so that it lands mid-run on any machine")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.launchers = [x for x in args.launchers.split(",") if x]
    args.faults = [x for x in args.faults.split(",") if x]
    if args.restart:
        args.faults = ["kill"]  # a frozen rank is ended by its launcher or the library first
    for given, valid, what in ((args.launchers, LAUNCHERS, "launcher"), (args.faults, FAULTS, "fault")):
        unknown = sorted(set(given) - set(valid))
        if unknown:
            p.error(f"unknown {what}(s) {unknown}; valid: {', '.join(valid)}")
    try:
        args.delay = tuple(float(x) for x in args.delay.split(","))
        assert len(args.delay) == 2 and 0 <= args.delay[0] <= args.delay[1]
    except (ValueError, AssertionError):
        p.error(f"--delay must be MIN,MAX seconds with 0 <= MIN <= MAX, got {args.delay!r}")
    if args.at_step is not None:
        total = RESTART_EPOCHS * RESTART_STEPS_PER_EPOCH
        try:
            args.at_step = tuple(int(x) for x in args.at_step.split(","))
            assert len(args.at_step) == 2 and 1 <= args.at_step[0] <= args.at_step[1] < total
        except (ValueError, AssertionError):
            p.error(f"--at-step must be MIN,MAX steps with 1 <= MIN <= MAX < {total} "
                    f"(the run's steps), got {args.at_step!r}")
        if not args.restart:
            p.error("--at-step applies to --restart trials only")
    return args


def command(launcher: str, out: Path, timeout: float) -> list[str]:
    return launcher_command(BACKENDS[launcher], 2, [
        "-m", TRAINER, "--dnn", "fashioncnn", "--dataset", "digits", "--compression",
        "--compressor", "spardl", "--batch-size", "16", "--max-epochs", "1000",
        "--max-steps", "100000", "--out", str(out), "--timeout", str(timeout)])


RESTART_EPOCHS = 20  # 880 steps of 2 ranks: about 10 s of training here
RESTART_STEPS_PER_EPOCH = 44


def restart_command(launcher: str, out: Path, timeout: float, every: int) -> list[str]:
    """A finite run that continues from its newest checkpoint when there is one; under
    torchrun with one restart of its own."""
    trainer = ["-m", TRAINER, "--dnn", "fashioncnn", "--dataset", "digits", "--compression",
               "--compressor", "spardl", "--batch-size", "16", "--max-epochs", str(RESTART_EPOCHS),
               "--out", str(out), "--timeout", str(timeout), "--resume", "auto",
               "--checkpoint-every", str(every), "--test-samples", "100"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--max-restarts=1", *trainer]
    return launcher_command(BACKENDS[launcher], 2, trainer)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and
    parentheses): state first, then the parent's pid. None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ranks(pid: int) -> list[int]:
    """The training processes under the launcher `pid`."""
    out = []
    for p in descendants(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if TRAINER.encode() in argv and Path(argv[0].decode() or "-").name.startswith("python"):
            out.append(p)
    return out


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def trial(launcher: str, fault: str, args: argparse.Namespace, rng: random.Random, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{launcher}-{fault}-{rng.random():.6f}"
    log = tmp / f"{out.name}.log"
    with open(log, "w") as sink, subprocess.Popen(command(launcher, out, args.timeout), cwd=ROOT, env=launch_env(),
                                                  stdout=sink, stderr=subprocess.STDOUT,
                                                  start_new_session=True) as proc:
        victims: list[int] = []
        try:
            deadline = time.monotonic() + 120
            while len(ranks(proc.pid)) < 2:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{launcher} did not start 2 ranks:\n{log.read_text()[-2000:]}")
                time.sleep(0.1)
            delay = rng.uniform(*args.delay)
            time.sleep(delay)
            victims = ranks(proc.pid)
            victim = rng.choice(victims)
            survivors = [p for p in victims if p != victim]
            os.kill(victim, FAULTS[fault])
            fault_at = time.monotonic()
            code, ended_s, survivor_s = None, None, None
            while time.monotonic() < fault_at + args.timeout + args.grace:
                if survivor_s is None and not all(running(p) for p in survivors):
                    survivor_s = time.monotonic() - fault_at
                if proc.poll() is not None:
                    code, ended_s = proc.returncode, time.monotonic() - fault_at
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for p in victims:  # a rank its launcher left behind (a frozen one, say)
                if running(p):
                    os.kill(p, signal.SIGKILL)
    text = log.read_text()
    return {"launcher": launcher, "fault": fault, "after_start_s": round(delay, 3),
            "exit_code": code, "hung": code is None, "ended_after_fault_s": ended_s,
            "survivor_exited_after_fault_s": survivor_s,
            "raised": library_noticed(text),
            "error_exit": code not in (None, 0)}


#: what a surviving rank's output holds when the library noticed the fault: the transports'
#: errors, or the start-up watchdog's stack (a fault during MPI's or Horovod's start-up; see
#: spardl_grace.transport.base.exit_if_not_done_within)
NOTICED = {"TransportTimeout": "TransportTimeout", "TransportError": "TransportError",
           "start_mpi_or_exit_after": "StartupTimeout",
           "start_horovod_or_exit_after": "StartupTimeout"}


def library_noticed(text: str) -> str | None:
    """Which of NOTICED a run's output shows, or None when the launcher alone ended it."""
    return next((name for marker, name in NOTICED.items() if marker in text), None)


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    """The exit status, or None when `proc` has not ended within `seconds`."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def final_params(out: Path):
    """Rank 0's parameters at the end of the run in `out`, or None if it did not end."""
    import torch
    path = out / "final-rank0.pt"
    return torch.load(path, weights_only=True)["params"] if path.exists() else None


def logged(out: Path, kind: str) -> list[int]:
    """The steps of rank 0's log records of `kind` ('step': each training step once done;
    'start': each start of the run), over every start of the run."""
    import json
    log = out / "log.jsonl"
    if not log.exists():
        return []
    whole = log.read_text().split("\n")[:-1]  # a line still being written is left out
    return [r["step"] for r in map(json.loads, whole) if r["kind"] == kind]


def restart_trial(launcher: str, args: argparse.Namespace, rng: random.Random, tmp: Path,
                  reference) -> dict[str, Any]:
    """Kill one rank at a random moment; the job must finish from its checkpoint."""
    out = tmp / f"restart-{launcher}-{rng.random():.6f}"
    cmd = restart_command(launcher, out, args.timeout, args.checkpoint_every)
    budget = args.timeout + args.grace + 120  # a whole run fits in it many times
    with open(tmp / f"{out.name}.log", "w") as sink:
        with subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=sink,
                              stderr=subprocess.STDOUT, start_new_session=True) as proc:
            try:
                while len(ranks(proc.pid)) < 2 and proc.poll() is None:
                    time.sleep(0.1)
                started = time.monotonic()
                if args.at_step is None:
                    time.sleep(rng.uniform(*args.delay))
                else:
                    target = rng.randint(*args.at_step)
                    while len(logged(out, "step")) < target and proc.poll() is None:
                        time.sleep(0.02)
                delay = time.monotonic() - started
                victims = ranks(proc.pid)
                if victims:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                done_at_kill = len(logged(out, "step"))
                code = _wait(proc, budget)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        relaunched = launcher != "torchrun" and code not in (None, 0)
        if relaunched:  # what a scheduler's requeue (or a shell loop) does
            with subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True) as proc:
                code = _wait(proc, budget)
                if code is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    params = final_params(out)
    resumed_from = logged(out, "start")[-1]
    # Killed after its last step (while it was ending), a run loses nothing; killed before,
    # it finished only by starting again, at its last start's step.
    ended_before_kill = done_at_kill >= len(set(logged(out, "step")))
    return {"launcher": launcher, "after_start_s": round(delay, 3), "relaunched": relaunched,
            "finished": code == 0 and params is not None, "exit_code": code,
            "steps_done_at_kill": done_at_kill, "resumed_from_step": resumed_from,
            "steps_lost": 0 if ended_before_kill else done_at_kill - resumed_from,
            "bit_identical": params is not None and bool((params == reference).all())}


def summarize_restarts(trials: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    rows = []
    for launcher in dict.fromkeys(t["launcher"] for t in trials):
        ts = [t for t in trials if t["launcher"] == launcher]
        rows.append({"launcher": launcher, "trials": len(ts),
                     "finished": sum(t["finished"] for t in ts),
                     "bit_identical": sum(t["bit_identical"] for t in ts),
                     "max_steps_lost": max(t["steps_lost"] for t in ts),
                     "checkpoint_every": every})
    return rows


def restart_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'launcher':<12}{'trials':>7}{'finished':>9}{'bit-identical':>14}"
             f"{'max steps lost':>15}{'checkpoint every':>17}"]
    for r in rows:
        lines.append(f"{r['launcher']:<12}{r['trials']:>7}{r['finished']:>9}{r['bit_identical']:>14}"
                     f"{r['max_steps_lost']:>15}{r['checkpoint_every']:>17}")
    return "\n".join(lines)


def run_restarts(args: argparse.Namespace, rng: random.Random, tmp: Path) -> dict[str, Any]:
    """--restart: a reference run per launcher, then --trials killed and restarted runs."""
    trials = []
    for launcher in args.launchers:
        out = tmp / f"reference-{launcher}"
        subprocess.run(restart_command(launcher, out, args.timeout, args.checkpoint_every),
                       cwd=ROOT, env=launch_env(), capture_output=True, check=True)
        reference = final_params(out)
        for _ in range(args.trials):
            trials.append(restart_trial(launcher, args, rng, tmp, reference))
            print(trials[-1], flush=True)
    rows = summarize_restarts(trials, args.checkpoint_every)
    print(restart_table(rows))
    return {"summary": rows, "trials": trials}


def summarize(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for launcher in dict.fromkeys(t["launcher"] for t in trials):
        for fault in dict.fromkeys(t["fault"] for t in trials):
            ts = [t for t in trials if t["launcher"] == launcher and t["fault"] == fault]
            if not ts:
                continue
            ended = [t["ended_after_fault_s"] for t in ts if t["ended_after_fault_s"] is not None]
            noticed = [t["survivor_exited_after_fault_s"] for t in ts
                       if t["survivor_exited_after_fault_s"] is not None]
            rows.append({"launcher": launcher, "fault": fault, "injected": len(ts),
                         "ended_with_error": sum(t["error_exit"] for t in ts),
                         "library_raised": sum(t["raised"] is not None for t in ts),
                         "hung": sum(t["hung"] for t in ts),
                         "max_s_to_survivor_exit": max(noticed) if noticed else None,
                         "median_s_to_end": statistics.median(ended) if ended else None,
                         "max_s_to_end": max(ended) if ended else None})
    return rows


def table(rows: list[dict[str, Any]], timeout: float) -> str:
    lines = [f"transport timeout {timeout:g} s; seconds after the fault: until the first "
             "surviving rank exited (max), until the launcher ended (median, max)",
             f"{'launcher':<12}{'fault':<7}{'injected':>9}{'error exit':>11}{'raised':>8}{'hung':>6}"
             f"{'survivor':>10}{'median':>8}{'max':>8}"]
    def fmt(x):
        return f"{x:.1f}" if x is not None else "-"
    for r in rows:
        lines.append(f"{r['launcher']:<12}{r['fault']:<7}{r['injected']:>9}{r['ended_with_error']:>11}"
                     f"{r['library_raised']:>8}{r['hung']:>6}{fmt(r['max_s_to_survivor_exit']):>10}"
                     f"{fmt(r['median_s_to_end']):>8}{fmt(r['max_s_to_end']):>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    trials = []
    if args.restart:
        with tempfile.TemporaryDirectory() as tmp:
            result = {"machine": machine(), "config": {k: v for k, v in vars(args).items()
                                                       if k != "json"},
                      **run_restarts(args, rng, Path(tmp))}
        write_json(args.json, result)
        return result
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.trials):
            for launcher in args.launchers:
                for fault in args.faults:
                    trials.append(trial(launcher, fault, args, rng, Path(tmp)))
                    print(trials[-1], flush=True)
    rows = summarize(trials)
    print(table(rows, args.timeout))
    result = {"machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "json"},
              "summary": rows, "trials": trials}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
