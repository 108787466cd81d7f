"""FSDP2 scenarios for tests/test_fsdp.py, run by tests/mp_worker.py on 4 gloo ranks (torchrun):
a 2 x 2 mesh, ranks 2r + s holding shard s of replica r."""
from __future__ import annotations

import torch

SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl"}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _model(integer: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if integer:  # integer weights and inputs: every gradient and partial sum is exact
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


def _batch(rank: int, step: int, integer: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    if integer:
        return torch.randint(-2, 3, (4, 8), generator=g).float()
    return torch.randn(4, 8, generator=g)


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def dense_density_equals_native_hsdp(transport) -> dict:
    """One backward on integer data: SparDL at density 1 across the replicas (hybrid_shard)
    against FSDP's native HSDP (fully_shard over the 2-D mesh): each rank's gradient shards."""
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import hybrid_shard
    mesh = _mesh()
    hybrid = _model(integer=True)
    hybrid_shard(hybrid, mesh, {**SPARDL, "compress_ratio": 1.0})
    native = _model(integer=True)
    for layer in native:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(native, mesh=mesh)
    x = _batch(transport.rank, 0, integer=True)
    for model in (hybrid, native):
        model(x).pow(2).sum().backward()
    return {"hybrid": _local_grads(hybrid), "native": _local_grads(native)}


def conserving_steps(transport) -> dict:
    """Three steps at density 0.1: what every unit's hook got (the shard reduced inside the
    node), the residual before and after, and what it returned; and the parameters' shards
    after each optimizer step."""
    from spardl_grace.fsdp import hybrid_shard
    mesh = _mesh()
    model = _model()
    sync = hybrid_shard(model, mesh, {**SPARDL, "compress_ratio": 0.1})
    records: dict[str, list] = {name: [] for name in sync.hooks}
    for name, hook in sync.hooks.items():
        def recording(shard, hook=hook, name=name):
            residuals = sync.grace.memory.residuals
            old = residuals.get(name, torch.zeros(shard.numel())).clone()
            given = shard.clone().reshape(-1)
            hook(shard)
            records[name].append({"given": given, "old": old, "result": shard.clone().reshape(-1),
                                  "new": residuals[name].clone()})
        _rehook(model, name, recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = []
    for step in range(3):
        optimizer.zero_grad()
        model(_batch(transport.rank, step)).pow(2).sum().backward()
        optimizer.step()
        params.append([p.detach().to_local().clone() for p in model.parameters()])
    return {"records": records, "params": params}


def _rehook(model: torch.nn.Module, name: str, hook) -> None:
    """Put `hook` on the fully_shard unit hybrid_shard named `name`."""
    module = model if name == "<root>" else model.get_submodule(name)
    module.set_all_reduce_hook(hook)


def _train(model, optimizer, rank: int, steps) -> None:
    for step in steps:
        optimizer.zero_grad()
        model(_batch(rank, step)).pow(2).sum().backward()
        optimizer.step()


def _shards(model) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]


def dcp_resume(transport) -> dict:
    """Six steps at density 0.1 without a stop, against three steps, a checkpoint through
    torch.distributed.checkpoint (model, optimizer, the HybridSync), everything built anew,
    loaded, and three more steps: each rank's parameter shards."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from spardl_grace.fsdp import hybrid_shard

    def build():
        model = _model()
        sync = hybrid_shard(model, _mesh(), {**SPARDL, "compress_ratio": 0.1})
        return model, sync, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, _, optimizer = build()
    _train(model, optimizer, transport.rank, range(6))
    uninterrupted = _shards(model)

    model, sync, optimizer = build()
    _train(model, optimizer, transport.rank, range(3))
    holder = [tempfile.mkdtemp(prefix="spardl-dcp-") if transport.rank == 0 else None]
    dist.broadcast_object_list(holder, 0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "spardl": sync}, checkpoint_id=holder[0])

    model, sync, optimizer = build()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "spardl": sync}
    dcp.load(state, checkpoint_id=holder[0])
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    _train(model, optimizer, transport.rank, range(3, 6))
    return {"uninterrupted": uninterrupted, "resumed": _shards(model),
            "residual_names": sorted(sync.grace.memory.residuals)}
