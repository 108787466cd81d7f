"""torch.distributed transport (gloo on CPU, nccl on CUDA).

Gloo needs CPU tensors and NCCL CUDA tensors; a tensor on the other kind of device is moved
once per message and the result is returned on the caller's device. Sizes of variable-size
messages travel first as one int64, so the receiver never needs to know them in advance;
a sendrecv whose caller knows the size (recv_numel) skips that round trip.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import (
    DEFAULT_TIMEOUT_S,
    QueuedOp,
    Transport,
    TransportError,
    _check_1d,
    exit_with_failure,
    fail_job_at_exit,
)
from .p2p import RECV, SEND, P2POps, PointToPoint, backend_failure

#: backends that take a single name in new_group; anything else is passed as its config
_PLAIN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def backend_spec(group: dist.ProcessGroup | None) -> str:
    """What new_group needs to make a group with `group`'s backends: its backend's name
    ('gloo', 'nccl'), or its per-device config ('cpu:gloo,cuda:nccl', torch's default when
    init_process_group is given no backend)."""
    name = str(dist.get_backend(group))
    return name if name in _PLAIN_BACKENDS else str(dist.get_backend_config(group))


def comm_device(spec: str, cuda_available: bool, current: int = 0) -> torch.device:
    """The device messages travel from: CUDA when the backend sends CUDA tensors over NCCL
    ('nccl', or a config such as 'cpu:gloo,cuda:nccl') and CUDA is there, else the CPU
    (gloo and MPI take CPU tensors)."""
    if cuda_available and (spec == "nccl" or "cuda:nccl" in spec):
        return torch.device("cuda", current)
    return torch.device("cpu")


def private_group(group: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup:
    """A new process group of `group`'s ranks (the default group's when None) and backends,
    for the library's traffic alone, so that no collective of the user's, on any group of
    theirs, can pair with one of the library's.

    Collective over the whole default group: every rank calls it at the same point, each with
    its own group when the groups partition the ranks (an FSDP mesh's replica groups). The
    ranks first share which groups they asked for, then make every one of them in the same
    order (torch.distributed's rule for new_group); groups that overlap without being equal are
    refused on every rank. The new groups' backends time out after `timeout` seconds (the
    transport's): with torch's default of 30 minutes, a gloo worker thread still waiting for a
    frozen peer after the transport gave up kept the process from exiting, since the group's
    destructor joins that thread."""
    spec = backend_spec(group)
    mine = sorted(dist.get_process_group_ranks(group)) if group is not None else None
    world = dist.get_world_size()
    asked: list[list[int] | None] = [None] * world
    dist.all_gather_object(asked, mine)
    groups = sorted({tuple(ranks if ranks is not None else range(world)) for ranks in asked})
    covered = [r for members in groups for r in members]
    if len(covered) != len(set(covered)):
        raise ValueError(
            f"the ranks asked for transports over overlapping groups {groups}: make one "
            "transport per group of a partition (each rank over its own group) at a time"
        )
    rank = dist.get_rank()
    made = None
    for members in groups:
        made_now = dist.new_group(list(members), backend=spec, timeout=timedelta(seconds=timeout))
        if rank in members:
            made = made_now
    assert made is not None  # every rank asked for a group holding itself
    return made


#: the integer types gloo's and NCCL's collectives refuse ("Invalid scalar type"), which
#: QSGD's levels of 128 and more travel as (int16): gathered and broadcast as their bytes,
#: all-reduced in the wider type (point-to-point messages carry them as they are)
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


#: the library's process groups, released at exit (_release_groups)
_PRIVATE_GROUPS: list[weakref.ref[TorchDistTransport]] = []


def _release_groups() -> None:
    """At interpreter exit, while it is still whole, _release every transport's group. A group
    the library kept referenced outlived the user's destroy_process_group() and was destroyed
    during finalisation, where gloo's worker threads, freeing tensors they still held, took
    the GIL of an interpreter being torn down: SIGABRT ("terminate called without an active
    exception") after all work was done, in about one FSDP2 flat_shard exit in four."""
    for ref in _PRIVATE_GROUPS:
        transport = ref()
        if transport is not None:
            _release(transport)
    _PRIVATE_GROUPS.clear()


def _release(transport: TorchDistTransport) -> None:
    """Destroy `transport`'s own process group, unless the user's destroy_process_group() did,
    and drop the transport's reference to it (it raises TransportError if used afterwards)."""
    group, transport._group = transport._group, None
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):  # already destroyed with the default group
        pass


class TorchDistTransport(PointToPoint, Transport):
    """Transport over an initialised torch.distributed process group.

    The library's messages travel on a process group of its own, made at construction over
    `group`'s ranks with `group`'s backends (private_group): construction is collective over
    the default group, as torch.distributed.new_group is. The user's collectives, barriers
    and object broadcasts, on the default group or any other, then never meet the library's,
    whichever thread issues them. `timeout` bounds every wait; the process group's own
    timeout (set at init_process_group) bounds the collectives inside the backend as well."""

    queues_collectives = True

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        if not dist.is_available() or not dist.is_initialized():
            raise TransportError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group (e.g. under torchrun) first"
            )
        self.backend = backend_spec(group)
        self.user_group = group
        try:
            self._group: dist.ProcessGroup | None = private_group(group, timeout)
        except RuntimeError as exc:  # a peer that died or froze while the groups were made
            fail_job_at_exit("torch", exit_with_failure)
            raise backend_failure(exc, dist.get_rank(), "the library's own process group") from exc
        if not _PRIVATE_GROUPS:
            atexit.register(_release_groups)
        _PRIVATE_GROUPS.append(weakref.ref(self))
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.timeout = timeout
        cuda = torch.cuda.is_available()
        self._device = comm_device(self.backend, cuda, torch.cuda.current_device() if cuda else 0)

    def global_rank(self, rank: int) -> int:
        """The default group's rank of `rank` in this transport's group."""
        return dist.get_global_rank(self.group, rank)

    @property
    def group(self) -> dist.ProcessGroup:
        """The library's own process group (private_group)."""
        if self._group is None:
            raise TransportError(
                "this transport's process group was released at interpreter exit, before "
                "torch finalises (an exit handler registered earlier than the transport's "
                "first use ran after it)"
            )
        return self._group

    def _complete(self, issue, name: str) -> None:
        """Issue the ops (`issue()` returns their works) and wait for them. A dead peer can
        make gloo fail while posting an op as well as while waiting: both become
        TransportError (TransportTimeout for a timeout)."""
        try:
            for w in issue():
                w.wait(timeout=timedelta(seconds=self.timeout))
        except TransportError:  # the group was released: no peer failed
            raise
        except RuntimeError as exc:
            raise self._failure(exc, name) from exc

    def _failure(self, exc: RuntimeError, name: str) -> TransportError:
        # A backend thread may still wait for the failed peer, and the interpreter's exit
        # would join it: end the process at exit instead, with a failure.
        fail_job_at_exit("torch", exit_with_failure)
        return backend_failure(exc, dist.get_rank(), name)

    def _p2p(self, ops: P2POps, name: str) -> None:
        """Post `ops` in the given order (callers post receives first; see PointToPoint) and
        wait for them."""
        if not ops:
            return
        post = {RECV: dist.irecv, SEND: dist.isend}
        p2p = [
            dist.P2POp(post[kind], t, self.global_rank(peer), group=self.group)
            for kind, t, peer in ops
        ]
        self._complete(lambda: dist.batch_isend_irecv(p2p), name)

    def _alltoall_sizes(self, send_sizes: torch.Tensor, name: str) -> torch.Tensor:
        recv_sizes = torch.empty_like(send_sizes)
        self._complete(
            lambda: [
                dist.all_to_all_single(recv_sizes, send_sizes, group=self.group, async_op=True)
            ],
            name,
        )
        return recv_sizes

    def _allgather_sizes(self, n: int, name: str) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64, device=self._device)
        sizes = [torch.empty_like(mine) for _ in range(self.size)]
        self._complete(
            lambda: [dist.all_gather(sizes, mine, group=self.group, async_op=True)], name
        )
        return [int(s.item()) for s in sizes]

    def allgather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        _check_1d(tensor, "allgather")
        if tensor.dtype in _WIDER:  # gathered as its bytes
            parts = self.allgather(tensor.contiguous().view(torch.uint8), name)
            return [p.view(tensor.dtype) for p in parts]
        sizes = self._allgather_sizes(tensor.numel(), name)
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=tensor.dtype, device=self._device)
        padded[: tensor.numel()] = self._on_comm(tensor)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        if longest:
            self._complete(
                lambda: [dist.all_gather(parts, padded, group=self.group, async_op=True)], name
            )
        return [p[:s].to(tensor.device) for p, s in zip(parts, sizes)]

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if tensor.dtype in _WIDER:  # summed wider, wrapped back into the narrow type
            return self.allreduce(tensor.to(_WIDER[tensor.dtype]), name).to(tensor.dtype)
        out = self._on_comm(tensor).clone()
        self._complete(lambda: [dist.all_reduce(out, group=self.group, async_op=True)], name)
        return out.to(tensor.device)

    def allreduce_async_(self, tensor: torch.Tensor, name: str) -> QueuedOp:
        """dist.all_reduce(async_op=True) on `tensor` itself when it is contiguous on the
        backend's device (gloo: CPU, NCCL: CUDA), as DDP all-reduces its buckets; otherwise
        done before this returns."""
        if not tensor.is_contiguous() or tensor.device != self._device:
            return super().allreduce_async_(tensor, name)
        group = self.group
        try:
            work = dist.all_reduce(tensor, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._failure(exc, name) from exc
        future = work.get_future().then(lambda done: (done.value(), tensor)[1])
        return QueuedOp(future, lambda: self._complete(lambda: [work], name))

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        self._check_peer(root, "root")
        if tensor.dtype in _WIDER:  # broadcast as its bytes
            as_bytes = tensor.contiguous().reshape(-1).view(torch.uint8)
            return self.broadcast(as_bytes, root, name).view(tensor.dtype).view(tensor.shape)
        out = self._on_comm(tensor).clone()
        source = self.global_rank(root)
        self._complete(lambda: [dist.broadcast(out, source, group=self.group, async_op=True)], name)
        return out.to(tensor.device)

    def barrier(self, name: str = "barrier") -> None:
        self.allreduce(torch.zeros(1, device=self._device), name)


def destroy_and_exit(code: int = 0) -> None:
    """Destroy the default process group and end this worker process at once.

    With torch 2.13, gloo's worker threads can still hold tensors while the interpreter
    finalises, and a worker exit can then abort with "terminate called without an active
    exception" (SIGABRT) although all work is done (the race is described in pytorch/pytorch
    PR 179291). The library's own torch.distributed groups are released before finalisation
    (_release_groups); a group of the user's kept alive past it, and the gloo channel of the
    Horovod transport, are not, and ending the process without finalisation avoids the race
    for those too; call this last, after results are written. Under mpirun MPI is finalised
    first when `code` is 0 (mpirun reports a rank that exits without it as a failure)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    MPI = sys.modules.get("mpi4py.MPI")
    if code == 0 and MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
