"""The training CLI's sharded mode (--fsdp): FSDP2 with this library's synchronisation, behind
the trainer's sync interface (as experiments.syncs.GraceSync and testbed.baselines.TorchDDPSync).

hybrid: parameters sharded over each "node" of --nworkers / --fsdp-nodes ranks, each unit's
gradient shard averaged across the nodes by the sparse all-reduce (spardl_grace.fsdp.hybrid_shard
on a nodes x ranks-per-node mesh). flat: sharded over every rank, SparDL's Spar-Reduce-Scatter
as FSDP's reduce-scatter (spardl_grace.fsdp.flat_shard). Units: every direct child of the model
that has parameters (the library's default).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

MODES = ("hybrid", "flat")


class ShardedSync:
    """FSDP2 synchronises during backward; step() is the optimizer's. bytes_sent: what this
    rank's communicator sent (across the nodes for hybrid; the reduce-scatter for flat), not
    FSDP's own all-gathers and in-node reduce-scatters."""

    def __init__(self, model: torch.nn.Module, mode: str, nodes: int, params: dict[str, Any],
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]):
        """`make_optimizer` builds the optimiser over the sharded model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import spardl_grace.fsdp

        self.plain = copy.deepcopy(model)  # rank 0 evaluates the gathered weights in it
        world = dist.get_world_size()
        device = next(model.parameters()).device.type
        if mode == "hybrid":
            mesh = init_device_mesh(device, (nodes, world // nodes),
                                    mesh_dim_names=("replicate", "shard"))
            self.shards = spardl_grace.fsdp.hybrid_shard(model, mesh, params)
        else:
            self.shards = spardl_grace.fsdp.flat_shard(model, params)
        self.model = model
        self.optimizer = make_optimizer(model)

    def synchronize(self) -> None:
        """Nothing to do: FSDP has reduced the gradients during backward."""

    def step(self) -> None:
        self.optimizer.step()

    @property
    def grace(self) -> Any:
        return self.shards.grace

    @property
    def bytes_sent(self) -> int:
        return self.shards.bytes_sent

    @property
    def last_stats(self) -> dict[str, float]:
        return {}

    def set_density(self, density: float) -> None:
        self.grace.set_density(density)

    def residual_norm(self) -> float:
        """L2 norm of this rank's residuals (its shards')."""
        from experiments.evaluation import residual_norm
        return residual_norm(self.grace)

    def evaluation_model(self, rank: int) -> torch.nn.Module | None:
        """The whole model, gathered from the shards (a collective: every rank calls it), in a
        plain module on rank 0; None on the others."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        full = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if rank != 0:
            return None
        self.plain.load_state_dict(full)
        return self.plain

    def local_parameters(self) -> torch.Tensor:
        """This rank's shards of the parameters, flattened."""
        return torch.cat([p.to_local().detach().reshape(-1) for p in self.model.parameters()])
