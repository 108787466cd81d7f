"""The common base of the sparse all-reduces that code their messages."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from ..api import Memory, SparseAllreduce
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

    def reduce(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.next_step(name)
        ex = Exchange(self.transport, f"{name}.{step}", self.PHASES, self.codec)
        if tensor.numel() == 0:
            result, residual = tensor.clone(), tensor.clone()
        else:
            result, residual = self.sparse_allreduce(tensor, name, step, ex)
        self.last_stats = ex.stats.as_dict()
        return result, residual

    @abstractmethod
    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the algorithm on the non-empty flat compensated `tensor` (step `step`
        of `name`): (the average every rank applies, this rank's new residual), exchanged
        through `ex`."""

    def zeros_for_result(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like the flat `like`, for this step's result of `name`: a new tensor, or,
        with `reuse_results`, the buffer of the previous step's result of `name`, zeroed again
        (cheaper than a fresh gradient-sized allocation, whose first touch costs page faults)."""
        if not self.reuse_results:
            return torch.zeros_like(like)
        return self.scratch.get(f"result.{name}", like.numel(), like.dtype, like.device).zero_()

    def next_step(self, name: str) -> int:
        """This call's step number for `name` (0 first), advancing the counter."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    def _own_state(self) -> dict[str, Any]:
        return {"steps": dict(self._steps)}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._steps = dict(state.get("steps", {}))
