"""Joining the ranks a launcher started, and starting local ranks: one place for what the
training CLI, the benchmarks and the tests all need.

    from spardl_grace.launch import join
    transport = join(timeout=60)   # under torchrun, mpirun or horovodrun: the backend is started
    grc = grace_from_params(params, transport)

Launchers are recognised by the environment they set: horovodrun (HOROVOD_RANK), torchrun
(TORCHELASTIC_RUN_ID, or RANK and WORLD_SIZE), mpirun (Open MPI's OMPI_COMM_WORLD_SIZE, MPICH's
PMI_SIZE or PMIx's PMIX_RANK). horovodrun in MPI mode sets only MPI's variables: pass
launcher='horovod' to join() there.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch

from .transport import (
    DEFAULT_TIMEOUT_S,
    Transport,
    TransportError,
    TransportTimeout,
    default_transport,
    under_mpirun,
)

LAUNCHERS = ("horovod", "torchrun", "mpirun", "none")
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "HOROVOD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMIX_LOCAL_RANK",
)
# What Open MPI needs in a container: running as root, more ranks than cores, and no
# cross-memory attach (ptrace is often forbidden), which otherwise fails or hangs a run.
OPEN_MPI_CONTAINER_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
}
LOCAL_BACKENDS = ("gloo", "mpi", "horovod", "horovod-gloo", "horovod-mpi")


def detect_launcher(environ: Mapping[str, str] = os.environ) -> str:
    """'horovod', 'torchrun', 'mpirun' or 'none', from the variables the launcher set."""
    if "HOROVOD_RANK" in environ:
        return "horovod"
    if "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ):
        return "torchrun"
    if under_mpirun(environ):
        return "mpirun"
    return "none"


def local_rank(default: int = 0, environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node, as the launcher set it; `default` without one."""
    return next((int(environ[key]) for key in LOCAL_RANK_VARIABLES if key in environ), default)


def local_world_size(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many ranks the launcher started on this node (torchrun's LOCAL_WORLD_SIZE, Open
    MPI's OMPI_COMM_WORLD_LOCAL_SIZE, Horovod's HOROVOD_LOCAL_SIZE); `default` without one."""
    keys = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")
    return next((int(environ[key]) for key in keys if key in environ), default)


def torch_backend(device: str, ranks_on_node: int) -> str:
    """torch.distributed's backend for ranks on `device` ('cpu' or 'cuda'): NCCL where every
    rank of a node has a GPU of its own (`ranks_on_node`, local_world_size(): the ranks on one
    node, not the job's; nodes alike, as torchrun's --nproc-per-node makes them); gloo
    otherwise (CPU training, or ranks sharing a GPU, which NCCL refuses). Gloo moves CUDA
    tensors through the host."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= ranks_on_node else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (for a rendezvous that starts soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_torch_distributed(
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    init_method: str = "env://",
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """init_process_group with `timeout` seconds for every collective (so a dead peer raises
    instead of hanging). rank and world_size come from the environment (torchrun) unless
    given, as with a tcp:// init_method for ranks this process spawned itself."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=init_method,
        timeout=timedelta(seconds=timeout),
        rank=rank,
        world_size=world_size,
    )


def join(
    timeout: float = DEFAULT_TIMEOUT_S, launcher: str | None = None, backend: str = "gloo"
) -> Transport:
    """Start the communication backend of the launcher that started this process and return
    its transport: hvd.init() under horovodrun, init_process_group(`backend`) under torchrun,
    MPI (mpi4py) under mpirun. `launcher` overrides detect_launcher() (one of LAUNCHERS but
    'none'). A backend that is already started is used as it is. TransportError when no
    launcher started this process; ValueError for an unknown launcher."""
    kind = detect_launcher() if launcher is None else launcher
    if kind not in LAUNCHERS:
        raise ValueError(f"unknown launcher {kind!r}; valid choices: {', '.join(LAUNCHERS)}")
    if kind == "none":
        raise TransportError(
            "no launcher started this process: run it under torchrun, mpirun "
            "or horovodrun, or use spardl_grace.transport.run_local for threads"
        )
    if kind == "horovod":
        from .transport.horovod import start_horovod_or_exit_after

        start_horovod_or_exit_after(timeout)
    elif kind == "torchrun":
        import torch.distributed as dist

        if not dist.is_initialized():
            _join_torchrun(backend, timeout)
    return default_transport(timeout=timeout)


def _join_torchrun(backend: str, timeout: float) -> None:
    """init_process_group for the ranks torchrun started, in this restart round's own keys.

    torchrun's agent hosts one store for all its restart rounds and its workers use it as it
    is (TORCHELASTIC_USE_AGENT_STORE; pytorch/pytorch#135712), so the ranks of a restarted
    round can read the addresses the previous round's ranks published and connect to sockets
    that no longer exist: gloo then retries until its timeout ('connectFullMesh failed ...
    Connection refused'), while the ranks that wait for them sit idle. Each round here joins
    under a prefix of its own (TORCHELASTIC_RESTART_COUNT). Joining is bounded by `timeout`
    and fails with TransportError naming the round and the rank."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=False,
                timeout=timedelta(seconds=timeout),
            )
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"spardl_grace/restart_{attempt}", store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout),
            )
        else:
            start_torch_distributed(backend, timeout)
    except RuntimeError as exc:  # torch's DistError and gloo's errors are RuntimeErrors
        # a peer frozen in the rendezvous shows as a timeout; a dead one as another error
        kind = (
            TransportTimeout if "imeout" in str(exc) or "imed out" in str(exc) else TransportError
        )
        raise kind(
            f"torchrun restart round {attempt}: rank {rank} of {world} could not join the "
            f"others within {timeout:g} s ({type(exc).__name__}: {exc})"
        ) from exc


def open_mpi_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` plus OPEN_MPI_CONTAINER_ENV (the variables already set keep their values)."""
    return {**OPEN_MPI_CONTAINER_ENV, **environ}


def local_command(backend: str, nprocs: int, argv: list[str]) -> list[str]:
    """The command that runs `python ARGV` on `nprocs` ranks on this machine: torchrun for
    'gloo', mpirun for 'mpi', horovodrun for 'horovod' or 'horovod-gloo' (gloo) and
    'horovod-mpi'. Launchers are taken from this interpreter's environment."""
    bin_dir = Path(sys.executable).parent
    if backend == "gloo":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            *argv,
        ]
    if backend == "mpi":
        return ["mpirun", "-np", str(nprocs), sys.executable, *argv]
    if backend in ("horovod", "horovod-gloo", "horovod-mpi"):
        mode = "--mpi" if backend == "horovod-mpi" else "--gloo"
        return [
            str(bin_dir / "horovodrun"),
            "-np",
            str(nprocs),
            "-H",
            f"localhost:{nprocs}",
            mode,
            sys.executable,
            *argv,
        ]
    raise ValueError(f"unknown backend {backend!r}; valid choices: {', '.join(LOCAL_BACKENDS)}")
