"""Transports: how ranks exchange tensors. Algorithms use only the Transport interface.

from spardl_grace.transport import default_transport
transport = default_transport()   # Horovod if initialised, else torch.distributed, else MPI
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from .base import DEFAULT_TIMEOUT_S, Transport, TransportError, TransportTimeout
from .counting import CountingTransport, Message
from .local import LocalTransport, PeerFailure, run_local
from .threads import warn_if_oversubscribed

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CountingTransport",
    "LocalTransport",
    "Message",
    "PeerFailure",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "default_transport",
    "run_local",
    "shared_transport",
    "under_mpirun",
]


def _horovod_initialised() -> bool:
    if "horovod.torch" not in sys.modules:
        return False
    try:
        return bool(sys.modules["horovod.torch"].is_initialized())
    except Exception:  # an uninitialised Horovod raises from some queries
        return False


MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def under_mpirun(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPI launcher (Open MPI, MPICH, PMIx) started this process."""
    return any(key in environ for key in MPI_VARIABLES)


def default_transport(timeout: float = DEFAULT_TIMEOUT_S) -> Transport:
    """A new transport of the active backend: Horovod if initialised, else an initialised
    torch.distributed, else MPI when running under mpirun. Each one sends on a channel of its
    own, apart from the user's collectives (a process group, a duplicated communicator, a
    private gloo group beside Horovod): construction is collective, every rank calls it at the
    same point. Raises TransportError saying how to start one when none is active. Warns
    (RuntimeWarning, once) when the launcher's ranks on this host times their torch threads
    exceed its cores (threads.oversubscription)."""
    transport = _active_transport(timeout)
    warn_if_oversubscribed()
    return transport


# shared_transport's transport and what it was made for (the backend and its default group or
# communicator): a new backend, or a torch.distributed group made anew after a restart, gets
# a new one.
_SHARED: list[tuple[object, Transport]] = []


def _backend_identity() -> object:
    if _horovod_initialised():
        return ("horovod", sys.modules["horovod.torch"].size())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return "mpi"


def shared_transport(timeout: float = DEFAULT_TIMEOUT_S) -> Transport:
    """The active backend's transport for the library's one-off collectives on the caller's
    thread (broadcast_parameters, broadcast_optimizer_state without a DistributedOptimizer):
    one per process and backend, made on first use (collective, as default_transport is), so
    repeated broadcasts do not each open a channel. A synchroniser gets its own transport from
    default_transport instead: its communication thread never shares a channel."""
    identity = _backend_identity()
    if _SHARED and _SHARED[0][0] == identity:
        return _SHARED[0][1]
    transport = default_transport(timeout)
    _SHARED[:] = [(identity, transport)]
    return transport


def _active_transport(timeout: float) -> Transport:
    if _horovod_initialised():
        from .horovod import HorovodTransport

        return HorovodTransport(timeout=timeout)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .torch_dist import TorchDistTransport

        return TorchDistTransport(timeout=timeout)
    if under_mpirun():
        from .mpi import MPITransport

        return MPITransport(timeout=timeout)
    raise TransportError(
        "no communication backend is active. Start one of: horovod.torch.init() under horovodrun; "
        "torch.distributed.init_process_group('gloo' or 'nccl') under torchrun; mpirun (mpi4py); "
        "or pass transport=... explicitly (spardl_grace.transport.run_local for threads)."
    )
