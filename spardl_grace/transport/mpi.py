"""mpi4py transport (Open MPI under mpirun).

Tensors travel as raw bytes in host memory, so every dtype (bfloat16 included) works. All
operations are non-blocking MPI requests polled against a deadline: MPI has no timeouts of its
own, and a peer that died must not leave this rank waiting forever.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .base import (
    DEFAULT_TIMEOUT_S,
    Transport,
    TransportError,
    TransportTimeout,
    _check_1d,
    as_bytes,
    check_received,
    exit_if_not_done_within,
    fail_job_at_exit,
    from_bytes,
)

_REDUCE_DTYPES = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int32: "INT",
    torch.int64: "INT64_T",
    torch.uint8: "UNSIGNED_CHAR",
    torch.int16: "SHORT",
    torch.int8: "SIGNED_CHAR",
}


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    return as_bytes(t.detach().cpu()).numpy()


def start_mpi_or_exit_after(timeout: float) -> Any:
    """mpi4py's MPI module. Its first import runs MPI_Init, which waits for every rank of the
    job with no timeout of its own and holds the GIL meanwhile, so a peer frozen during
    start-up would hold this rank there forever (seen under load, where start-up is slow and
    a fault lands in it). The watchdog (exit_if_not_done_within) ends the process after
    `timeout` seconds with status 1 and the stack of this call ("Timeout" and this function's
    name in the output); mpirun then ends the job."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    with exit_if_not_done_within(timeout):
        from mpi4py import MPI
    return MPI


_aborts_on_uncaught = False  # the excepthook installed (once per process)


def abort_job_on_uncaught_exception(MPI: Any) -> None:
    """Once per process: an exception nothing catches ends the whole job (MPI_Abort, after
    the traceback is printed and output flushed), as `python -m mpi4py` does. Without it the
    failing rank waits in MPI_Finalize at exit for peers that wait in the library's next
    collective for it, and the job ended only after the transport's timeout (300 s)."""
    global _aborts_on_uncaught
    if _aborts_on_uncaught:
        return
    _aborts_on_uncaught = True
    previous = sys.excepthook

    def print_then_abort(kind, value, traceback) -> None:
        try:
            previous(kind, value, traceback)
        finally:
            # Open MPI's own notice of the abort can fail to print (its help files out of
            # resources), so the job's log says in the library's words why it ended.
            rank = MPI.COMM_WORLD.Get_rank()
            print(
                f"spardl_grace: an uncaught exception on rank {rank} ends the MPI job (MPI_Abort)",
                file=sys.stderr,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = print_then_abort


class MPITransport(Transport):
    """Transport over an mpi4py communicator (COMM_WORLD by default).

    The library's messages travel on a duplicate of it (`comm.Idup()`, made at construction:
    collective over `comm`, within the timeout), a communication context of their own, so that
    no message, collective or barrier of the user's on `comm` can match one of the library's.
    With more than one rank in the job, an exception nothing catches then ends the job at once
    (abort_job_on_uncaught_exception)."""

    def __init__(self, comm=None, timeout: float = DEFAULT_TIMEOUT_S):
        MPI = start_mpi_or_exit_after(timeout)
        self._MPI = MPI
        self.user_comm = comm if comm is not None else MPI.COMM_WORLD
        self.comm = self.user_comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout
        # Non-blocking, so that a peer that never joins ends in TransportTimeout, not a hang.
        private, request = self.user_comm.Idup()
        self._wait([request], "duplicate the communicator")
        self.comm = private
        self.thread_safe = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if MPI.COMM_WORLD.Get_size() > 1:
            abort_job_on_uncaught_exception(MPI)

    def _wait(self, requests, name: str, statuses: list | None = None) -> None:
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not self._MPI.Request.Testall(requests, statuses):
            polls += 1
            if polls > 2000:
                # Spin briefly for latency, then yield the core: ranks are often oversubscribed.
                time.sleep(0.0002)
                if time.monotonic() > deadline:
                    # MPI_Abort: mpirun then ends every rank, a frozen one included.
                    fail_job_at_exit("mpi", lambda: self.comm.Abort(1))
                    for r in requests:
                        # Completed requests are null and collectives' cannot be cancelled:
                        # MPI calls both erroneous, and the timeout must still be what is raised.
                        try:
                            r.Cancel()
                        except self._MPI.Exception:
                            pass
                    raise TransportTimeout(
                        f"rank {self.rank}: '{name}' did not complete within "
                        f"{self.timeout:.1f}s (a peer may have died)"
                    )

    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
        _check_1d(tensor, "sendrecv")
        self._check_peer(dst, "destination")
        self._check_peer(src, "source")
        out = _np_bytes(tensor)
        if recv_numel is None:
            n_out = np.array([out.size], dtype=np.int64)
            n_in = np.empty(1, dtype=np.int64)
            self._wait(
                [self.comm.Irecv(n_in, src, tag=1), self.comm.Isend(n_out, dst, tag=1)], name
            )
            nbytes = int(n_in[0])
        else:
            nbytes = recv_numel * tensor.element_size()
        # One byte of room: a longer message then arrives whole enough to be counted and refused
        # (MPI would otherwise fail it as truncated, or leave a shorter one's tail unwritten).
        received = np.empty(nbytes + 1, dtype=np.uint8)
        statuses = [self._MPI.Status(), self._MPI.Status()]
        # Receive posted first, so the peer's message never waits as an unexpected one.
        self._wait(
            [self.comm.Irecv(received, src, tag=2), self.comm.Isend(out, dst, tag=2)],
            name,
            statuses,
        )
        got = statuses[0].Get_count(self._MPI.BYTE)
        if got > nbytes:
            raise TransportError(
                f"rank {self.rank}: '{name}' expected {recv_numel} entries from "
                "its source and received more: the ranks disagree on the size"
            )
        check_received(got // max(tensor.element_size(), 1), recv_numel, name, self.rank)
        return self._to_tensor(received[:got], tensor)

    @staticmethod
    def _to_tensor(data: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return from_bytes(torch.from_numpy(data), like.dtype).to(like.device)

    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        _check_1d(tensor, "allgather")
        out = _np_bytes(tensor)
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait([self.comm.Iallgather(np.array([out.size], dtype=np.int64), sizes)], name)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        received = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._wait([self.comm.Iallgatherv(out, [received, sizes, displs, self._MPI.BYTE])], name)
        return [self._to_tensor(received[d : d + s], tensor) for d, s in zip(displs, sizes)]

    def alltoall(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        self._check_alltoall(tensors)
        parts = [_np_bytes(t) for t in tensors]
        send_sizes = np.array([p.size for p in parts], dtype=np.int64)
        recv_sizes = np.empty(self.size, dtype=np.int64)
        self._wait([self.comm.Ialltoall(send_sizes, recv_sizes)], name)
        send = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        send_displs = np.concatenate([[0], np.cumsum(send_sizes)[:-1]])
        recv_displs = np.concatenate([[0], np.cumsum(recv_sizes)[:-1]])
        received = np.empty(int(recv_sizes.sum()), dtype=np.uint8)
        self._wait(
            [
                self.comm.Ialltoallv(
                    [send, send_sizes, send_displs, self._MPI.BYTE],
                    [received, recv_sizes, recv_displs, self._MPI.BYTE],
                )
            ],
            name,
        )
        return [
            self._to_tensor(received[d : d + s], tensors[j])
            for j, (d, s) in enumerate(zip(recv_displs, recv_sizes))
        ]

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        # Half-precision types have no MPI reduction: reduce in fp32 and round once at the end.
        work = tensor.detach().cpu().contiguous()
        if work.dtype not in _REDUCE_DTYPES:
            if not work.is_floating_point():
                raise TransportError(f"allreduce '{name}': unsupported dtype {work.dtype}")
            work = work.float()
        send = work.numpy()
        received = np.empty_like(send)
        mpi_type = getattr(self._MPI, _REDUCE_DTYPES[work.dtype])
        self._wait([self.comm.Iallreduce([send, mpi_type], [received, mpi_type])], name)
        return torch.from_numpy(received).to(dtype=tensor.dtype, device=tensor.device)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        self._check_peer(root, "root")
        buf = _np_bytes(tensor).copy()
        self._wait([self.comm.Ibcast(buf, root=root)], name)
        return from_bytes(torch.from_numpy(buf), tensor.dtype).view(tensor.shape).to(tensor.device)

    def barrier(self, name: str = "barrier") -> None:
        self._wait([self.comm.Ibarrier()], name)
