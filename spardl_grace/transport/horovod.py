"""Horovod transport (horovodrun with --gloo or --mpi).

Horovod has no point-to-point send/recv, and each of its operations first passes its
background loop and its coordinator's negotiation (about 8 ms for a 256-byte exchange on an
emulated 100 Mbit link, against 0.6 ms through gloo). So by default every message of the
library, collectives included, goes over a gloo channel opened beside Horovod: a private gloo
process group among Horovod's ranks (rank 0 serves its rendezvous store; its address, on
Horovod's HOROVOD_GLOO_IFACE when horovodrun sets it, reaches the others through a Horovod
broadcast). That also keeps the library's traffic apart from the user's: Horovod names an
unnamed op by a per-process count of the ops submitted, so library ops submitted from the
communication thread while the user's thread submits an unnamed hvd.allreduce would give that
op different names on different ranks, and the job would stall.

If the channel cannot be opened on every rank, every rank warns and everything goes through
Horovod's public API instead (a send to one peer is an alltoall whose other parts are empty);
then name your own ops between backward() and step() (hvd.allreduce(t, name=...)).
SPARDL_HOROVOD_P2P=horovod (or p2p='horovod') asks for that path from the start.

Every Horovod op is named deterministically from the caller's name, since Horovod matches ops
across ranks by name. Payloads travel as raw bytes (uint8), so every dtype works; allreduce
runs in the tensor's dtype, fp32 for the half-precision types, int64 for the integer types
Horovod cannot reduce (uint8, int8, int16, bool), cast back after.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta

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
    exit_with_failure,
    fail_job_at_exit,
    from_bytes,
)
from .gloo_channel import GlooChannel, open_gloo_channel
from .p2p import RECV, SEND, P2POps, PointToPoint, backend_failure

#: the dtypes Horovod's CPU all-reduce takes (others are reduced in int64 and cast back)
HOROVOD_REDUCES = (torch.float32, torch.float64, torch.int32, torch.int64)
#: how point-to-point messages travel: a gloo channel beside Horovod, or Horovod's alltoall
P2P_MODES = ("gloo", "horovod")
P2P_ENV = "SPARDL_HOROVOD_P2P"
# Channels opened so far per Horovod world (rank, size): each transport opens its own (two
# synchronisers' communication threads never share one), labelled by this count, which every
# rank keeps alike because every rank constructs its transports in the same order. A world in
# which a channel could not be opened is not tried again (each try may wait out a timeout).
_OPENED: dict[tuple[int, int], int] = {}
_UNREACHABLE: set[tuple[int, int]] = set()


def start_horovod_or_exit_after(timeout: float) -> None:
    """hvd.init() unless Horovod is running. Its rendezvous waits for every rank up to
    Horovod's own timeout (HOROVOD_GLOO_TIMEOUT_SECONDS, 30 s by default, or forever under
    MPI) holding the GIL, so a peer frozen during start-up held this rank beyond the
    library's timeout: the watchdog (exit_if_not_done_within) ends the process after
    `timeout` seconds with status 1 and the stack of this call, and horovodrun the job."""
    import horovod.torch as hvd

    if not hvd.is_initialized():
        with exit_if_not_done_within(timeout):
            hvd.init()


class HorovodTransport(PointToPoint, Transport):
    """Transport over an initialised horovod.torch (hvd.init() must have been called).

    `p2p` (default: $SPARDL_HOROVOD_P2P, else 'gloo') chooses how sendrecv and alltoall travel:
    'gloo', a private gloo group beside Horovod that this transport opens for itself
    (collective: every rank constructs its transport), or 'horovod', Horovod's alltoall.
    Horovod matches its collectives by name, and the library's names carry `prefix`, so the
    user's own Horovod collectives never pair with the library's."""

    def __init__(
        self, timeout: float = DEFAULT_TIMEOUT_S, prefix: str = "spardl", p2p: str | None = None
    ):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise TransportError(
                "Horovod is not initialised: call horovod.torch.init() (under horovodrun) first"
            )
        mode = p2p if p2p is not None else os.environ.get(P2P_ENV, "gloo")
        if mode not in P2P_MODES:
            source = "p2p" if p2p is not None else P2P_ENV
            raise ValueError(f"{source}={mode!r}: valid choices are {', '.join(P2P_MODES)}")
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.timeout = timeout
        self._prefix = prefix
        self._device = torch.device("cpu")
        self._channel: GlooChannel | None = None
        if mode == "gloo" and self.size > 1:
            world = (self.rank, self.size)
            if world not in _UNREACHABLE:
                count = _OPENED.get(world, 0)
                _OPENED[world] = count + 1
                self._channel = open_gloo_channel(self, f"{prefix}.p2p_channel.{count}")
                if self._channel is None:
                    _UNREACHABLE.add(world)

    @property
    def p2p(self) -> str:
        """How point-to-point messages travel now: 'gloo' or 'horovod'."""
        return "horovod" if self._channel is None else "gloo"

    def _name(self, name: str, part: str) -> str:
        return f"{self._prefix}.{name}.{part}"

    def _sync(self, handle, name: str):
        deadline = time.monotonic() + self.timeout
        while not self._hvd.poll(handle):
            if time.monotonic() > deadline:
                # Horovod's shutdown would wait out its own timeout for the peer; horovodrun
                # ends the other ranks once this one exits with a failure.
                fail_job_at_exit("horovod", exit_with_failure)
                raise TransportTimeout(
                    f"rank {self.rank}: Horovod op '{name}' did not complete "
                    f"within {self.timeout:.1f}s (a peer may have died)"
                )
            time.sleep(0.0002)
        try:
            return self._hvd.synchronize(handle)
        except Exception as exc:  # Horovod raises HorovodInternalError and others
            raise TransportError(f"rank {self.rank}: Horovod op '{name}' failed: {exc}") from exc

    def _alltoall_bytes(self, parts: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        data = [as_bytes(p.detach().cpu()) for p in parts]
        splits = torch.tensor([d.numel() for d in data], dtype=torch.int32)
        handle = self._hvd.alltoall_async(
            torch.cat(data), splits=splits, name=self._name(name, "a2a")
        )
        out = self._sync(handle, name)
        received, recv_splits = out if isinstance(out, tuple) else (out, None)
        if recv_splits is None:
            raise TransportError("this Horovod does not return received splits from alltoall")
        return list(torch.split(received, recv_splits.tolist()))

    def _on_channel(self, post, name: str) -> None:
        """Run post(channel) (it returns the gloo works it started) and wait for them."""
        channel = self._channel
        assert channel is not None  # only called with a channel
        channel.allow(self.timeout)
        try:
            for w in post(channel):
                w.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            # As for a Horovod op: Horovod's shutdown would wait for the failed peer.
            fail_job_at_exit("horovod", exit_with_failure)
            raise backend_failure(exc, self.rank, name) from exc

    def _p2p(self, ops: P2POps, name: str) -> None:
        """Post `ops` on the gloo channel in the given order and wait for them."""
        self._on_channel(lambda ch: [ch.post(kind, t, peer) for kind, t, peer in ops], name)

    def _alltoall_sizes(self, send_sizes: torch.Tensor, name: str) -> torch.Tensor:
        """Point to point on the channel as well: one Horovod op would cost more than the
        whole exchange of 8-byte counts."""
        recv_sizes = send_sizes.clone()
        peers = [(self.rank + i) % self.size for i in range(1, self.size)]
        ops: P2POps = [(RECV, recv_sizes[j : j + 1], j) for j in peers]
        ops += [(SEND, send_sizes[j : j + 1], j) for j in peers]
        self._p2p(ops, f"{name}.sizes")
        return recv_sizes

    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
        """Transport.sendrecv, on the gloo channel (PointToPoint.sendrecv) or, without one, as
        one Horovod alltoall whose parts for other ranks are empty (it carries the sizes)."""
        if self._channel is not None:
            return super().sendrecv(tensor, dst, src, name, recv_numel)
        _check_1d(tensor, "sendrecv")
        self._check_peer(dst, "destination")
        self._check_peer(src, "source")
        empty = tensor.new_empty(0)
        parts = [tensor if j == dst else empty for j in range(self.size)]
        # Horovod's alltoall carries the sizes itself: one operation with or without recv_numel.
        received = from_bytes(self._alltoall_bytes(parts, name)[src], tensor.dtype)
        check_received(received.numel(), recv_numel, name, self.rank)
        return received.to(tensor.device)

    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        _check_1d(tensor, "allgather")
        data = as_bytes(tensor.detach().cpu())
        if self._channel is not None:
            return [
                from_bytes(p, tensor.dtype).to(tensor.device)
                for p in self._channel_allgather(data, name)
            ]
        sizes = self._sync(
            self._hvd.allgather_async(
                torch.tensor([data.numel()], dtype=torch.int64), name=self._name(name, "sizes")
            ),
            name,
        )
        gathered = self._sync(self._hvd.allgather_async(data, name=self._name(name, "data")), name)
        return [
            from_bytes(p, tensor.dtype).to(tensor.device)
            for p in torch.split(gathered, sizes.tolist())
        ]

    def alltoall(self, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Transport.alltoall, on the gloo channel (PointToPoint.alltoall) or as Horovod's."""
        if self._channel is not None:
            return super().alltoall(tensors, name)
        self._check_alltoall(tensors)
        received = self._alltoall_bytes(tensors, name)
        return [from_bytes(r, t.dtype).to(t.device) for r, t in zip(received, tensors)]

    def _channel_allgather(self, data: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Every rank's bytes over the channel: the sizes, then the bytes padded to the
        longest."""
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self._on_channel(lambda ch: [ch.allgather(sizes, size)], f"{name}.sizes")
        counts = [int(s) for s in sizes]
        padded = torch.zeros(max(counts), dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        if padded.numel():
            self._on_channel(lambda ch: [ch.allgather(parts, padded)], name)
        return [p[:n] for p, n in zip(parts, counts)]

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        work = tensor.detach().cpu().contiguous()
        if work.dtype in (torch.float16, torch.bfloat16):
            work = work.float()
        elif work.dtype not in HOROVOD_REDUCES:
            work = work.long()  # sums wrap back into the narrow type, as gloo's do
        if self._channel is not None:
            out = work.clone()
            self._on_channel(lambda ch: [ch.allreduce(out)], name)
        else:
            out = self._sync(
                self._hvd.allreduce_async(
                    work, op=self._hvd.Sum, name=self._name(name, "allreduce")
                ),
                name,
            )
        return out.to(dtype=tensor.dtype, device=tensor.device)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        self._check_peer(root, "root")
        data = as_bytes(tensor.detach().cpu()).clone()
        if self._channel is not None:
            self._on_channel(lambda ch: [ch.broadcast(data, root)], name)
            out = data
        else:
            out = self._sync(
                self._hvd.broadcast_async(data, root, name=self._name(name, "bcast")), name
            )
        return from_bytes(out, tensor.dtype).view(tensor.shape).to(tensor.device)

    def barrier(self, name: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), name)
