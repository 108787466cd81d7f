"""The GRACE abstractions (same signatures as GRACE, so GRACE users' code runs unchanged).

    tensors, ctx = compressor.compress(tensor, name)
    tensor = compressor.decompress(tensors, ctx)
    tensor = compressor.aggregate(list_of_tensors)
    tensor = memory.compensate(tensor, name)
    memory.update(tensor, name, compressor, tensors, ctx)
    averaged = communicator.step(tensor, name)                  # GRACE dist style
    handles, ctx = communicator.send_step(tensor, name)         # GRACE Horovod style
    averaged = communicator.receive_step(handles, ctx)

Two peer families share this interface (their common base, Synchronizer, is what
grace_from_params returns and what DistributedOptimizer and the DDP hook take):
  * GRACE's Communicator (allreduce, allgather, broadcast; compressor, memory, transport)
    compresses, updates the memory from the compressed tensor *before* communication, then
    exchanges compressed tensors;
  * SparseAllreduce (spardl, topka, gtopk, ...; memory, transport, density, codec) has no
    compressor: it selects *during* communication, so the residual is known only afterwards,
    and it hands the memory what was finally applied (Memory.store_residual).

state_dict() of every part holds only tensors and plain Python values, so it loads with
torch.load(weights_only=True).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from .agreement import agree_holding_own_state, digest, settings_of
from .comm_thread import CommThread, future_for
from .transport import Transport
from .transport.counting import ring_allreduce_bytes
from .warmup import warmup_density


def all_finite(tensor: torch.Tensor) -> bool:
    """torch.isfinite(tensor).all(), in one pass and without a tensor-sized mask: the minimum
    and the maximum are both finite exactly when every entry is (NaN propagates to both)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class Compressor(ABC):
    """Turns a tensor into a list of tensors to send (plus a local context) and back.

    `average`: whether the communicator divides the aggregate by the number of workers.
    `tensors_size_are_same`: whether every worker's compressed tensors have the same shapes
    (needed by all-reduce; all-gather handles either)."""

    #: keys of state_dict() that belong to one rank (a momentum of its own gradients), left out
    #: of what another rank may take over (Synchronizer.shared_state_dict)
    RANK_LOCAL_STATE: tuple[str, ...] = ()

    def __init__(self, average: bool = True, tensors_size_are_same: bool = True):
        self.average = average
        self.tensors_size_are_same = tensors_size_are_same
        self.transport: Transport | None = None
        self._steps: dict[str, int] = {}

    def bind(self, transport: Transport) -> None:
        """Give the compressor the transport (for compressors that communicate or need the rank)."""
        self.transport = transport

    @property
    def rank(self) -> int:
        return self.transport.rank if self.transport is not None else 0

    @property
    def bound_transport(self) -> Transport:
        """The transport bind() gave; RuntimeError if none was given (for compressors that
        communicate)."""
        return _bound(self)

    def next_step(self, name: str) -> int:
        """The per-name step counter (0 on the first call for `name`), then advance it."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], Any]:
        """Return (tensors to send, local context for decompress)."""

    @abstractmethod
    def decompress(self, tensors: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor of the original shape from compressed tensors."""

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Combine decompressed tensors from every worker (default: sum)."""
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t
        return total

    def state_dict(self) -> dict[str, Any]:
        """The per-name step counters, as plain values (loads with
        torch.load(weights_only=True))."""
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned; names it lacks start afresh."""
        self._steps = dict(state.get("steps", {}))


def _bound(part: Any) -> Transport:
    """`part`'s transport; RuntimeError when no communicator has bound one yet."""
    if part.transport is None:
        raise RuntimeError(
            f"{type(part).__name__} communicates but is not bound to a transport: "
            "build it into a communicator (grace_from_params) or call bind()"
        )
    return part.transport


def communication_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision gradients are synchronised (and their residuals kept) in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Memory(ABC):
    """Error feedback: what was not sent in one step is added back in the next.

    GRACE's protocol, per tensor `name`: compensate(tensor, name) returns the gradient plus
    what is remembered for `name` (the tensor to compress); a GRACE communicator then calls
    update(tensor, name, compressor, tensor_compressed, ctx) before it communicates, so the
    memory can keep what compression dropped; a sparse all-reduce, which decides the residual
    while it communicates, calls store_residual(name, residual, result) instead. A memory that
    communicates (a global residual) is given the transport with bind(). state_dict() and
    load_state_dict() checkpoint what it remembers. The library's memories are 'none',
    'residual', 'global_residual' (with DGC's momentum correction and local clipping), 'dgc',
    'efsignsgd' and 'powersgd' (grace_from_params' 'memory'); a GRACE user's own memory needs
    compensate() only."""

    def __init__(self) -> None:
        self.transport: Transport | None = None

    def bind(self, transport: Transport) -> None:
        """Give the memory the transport (memories that need the rank or the world size)."""
        self.transport = transport

    @property
    def bound_transport(self) -> Transport:
        """The transport bind() gave; RuntimeError if none was given (for memories that
        communicate)."""
        return _bound(self)

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor to compress: the gradient plus what is remembered for `name`."""

    def compensate_into(self, tensor: torch.Tensor, name: str, out: torch.Tensor) -> torch.Tensor:
        """compensate(), written into `out` (shaped like `tensor`) and returned: a sparse
        all-reduce that works on a buffer of its own gets the compensated gradient there
        directly. Where compensate()'s result has another dtype or shape than `out`, that
        result is returned instead (callers compare storage). This default copies; memories
        override it to write `out` in the same pass."""
        compensated = self.compensate(tensor, name)
        if compensated.dtype != out.dtype or compensated.shape != out.shape:
            return compensated
        return out.copy_(compensated)

    def update(
        self,
        tensor: torch.Tensor,
        name: str,
        compressor: Compressor,
        tensor_compressed: Sequence[torch.Tensor],
        ctx: Any,
    ) -> None:
        """Remember what compression dropped (GRACE communicators, before communication)."""

    def store_residual(
        self, name: str, residual: torch.Tensor, result: torch.Tensor | None = None
    ) -> None:
        """Remember `residual` for `name` (sparse all-reduces, after communication); `result`
        is the average every rank applied (momentum correction masks its velocity with it)."""
        raise ValueError(
            f"{type(self).__name__} cannot hold the residual of a sparse all-reduce; "
            "use memory 'global_residual', 'residual' or 'none'"
        )

    def stores(self) -> list[dict[str, torch.Tensor]]:
        """The memory's per-name stores of tensors shaped like the gradient (residuals,
        velocities). Fused-buffer callers split them per parameter between steps, so they
        survive a change of bucketing, and put the old entries back after a failed step
        (spardl_grace.sync). A memory must replace its entries, never change them in place."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The remembered tensors (residuals, velocities) and counters, as tensors and plain
        values; empty for a memory that keeps nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""


def _bind(part: Any, transport: Transport) -> None:
    """Give `part` the transport if it takes one: this library's compressors and memories do;
    GRACE users' own ones, written against GRACE's interface alone, need not."""
    bind = getattr(part, "bind", None)
    if callable(bind):
        bind(transport)


def _check_protocol(part: Any, what: str, methods: tuple[str, ...]) -> None:
    missing = [m for m in methods if not callable(getattr(part, m, None))]
    if missing:
        raise TypeError(
            f"the {what} {type(part).__name__} lacks {', '.join(missing)}: a GRACE "
            f"{what} has {', '.join(methods)}"
        )


def average_of(compressor: Any) -> bool:
    """GRACE's `average` of a compressor (True when it does not say)."""
    return getattr(compressor, "average", True)


def same_sizes(compressor: Any) -> bool:
    """GRACE's `tensors_size_are_same` of a compressor (True when it does not say)."""
    return getattr(compressor, "tensors_size_are_same", True)


def aggregate(compressor: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The compressor's aggregate of decompressed tensors; their sum when it has none."""
    combine = getattr(compressor, "aggregate", None)
    return combine(tensors) if callable(combine) else Compressor.aggregate(compressor, tensors)


def communication_thread(transport: Transport, name: str) -> CommThread | None:
    """One thread, named `name`, that runs communication in the order it is submitted, on its
    own CUDA stream for CUDA tensors (spardl_grace.comm_thread); None when the transport cannot
    be used from another thread (an MPI library without MPI_THREAD_MULTIPLE): then the caller
    communicates itself."""
    if not getattr(transport, "thread_safe", True):
        return None
    return CommThread(name)


def _resolve_transport(transport: Transport | int | None) -> Transport:
    """GRACE's constructors pass world_size (grace_dl.dist) or nothing (grace_dl.torch, for
    Horovod) where this library takes a transport: then the active backend's transport, which
    must have world_size ranks when one is given."""
    if isinstance(transport, Transport):
        return transport
    if transport is None:
        from .transport import default_transport

        return default_transport()
    if isinstance(transport, int) and not isinstance(transport, bool):
        from .transport import default_transport

        active = default_transport()
        if active.size != transport:
            raise ValueError(
                f"world_size {transport} does not match the active backend's {active.size} ranks"
            )
        return active
    raise TypeError(
        f"expected a Transport or GRACE's world_size (an int), got {type(transport).__name__}"
    )


class Synchronizer(ABC):
    """What grace_from_params returns: synchronises a tensor over the ranks, with a memory.

    Two peer families derive from it: GRACE's Communicator (compressor, memory, transport) and
    SparseAllreduce (memory, transport, density, codec). This class holds what they share: the
    transport, the memory, the ranks' agreement on each name, GRACE's step / send_step /
    receive_step with real handles and optional overlap, and checkpoints. `transport` may be
    GRACE's world_size instead (an int), or left out: the active backend's transport is then
    used, as in GRACE's Allgather(compressor, memory, world_size) and, for Horovod,
    Allgather(compressor, memory).

    reuse_results: False (the default) makes every step's result a new tensor, which the caller
    may keep. DistributedOptimizer and the DDP hook set it to True on the synchronizer they are
    given, because they copy each result into the gradients before the next step: then a sparse
    all-reduce may return the same buffer for a name each step (valid until that name's next
    step), which saves a gradient-sized allocation per step."""

    reuse_results = False
    #: grace_from_params' 'adam_freeze_step': DistributedOptimizer freezes an Adam's second
    #: moment after this many dense steps (spardl_grace.frozen_adam; 0: off)
    adam_freeze_step = 0
    #: grace_from_params' 'dense_warmup_steps': DistributedOptimizer's and the DDP hook's
    #: first steps synchronised dense (0: none)
    dense_warmup_steps = 0
    #: grace_from_params' 'exchange': what DistributedOptimizer's ranks synchronise,
    #: 'gradient' or 'update' (each rank's own optimizer step)
    exchange = "gradient"
    #: grace_from_params' 'exchange_period', 'outer_lr' and 'outer_momentum': with 'exchange':
    #: 'update', the steps between exchanges and the outer step on the averaged moves
    exchange_period = 1
    outer_lr = 1.0
    outer_momentum = 0.0
    #: attributes that differ between ranks by design (a rank's place in a schedule), left out
    #: of the fingerprint the ranks agree on
    RANK_LOCAL: tuple[str, ...] = ()
    #: keys of this communicator's own state that belong to one rank (estimates from its own
    #: gradients), left out of shared_state_dict()
    RANK_LOCAL_STATE: tuple[str, ...] = ()
    #: public attributes that are not settings the ranks agree on
    NOT_SETTINGS = ("world_size", "reuse_results", "restored", "state_saved_by")

    def __init__(self, memory: Memory, transport: Transport | int | None = None):
        _check_protocol(memory, "memory", ("compensate",))
        transport = _resolve_transport(transport)
        self.memory = memory
        self.transport = transport
        self.world_size = transport.size
        _bind(memory, transport)
        self.last_stats: dict[str, float] = {}
        self._agreed: dict[str, int] = {}
        self._executor: CommThread | None = None
        #: whether load_state_dict() (or load_shared_state_dict()) restored a state here
        self.restored = False
        #: the rank that saved the state load_state_dict() restored (None: none restored, or
        #: one saved before states recorded their rank)
        self.state_saved_by: int | None = None

    def _parts(self) -> dict[str, Any]:
        """The parts besides the memory whose settings the ranks agree on and whose state is
        checkpointed, by state-dict key."""
        return {}

    def fingerprint(self, tensor: torch.Tensor, name: str) -> dict[str, Any]:
        """What every rank must share to synchronise `tensor` under `name`: its numel, dtype
        and device type, and the settings of this synchronizer and its parts."""
        return {
            "name": name,
            "numel": tensor.numel(),
            "dtype": str(tensor.dtype),
            "device": tensor.device.type,
            "communicator": settings_of(self, self.RANK_LOCAL + self.NOT_SETTINGS),
            **{key: settings_of(part) for key, part in self._parts().items()},
            "memory": settings_of(self.memory),
        }

    def agree(self, tensor: torch.Tensor, name: str) -> None:
        """On the first step of `name`, and whenever its fingerprint changes here, check with
        one small collective that every rank has the same fingerprint; ValueError on every
        rank, naming the differing fields, if not (spardl_grace.agreement); also when any rank
        restored a compression state that another rank saved."""
        fields = self.fingerprint(tensor, name)
        key = digest({**fields, "state_saved_by": self.state_saved_by})
        if self._agreed.get(name) != key:
            agree_holding_own_state(self.transport, f"'{name}'", fields, self.state_saved_by)
            self._agreed[name] = key

    def result_is_finite(self, result: torch.Tensor, name: str) -> bool:
        """Whether every entry of `result`, this synchronizer's latest result for `name`, is
        finite: one pass over it here; a sparse all-reduce that knows where its result is
        non-zero looks there only."""
        return all_finite(result)

    def step(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the synchronised (averaged unless the compressor says otherwise) tensor,
        bit-identical on every rank, with the shape of `tensor`."""
        handles, ctx = self.send_step(tensor, name)
        return self.receive_step(handles, ctx)

    def overlap(self, enabled: bool = True) -> bool:
        """With `enabled`, send_step() returns at once with a pending handle and one
        communication thread runs the steps in the order they were sent (like Horovod's
        allreduce_async_), so GRACE's Horovod-style loop overlaps its exchanges with backward;
        receive_step() waits for the handle. Off (the default), send_step() exchanges before
        it returns. A transport that cannot be used from another thread (an MPI library
        without MPI_THREAD_MULTIPLE) keeps it off. Returns whether it is on. Every rank must
        send the same names in the same order either way."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        if enabled and self._executor is None:
            name = f"spardl-{type(self).__name__.lower()}"
            self._executor = communication_thread(self.transport, name)
        elif not enabled and self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return self._executor is not None

    def send_step(self, tensor: torch.Tensor, name: str) -> tuple[Any, Any]:
        """GRACE's Horovod-style first half of step(): check that the ranks agree on `name`,
        compensate, compress, update the memory, exchange. Returns (handle, None): the handle
        is a torch.futures.Future of the synchronised tensor, for receive_step(). It is
        complete when send_step() returns, unless overlap() is on: then it is pending while a
        communication thread exchanges, and holds the step's exception if one is raised."""
        handle: torch.futures.Future[torch.Tensor] = future_for(tensor)
        if self._executor is None:
            handle.set_result(self.synchronize(tensor, name))
        else:
            self._executor.submit(handle, tensor, self.synchronize, tensor, name)
        return handle, None

    def receive_step(self, handles: Any, ctx: Any) -> torch.Tensor:
        """GRACE's Horovod-style second half of step(): the synchronised tensor, once
        send_step()'s handle holds it (its exception if the step failed)."""
        if isinstance(handles, torch.futures.Future):
            return handles.wait()
        return handles

    @abstractmethod
    def synchronize(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """One whole step, here and now: check that the ranks agree on `name`, then
        compensate, exchange and average."""

    @abstractmethod
    def set_density(self, density: float) -> None:
        """Send this fraction of the entries from the next step on (DGC's density warm-up).
        Raises ValueError when the density is not in (0, 1] or nothing here has a density."""

    def state_dict(self) -> dict[str, Any]:
        """The memory's, the other parts' and this synchronizer's own state; a GRACE user's own
        compressor or memory without state_dict() contributes none (it is not checkpointed)."""
        return {
            **{key: _state_of(part) for key, part in self._parts().items()},
            "memory": _state_of(self.memory),
            "communicator": self._own_state(),
            "world_size": self.world_size,
            "rank": self.transport.rank,
            "classes": self._classes(),
        }

    def _classes(self) -> dict[str, str]:
        """The class names of this communicator and its memory, which a state is read by."""
        return {"communicator": type(self).__name__, "memory": type(self.memory).__name__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned. Raises ValueError when it was written by another
        number of workers: residuals and schedules belong to one partition of the work. A state
        another rank saved loads, and the next synchronisation raises ValueError on every rank
        (agreement.agree_holding_own_state)."""
        if state.get("world_size", self.world_size) != self.world_size:
            raise ValueError(
                f"checkpoint was written by {state['world_size']} workers, this run "
                f"has {self.world_size}: residuals and schedules do not carry over"
            )
        saved = state.get("classes", {})  # absent from checkpoints written before it
        memory = type(self.memory).__name__
        if saved.get("memory", memory) != memory and _holds_tensors(state.get("memory", {})):
            raise ValueError(
                f"this compression state was saved by {saved['communicator']} with "
                f"{saved['memory']}; this run's {type(self).__name__} with "
                f"{memory} cannot take its residuals (they would be lost "
                "or misread): resume with the settings it was saved with, or leave it unloaded "
                "to start the compression afresh"
            )
        parts = {**self._parts(), "memory": self.memory}
        for key, part in parts.items():
            load = getattr(part, "load_state_dict", None)
            if callable(load):
                load(state.get(key, {}))
        self._load_own_state(state.get("communicator", {}))
        self.restored = True
        self.state_saved_by = state.get("rank")

    def shared_state_dict(self) -> dict[str, Any]:
        """state_dict() without what belongs to this rank alone: the memory (residuals,
        velocities) and each part's RANK_LOCAL_STATE keys. What is left (step counters,
        schedules, thresholds computed from every rank's data) is the same on every rank, so a
        rank starting afresh may take it from another (spardl_grace.broadcast_optimizer_state)."""
        state = self.state_dict()
        del state["memory"], state["rank"]
        for key, part in {**self._parts(), "communicator": self}.items():
            for local in getattr(part, "RANK_LOCAL_STATE", ()):
                state[key].pop(local, None)
        return state

    def load_shared_state_dict(self, shared: dict[str, Any]) -> None:
        """Take another rank's shared_state_dict(), keeping this rank's memory and rank-local
        state."""
        own = self.state_dict()
        merged = {
            key: {**own[key], **shared[key]} if isinstance(own.get(key), dict) else shared[key]
            for key in shared
        }
        self.load_state_dict({**own, **merged})

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        pass


DEFAULT_WARMUP_START = 0.25  # DGC's first stage
#: grace_from_params' default floor on the entries a tensor sends a step: 16 KB on the exact
#: wire (at most 8.7 KB on the default compact one), about one round trip's worth of bytes on a
#: 100 Mbit link, so it costs next to no time;
#: on a model of 18K parameters at density 0.01 it took a one-epoch Horovod script from 3.0
#: points below dense to 0.3 (10 seeds each; 1,024 entries: 1.1 below;
#: experiments/results/horovod_defaults)
DEFAULT_MIN_ENTRIES = 2048


def _check_density(density: float) -> None:
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")


class Communicator(Synchronizer):
    """GRACE's communicator: compress, update the memory, exchange, decompress, average.

    The compressor and memory may be this library's or any objects with GRACE's interface
    (compress / decompress, optionally aggregate, average and tensors_size_are_same;
    compensate, optionally update): bind, state_dict and the other methods this library adds
    are used where present. Subclasses implement GRACE's send_receive."""

    def __init__(
        self, compressor: Compressor, memory: Memory, transport: Transport | int | None = None
    ):
        _check_protocol(compressor, "compressor", ("compress", "decompress"))
        super().__init__(memory, transport)
        self.compressor = compressor
        _bind(compressor, self.transport)

    def _parts(self) -> dict[str, Any]:
        return {"compressor": self.compressor}

    def synchronize(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """One whole step, here and now: check that the ranks agree on `name`, compensate,
        compress, update the memory, exchange, decompress and aggregate. last_stats then
        holds the step's 'bytes_sent' (bytes_sent_for), 'coding_s' (compress) and 'comm_s'
        (the rest)."""
        self.agree(tensor, name)
        start = time.perf_counter()
        compensated = self.memory.compensate(tensor, name)
        tensors, ctx = self.compressor.compress(compensated, name)
        coded = time.perf_counter()
        update = getattr(self.memory, "update", None)
        if callable(update):
            update(compensated, name, self.compressor, tensors, ctx)
        result = self.send_receive(tensors, name, ctx)
        # PowerSGD all-reduces its factors inside compress and sends no tensors after it
        inside = ring_allreduce_bytes(
            getattr(self.compressor, "allreduced_bytes", 0), self.world_size
        )
        self.last_stats = {
            "bytes_sent": self.bytes_sent_for(tensors) + inside,
            "coding_s": coded - start,
            "comm_s": time.perf_counter() - coded,
        }
        return result

    @abstractmethod
    def send_receive(self, tensors: list[torch.Tensor], name: str, ctx: Any) -> torch.Tensor:
        """Exchange compressed tensors and return the aggregated dense result."""

    def bytes_sent_for(self, tensors: list[torch.Tensor]) -> int:
        """The bytes this rank sends to exchange `tensors`: each peer gets each once (an
        all-gather's or a broadcast's count, as the sparse all-reduces count theirs)."""
        return sum(t.numel() * t.element_size() for t in tensors) * (self.world_size - 1)

    def set_density(self, density: float) -> None:
        """Set the compressor's compress_ratio (top-k, random-k, DGC); ValueError for a
        compressor without one."""
        _check_density(density)
        if not hasattr(self.compressor, "compress_ratio"):
            raise ValueError(
                f"{type(self).__name__} with {type(self.compressor).__name__} has "
                "no density to set; use a sparse all-reduce or a top-k, random-k or "
                "DGC compressor"
            )
        self.compressor.compress_ratio = density


def _holds_tensors(state: Any) -> bool:
    """Whether a state (nested dicts, lists and tuples) holds a tensor with entries."""
    if isinstance(state, torch.Tensor):
        return state.numel() > 0
    if isinstance(state, dict):
        return any(_holds_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_tensors(v) for v in state)
    return False


def _state_of(part: Any) -> dict[str, Any]:
    state = getattr(part, "state_dict", None)
    return state() if callable(state) else {}


class SparseAllreduce(Synchronizer):
    """Base of the sparse all-reduces, the peers of GRACE's communicators: they select entries
    themselves while they communicate, so there is no compressor, and the residual is decided
    by communication. One density (`density`, set_density: the steady state), an optional
    density warm-up (set_density_warmup: DGC's stages over each name's first steps, see
    spardl_grace.warmup), an optional floor on the entries a tensor sends (set_min_entries)
    and, in CodedAllreduce, one step counter per name.

    Subclasses implement reduce(compensated_flat, name) -> (result_flat, residual_flat), where
    result is the average applied by every worker and residual is what this worker keeps. The
    invariant they promise (conservation) is
        sum_w compensated_w == P * result + sum_w residual_w      (up to float rounding)."""

    def __init__(self, memory: Memory, transport: Transport | int | None, density: float):
        if not callable(getattr(memory, "store_residual", None)):
            raise ValueError(
                f"{type(self).__name__} decides the residual during communication and hands it "
                f"to the memory's store_residual(name, residual, result), which "
                f"{type(memory).__name__} lacks: use memory 'global_residual', 'residual' or "
                "'none', or give yours that method"
            )
        super().__init__(memory, transport)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density (compress_ratio) must be in (0, 1], got {density}")
        self.density = float(density)
        self.density_warmup_steps = 0
        self.density_warmup_start = DEFAULT_WARMUP_START
        self.min_entries = 0

    def set_density(self, density: float) -> None:
        """Send this fraction of the entries from the next step on, after any warm-up (the
        warm-up's stages are those above it)."""
        _check_density(density)
        self.density = float(density)

    def set_density_warmup(self, steps: int, start: float = DEFAULT_WARMUP_START) -> None:
        """Warm the density up over each name's first `steps` steps: DGC's stages start,
        start/4, ... above the density, then the density itself (0 steps: none). Every rank
        must set the same (the ranks' agreement checks it)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"density warm-up steps must be an int >= 0, got {steps!r}")
        _check_density(start)
        self.density_warmup_steps = steps
        self.density_warmup_start = float(start)

    def set_min_entries(self, entries: int) -> None:
        """Send at least about `entries` entries of every tensor a step, all of a smaller
        one (0: no floor): the density of a tensor of n entries is at least
        min(1, (entries + 0.5) / n), rounded as the algorithm rounds any density. At density
        0.01 a model of 18K parameters would send 184 entries a step, each entry about once
        in 100 steps; the default's 2,048 entries are about a round trip's worth of bytes on
        a 100 Mbit link, and the floor leaves a large tensor's density alone. Every rank must
        set the same (the ranks' agreement checks it)."""
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise ValueError(f"min_entries must be an int >= 0, got {entries!r}")
        self.min_entries = entries

    def density_at(self, step: int, numel: int = 0) -> float:
        """The density a name's step `step` (0 first) sends: the warm-up's stage, then the
        density; for a tensor of `numel` entries (0: not known), at least min_entries'."""
        density = warmup_density(
            step, self.density_warmup_steps, self.density_warmup_start, self.density
        )
        if self.min_entries and numel:
            # The half entry keeps floor(numel * density) at min_entries despite rounding.
            density = max(density, min(1.0, (self.min_entries + 0.5) / numel))
        return density

    def synchronize(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Check that the ranks agree on `name`, compensate (into the algorithm's own buffer
        where it offers one), run the sparse all-reduce, and hand the memory the residual the
        all-reduce left. Returns the result, shaped like `tensor`."""
        compensated = self.agreed_compensation(tensor, name)
        result, residual = self.reduce(compensated.reshape(-1), name)
        result = result.view(tensor.shape)
        self.memory.store_residual(name, residual.view(tensor.shape), result)
        return result

    def agreed_compensation(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Check that the ranks agree on `name`, then `tensor` compensated by the memory, written
        into the algorithm's own buffer where it offers one (compensation_buffer)."""
        self.agree(tensor, name)
        buffer = self.compensation_buffer(tensor, name)
        if buffer is None:
            return self.memory.compensate(tensor, name)
        return self.memory.compensate_into(tensor, name, buffer.view(tensor.shape))

    def compensation_buffer(self, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
        """A flat buffer of tensor.numel() entries for the memory to write this step's
        compensated gradient into, when reduce() would otherwise copy it into a buffer of its
        own (saving that pass); None: the memory returns a tensor of its choice."""
        return None

    @abstractmethod
    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Synchronise a flat compensated tensor; return (averaged result, new residual)."""
