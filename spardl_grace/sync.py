"""Bucketed gradient synchronisation: what DistributedOptimizer and the DDP comm hook share.

A bucket is a flat buffer holding the gradients of some parameters back to back. It is
synchronised under a key derived from the names of its parameters, while the memory's
per-name stores (residuals, velocities) are kept *per parameter* between steps: before a
bucket is synchronised its parameters' entries are concatenated under the bucket's key, and
afterwards split back. So error feedback survives any change of bucketing (DDP rebuilds its
buckets after the first iteration; a user may change the bucket size between a checkpoint and
the resumed run), and the two integrations write the same checkpoint.

Per-bucket state that is not a tensor per entry (step counters, Ok-Topk thresholds and
regions) stays under the bucket key; after a rebuild it starts afresh, which the algorithms
handle as on their first step.

GRACE's communicators (allreduce, allgather, broadcast with a GRACE compressor) compress each
parameter's gradient on its own, in the parameter's shape, under the parameter's name, as
GRACE does inside Horovod: PowerSGD needs the matrix, QSGD's norm and one-bit's scale are a
tensor's, top-k selects per tensor. The sparse all-reduces take the bucket whole (SparDL
balances its selection over all of it).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .agreement import agree_holding_own_state
from .api import (
    Communicator,
    Memory,
    Synchronizer,
    communication_dtype,
    communication_thread,
)
from .comm_thread import fail, fulfil, future_for
from .communicators.dense import Dense
from .memories.none import NoneMemory
from .transport.base import QueuedOp, TransportTimeout, timeout_at_most

T = TypeVar("T")

#: how long the first synchronisation of a bucket in a process waits for the other ranks
FIRST_STEP_TIMEOUT_S = 60.0

#: the name segments of modules that wrap another (torch.compile's OptimizedModule, activation
#: checkpointing's CheckpointWrapper, FSDP1's wrapper): torch's own state dicts leave them out
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def stable_name(name: str) -> str:
    """`name` (from named_parameters()) without the segments of wrapping modules, so the
    residuals a checkpoint keys by it resume whether or not the model is compiled or wrapped."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class Bucket:
    """The parameters (by stable name) whose gradients lie back to back in a flat buffer."""

    names: tuple[str, ...]
    numels: tuple[int, ...]

    def __post_init__(self):
        if len(self.names) != len(self.numels) or not self.names:
            raise ValueError("a bucket needs one numel per parameter name, and at least one")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"parameter names in a bucket must be unique: {self.names}")

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def key(self) -> str:
        """Stable across processes and runs: the first name, the count and a digest of all."""
        digest = hashlib.sha1("\0".join(self.names).encode()).hexdigest()[:10]
        return f"bucket[{self.names[0]}+{len(self.names) - 1}]{digest}"


def _back_to_back(parts: list[torch.Tensor | None], numels: tuple[int, ...]) -> torch.Tensor | None:
    """One flat view over `parts` if they already lie back to back in one storage (as the
    previous step's split of a bucket leaves them), so the bucket's entries need no copy;
    None otherwise."""
    first = parts[0]
    if first is None or not first.is_contiguous():
        return None
    step = first.element_size()
    address = first.data_ptr()
    for part, numel in zip(parts, numels):
        if (
            part is None
            or part.numel() != numel
            or not part.is_contiguous()
            or part.dtype != first.dtype
            or part.device != first.device
            or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or part.data_ptr() != address
        ):
            return None
        address += numel * step
    return first.as_strided((sum(numels),), (1,))


class _Outcome:
    keep = True


def stores_of(memory: Memory) -> list[dict[str, torch.Tensor]]:
    """The memory's per-name stores (Memory.stores); none for a GRACE user's own memory
    without stores(), whose entries stay under the key it was stepped with."""
    stores = getattr(memory, "stores", None)
    return stores() if callable(stores) else []


@contextmanager
def per_parameter_stores(memory: Memory, bucket: Bucket) -> Iterator[_Outcome]:
    """Within the block, the memory's stores hold the bucket's entries under bucket.key;
    afterwards, under each parameter's name (flat, numel entries each; views of the bucket's
    tensor, so the next step finds them back to back and needs no copy). If the block fails or
    sets `keep = False` on what it is given, the entries from before the block are put back:
    memories replace their entries and never change them in place, so those are intact."""
    saved = []
    for store in stores_of(memory):
        parts = [store.pop(name, None) for name in bucket.names]
        saved.append((store, parts))
        present = next((p for p in parts if p is not None), None)
        if present is not None:
            whole = _back_to_back(parts, bucket.numels)
            store[bucket.key] = (
                whole
                if whole is not None
                else torch.cat(
                    [
                        (p if p is not None else present.new_zeros(n)).reshape(-1)
                        for p, n in zip(parts, bucket.numels)
                    ]
                )
            )
    outcome = _Outcome()
    try:
        yield outcome
    except BaseException:
        outcome.keep = False
        raise
    finally:
        for store, parts in saved:
            whole = store.pop(bucket.key, None)
            if outcome.keep and whole is not None:
                store.update(zip(bucket.names, torch.split(whole.reshape(-1), list(bucket.numels))))
            elif not outcome.keep:
                store.update((n, p) for n, p in zip(bucket.names, parts) if p is not None)


@contextmanager
def set_aside(memory: Memory, names: Collection[str]) -> Iterator[None]:
    """Within the block the memory's stores hold nothing under `names` (their residuals and
    velocities set aside, so this rank sends none of them); afterwards the set-aside entries
    are back, and whatever the block left under those names is dropped."""
    if not names:
        yield
        return
    saved = [(store, {n: store.pop(n) for n in names if n in store}) for store in stores_of(memory)]
    try:
        yield
    finally:
        for store, parts in saved:
            for name in names:
                store.pop(name, None)
            store.update(parts)


@contextmanager
def put_back_unless_kept(memory: Memory, names: tuple[str, ...]) -> Iterator[_Outcome]:
    """Within the block the memory works on each of `names` under its own name; when the block
    sets `keep = False` on what it is given (or raises), every one of their entries from
    before it is put back (memories replace their entries and never change them in place)."""
    saved = [(store, {n: store.get(n) for n in names}) for store in stores_of(memory)]
    outcome = _Outcome()
    try:
        yield outcome
    except BaseException:
        outcome.keep = False
        raise
    finally:
        if not outcome.keep:
            for store, parts in saved:
                for name, part in parts.items():
                    if part is None:
                        store.pop(name, None)
                    else:
                        store[name] = part


def settle(future: torch.futures.Future) -> None:
    """Wait until `future` is complete, without raising the error it may hold: whoever holds
    the future gets that error when they wait on it."""
    try:
        future.wait()
    except BaseException:
        return


def check_dense_path_keeps_momentum(
    momentum_correction: float, dense_warmup_steps: int, min_numel: int
) -> None:
    """ValueError for momentum correction beside a dense path: the momentum lives in the
    memory, and dense steps (dense_warmup_steps) and dense buckets (min_numel) bypass it, so
    they would train without any momentum (the optimizer's must be off)."""
    if momentum_correction and (dense_warmup_steps or min_numel):
        raise ValueError(
            f"momentum correction ({momentum_correction}) keeps the momentum in the memory, "
            f"which dense steps and dense buckets bypass: with dense_warmup_steps="
            f"{dense_warmup_steps} and min_numel={min_numel} they would train without "
            "momentum: leave dense_warmup_steps at 0 and min_numel at 0, and warm up with the "
            "density instead (grace_from_params' 'density_warmup_steps', whose stages keep the "
            "momentum; 'auto' needs no warm-up: its measured dense steps keep it)"
        )


class GradientSync:
    """Synchronises the buckets of one model with a grace communicator: the asynchronous core
    that DistributedOptimizer and the DDP hook share.

    submit(flat, bucket) returns a torch.futures.Future at once and a communication thread
    synchronises the buckets one after another in the order they were submitted (the same on
    every rank), so the caller's backward pass goes on meanwhile. Once a bucket fails, the
    step's later buckets fail with the same error at once instead of each waiting out the
    transport's timeout. end_step() waits for the step's buckets and closes the step.

    The first time a bucket is synchronised, the ranks check that they hold the same
    parameters with the same sizes in it (one small collective; ValueError on every rank
    otherwise), as the communicator checks the rest (spardl_grace.agreement).

    A step whose result is not finite (an fp16 overflow that a GradScaler will skip, a NaN
    batch) leaves the memory as it was, instead of poisoning the residuals for good.
    dense_warmup_steps: the first steps are plain dense averages (no selection, residuals
    untouched), as DGC-style warm-up. min_numel: buckets smaller than this are always sent
    dense (a few tiny tensors do not repay selection and headers). first_step_timeout: the
    first synchronisation of each bucket in this process (the first step after a start or
    restart) waits at most this long (FIRST_STEP_TIMEOUT_S, 60 s) for the other ranks to join
    its layout check, rather than the transport's timeout, so a step that only some ranks take
    fails fast on those ranks (TransportTimeout naming the bucket). overlap: synchronise on a
    communication thread (off, or with an MPI library without MPI_THREAD_MULTIPLE, submit()
    synchronises before it returns a completed future).

    A step in which every bucket is a plain dense average (the dense warm-up, or the 'dense'
    communicator with a memory that keeps nothing) does not use the thread where the transport
    queues collectives (torch.distributed): each bucket's all-reduce is queued in the backend
    as soon as it is submitted, in place of the bucket, and the backend runs them back to back
    while backward goes on, as DDP's own all-reduces do. Only whole steps are queued: queued
    operations and the thread's could interleave differently on different ranks. The results
    are the same bits either way; a queued step's comm_s is not measured (0)."""

    def __init__(
        self,
        grace: Synchronizer,
        dense_warmup_steps: int = 0,
        min_numel: int = 0,
        overlap: bool = True,
        thread_name: str = "spardl-comm",
        first_step_timeout: float = FIRST_STEP_TIMEOUT_S,
        parameter_names: Collection[str] = (),
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ):
        if not isinstance(grace, Synchronizer):
            raise TypeError(
                f"grace must be a spardl_grace Synchronizer (from grace_from_params(...)), "
                f"got {type(grace).__name__}"
            )
        for what, value in (("dense_warmup_steps", dense_warmup_steps), ("min_numel", min_numel)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} must be an int >= 0, got {value!r}")
        if isinstance(first_step_timeout, bool) or not (
            isinstance(first_step_timeout, (int, float)) and first_step_timeout > 0
        ):
            raise ValueError(f"first_step_timeout must be > 0 seconds, got {first_step_timeout!r}")
        self.first_step_timeout = float(first_step_timeout)
        check_dense_path_keeps_momentum(
            getattr(grace.memory, "momentum_correction", 0.0),
            max(dense_warmup_steps, grace.dense_warmup_steps),
            min_numel,
        )
        self.grace = grace
        grace.reuse_results = True  # each result is copied into the gradients before the next step
        self.dense = Dense(NoneMemory(), grace.transport)
        if dense_warmup_steps and grace.dense_warmup_steps not in (0, dense_warmup_steps):
            raise ValueError(
                f"dense_warmup_steps={dense_warmup_steps} here and 'dense_warmup_steps': "
                f"{grace.dense_warmup_steps} in the communicator's params: give one of them"
            )
        # The steps before an Adam's variance freezes are the dense ones that estimate it.
        self.dense_warmup_steps = max(
            dense_warmup_steps, grace.dense_warmup_steps, grace.adam_freeze_step
        )
        self.min_numel = min_numel
        self.parameter_names = frozenset(parameter_names)
        #: each parameter's shape, by name, in which a GRACE communicator compresses it
        self.shapes = dict(shapes or {})
        self.steps = 0
        #: whether the last finished step synchronised every bucket sparsely with a finite
        #: result (False when a bucket went dense, whose result is not checked)
        self.last_step_finite = False
        self._step_finite = True
        self._agreed: set[Bucket] = set()
        #: the last step's statistics (bytes, entries, seconds), summed over its buckets
        self.last_stats: dict[str, float] = {}
        self._step_stats: dict[str, float] = {}
        # Without a thread, buckets are synchronised where they become ready.
        self._executor = communication_thread(grace.transport, thread_name) if overlap else None
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        self._queued: list[tuple[QueuedOp, torch.futures.Future[torch.Tensor]]] = []
        self._settling = threading.Lock()  # a queued op's callback and wait_queued() race
        self._step_error: BaseException | None = None

    @property
    def asynchronous(self) -> bool:
        """Whether submit() returns before the bucket is synchronised (a communication thread)."""
        return self._executor is not None

    def submit(
        self, flat: torch.Tensor, bucket: Bucket, idle: tuple[str, ...] = ()
    ) -> torch.futures.Future[torch.Tensor]:
        """Synchronise `flat` (the bucket's gradients) as synchronize() does, on the
        communication thread, or with its all-reduce queued in the backend in a step of plain
        dense averages (see the class docstring): the future is pending until the result is
        there, and holds synchronize()'s exception if it fails. Every rank must submit the
        same buckets in the same order within a step, then call end_step()."""
        queueing = self._queueing()
        # A queued all-reduce's own future orders its result against the waiter's streams.
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future() if queueing is not None else future_for(flat)
        )
        self._pending.append(future)
        if queueing is not None:
            self._queue(queueing, flat, bucket, future)
        elif self._executor is None:
            fulfil(future, self._in_step, self.synchronize, flat, bucket, idle)
        else:
            self._executor.submit(future, flat, self._in_step, self.synchronize, flat, bucket, idle)
        return future

    def _queueing(self) -> Dense | None:
        """The dense communicator whose all-reduces this step queues in the backend, if every
        bucket of the step is a plain dense average and the transport queues collectives
        (see the class docstring); None: the step runs on the thread."""
        if self._executor is None or not self.grace.transport.queues_collectives:
            return None
        if self.steps < self.dense_warmup_steps:
            return self.dense
        if isinstance(self.grace, Dense) and self.grace.can_queue:
            return self.grace
        return None

    def _queue(
        self,
        dense: Dense,
        flat: torch.Tensor,
        bucket: Bucket,
        future: torch.futures.Future[torch.Tensor],
    ) -> None:
        """Queue the bucket's all-reduce (in place of `flat` where it has the communication
        dtype); `future` gets the average, or the error, as the thread would give it."""
        self._step_finite = False
        try:
            queued = self._in_step(self._queue_bucket, dense, flat, bucket)
        except BaseException as exc:
            fail(future, exc)
            return
        self._add_stats(dense.last_stats)
        self._queued.append((queued, future))
        queued.future.add_done_callback(functools.partial(self._settle_queued, future))

    def _queue_bucket(self, dense: Dense, flat: torch.Tensor, bucket: Bucket) -> QueuedOp:
        self._check_bucket(flat, bucket)
        return dense.queue(flat.to(communication_dtype(flat.dtype)), bucket.key)

    def _settle_queued(
        self, future: torch.futures.Future[torch.Tensor], done: torch.futures.Future
    ) -> None:
        with self._settling:
            if future.done():
                return
            try:
                future.set_result(done.value())
            except BaseException as exc:
                fail(future, exc)

    def wait_queued(self) -> None:
        """Wait, within the transport's timeout, for the all-reduces this step queued: one
        that fails or times out fails its future (TransportTimeout, TransportError) and the
        step, so a dead peer never leaves a queued bucket pending forever."""
        queued, self._queued = self._queued, []
        for op, future in queued:
            try:
                op.wait()
            except BaseException as exc:
                self._step_error = self._step_error or exc
                with self._settling:
                    if not future.done():
                        fail(future, exc)

    def _in_step(self, run: Callable[..., T], *args: Any) -> T:
        """run(*args) as part of the step: failing at once with the step's error when an
        earlier bucket of the step failed, and recording its own failure as the step's."""
        if self._step_error is not None:
            raise self._step_error
        try:
            return run(*args)
        except BaseException as exc:
            self._step_error = exc
            raise

    def is_dense(self, bucket: Bucket) -> bool:
        """Whether `bucket` is synchronised dense this step: during the dense warm-up, or when it
        holds fewer than min_numel entries."""
        return self.steps < self.dense_warmup_steps or bucket.numel < self.min_numel

    def synchronize(
        self, flat: torch.Tensor, bucket: Bucket, idle: tuple[str, ...] = ()
    ) -> torch.Tensor:
        """The average over ranks of `flat` (the bucket's gradients), identical on every rank,
        in communication_dtype(flat.dtype). Every rank must call it for the same buckets in
        the same order. `idle`: the bucket's parameters this rank computed no gradient for
        (their entries in `flat` are zeros): this rank sends nothing of theirs and keeps their
        memory as it was, so what their residual would have sent is not lost where nothing
        applies the result (DDP leaves a parameter no rank used untouched)."""
        self._check_bucket(flat, bucket)
        flat = flat.to(communication_dtype(flat.dtype))
        # A communication thread starts on CUDA device 0, not on the device the rank chose.
        with (
            torch.cuda.device(flat.device) if flat.is_cuda else nullcontext(),
            set_aside(self.grace.memory, idle),
        ):
            if self.is_dense(bucket):
                result = self.dense.step(flat, bucket.key)
                self._add_stats(self.dense.last_stats)
                self._step_finite = False
                return result
            if isinstance(self.grace, Communicator):
                return self._each_parameter(flat, bucket)
            with per_parameter_stores(self.grace.memory, bucket) as outcome:
                result = self.grace.step(flat, bucket.key)
                # The result is identical on every rank, so all ranks decide alike, unasked.
                outcome.keep = self.grace.result_is_finite(result, bucket.key)
            self._step_finite = self._step_finite and outcome.keep
            self._add_stats(self.grace.last_stats)
            return result

    def _each_parameter(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """A GRACE communicator's step on each of the bucket's parameters, in its shape (a
        name without one: flat) and under its name (see the module docstring); the results
        back to back. A result that is not finite puts back every parameter's memory."""
        results = []
        with put_back_unless_kept(self.grace.memory, bucket.names) as outcome:
            for name, part in zip(bucket.names, torch.split(flat, list(bucket.numels))):
                # A copy in storage of its own: MKL's kernels differ with the alignment of a
                # view into the bucket (PowerSGD's products then drift an ulp from GRACE's
                # loop on p.grad, on AMD CPUs).
                own = part.view(self.shapes.get(name, part.shape)).clone()
                result = self.grace.step(own, name)
                outcome.keep = outcome.keep and self.grace.result_is_finite(result, name)
                self._add_stats(self.grace.last_stats)
                results.append(result.reshape(-1))
        self._step_finite = self._step_finite and outcome.keep
        return torch.cat(results)

    def _check_bucket(self, flat: torch.Tensor, bucket: Bucket) -> None:
        """ValueError if `flat` is not the bucket's flat buffer; the first time in this
        process, the ranks agree on the bucket's layout (the communicator checks its total
        size; the layout inside must match too) and on the step their compression states are
        at, so ranks that resumed different compression states all raise at once."""
        if flat.dim() != 1 or flat.numel() != bucket.numel:
            raise ValueError(
                f"bucket {bucket.key} holds {bucket.numel} entries, "
                f"got a buffer of shape {tuple(flat.shape)}"
            )
        if bucket not in self._agreed:
            transport = self.grace.transport
            try:
                with timeout_at_most(transport, self.first_step_timeout):
                    agree_holding_own_state(
                        transport,
                        f"the layout of bucket {bucket.key}",
                        {
                            "parameters": list(bucket.names),
                            "numels": list(bucket.numels),
                            "compression_state_step": self.steps,
                            # ranks whose dense steps end at different steps would pair a
                            # dense all-reduce with a sparse exchange
                            "dense_warmup_steps": self.dense_warmup_steps,
                            "adam_freeze_step": self.grace.adam_freeze_step,
                            "exchange": self.grace.exchange,
                        },
                        self.grace.state_saved_by,
                    )
            except ValueError as exc:
                if "compression_state_step" not in str(exc):
                    raise
                raise ValueError(
                    f"{exc}. The ranks resumed compression states of different steps (rank 0 "
                    "alone loaded one?): restore every rank's own, or none, or call "
                    "spardl_grace.broadcast_optimizer_state(optimizer, root_rank) after "
                    "loading, which gives fresh ranks root's step"
                ) from exc
            except TransportTimeout as exc:
                raise TransportTimeout(
                    f"rank {transport.rank}: the first synchronisation of bucket {bucket.key} "
                    f"(in this process: after a start or restart) waited "
                    f"{min(transport.timeout, self.first_step_timeout):.0f} s for ranks that "
                    "never joined it. Every rank must take the same steps: a step() or "
                    "synchronize() that only some ranks call (a step on rank 0 alone, before "
                    "broadcasting its state) ends here. A rank that legitimately arrives later "
                    f"needs a larger first_step_timeout ({exc})"
                ) from exc
            self._agreed.add(bucket)

    def _add_stats(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self._step_stats[key] = self._step_stats.get(key, 0) + value

    def end_step(self) -> None:
        """Close the step: wait for its submitted buckets; if all succeeded the step counts
        (steps + 1, its statistics become last_stats), if one failed (its error went to its
        future) the step is dropped and the next one starts afresh."""
        self.wait_queued()
        for future in self._pending:
            settle(future)
        failed = self._step_error is not None
        self._pending, self._step_error = [], None
        finite, self._step_finite = self._step_finite, True
        if failed:
            self._step_stats = {}
            self.last_step_finite = False
            return
        self.steps += 1
        self.last_step_finite = finite
        self.last_stats, self._step_stats = self._step_stats, {}

    def state_dict(self) -> dict[str, Any]:
        """The whole compression state (compressor, memory, communicator, steps); tensors and
        plain values only, so it loads with torch.load(weights_only=True)."""
        return {"grace": self.grace.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict() of the same world size (ValueError otherwise). Residuals saved
        under a wrapped module's names (a compiled model's) are taken under stable_name(); a
        residual of a parameter not among parameter_names raises ValueError (the model's
        parameters were renamed since the save: it would never be sent); whatever raises
        leaves the state as it was. A state saved before residuals were keyed so brings its
        residuals over; its step counters and schedules, keyed by the buckets' old names,
        start afresh."""
        before = (self.grace.state_dict(), self.grace.state_saved_by, self.grace.restored)
        try:
            self.grace.load_state_dict(state["grace"])
            self._check_stored_names()
        except BaseException:
            self.grace.load_state_dict(before[0])
            self.grace.state_saved_by, self.grace.restored = before[1:]
            raise
        self.steps = int(state["steps"])

    def _check_stored_names(self) -> None:
        """Take the memory's entries saved under a wrapped module's names under stable_name();
        ValueError for an entry of a parameter not among parameter_names."""
        for store in stores_of(self.grace.memory):
            for name in [n for n in store if stable_name(n) != n]:
                store[stable_name(name)] = store.pop(name)
            unknown = sorted(set(store) - self.parameter_names) if self.parameter_names else []
            if unknown:
                raise ValueError(
                    f"the compression state holds residuals of {len(unknown)} parameters this "
                    f"model does not have ({', '.join(map(repr, unknown[:4]))}"
                    f"{', ...' if len(unknown) > 4 else ''}): it was saved from a model whose "
                    "parameters had other names, and they would never be sent. Resume the "
                    "model it was saved from, or leave the compression state out"
                )

    def shared_state_dict(self) -> dict[str, Any]:
        """state_dict() without what belongs to this rank alone (Synchronizer.shared_state_dict):
        the step counters and schedules every rank shares."""
        return {"grace": self.grace.shared_state_dict(), "steps": self.steps}

    def load_shared_state_dict(self, shared: dict[str, Any]) -> None:
        """Take another rank's shared_state_dict(), keeping this rank's residuals."""
        self.grace.load_shared_state_dict(shared["grace"])
        self.steps = int(shared["steps"])
