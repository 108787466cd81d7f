"""A warning for ranks whose torch threads outnumber their host's cores.

torch runs every op over more than 32,768 elements (its grain for parallel loops) on its
intra-op threads, and those threads spin before they sleep. When the ranks on one host each
keep torch's default (one thread per core) they take turns on the cores, and such an op waits
for its threads to be scheduled: on 2 cores with 4 ranks of 2 threads, a 40 KB exchange took
20.6 ms against 0.85 ms with one thread each (benchmarks.oversubscribe). torchrun sets
OMP_NUM_THREADS=1 for several ranks a host; mpirun and horovodrun leave it to the user.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch

#: the ranks on this host, as each launcher states them (torchrun, horovodrun, Open MPI,
#: MPICH, PMIx)
LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "HOROVOD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "PMIX_LOCAL_SIZE",
)

_warned = False


def local_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """How many ranks the launcher started on this host; None when no launcher says."""
    return next((int(environ[key]) for key in LOCAL_SIZE_VARIABLES if key in environ), None)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscription(ranks: int | None, threads: int, available: int) -> str | None:
    """The warning for `ranks` ranks on a host of `available` cores with `threads` torch
    threads each, or None when they fit (or one thread each: nothing then spins)."""
    if ranks is None or threads <= 1 or ranks * threads <= available:
        return None
    share = max(1, available // ranks)
    return (
        f"{ranks} ranks on this host with {threads} torch threads each exceed its "
        f"{available} cores: every op over 32,768 elements (messages among them) then waits "
        f"for its threads to be scheduled (a 40 KB exchange: 20 ms instead of 1). Set "
        f"OMP_NUM_THREADS={share} for each rank (torchrun does so itself) or call "
        f"torch.set_num_threads({share}) before training."
    )


def warn_if_oversubscribed(environ: Mapping[str, str] = os.environ) -> None:
    """Warn once per process when this host's ranks times their torch threads exceed its
    cores (see oversubscription)."""
    global _warned
    if _warned:
        return
    message = oversubscription(local_size(environ), torch.get_num_threads(), cores())
    if message is not None:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)
