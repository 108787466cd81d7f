"""The training CLI's synchronisation paths: this library's DistributedOptimizer and DDP hook
(GraceSync, GraceHookSync), and build_sync, which picks the path the arguments ask for among
them, PyTorch's own (testbed.baselines), DiLoCo (experiments.diloco) and FSDP2
(experiments.sharded). Each offers the trainer one interface: synchronize(), step(),
bytes_sent, last_stats, set_density(), the compression state and the residual norm.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from deepreduce_compat import deepreduce_from_params
from experiments import recipe
from experiments.cli import grace_params, is_baseline
from experiments.evaluation import residual_norm


class GraceSync:
    """This library's path: DistributedOptimizer with a grace communicator, bytes counted by
    a CountingTransport (the trainer's sync interface, as testbed.baselines.TorchDDPSync)."""

    def __init__(self, model: torch.nn.Module, optimizer, counting):
        self.model = model
        self.optimizer = optimizer
        self.counting = counting

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def step(self) -> None:
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    @property
    def bytes_sent(self) -> int:
        return self.counting.bytes_sent

    @property
    def last_stats(self) -> dict[str, float]:
        return self.optimizer.last_stats

    def set_density(self, density: float) -> None:
        self.grace.set_density(density)

    def compression_state(self) -> dict[str, Any]:
        return self.optimizer.compression_state_dict()

    def load_compression_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_compression_state_dict(state)

    def residual_norm(self) -> float:
        return residual_norm(self.grace)

    @property
    def grace(self):
        return self.optimizer.grace

class GraceHookSync(GraceSync):
    """This library's algorithm through DistributedDataParallel and spardl_grace.comm_hook:
    DDP synchronises each bucket during backward, as with its own all-reduce."""

    def __init__(self, model: torch.nn.Module, optimizer, counting, grc, bucket_cap_mb: float,
                 overlap: bool = True):
        import spardl_grace
        if not torch.distributed.is_initialized():
            raise RuntimeError("--ddp-hook is DistributedDataParallel: it needs torch.distributed "
                               "(self-launched workers, torchrun, or mpirun with env://), not "
                               "threads or Horovod")
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        super().__init__(ddp, optimizer, counting)
        self.hook = spardl_grace.CommHookState(grc, ddp, overlap=overlap)
        ddp.register_comm_hook(self.hook, spardl_grace.comm_hook)

    def synchronize(self) -> None:
        """Nothing to do: DDP has synchronised during backward."""

    def step(self) -> None:
        self.optimizer.step()

    @property
    def grace(self):
        return self.hook.sync.grace

    @property
    def last_stats(self) -> dict[str, float]:
        return self.hook.last_stats

    def compression_state(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_compression_state(self, state: dict[str, Any]) -> None:
        self.hook.load_state_dict(state)

def build_sync(args: argparse.Namespace, model: torch.nn.Module, transport,
               steps_per_epoch: int | None = None):
    """(sync, grace params or None): the algorithm the arguments ask for, with the optimiser
    of --optimizer's recipe (experiments.recipe), and the library's density warm-up for a
    sparse all-reduce when `steps_per_epoch` is known."""
    import spardl_grace
    optimizer = recipe.make_optimizer(args, model)
    if args.compression and args.compressor == "diloco":
        from experiments.diloco import DiLoCoSync
        return DiLoCoSync(model, optimizer, args.diloco_period, args.diloco_outer_lr,
                          args.diloco_outer_momentum, args.diloco_outer_density,
                          transport, args.min_entries), None
    if is_baseline(args):
        from testbed.baselines import TorchDDPSync
        postlocal = args.compressor == "torch_postlocal"
        return TorchDDPSync(model, optimizer, args.compressor, args.powersgd_rank,
                            args.postlocal_start_iter if postlocal else args.powersgd_start_iter,
                            args.bucket_cap_mb, args.postlocal_period), None
    params = grace_params(args, steps_per_epoch)
    if args.fsdp is not None:
        if not torch.distributed.is_initialized():
            raise SystemExit("--fsdp needs torch.distributed: workers the CLI starts itself "
                             "(--nworkers >= 2) or torchrun, not Horovod or one thread")
        from experiments.sharded import ShardedSync
        return ShardedSync(model, args.fsdp, args.fsdp_nodes, params,
                           lambda sharded: recipe.make_optimizer(args, sharded)), params
    counting = spardl_grace.transport.CountingTransport(transport)
    grc = deepreduce_from_params(params, transport=counting)
    if args.ddp_hook:
        from testbed.baselines import ONE_BUCKET_MB
        return GraceHookSync(model, optimizer, counting, grc, args.bucket_cap_mb or ONE_BUCKET_MB,
                             not args.no_overlap), params
    distributed = spardl_grace.DistributedOptimizer(
        optimizer, grc, named_parameters=model.named_parameters(),
        bucket_cap_mb=args.bucket_cap_mb, overlap=not args.no_overlap)
    return GraceSync(model, distributed, counting), params
