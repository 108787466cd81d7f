"""The common base of the sparse all-reduces that code their messages."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from ..api import Memory, SparseAllreduce, all_finite, communication_dtype
from ..buffers import BufferPool, Scratch
from ..payload import IdentityCodec, PayloadCodec
from ..transport import Transport
from .exchange import Exchange


class CodedAllreduce(SparseAllreduce):
    """A sparse all-reduce whose sparse messages go through a PayloadCodec (identity unless
    given; DeepReduce codecs plug in here), with a per-name step counter that keys shared
    randomness and periodic work, and is part of the checkpointed state. Selection's temporaries
    live in `scratch`, reused from step to step; buffers that leave a step (residuals) come
    from `pool`.

    Working buffer. An algorithm that modifies the compensated gradient as it goes (and hands
    what is left to the memory as the residual) works on a pooled buffer of working_numel(n)
    entries: compensation_buffer() gives the memory its first n entries to write the
    compensated gradient into, and working_copy() returns it, zero-padded, for the step (a
    copy only when the memory wrote elsewhere). The buffer is handed out again once the memory
    has replaced the residual that is a view of it, so no step pays a gradient-sized
    allocation.

    reduce() runs a step: it advances the step counter, creates the step's Exchange (which
    names, counts and times its messages), answers an empty tensor itself, and keeps the
    Exchange's statistics as last_stats; subclasses write sparse_allreduce() against the
    Exchange and declare the phases their statistics report in PHASES."""

    PHASES: tuple[str, ...] = ()

    def __init__(
        self,
        memory: Memory,
        transport: Transport,
        density: float,
        codec: PayloadCodec | None = None,
    ):
        super().__init__(memory, transport, density)
        self.codec = codec or IdentityCodec()
        self._steps: dict[str, int] = {}
        self.scratch = Scratch()  # per-step temporaries of selection, reused
        self.pool = BufferPool()  # gradient-sized buffers handed out, reused once released
        self._prepared: dict[str, torch.Tensor] = {}  # working buffers given to the memory
        # Per name, where the latest result may be non-zero: (its buffer's address, positions).
        self._support: dict[str, tuple[int, torch.Tensor]] = {}

    def fingerprint(self, tensor: torch.Tensor, name: str) -> dict[str, Any]:
        """Synchronizer's fingerprint, and the density this step of `name` sends: ranks that
        are in different stages of the density warm-up raise at once."""
        return {
            **super().fingerprint(tensor, name),
            "step_density": self.density_at(self._steps.get(name, 0), tensor.numel()),
        }

    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        step, ex = self.new_exchange(name)
        if tensor.numel() == 0:
            result, residual = tensor.clone(), tensor.clone()
        else:
            result, residual = self.sparse_allreduce(tensor, name, step, ex)
        self.last_stats = ex.stats.as_dict()
        return result, residual

    def new_exchange(self, name: str) -> tuple[int, Exchange]:
        """This call's step number for `name` (advancing the counter) and the step's Exchange,
        whose messages that step names."""
        step = self.next_step(name)
        return step, Exchange(self.transport, f"{name}.{step}", self.PHASES, self.codec)

    @abstractmethod
    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the algorithm on the non-empty flat compensated `tensor` (step `step`
        of `name`, which sends density_at(step) of the entries): (the average every rank
        applies, this rank's new residual), exchanged through `ex`."""

    def working_numel(self, numel: int) -> int:
        """Length of the working buffer for a tensor of `numel` entries (padding included)."""
        return numel

    def compensation_buffer(self, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
        n = tensor.numel()
        if n == 0:
            return None
        working = self._working_buffer(
            name, self.working_numel(n), communication_dtype(tensor.dtype), tensor.device
        )
        self._prepared[name] = working
        return working[:n]

    def working_copy(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """This step's working buffer for the flat compensated `tensor` of `name`: its
        working_numel() entries start with `tensor`'s and are zero past them. It is the buffer
        compensation_buffer() gave the memory when the memory wrote `tensor` there (no copy),
        else a pooled one `tensor` is copied into; never `tensor` itself otherwise, so the
        caller's gradient is not modified."""
        n = tensor.numel()
        numel = self.working_numel(n)
        working = self._prepared.pop(name, None)
        if (
            working is None
            or working.numel() != numel
            or working.dtype != tensor.dtype
            or working.device != tensor.device
        ):
            working = self._working_buffer(name, numel, tensor.dtype, tensor.device)
        if working.data_ptr() != tensor.data_ptr():  # the memory did not write it in place
            working[:n] = tensor
        working[n:] = 0
        return working

    def _working_buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # Handed to the memory as the residual, so from the pool: the previous step's residual
        # is still held (the memory replaces it after this step), the one before is free again.
        return self.pool.take(f"working.{name}", numel, dtype, device, slots=2)

    def zeros_for_result(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like the flat `like`, for this step's result of `name`, zeroed again in
        a buffer that was used before (cheaper than a fresh gradient-sized allocation, whose
        first touch costs page faults): with `reuse_results`, the previous step's result of
        `name`, where only the positions record_support() named are zeroed again if it was
        called (callers do not write into results they are lent); otherwise a pooled buffer
        that nothing outside the pool holds any more, so a result the caller keeps is never
        overwritten."""
        support = self._support.pop(name, None)
        if not self.reuse_results:
            buffer = self.pool.take(
                f"result.{name}", like.numel(), like.dtype, like.device, slots=2
            )
            return buffer.zero_()
        buffer = self.scratch.get(f"result.{name}", like.numel(), like.dtype, like.device)
        if support is not None and support[0] == buffer.data_ptr():
            return buffer.index_fill_(0, support[1], 0)
        return buffer.zero_()

    def record_support(self, name: str, result: torch.Tensor, positions: torch.Tensor) -> None:
        """Note that this step's `result` of `name` (from zeros_for_result) is zero outside
        `positions`: the next step zeroes only those again, and result_is_finite() looks only
        there."""
        self._support[name] = (result.data_ptr(), positions)

    def result_is_finite(self, result: torch.Tensor, name: str) -> bool:
        support = self._support.get(name)
        if support is None or support[0] != result.data_ptr():
            return all_finite(result)
        return all_finite(result.reshape(-1).index_select(0, support[1]))

    def next_step(self, name: str) -> int:
        """This call's step number for `name` (0 first), advancing the counter."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    def _own_state(self) -> dict[str, Any]:
        return {"steps": dict(self._steps)}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._steps = dict(state.get("steps", {}))
