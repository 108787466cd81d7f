"""What a PyTorch user runs instead of this library, as it ships: DistributedDataParallel with
its built-in all-reduce, its fp16 compression hook, its PowerSGD hook, or post-local SGD (its
post_localSGD_hook with PostLocalSGDOptimizer and a PeriodicModelAverager).

    sync = TorchDDPSync(model, optimizer, "torch_powersgd", powersgd_rank=4, start_iter=10)
    loss_fn(sync.model(x), y).backward()       # DDP all-reduces (or compresses) in backward
    sync.step()

Post-local SGD all-reduces gradients like DDP for its first start_iter steps, then trains
locally and averages the parameters every `period` steps. Its hook then all-reduces within a
subgroup; here every worker stands for a machine of its own (the emulated cluster), so that
subgroup is the worker alone and only the averaging crosses the network.

Nothing here re-implements a hook: torch.distributed.algorithms.ddp_comm_hooks are called as
they are. DDP gets one bucket for the whole model unless bucket_cap_mb is given (PowerSGD's hook
fails on gloo with several buckets, "Received data size doesn't match expected size", and one
bucket is also what SparDL gets by default); DDP's own default is 25 MB. Bytes are counted
from what the hooks all-reduce: the whole gradient (fp32, or fp16 with the fp16 hook), or
PowerSGD's own count of the entries it sends (P and Q factors plus the tensors it leaves
uncompressed), each through a ring all-reduce.
"""
from __future__ import annotations

import torch

from spardl_grace.transport.counting import ring_allreduce_bytes

BASELINES = ("torch_ddp", "torch_fp16", "torch_powersgd", "torch_postlocal")
ONE_BUCKET_MB = 1024  # DDP's bucket cap that keeps every model here in one bucket


class TorchDDPSync:
    """DDP with one of torch's own communication choices, behind the trainer's sync interface
    (model, optimizer, step, bytes_sent, stats, state)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str,
                 powersgd_rank: int = 1, start_iter: int = 10, bucket_cap_mb: float | None = None,
                 period: int = 4):
        """`start_iter`: PowerSGD's start_powerSGD_iter, or post-local SGD's start_localSGD_iter
        (its averager's warm-up); `period`: post-local SGD's steps per model averaging."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; valid choices: {', '.join(BASELINES)}")
        if not dist.is_initialized():
            raise RuntimeError(f"{name} is DistributedDataParallel: it needs torch.distributed "
                               "(self-launched workers, torchrun, or mpirun with env://), not "
                               "threads or Horovod")
        self.name = name
        self.world = dist.get_world_size()
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=ONE_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb)
        self.optimizer = optimizer
        self.powersgd = None
        if name == "torch_fp16":
            self.model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        elif name == "torch_powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=start_iter, random_seed=0)
            self.model.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)
        self.averager = None
        if name == "torch_postlocal":
            self.averager, self.optimizer = _post_local_sgd(self.model, optimizer, start_iter, period)
        self.bytes_sent = 0
        self._counted = 0  # PowerSGD's running count of sent entries, at the last step
        self.last_stats: dict[str, float] = {}

    def synchronize(self) -> None:
        """Nothing to do: DDP has all-reduced during backward."""

    def step(self) -> None:
        self.bytes_sent += self._step_bytes()
        self.optimizer.step()

    def _step_bytes(self) -> int:
        if self.averager is not None:
            return self._post_local_bytes()
        if self.name == "torch_fp16":
            return ring_allreduce_bytes(2 * self.numel, self.world)
        state = self.powersgd
        if state is None or state.iter <= state.start_powerSGD_iter:
            # The hook's iteration counter is advanced by the last bucket of each step; up to
            # and including start_powerSGD_iter it runs DDP's vanilla all-reduce.
            return ring_allreduce_bytes(4 * self.numel, self.world)
        sent = state.total_numel_after_compression - self._counted
        self._counted = state.total_numel_after_compression
        return ring_allreduce_bytes(4 * sent, self.world)

    def _post_local_bytes(self) -> int:
        """Gradients all-reduced before start_iter; after it, the parameters on the steps the
        averager averages (the step it is about to take, by its own rule), nothing between."""
        averager = self.averager
        if averager.step < averager.warmup_steps:
            return ring_allreduce_bytes(4 * self.numel, self.world)
        if (averager.step - averager.warmup_steps) % averager.period == 0:
            return ring_allreduce_bytes(4 * self.numel, self.world)
        return 0

    def set_density(self, density: float) -> None:
        raise ValueError(f"{self.name} has no density to warm up")

    def residual_norm(self) -> float:
        """0: PowerSGD's error feedback lives inside torch's hook state, not reported here."""
        return 0.0

    def compression_state(self) -> None:
        """None: torch's hook state (PowerSGD's error feedback and Q) is not checkpointed, so
        the trainer refuses --resume for these baselines."""
        return None


def _post_local_sgd(ddp: torch.nn.parallel.DistributedDataParallel,
                    optimizer: torch.optim.Optimizer, start_iter: int, period: int):
    """Post-local SGD as torch's docs set it up, with a subgroup of one worker each: (the
    averager, the PostLocalSGDOptimizer wrapping `optimizer`)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    if period < 2:
        raise ValueError(f"post-local SGD's period must be >= 2 (1 is plain DDP), got {period}")
    subgroup, _ = dist.new_subgroups(group_size=1)
    ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup,
                                             start_localSGD_iter=start_iter), post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=start_iter)
    return averager, PostLocalSGDOptimizer(optim=optimizer, averager=averager)
