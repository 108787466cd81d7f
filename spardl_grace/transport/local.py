"""In-process transport: P ranks as threads exchanging tensors through per-pair FIFO queues.

Used by the tests and by simulations. Every message carries the operation's name, and a
receiver that finds a different name raises, so an algorithm whose ranks disagree on the
sequence of operations fails loudly instead of silently mixing data. When any rank fails,
the others stop waiting at once with PeerFailure.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import (
    DEFAULT_TIMEOUT_S,
    Transport,
    TransportError,
    TransportTimeout,
    _check_1d,
    check_received,
)

_POLL_S = 0.02


class PeerFailure(TransportError):
    """Another rank of the local world raised; this rank stops waiting for it."""


class _World:
    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self.queues: dict[tuple[int, int], queue.Queue[Any]] = {
            (s, d): queue.Queue() for s in range(size) for d in range(size)
        }
        self.failed = threading.Event()


class LocalTransport(Transport):
    """One rank of a world of threads. Create a world with `LocalTransport.world(size)`."""

    def __init__(self, world: _World, rank: int):
        self._world = world
        self.rank = rank
        self.size = world.size
        self.timeout = world.timeout

    @staticmethod
    def world(size: int, timeout: float = DEFAULT_TIMEOUT_S) -> list[LocalTransport]:
        """`size` connected transports, one per rank, for threads of one process; operations
        raise TransportTimeout after `timeout` seconds without their peers."""
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        w = _World(size, timeout)
        return [LocalTransport(w, r) for r in range(size)]

    def _send(self, dst: int, name: str, tensor: torch.Tensor) -> None:
        copy = tensor.detach().clone()
        written = None
        if copy.is_cuda:
            # The ranks' threads may run on different streams (each rank's communication
            # thread has its own): the receiver waits for the copy to be written.
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(copy.device))
        self._world.queues[(self.rank, dst)].put((name, copy, written))

    def _recv(self, src: int, name: str, like: torch.Tensor) -> torch.Tensor:
        q = self._world.queues[(src, self.rank)]
        deadline = time.monotonic() + self.timeout
        while True:
            if self._world.failed.is_set():
                raise PeerFailure(f"rank {self.rank}: another rank failed during '{name}'")
            try:
                got_name, tensor, written = q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TransportTimeout(
                        f"rank {self.rank}: no message from rank {src} for '{name}' "
                        f"within {self.timeout:.1f}s"
                    ) from None
        if got_name != name:
            raise TransportError(
                f"rank {self.rank}: expected '{name}' from rank {src}, got '{got_name}' "
                "(ranks are running different sequences of operations)"
            )
        if written is not None:
            stream = torch.cuda.current_stream(tensor.device)
            stream.wait_event(written)
            tensor.record_stream(stream)  # freed here, not on the sender's stream
        return tensor.to(like.device)

    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
        _check_1d(tensor, "sendrecv")
        self._check_peer(dst, "destination")
        self._check_peer(src, "source")
        self._send(dst, name, tensor)
        received = self._recv(src, name, tensor)
        check_received(received.numel(), recv_numel, name, self.rank)
        return received

    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        _check_1d(tensor, "allgather")
        for peer in range(self.size):
            if peer != self.rank:
                self._send(peer, name, tensor)
        return [
            tensor.detach().clone() if peer == self.rank else self._recv(peer, name, tensor)
            for peer in range(self.size)
        ]

    def alltoall(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        self._check_alltoall(tensors)
        for peer, t in enumerate(tensors):
            if peer != self.rank:
                self._send(peer, name, t)
        return [
            tensors[peer].detach().clone()
            if peer == self.rank
            else self._recv(peer, name, tensors[peer])
            for peer in range(self.size)
        ]

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        flat = tensor.reshape(-1)
        parts = self.allgather(flat, name)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.view(tensor.shape)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        self._check_peer(root, "root")
        if self.rank == root:
            for peer in range(self.size):
                if peer != root:
                    self._send(peer, name, tensor)
            return tensor.detach().clone()
        got = self._recv(root, name, tensor)
        if got.shape != tensor.shape:
            raise TransportError(
                f"broadcast '{name}': root sent shape {tuple(got.shape)}, "
                f"rank {self.rank} expected {tuple(tensor.shape)}"
            )
        return got

    def barrier(self, name: str = "barrier") -> None:
        self.allgather(torch.zeros(0), name)


def run_local(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(transport, *args, **kwargs) on `world_size` ranks (threads); return per-rank results.

    If any rank raises, the others are released (PeerFailure) and the first original
    exception is re-raised here, so a broken rank never leaves the caller hanging."""
    transports = LocalTransport.world(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(transports[rank], *args, **kwargs)
        except BaseException as exc:
            errors[rank] = exc
            transports[rank]._world.failed.set()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"local-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    originals = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
    if originals or any(errors):
        raise (originals or [e for e in errors if e is not None])[0]
    return results
