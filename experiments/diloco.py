"""DiLoCo (Douillard et al., 2023), the low-communication baseline for language models: each
worker takes H steps of its own optimiser (the inner AdamW) on its own data with no
communication, then the workers average their displacement from the last global model (the
outer gradient, one dense all-reduce of the parameters) and an outer SGD with Nesterov
momentum (by default lr 0.7, momentum 0.9, the paper's) moves the global model, which every
worker then continues from: with lr 1 and no momentum, plain parameter averaging. Bytes: one ring all-reduce of the fp32 parameters every H steps.
"""
from __future__ import annotations

import torch

from spardl_grace.transport.counting import ring_allreduce_bytes

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


class DiLoCoSync:
    """DiLoCo behind the training CLI's sync interface (model, optimizer, synchronize, step,
    bytes_sent, last_stats, state). Needs torch.distributed (the self-launched workers or
    torchrun). The run's models are identical after each outer step, and only then.
    outer_lr, outer_momentum: the outer SGD's (Nesterov when the momentum is not 0)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, period: int,
                 outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM):
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
        self.bytes_sent = 0
        self.last_stats: dict[str, float] = {}

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
        dist.all_reduce(delta)
        delta.div_(self.world)
        offset = 0
        for g in self.global_params:
            g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer.step()
        for g, p in zip(self.global_params, self.params):
            p.copy_(g)
        self.bytes_sent += ring_allreduce_bytes(4 * self.numel, self.world)

    def set_density(self, density: float) -> None:
        raise ValueError("diloco has no density to warm up")

    def residual_norm(self) -> float:
        return 0.0

    def compression_state(self) -> None:
        """None: the outer state is not checkpointed, so the trainer refuses --resume."""
        return None
