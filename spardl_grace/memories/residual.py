"""'residual': classic error feedback, A = beta * R + gamma * g and R' = A - decompress(sent).
'global_residual': the same store fed by a sparse all-reduce with the residual it computed
after communication (for SparDL, Global Residual Collection: what was dropped anywhere on the
way, including other workers' contributions this worker absorbed).

Residuals are kept in float32 (or float64) even for half-precision gradients, so small
corrections are not rounded away; compensate returns the wider dtype.

With a sparse all-reduce, two of DGC's techniques (Lin et al., "Deep Gradient Compression")
are options of this memory:

* momentum correction m: the worker keeps a velocity u per name, u <- m*u + g, and the sparse
  all-reduce synchronises R + u instead of R + g. After the step, momentum factor masking
  clears u wherever the applied result is non-zero (the entries every rank just applied), so
  stale momentum does not push an entry that was already updated (momentum_masking=False
  keeps the velocity: then at density 1 it is synchronous SGD with momentum exactly, where with
  masking it is SGD without momentum, and an entry sent every step moves 1 - m as far as
  momentum would move it). A dense synchronisation ('auto's dense candidates) applies every
  entry in full, with nothing delayed for masking to guard against, so there the velocity is
  kept whatever momentum_masking says (keep_velocity): dense steps are synchronous SGD with
  momentum (exactly so without weight decay, which the optimizer applies as wd / (1 - m)),
  not SGD without it. The optimizer then runs
  without its own momentum: DistributedOptimizer and the DDP hook take an SGD's momentum m over
  for each step (spardl_grace.momentum). With nesterov, R + g + m*u is synchronised instead
  (DGC's Nesterov variant).
  Conserved every step: sum_w (R_w + m*u_w + g_w) == P * result + sum_w R'_w, exactly the
  sparse all-reduce's own invariant with g replaced by the new velocity. Through the velocity
  a gradient enters again in later steps (m*g, m^2*g, ...), as momentum does; masking stops
  that at the entries just applied, and touches nothing the identity counts. Without masking
  nothing stops it, so every gradient is applied 1/(1 - m) times over, as momentum applies it.
* local gradient clipping c: each worker clips its gradient to L2 norm c / sqrt(P) before it
  enters the velocity, so the sum over P workers is bounded by about c, as a clip of the
  averaged gradient to c would bound it.
"""

from __future__ import annotations

import math

import torch

from ..api import Memory, communication_dtype
from ..buffers import BufferPool


class ResidualMemory(Memory):
    """GRACE's 'residual' memory: A = beta * R + gamma * g, R' = A - what was sent; with
    momentum_correction, momentum_masking and local_clip_norm, DGC's techniques for the sparse
    all-reduces (module docstring)."""

    def __init__(
        self,
        beta: float = 1.0,
        gamma: float = 1.0,
        momentum_correction: float = 0.0,
        local_clip_norm: float | None = None,
        momentum_masking: bool = True,
    ):
        super().__init__()
        self.beta = beta
        self.gamma = gamma
        self.momentum_correction = momentum_correction
        self.momentum_masking = momentum_masking
        #: DGC's Nesterov variant: accumulate g + m * u instead of u (DistributedOptimizer sets
        #: it for an SGD with nesterov=True whose momentum it takes over)
        self.nesterov = False
        self.local_clip_norm = local_clip_norm
        self._keep_velocity = False
        self.residuals: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}
        self._new_velocity: dict[str, torch.Tensor] = {}
        self._pool = BufferPool()

    def compensate(self, tensor, name):
        return self._compensate(tensor, name, None)

    def compensate_into(self, tensor, name, out):
        return self._compensate(tensor, name, out)

    def _compensate(
        self, tensor: torch.Tensor, name: str, out: torch.Tensor | None
    ) -> torch.Tensor:
        tensor = tensor.to(communication_dtype(tensor.dtype))
        if self.local_clip_norm is not None:
            tensor = self._clip(tensor, self.local_clip_norm)
        if self.momentum_correction:
            velocity = self.velocities.get(name)
            if velocity is not None:
                self._check_shape("velocity", name, velocity, tensor)
                velocity = torch.add(tensor, velocity, alpha=self.momentum_correction)
            else:
                # A copy: kept whole (no masking), it must not share the caller's gradient,
                # which DDP's bucket buffers and in-place loops write again next step.
                velocity = tensor.clone()
            self._new_velocity[name] = velocity
            tensor = (
                torch.add(tensor, velocity, alpha=self.momentum_correction)
                if self.nesterov
                else velocity
            )
        residual = self.residuals.get(name)
        if residual is None:
            compensated = tensor if self.gamma == 1.0 else self.gamma * tensor
        elif self.beta == 1.0 and self.gamma == 1.0:
            self._check_shape("residual", name, residual, tensor)
            dtype = torch.result_type(residual, tensor)
            if out is None or out.dtype != dtype:
                # A buffer released by an earlier step: no gradient-sized allocation.
                out = self._pool.take(
                    f"compensated.{name}", tensor.numel(), dtype, tensor.device
                ).view(tensor.shape)
            return torch.add(residual, tensor, out=out)  # one pass instead of three
        else:
            self._check_shape("residual", name, residual, tensor)
            compensated = self.beta * residual + self.gamma * tensor
        if out is None or out.dtype != compensated.dtype:
            return compensated
        return out.copy_(compensated)

    @staticmethod
    def _check_shape(what: str, name: str, kept: torch.Tensor, tensor: torch.Tensor) -> None:
        if kept.shape != tensor.shape:
            raise ValueError(
                f"{what} for '{name}' has shape {tuple(kept.shape)}, the gradient "
                f"{tuple(tensor.shape)}: one name must always carry the same tensor"
            )

    def _clip(self, tensor: torch.Tensor, clip_norm: float) -> torch.Tensor:
        size = self.transport.size if self.transport is not None else 1
        bound = clip_norm / math.sqrt(size)
        norm = torch.linalg.vector_norm(tensor)
        # A tensor-valued factor keeps the clip free of a device-to-host sync.
        return tensor * torch.clamp(bound / (norm + 1e-12), max=1.0)

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        self.residuals[name] = tensor - compressor.decompress(tensor_compressed, ctx)

    def keep_velocity(self, keep: bool) -> None:
        """Whether the results handed to store_residual from now on are dense (every entry
        applied in full): then the velocity is kept, not masked. 'auto' sets it on each switch
        between its dense candidates and SparDL; every rank switches at the same step."""
        self._keep_velocity = bool(keep)

    def store_residual(self, name, residual, result=None):
        self.residuals[name] = residual
        velocity = self._new_velocity.pop(name, None)
        if velocity is None:
            return
        if self.momentum_masking and not self._keep_velocity:
            if result is None:
                raise ValueError(
                    "momentum correction masks the velocity where the result was "
                    "applied: store_residual needs the result"
                )
            velocity = velocity.masked_fill(result != 0, 0)
        self.velocities[name] = velocity

    def stores(self):
        return [self.residuals, self.velocities]

    def state_dict(self):
        return {"residuals": dict(self.residuals), "velocities": dict(self.velocities)}

    def load_state_dict(self, state):
        self.residuals = dict(state.get("residuals", {}))
        self.velocities = dict(state.get("velocities", {}))


class GlobalResidualMemory(ResidualMemory):
    """'global_residual': the residual store of the sparse all-reduces, fed after
    communication with what the all-reduce left (SparDL's Global Residual Collection)."""

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        raise ValueError(
            "memory 'global_residual' collects residuals after communication and works "
            "with the sparse all-reduce communicators (spardl, topka, topkdsa, gtopk, "
            "oktopk); use memory 'residual' with communicator allgather/allreduce"
        )
