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
    """The transport of the active backend: Horovod if initialised, else an initialised
    torch.distributed, else MPI when running under mpirun. Raises TransportError saying how to
    start one when none is active. Warns (RuntimeWarning, once) when the launcher's ranks on
    this host times their torch threads exceed its cores (threads.oversubscription)."""
    transport = _active_transport(timeout)
    warn_if_oversubscribed()
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
