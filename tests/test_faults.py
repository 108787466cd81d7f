"""Fault injection (benchmarks.faults): a rank of a real training run under torchrun, mpirun and
horovodrun is killed or frozen at a random moment; the run must end with a failure in bounded
time, never hang. The bounds come from configured timeouts, not from a quiet machine's timings:
the library notices a frozen rank within the transport's timeout (TransportTimeout, or during
MPI's start-up the watchdog's StartupTimeout); each launcher then takes its own configured
shutdown time; and a loaded machine may take LOAD_ALLOWANCE_S more to start and stop processes
(the README's test command once ran beside other jobs: torchrun ended 48 s after the fault)."""
from __future__ import annotations

import pytest

from conftest import require

from benchmarks import faults

TIMEOUT_S = 5.0
# torchrun gives a rank 30 s to obey SIGTERM before SIGKILL (torch.distributed.elastic);
# horovodrun stops the other ranks after its first one failed, within about 10 s; mpirun ends
# the job as soon as a rank exits with a failure.
LAUNCHER_SHUTDOWN_S = {"torchrun": 30.0, "mpirun": 0.0, "horovodrun": 10.0}
LOAD_ALLOWANCE_S = 30.0


@pytest.mark.parametrize("launcher,backend", [("torchrun", "gloo"), ("mpirun", "mpi"),
                                              ("horovodrun", "horovod-gloo")])
def test_a_killed_or_frozen_rank_ends_the_run_with_a_failure(launcher, backend):
    require(backend)
    bound = TIMEOUT_S + LAUNCHER_SHUTDOWN_S[launcher] + LOAD_ALLOWANCE_S
    result = faults.main(["--launchers", launcher, "--trials", "1", "--timeout", str(TIMEOUT_S),
                          "--seed", "1", "--grace", str(bound)])
    trials = {t["fault"]: t for t in result["trials"]}
    assert set(trials) == {"kill", "stop"}
    for fault, t in trials.items():
        assert not t["hung"], t
        assert t["error_exit"], t  # a failed job says so with its exit status
        assert t["ended_after_fault_s"] < bound, t
    stop = trials["stop"]
    # the library noticed, not the launcher
    assert stop["raised"] in ("TransportTimeout", "StartupTimeout"), stop
    assert stop["survivor_exited_after_fault_s"] < TIMEOUT_S + LOAD_ALLOWANCE_S, stop


def test_bad_options_name_the_valid_choices():
    with pytest.raises(SystemExit):
        faults.parse_args(["--launchers", "slurm"])
    with pytest.raises(SystemExit):
        faults.parse_args(["--delay", "5,1"])


def test_a_rank_frozen_before_mpi_starts_ends_the_job_within_the_timeout(tmp_path):
    """MPI_Init waits for every rank with no timeout and holds the GIL: rank 1 freezing itself
    before it starts MPI held rank 0 in it forever (under load, faults land in start-up). The
    transport's watchdog ends rank 0 after its timeout, and mpirun the job."""
    import subprocess
    import time

    from conftest import ROOT, launch_env, launcher_command
    require("mpi")
    script = tmp_path / "frozen_at_start.py"
    script.write_text(
        "import os, signal\n"
        "if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "from spardl_grace.transport.mpi import MPITransport\n"
        "MPITransport(timeout=3.0)\n")
    started = time.monotonic()
    done = subprocess.run(launcher_command("mpi", 2, [str(script)]), cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S + LOAD_ALLOWANCE_S + 30)
    assert done.returncode != 0
    assert "start_mpi_or_exit_after" in done.stdout + done.stderr
    assert time.monotonic() - started < 3.0 + LOAD_ALLOWANCE_S


def test_an_uncaught_exception_on_one_rank_ends_the_mpirun_job_at_once(tmp_path):
    """Rank 1's KeyError mid-training: it waited in MPI_Finalize at exit for its peers, which
    waited for it in the next collective until the transport's timeout (300 s here). Now its
    traceback is printed and MPI_Abort ends the job (as `python -m mpi4py` does)."""
    import subprocess

    from conftest import ROOT, launch_env, launcher_command
    require("mpi")
    script = tmp_path / "raises.py"
    script.write_text(
        "import sys, torch\n"
        "sys.path.insert(0, 'examples')\n"
        "import spardl_grace\n"
        "from toy_task import batch, make_model\n"
        "grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': "
        "'global_residual', 'communicator': 'spardl', 'compress_ratio': 0.05})\n"
        "rank, model = grc.transport.rank, make_model()\n"
        "opt = spardl_grace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "
        "grc, named_parameters=model.named_parameters())\n"
        "for step in range(20):\n"
        "    opt.zero_grad()\n"
        "    x, y = batch(rank, step)\n"
        "    if rank == 1 and step == 3:\n"
        "        raise KeyError('a bug on rank 1')\n"
        "    torch.nn.functional.cross_entropy(model(x), y).backward()\n"
        "    opt.step()\n")
    done = subprocess.run(launcher_command("mpi", 3, [str(script)]), cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "KeyError: 'a bug on rank 1'" in out
    assert "an uncaught exception on rank 1 ends the MPI job" in out
    assert "TransportTimeout" not in out
