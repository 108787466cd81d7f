"""Start every rank from the same model and optimizer: Horovod's broadcast_parameters,
broadcast_object and broadcast_optimizer_state, for any transport (horovodrun, torchrun, mpirun).

    spardl_grace.broadcast_parameters(model.state_dict(), root_rank=0)
    spardl_grace.broadcast_optimizer_state(optimizer, root_rank=0)

The compression state (residuals and schedules) of a spardl_grace.DistributedOptimizer is
handled by broadcast_optimizer_state as resume_compression_state documents: residuals stay
each rank's own, because root's residuals copied to every rank would count root's unsent
gradient mass P times.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .agreement import agree
from .transport import Transport, shared_transport


def _check_root(root_rank: int, transport: Transport) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < transport.size:
        raise ValueError(f"root_rank must be a rank in 0..{transport.size - 1}, got {root_rank!r}")


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    transport: Transport | None = None,
) -> None:
    """Overwrite, in place, every tensor of `params` (model.state_dict() or
    model.named_parameters()) with root_rank's. Tensors go in name order, so every rank must
    pass the same names."""
    transport = transport or shared_transport()
    _check_root(root_rank, transport)
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    with torch.no_grad():
        for name, tensor in items:
            received = transport.broadcast(tensor.detach().reshape(-1), root_rank, f"bcast.{name}")
            tensor.copy_(received.view_as(tensor))


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    transport: Transport | None = None,
    name: str = "object",
) -> Any:
    """root_rank's `obj` on every rank (the others pass anything, e.g. None). `obj` is written
    with torch.save and read back with torch.load(weights_only=True), so it may hold tensors,
    numbers, strings, None and lists, tuples and dicts of them (any state_dict); tensors come
    back on the CPU, bit for bit. Two broadcasts: the size, then the bytes (the transport
    moves them to the backend's device)."""
    transport = transport or shared_transport()
    _check_root(root_rank, transport)
    if transport.rank == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    size = transport.broadcast(size, root_rank, f"{name}.size")
    if transport.rank != root_rank:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    data = transport.broadcast(data, root_rank, f"{name}.bytes")
    raw = data.cpu().numpy().tobytes()
    return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")


def _structure(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What every rank's optimizer must share for root's state to fit it."""
    return {
        "class": type(optimizer).__name__,
        "parameters": [[list(p.shape) for p in g["params"]] for g in optimizer.param_groups],
        "dtypes": [[str(p.dtype) for p in g["params"]] for g in optimizer.param_groups],
    }


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    transport: Transport | None = None,
) -> None:
    """Give every rank root_rank's optimizer state: afterwards optimizer.state_dict() (state
    tensors, step counts, and the param groups' settings such as the learning rate) equals
    root's bit for bit on every rank, whether a rank had state or not. Any torch.optim
    optimizer, plain or wrapped by spardl_grace.DistributedOptimizer; no optimizer step is
    taken and no parameter changes.

    For a spardl_grace.DistributedOptimizer the compression state follows
    resume_compression_state: residuals stay each rank's own, a rank that has not
    synchronised yet takes root's step counters and schedules. With 'exchange_period' or
    'outer_momentum', every rank takes root's outer state (the parameters of the last
    exchange, the outer momentum, the steps since: the same on every rank by design), so the
    ranks exchange at the same step from the same place.

    The ranks first check that their optimizers have the same class and parameter shapes (all
    raise ValueError at once otherwise). The transport is the DistributedOptimizer's, else
    the active backend's."""
    sync = getattr(optimizer, "_sync", None)
    if transport is None:
        transport = sync.grace.transport if sync is not None else shared_transport()
    _check_root(root_rank, transport)
    agree(transport, "the optimizer to broadcast", _structure(optimizer))
    state = broadcast_object(
        optimizer.state_dict() if transport.rank == root_rank else None,
        root_rank,
        transport,
        "optimizer.state",
    )
    if transport.rank != root_rank:
        optimizer.load_state_dict(state)
    if sync is not None:
        resume_compression_state(sync, root_rank, transport)
    if getattr(optimizer, "_keeps_outer_state", False):
        outer = broadcast_object(
            optimizer._outer_state_dict() if transport.rank == root_rank else None,  # type: ignore[attr-defined]
            root_rank,
            transport,
            "optimizer.outer",
        )
        optimizer._load_outer_state_dict(outer)  # type: ignore[attr-defined]


def resume_compression_state(sync: Any, root_rank: int, transport: Transport) -> None:
    """The rule for a DistributedOptimizer's compression state when ranks resume from one
    rank's checkpoint (Horovod's pattern: rank 0 loads, then broadcasts):

    - Residuals, velocities and other per-rank memories are never copied: each rank keeps
      what it restored itself (load_compression_state_dict from its own per-rank
      checkpoint), or starts with none. What is lost without a per-rank checkpoint is each
      rank's unsent gradient mass at the checkpoint, as after a dense step.
    - A rank that has not synchronised yet (a fresh compression state) takes root's step
      counters and schedules (the density warm-up's position, SparDL's h, Ok-Topk's global
      threshold), so every rank continues root's schedule.
    - A rank that restored its own compression state must be at root's step; if any is not,
      every rank raises ValueError at once, naming each rank's step.

    One all-gather of the ranks' steps, and a broadcast of root's counters when some rank
    takes them."""
    mine = torch.tensor([sync.steps], dtype=torch.int64)
    steps = [int(s[0]) for s in transport.allgather(mine, "compression.steps")]
    root_steps = steps[root_rank]
    other = [r for r, s in enumerate(steps) if s not in (0, root_steps)]
    if other or (root_steps == 0 and any(steps)):
        raise ValueError(
            f"the ranks' compression states are at different steps (by rank: {steps}): a rank "
            f"that restored its own compression state must be at root rank {root_rank}'s step; "
            "restore every rank's from the same checkpoint, or none (residuals then start at "
            "zero and root's step counters are taken)"
        )
    if root_steps == 0 or all(s == root_steps for s in steps):
        return
    shared = broadcast_object(
        sync.shared_state_dict() if transport.rank == root_rank else None,
        root_rank,
        transport,
        "compression.shared",
    )
    if sync.steps == 0:
        sync.load_shared_state_dict(shared)
