"""spardl_grace.launch: which launcher started a process, and what joining it needs. Real
joins under torchrun, mpirun and horovodrun run in every multi-process test (tests/mp_worker.py
joins through launch.join)."""
from __future__ import annotations

import socket

import pytest

from spardl_grace import launch
from spardl_grace.transport import TransportError


@pytest.mark.parametrize("environ,expected", [
    ({"HOROVOD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "horovod"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "torchrun"),
    ({"RANK": "1"}, "none"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
    ({"PMI_SIZE": "2"}, "mpirun"),
    ({"PMIX_RANK": "0"}, "mpirun"),  # Open MPI 5 under PRRTE sets PMIx's variables
    ({}, "none"),
])
def test_detect_launcher(environ, expected):
    assert launch.detect_launcher(environ) == expected


def test_local_rank_from_each_launcher():
    assert launch.local_rank(environ={"LOCAL_RANK": "3"}) == 3
    assert launch.local_rank(environ={"HOROVOD_LOCAL_RANK": "2"}) == 2
    assert launch.local_rank(environ={"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert launch.local_rank(environ={"MPI_LOCALRANKID": "4"}) == 4
    assert launch.local_rank(default=7, environ={}) == 7


def test_join_without_a_launcher_says_how_to_start_one(monkeypatch):
    for key in ("HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE",
                *launch.LOCAL_RANK_VARIABLES, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(TransportError, match="run it under torchrun, mpirun or horovodrun"):
        launch.join(1.0)
    with pytest.raises(ValueError, match="unknown launcher 'slurm'; valid choices: horovod, "
                                         "torchrun, mpirun, none"):
        launch.join(1.0, launcher="slurm")


def test_local_command_for_each_backend():
    assert launch.local_command("gloo", 3, ["w.py"])[-3:] == ["--standalone",
                                                              "--nproc-per-node=3", "w.py"]
    assert launch.local_command("mpi", 2, ["w.py"])[:3] == ["mpirun", "-np", "2"]
    hvd = launch.local_command("horovod-mpi", 2, ["w.py"])
    assert hvd[0].endswith("horovodrun") and "--mpi" in hvd and "localhost:2" in hvd
    assert "--gloo" in launch.local_command("horovod", 2, ["w.py"])
    with pytest.raises(ValueError, match="unknown backend 'nccl'; valid choices: gloo, mpi"):
        launch.local_command("nccl", 2, ["w.py"])


def test_free_port_can_be_bound():
    port = launch.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_open_mpi_env_keeps_what_the_user_set():
    env = launch.open_mpi_env({"OMPI_MCA_rmaps_base_oversubscribe": "0", "PATH": "/bin"})
    assert env["OMPI_MCA_rmaps_base_oversubscribe"] == "0" and env["PATH"] == "/bin"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_torch_backend_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        launch.torch_backend("tpu", 2)
