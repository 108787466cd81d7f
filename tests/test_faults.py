"""Fault injection (benchmarks.faults): a rank of a real training run under torchrun, mpirun and
horovodrun is killed or frozen at a random moment; the run must end with a failure in bounded
time, never hang. Frozen ranks are noticed by the library (TransportTimeout) within the
transport's timeout + 10 s; torchrun then gives the frozen rank 30 s to obey SIGTERM, and
horovodrun takes 5 to 10 s to end the job after its first rank failed."""
from __future__ import annotations

import pytest

from conftest import require

from benchmarks import faults

TIMEOUT_S = 5.0
LAUNCHER_GRACE_S = {"torchrun": 40.0, "mpirun": 10.0, "horovodrun": 20.0}


@pytest.mark.parametrize("launcher,backend", [("torchrun", "gloo"), ("mpirun", "mpi"),
                                              ("horovodrun", "horovod-gloo")])
def test_a_killed_or_frozen_rank_ends_the_run_with_a_failure(launcher, backend):
    require(backend)
    result = faults.main(["--launchers", launcher, "--trials", "1", "--timeout", str(TIMEOUT_S),
                          "--seed", "1"])
    trials = {t["fault"]: t for t in result["trials"]}
    assert set(trials) == {"kill", "stop"}
    for fault, t in trials.items():
        assert not t["hung"], t
        assert t["error_exit"], t  # a failed job says so with its exit status
        assert t["ended_after_fault_s"] < TIMEOUT_S + LAUNCHER_GRACE_S[launcher], t
    stop = trials["stop"]
    assert stop["raised"] == "TransportTimeout", stop  # the library noticed, not the launcher
    assert stop["survivor_exited_after_fault_s"] < TIMEOUT_S + 10.0, stop


def test_bad_options_name_the_valid_choices():
    with pytest.raises(SystemExit):
        faults.parse_args(["--launchers", "slurm"])
    with pytest.raises(SystemExit):
        faults.parse_args(["--delay", "5,1"])
