"""The Transport interface every algorithm is written against.

Algorithms are SPMD: every rank calls the same sequence of Transport operations with the same
`name` arguments. Names make collectives deterministic under Horovod (ops are matched by name),
label messages for CountingTransport, and let the local backend detect mismatched programs.

Variable-size operations take and return 1-D tensors; the receiver learns sizes from the
transport, never from the caller. Received tensors have the sender's dtype and live on the
device of the tensor the caller passed in.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

DEFAULT_TIMEOUT_S = 300.0


@contextmanager
def timeout_at_most(transport: Transport, seconds: float) -> Iterator[None]:
    """Within the block, `transport`'s operations (and those of the transports it wraps, e.g.
    under a CountingTransport) time out after min(their timeout, `seconds`). Only for a block
    in which no other thread uses the transport."""
    chain = []
    current: Transport | None = transport
    while current is not None:
        chain.append((current, current.timeout))
        current = getattr(current, "inner", None)
    for t, old in chain:
        t.timeout = min(old, seconds)
    try:
        yield
    finally:
        for t, old in chain:
            t.timeout = old


class QueuedOp:
    """An operation the backend runs while the caller goes on: `future` completes with its
    result; wait() returns once it is done and raises TransportTimeout when it is not done
    within the transport's timeout (TransportError if it failed), so a dead peer never makes
    a queued operation hang forever."""

    def __init__(self, future: torch.futures.Future, wait: Callable[[], None]):
        self.future = future
        self.wait = wait


def completed(result: torch.Tensor) -> QueuedOp:
    """A QueuedOp that is already done."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(result)
    return QueuedOp(future, lambda: None)


class TransportError(RuntimeError):
    """A communication operation failed (peer gone, mismatched program, bad arguments)."""


class TransportTimeout(TransportError, TimeoutError):
    """A communication operation did not complete within the transport's timeout."""


class Transport(ABC):
    """Point-to-point and collective communication among `size` ranks.

    Implementations: LocalTransport (threads in one process), TorchDistTransport
    (torch.distributed: gloo, nccl), MPITransport (mpi4py), HorovodTransport, and the
    CountingTransport wrapper. Every operation raises TransportTimeout when it cannot complete
    within `timeout` seconds, so a dead peer never makes the others hang forever.
    """

    rank: int
    size: int
    timeout: float
    #: whether a background thread may communicate while the caller's thread does not
    thread_safe: bool = True
    #: whether allreduce_async_ queues the all-reduce in the backend and returns at once
    queues_collectives: bool = False

    def global_rank(self, rank: int) -> int:
        """The job's rank of this transport's rank `rank` (they differ on a subgroup, such as
        one dimension of an FSDP2 mesh): what messages name, so the user finds the process."""
        return rank

    @abstractmethod
    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
        """Send the 1-D `tensor` to rank `dst` and return the 1-D tensor rank `src` sent us.

        Every rank calls sendrecv in the same step. Without `recv_numel` the receiver does not
        know the size: the transports that need it (torch.distributed, MPI) send it first, a
        second round trip. With `recv_numel` (the caller knows what src sends, e.g. a fixed
        number of entries) the message is one round trip, and a message of any other size
        raises TransportError instead of being truncated or padded."""

    @abstractmethod
    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Return every rank's 1-D tensor (sizes may differ), indexed by rank."""

    @abstractmethod
    def alltoall(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Send tensors[j] to rank j; return what each rank sent to us, indexed by rank."""

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the element-wise sum over ranks, bit-identical on every rank, as a new tensor
        (the caller may write into it). Input unchanged."""

    def allreduce_async_(self, tensor: torch.Tensor, name: str) -> QueuedOp:
        """Sum `tensor` over ranks in place, as allreduce() sums (the same bits). Where
        `queues_collectives`, the backend runs it while the caller goes on, as DDP queues its
        buckets' all-reduces; here, by default, it is done before this returns. Several may be
        queued; every rank must queue the same ones in the same order, and wait for all of
        them before its next operation of another kind."""
        tensor.copy_(self.allreduce(tensor, name))
        return completed(tensor)

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Return root's tensor on every rank; non-root ranks pass a tensor of the same shape."""

    @abstractmethod
    def barrier(self, name: str = "barrier") -> None:
        """Return once every rank has entered the barrier."""

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise TransportError(f"{what} rank {peer} is outside 0..{self.size - 1}")

    def _check_alltoall(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != self.size:
            raise TransportError(
                f"alltoall needs one tensor per rank ({self.size}), got {len(tensors)}"
            )
        for t in tensors:
            _check_1d(t, "alltoall")


def check_received(received_numel: int, expected: int | None, name: str, rank: int) -> None:
    """TransportError when a message announced as `expected` entries has another size."""
    if expected is not None and received_numel != expected:
        raise TransportError(
            f"rank {rank}: '{name}' expected {expected} entries from its source, "
            f"received {received_numel}: the ranks disagree on the message size"
        )


def _check_1d(tensor: torch.Tensor, op: str) -> None:
    if tensor.dim() != 1:
        raise TransportError(f"{op} takes 1-D tensors, got shape {tuple(tensor.shape)}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a 1-D uint8 tensor (no copy when already contiguous)."""
    t = tensor.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of as_bytes for 1-D tensors of `dtype`."""
    if dtype == torch.bool:
        return data.view(torch.uint8).to(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data.numel() % itemsize:
        raise TransportError(f"{data.numel()} bytes is not a whole number of {dtype} elements")
    if data.numel() == 0:
        return torch.empty(0, dtype=dtype, device=data.device)
    if data.storage_offset() % itemsize:
        data = data.clone()
    return data.view(dtype)


_FAIL_AT_EXIT: set[str] = set()


def fail_job_at_exit(backend: str, end: Callable[[], None]) -> None:
    """After a timeout a peer may be frozen, and the backend's shutdown at interpreter exit
    (MPI_Finalize, which mpi4py runs; Horovod's shutdown) waits for that peer: forever under
    MPI, Horovod's own gloo timeout (30 s) under Horovod. Once per process and backend, register
    `end` to run at exit before that shutdown (atexit runs last-registered first, and mpi4py's
    finalisation after every atexit function): it must end the process, or the whole job, with
    a failure. Output is flushed first, so the error that caused it is not lost."""
    if backend in _FAIL_AT_EXIT:
        return
    _FAIL_AT_EXIT.add(backend)

    def flush_and_end() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        end()

    atexit.register(flush_and_end)


@contextmanager
def exit_if_not_done_within(timeout: float) -> Iterator[None]:
    """Within the block, end the process with status 1 and every thread's stack after
    `timeout` seconds. For start-up calls that wait for every rank with no timeout of their
    own and hold the GIL meanwhile (MPI_Init, Horovod's init), where a frozen peer would hold
    this rank forever: faulthandler's watchdog is a C thread and needs no GIL. It replaces any
    faulthandler timer of the process's own for the duration of the block."""
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def exit_with_failure() -> None:
    """End this process at once with status 1, skipping the remaining exit handlers."""
    os._exit(1)
