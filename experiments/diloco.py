"""DiLoCo (Douillard et al., 2023), the low-communication baseline for language models: each
worker takes H steps of its own optimiser (the inner AdamW) on its own data with no
communication, then the workers average their displacement from the last global model (the
outer gradient, one dense all-reduce of the parameters) and an outer SGD with Nesterov
momentum (by default lr 0.7, momentum 0.9, the paper's) moves the global model, which every
worker then continues from: with lr 1 and no momentum, plain parameter averaging. Bytes: one
ring all-reduce of the fp32 parameters every H steps.

With an outer density (SparseLoCo's idea, Sarfi et al., 2025), the outer gradient is averaged
by SparDL on the compact wire with global residuals (error feedback) instead of the dense
all-reduce: each outer step sends the largest entries of the displacements plus what earlier
outer steps left behind.
"""
from __future__ import annotations

from typing import Any

import torch

from spardl_grace.transport.counting import ring_allreduce_bytes

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


class DiLoCoSync:
    """DiLoCo behind the training CLI's sync interface (model, optimizer, synchronize, step,
    bytes_sent, last_stats, state). Needs torch.distributed (the self-launched workers or
    torchrun). The run's models are identical after each outer step, and only then.
    outer_lr, outer_momentum: the outer SGD's (Nesterov when the momentum is not 0);
    outer_density: SparDL's density for the outer gradient (None: the dense all-reduce), over
    `transport` (the library's, needed then), with `min_entries` as its floor (None: the
    library's default)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, period: int,
                 outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
                 outer_density: float | None = None, transport: Any = None,
                 min_entries: int | None = None):
        import torch.distributed as dist

        if period < 1:
            raise ValueError(f"DiLoCo's period H must be >= 1, got {period}")
        if not dist.is_initialized():
            raise RuntimeError("diloco all-reduces with torch.distributed: self-launched "
                               "workers (--nworkers >= 2) or torchrun, not threads or Horovod")
        self.model, self.optimizer, self.period = model, optimizer, period
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world = dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.steps = 0
        self._dense_bytes = 0
        self.last_stats: dict[str, float] = {}
        self.sparse = None
        if outer_density is not None:
            import spardl_grace
            from spardl_grace.transport import CountingTransport

            if transport is None:
                raise ValueError("a sparse outer step needs the library's transport")
            self.counting = CountingTransport(transport)
            self.sparse = spardl_grace.grace_from_params(
                {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
                 "compress_ratio": outer_density, "wire": "compact",
                 **({} if min_entries is None else {"min_entries": min_entries})}, self.counting)

    @property
    def bytes_sent(self) -> int:
        """Bytes this worker sent so far: the dense all-reduces' or SparDL's."""
        return self.counting.bytes_sent if self.sparse is not None else self._dense_bytes

    def synchronize(self) -> None:
        """Nothing to do: the inner steps use this worker's own gradient."""

    def step(self) -> None:
        """The inner step; every `period` steps also the outer one."""
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> None:
        import torch.distributed as dist

        delta = torch.cat([(g - p).reshape(-1) for g, p in zip(self.global_params, self.params)])
        if self.sparse is not None:
            delta = self.sparse.step(delta, "diloco.outer")
            self.last_stats = dict(self.sparse.last_stats)
        else:
            dist.all_reduce(delta)
            delta.div_(self.world)
            self._dense_bytes += ring_allreduce_bytes(4 * self.numel, self.world)
        offset = 0
        for g in self.global_params:
            g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer.step()
        for g, p in zip(self.global_params, self.params):
            p.copy_(g)

    def set_density(self, density: float) -> None:
        raise ValueError("diloco has no density to warm up")

    def residual_norm(self) -> float:
        return 0.0

    def compression_state(self) -> None:
        """None: the outer state is not checkpointed, so the trainer refuses --resume."""
        return None
