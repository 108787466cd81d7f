"""Horovod transport (horovodrun with --gloo or --mpi), through Horovod's public API only.

Horovod has no point-to-point send/recv: a step in which each rank sends to one peer is an
alltoall whose splits are zero for every other rank. Every op is named deterministically from
the caller's name, since Horovod matches ops across ranks by name. Payloads travel as raw
bytes (uint8), so every dtype works; allreduce runs in the tensor's dtype, fp32 for the
half-precision types, int64 for the integer types Horovod cannot reduce (uint8, int8, int16,
bool), cast back after.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .base import (
    DEFAULT_TIMEOUT_S,
    Transport,
    TransportError,
    TransportTimeout,
    _check_1d,
    as_bytes,
    check_received,
    exit_with_failure,
    fail_job_at_exit,
    from_bytes,
)


#: the dtypes Horovod's CPU all-reduce takes (others are reduced in int64 and cast back)
HOROVOD_REDUCES = (torch.float32, torch.float64, torch.int32, torch.int64)


class HorovodTransport(Transport):
    """Transport over an initialised horovod.torch (hvd.init() must have been called)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, prefix: str = "spardl"):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise TransportError(
                "Horovod is not initialised: call horovod.torch.init() (under horovodrun) first"
            )
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.timeout = timeout
        self._prefix = prefix

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

    def sendrecv(
        self, tensor: torch.Tensor, dst: int, src: int, name: str, recv_numel: int | None = None
    ) -> torch.Tensor:
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
        self._check_alltoall(tensors)
        received = self._alltoall_bytes(tensors, name)
        return [from_bytes(r, t.dtype).to(t.device) for r, t in zip(received, tensors)]

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        work = tensor.detach().cpu().contiguous()
        if work.dtype in (torch.float16, torch.bfloat16):
            work = work.float()
        elif work.dtype not in HOROVOD_REDUCES:
            work = work.long()  # sums wrap back into the narrow type, as gloo's do
        out = self._sync(
            self._hvd.allreduce_async(work, op=self._hvd.Sum, name=self._name(name, "allreduce")),
            name,
        )
        return out.to(dtype=tensor.dtype, device=tensor.device)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        self._check_peer(root, "root")
        data = as_bytes(tensor.detach().cpu()).clone()
        out = self._sync(
            self._hvd.broadcast_async(data, root, name=self._name(name, "bcast")), name
        )
        return from_bytes(out, tensor.dtype).view(tensor.shape).to(tensor.device)

    def barrier(self, name: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), name)
