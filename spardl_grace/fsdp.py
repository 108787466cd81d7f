"""Sharded training (FSDP2) with a sparse all-reduce across the slow link: hybrid sharding.

    mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    sync = spardl_grace.fsdp.hybrid_shard(model, mesh, {'compressor': 'topk',
        'memory': 'global_residual', 'communicator': 'spardl', 'compress_ratio': 0.01},
        units=model.layers)          # then train as with any fully_shard model

Parameters are sharded inside a node by FSDP2 (`fully_shard` over the mesh's shard dimension,
where the fast links are: FSDP's all-gathers and reduce-scatters stay there). Each unit's
gradient shard, once FSDP has reduce-scattered it inside the node, is averaged across the
replicate dimension (between nodes) by the sparse all-reduce that `params` choose, in the
unit's all-reduce hook (`FSDPModule.set_all_reduce_hook`), with a residual per unit and rank:
only the sparse messages cross the slow link. FSDP's own HSDP (`fully_shard(mesh=mesh)` over
both dimensions) all-reduces the same shard dense across the replicas instead; to switch,
call `fully_shard` with the 2-D mesh and no hook. With a dense communicator the two compute the
same average.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed

from .transport.torch_dist import TorchDistTransport

MESH_DIMS = ("replicate", "shard")


class ReplicaHook:
    """The all-reduce hook of one fully_shard unit: replaces the unit's reduced gradient shard
    (FSDP's reduce-scatter output, padding included) by its average over the replicas, as the
    communicator `grace` computes it under the name `name` (its residual key)."""

    def __init__(self, grace: Any, name: str):
        self.grace = grace
        self.name = name
        self.bytes_sent = 0  # by this rank, across the replicas, over every call

    def __call__(self, reduce_output: torch.Tensor) -> None:
        flat = reduce_output.view(-1)
        flat.copy_(self.grace.step(flat, self.name))
        self.bytes_sent += int(self.grace.last_stats.get("bytes_sent", 0))


class HybridSync:
    """What hybrid_shard set up: the communicator across the replicas (`grace`) and each
    unit's hook by name (`hooks`).

    Its compression state (residuals, step counters, warm-up progress) is per rank. It is a
    Stateful for torch.distributed.checkpoint: put it in the state dict you save and load, as
    with the model's and the optimizer's,

        dcp.save({"model": model_sd, "optim": optim_sd, "spardl": sync}, checkpoint_id=path)

    and each rank's state is saved under its own key (as bytes) and comes back to that rank."""

    def __init__(self, grace: Any, hooks: Mapping[str, ReplicaHook], rank: int):
        self.grace = grace
        self.hooks = dict(hooks)
        self._key = f"rank{rank}"

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent across the replicas, every unit and step together."""
        return sum(hook.bytes_sent for hook in self.hooks.values())

    def state_dict(self) -> dict[str, Any]:
        """{'rank<r>': this rank's compression state, torch.save'd into a BytesIO}."""
        buffer = io.BytesIO()
        torch.save(self.grace.state_dict(), buffer)
        buffer.seek(0)
        return {self._key: buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from what state_dict() gave on this rank; ValueError when the checkpoint holds
        no state for this rank (written by another number of ranks)."""
        if self._key not in state:
            raise ValueError(
                f"the checkpoint holds no compression state for {self._key} (it has "
                f"{sorted(state)}): it was written by another number of ranks"
            )
        buffer = state[self._key]
        buffer.seek(0)
        self.grace.load_state_dict(torch.load(buffer, weights_only=True))


def _check_mesh(mesh: Any, replicate: str, shard: str) -> None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or set(names) != {replicate, shard}:
        raise ValueError(
            f"hybrid_shard needs a 2-D device mesh with dimensions named {replicate!r} (across "
            f"nodes) and {shard!r} (inside a node), e.g. init_device_mesh('cpu', (nodes, "
            f"per_node), mesh_dim_names=({replicate!r}, {shard!r})); got {mesh.ndim}-D "
            f"with names {names}"
        )


def hybrid_shard(
    model: torch.nn.Module,
    mesh: Any,
    params: Mapping[str, Any],
    units: Iterable[torch.nn.Module] | None = None,
    *,
    replicate: str = "replicate",
    shard: str = "shard",
    **fully_shard_kwargs: Any,
) -> HybridSync:
    """fully_shard each of `units` (default: every direct child of `model` that has
    parameters) and then `model` over mesh[shard], and average each unit's gradient shard
    across mesh[replicate] with the communicator grace_from_params(params) builds on that
    dimension's process group. Returns the HybridSync. `fully_shard_kwargs` go to every
    fully_shard call (mp_policy, reshard_after_forward, ...). ValueError for a mesh that is not
    2-D with those dimension names, and for params grace_from_params refuses."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from .registry import grace_from_params

    _check_mesh(mesh, replicate, shard)
    transport = TorchDistTransport(group=mesh[replicate].get_group())
    grace = grace_from_params(dict(params), transport=transport)
    names = {id(module): name for name, module in model.named_modules()}
    chosen = (
        list(units)
        if units is not None
        else [child for child in model.children() if any(True for _ in child.parameters())]
    )
    hooks: dict[str, ReplicaHook] = {}
    for unit in chosen:
        if id(unit) not in names or unit is model:
            raise ValueError("hybrid_shard's units must be submodules of the model")
        hooks[names[id(unit)]] = ReplicaHook(grace, names[id(unit)])
        fully_shard(unit, mesh=mesh[shard], **fully_shard_kwargs)
    fully_shard(model, mesh=mesh[shard], **fully_shard_kwargs)
    for unit in chosen:
        cast(FSDPModule, unit).set_all_reduce_hook(hooks[names[id(unit)]])
    hooks["<root>"] = ReplicaHook(grace, "<root>")
    cast(FSDPModule, model).set_all_reduce_hook(hooks["<root>"])  # parameters of no unit
    return HybridSync(grace, hooks, torch.distributed.get_rank())
