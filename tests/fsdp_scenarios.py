"""FSDP2 scenarios for tests/test_fsdp.py, run by tests/mp_worker.py on 4 gloo ranks (torchrun):
hybrid_shard on a 2 x 2 mesh (ranks 2r + s hold shard s of replica r); flat_shard over all 4."""
from __future__ import annotations

import torch

# No floor: the test models' units are small, and the sparse path is what is tested.
SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "min_entries": 0}


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
    """One backward on integer data: SparDL at density 1 on the exact wire across the replicas
    (hybrid_shard) against FSDP's native HSDP (fully_shard over the 2-D mesh): each rank's
    gradient shards."""
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import hybrid_shard
    mesh = _mesh()
    hybrid = _model(integer=True)
    hybrid_shard(hybrid, mesh, {**SPARDL, "compress_ratio": 1.0, "wire": "exact"})
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
    return {"records": records, "params": _three_steps(model, transport.rank)}


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


def _three_steps(model, rank: int) -> list[list[torch.Tensor]]:
    """Three SGD steps; the parameter shards after each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = []
    for step in range(3):
        _train(model, optimizer, rank, [step])
        params.append(_shards(model))
    return params


def dcp_resume(transport) -> dict:
    """hybrid_shard: see _dcp_resume."""
    from spardl_grace.fsdp import hybrid_shard
    return _dcp_resume(transport, lambda model: hybrid_shard(model, _mesh(), {**SPARDL, "compress_ratio": 0.1}))


def flat_dcp_resume(transport) -> dict:
    """flat_shard: see _dcp_resume."""
    from spardl_grace.fsdp import flat_shard
    return _dcp_resume(transport, lambda model: flat_shard(model, {**SPARDL, "compress_ratio": 0.1}))


def _dcp_resume(transport, shard) -> dict:
    """Six steps at density 0.1 without a stop, against three steps, a checkpoint through
    torch.distributed.checkpoint (model, optimizer, the ShardSync), everything built anew,
    loaded, and three more steps: each rank's parameter shards."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        model = _model()
        sync = shard(model)
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


def _flat_pair(integer: bool, **kwargs):
    """The same model under flat_shard at density 1 and under FSDP's own 1-D fully_shard."""
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import flat_shard
    flat = _model(integer=integer)
    flat_shard(flat, {**SPARDL, "compress_ratio": 1.0, "wire": "exact"}, **kwargs)
    native = _model(integer=integer)
    for layer in native:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(native, **kwargs)
    return flat, native


def flat_density_one_equals_native_fsdp(transport) -> dict:
    """One backward on integer data, FSDP's AVG and (forced) SUM: SparDL's reduce-scatter at
    density 1 against FSDP's own; and with reduce_dtype bfloat16 on real-valued data."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    out = {}
    for case in ("avg", "sum"):
        flat, native = _flat_pair(integer=True)
        if case == "sum":
            for model in (flat, native):
                for module in model.modules():
                    if hasattr(module, "set_force_sum_reduction_for_comms"):
                        module.set_force_sum_reduction_for_comms(True)
        x = _batch(transport.rank, 0, integer=True)
        for model in (flat, native):
            model(x).pow(2).sum().backward()
        out[case] = {"flat": _local_grads(flat), "native": _local_grads(native)}
    flat, native = _flat_pair(integer=False, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    _, exact = _flat_pair(integer=False)
    x = _batch(transport.rank, 0)
    for model in (flat, native, exact):
        model(x).pow(2).sum().backward()
    out["bf16"] = {"flat": _local_grads(flat), "native": _local_grads(native),
                   "fp32": _local_grads(exact)}
    return out


class _Recording:
    """Wraps a unit's SparseReduceScatter: what it was given, the residual before and after,
    and the shard it wrote."""

    def __init__(self, comm, records):
        self.comm, self.records = comm, records

    def allocate(self, size, *, dtype, device):
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        residuals = self.comm.grace.memory.residuals
        old = residuals.get(self.comm.name, torch.zeros(input_tensor.numel())).clone()
        given = input_tensor.clone().reshape(-1)
        self.comm(output_tensor, input_tensor, group, op, async_op)
        self.records.append({"given": given, "old": old.reshape(-1),
                             "shard": output_tensor.clone().reshape(-1),
                             "new": residuals[self.comm.name].clone().reshape(-1)})


def flat_conserving_steps(transport) -> dict:
    """Three steps at density 0.1 under flat_shard: each unit's records (see _Recording), the
    bytes this rank sent, and the parameter shards after each step."""
    from spardl_grace.fsdp import flat_shard
    model = _model()
    sync = flat_shard(model, {**SPARDL, "compress_ratio": 0.1})
    records: dict[str, list] = {name: [] for name in sync.hooks}
    for name, comm in sync.hooks.items():
        module = model if name == "<root>" else model.get_submodule(name)
        module.set_custom_reduce_scatter(_Recording(comm, records[name]))
    return {"records": records, "params": _three_steps(model, transport.rank),
            "bytes_sent": sync.bytes_sent}


class _Titan(torch.nn.Module):
    """torchtitan's layout: the blocks in a ModuleDict (model.layers), units given by it."""

    def __init__(self):
        super().__init__()
        base = _model(integer=True)
        self.layers = torch.nn.ModuleDict({"0": base[0], "1": base[2], "2": base[4]})

    def forward(self, x):
        for i, layer in enumerate(self.layers.values()):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


def _titan_settings(model) -> None:
    """What torchtitan sets on every FSDP module: the script normalises the loss itself."""
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _accumulate(model, rank: int, micro_batches: int) -> None:
    """Micro-batches with the cross-replica all-reduce deferred to the last, as torchtitan
    does (set_requires_all_reduce(False) before the others)."""
    for micro in range(micro_batches):
        model.set_requires_all_reduce(micro == micro_batches - 1)
        model(_batch(rank, micro, integer=True)).pow(2).sum().backward()


def torchtitan_settings_equal_native_hsdp(transport) -> dict:
    """Integer data, a ModuleDict of units, divide factor 1 with force-sum on every module:
    hybrid_shard at density 1 on the exact wire against FSDP's own HSDP, for one backward and
    for two micro-batches with the all-reduce deferred; and how often the sparse sync ran."""
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import hybrid_shard
    out = {}
    for case, micro_batches in (("one", 1), ("accumulated", 2)):
        mesh = _mesh()
        hybrid = _Titan()
        sync = hybrid_shard(hybrid, mesh, {**SPARDL, "compress_ratio": 1.0, "wire": "exact"},
                            units=hybrid.layers)
        native = _Titan()
        for layer in native.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(native, mesh=mesh)
        for model in (hybrid, native):
            _titan_settings(model)
            _accumulate(model, transport.rank, micro_batches)
        out[case] = {"hybrid": _local_grads(hybrid), "native": _local_grads(native),
                     "bytes_sent": sync.bytes_sent}
    return out


def flat_divide_factor(transport) -> dict:
    """set_gradient_divide_factor(2) makes FSDP ask for PREMUL_SUM(1/2): flat_shard at density 1
    against the same model under FSDP's default average (a divide factor of 4, the ranks),
    on integer data: twice its gradient."""
    out = {}
    for case in ("factor2", "avg"):
        flat, _ = _flat_pair(integer=True)
        if case == "factor2":
            for module in flat.modules():
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(2.0)
        flat(_batch(transport.rank, 0, integer=True)).pow(2).sum().backward()
        out[case] = _local_grads(flat)
    return out


def momentum_taken_over(transport) -> dict:
    """hybrid_shard with momentum correction 0.9 at density 0.1, with DGC's masking and
    without: four steps of the user's SGD(momentum=0.9, weight_decay=1e-3) as built, and of
    DGC's recipe (SGD without momentum, weight decay scaled by 1/(1 - 0.9)); the parameter
    shards of each, and the user's group."""
    from spardl_grace.fsdp import hybrid_shard
    out = {}
    for masking in (True, False):
        suffix = "" if masking else "_unmasked"
        params = {**SPARDL, "compress_ratio": 0.1, "momentum_correction": 0.9,
                  "momentum_masking": masking}
        for case, momentum, decay in (("users", 0.9, 1e-3), ("dgc", 0.0, 1e-3 / (1 - 0.9))):
            model = _model()
            hybrid_shard(model, _mesh(), params)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum,
                                        weight_decay=decay)
            _train(model, optimizer, transport.rank, range(4))
            out[case + suffix] = _shards(model)
            out[f"{case}{suffix}_group"] = (optimizer.param_groups[0]["momentum"],
                                            optimizer.param_groups[0]["weight_decay"])
    return out


def auto_between_replicas(transport) -> dict:
    """hybrid_shard with 'communicator': 'auto' (2 measured dense steps, then its plan):
    the parameter shards after 6 SGD steps, and what auto chose."""
    from spardl_grace.fsdp import hybrid_shard
    model = _model()
    sync = hybrid_shard(model, _mesh(), {"communicator": "auto", "memory": "global_residual",
                                         "auto_measure_steps": 2, "auto_replan_window": 0,
                                         "min_entries": 0})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, transport.rank, range(6))
    return {"params": _shards(model), "choice": sync.grace.choice, "plan": sync.grace.plan}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.adapter = torch.nn.Linear(16, 16)

    def forward(self, x, skip: bool):
        x = torch.relu(self.lin(x))
        return x if skip else x + self.adapter(x)


class _Blocks(torch.nn.Module):
    """torchtitan's layout: the blocks in a ModuleDict (a container without forward) between
    an input and an output layer; `skip` leaves block '1''s adapter out (its parameters get no
    gradient), as a conditional branch does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(3)})
        self.out = torch.nn.Linear(16, 4)
        self.skip = False

    def forward(self, x):
        x = self.inp(x)
        for name, layer in self.layers.items():
            x = layer(x, self.skip and name == "1")
        return self.out(x)


def _skipping_steps(model, rank: int, skip_on) -> list[torch.Tensor]:
    """Four SGD steps, block '1''s adapter skipped where skip_on(step) holds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model.skip = skip_on(step)
        optimizer.zero_grad()
        model(_batch(rank, step)).pow(2).sum().backward()
        optimizer.step()
    return _shards(model)


def user_patterns(transport) -> dict:
    """What torchtitan-style scripts met: the default units of a model keeping its blocks in a
    ModuleDict (fully_shard refused the container); a block without gradient on some steps,
    on every rank or on rank 0 alone (the unit's shard changed size and the residual's check
    raised), at density 1 on the exact wire against HSDP with reduce_scatter_unused_params,
    and flat_shard's sparse steps; a DCP resume that leaves the ShardSync out (afresh, in
    silence before) and one that keeps it; a state of another layout loaded."""
    import io
    import tempfile
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import flat_shard, hybrid_shard
    rank, out = transport.rank, {}
    hybrid = _Blocks()
    sync = hybrid_shard(hybrid, _mesh(), {**SPARDL, "compress_ratio": 1.0, "wire": "exact"})
    out["units"] = sorted(sync.hooks)
    native = _Blocks()
    for unit in [native.inp, *native.layers.values(), native.out, native]:
        fully_shard(unit, mesh=_mesh())
    native.set_reduce_scatter_unused_params(True)
    for who, skip_on in (("every rank", lambda s: s % 2 == 1), ("rank 0", lambda s: rank == 0)):
        out[who] = {"hybrid": _skipping_steps(hybrid, rank, skip_on),
                    "native": _skipping_steps(native, rank, skip_on)}
    flat = _Blocks()
    flat_shard(flat, {**SPARDL, "compress_ratio": 0.1})
    out["flat"] = _skipping_steps(flat, rank, lambda s: s % 2 == 1)

    holder = [tempfile.mkdtemp(prefix="spardl-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(holder, 0)

    def build():
        model = _Blocks()
        sync = hybrid_shard(model, _mesh(), {**SPARDL, "compress_ratio": 0.1})
        return model, sync, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, sync, optimizer = build()
    _train(model, optimizer, rank, range(2))
    dcp.save({"model": get_state_dict(model, optimizer)[0], "optim": get_state_dict(model, optimizer)[1],
              "spardl": sync}, checkpoint_id=holder[0])
    for keep in (False, True):
        model, sync, optimizer = build()
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DCP steps to create the state
        state = {"model": model_sd, "optim": optim_sd, **({"spardl": sync} if keep else {})}
        dcp.load(state, checkpoint_id=holder[0])
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, optimizer, rank, range(2, 4))
        out[f"resumed, ShardSync {'kept' if keep else 'left out'}"] = [
            str(w.message) for w in caught if "spardl_grace" in str(w.message)
            and "steps on" not in str(w.message)]
        out[f"Adam advice, ShardSync {'kept' if keep else 'left out'}"] = [
            str(w.message) for w in caught if "steps on" in str(w.message)]
    saved = sync.state_dict()[f"rank{rank}"]
    state = torch.load(saved, weights_only=True)
    state["layout"]["communicator_ranks"] = 4
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        sync.load_state_dict({f"rank{rank}": buffer})
    except ValueError as exc:
        out["other layout"] = str(exc)
    return out


def setup_patterns(transport) -> dict:
    """How users hand flat_shard and hybrid_shard their models: tied weights (an embedding
    and the output layer sharing one) with the default units, and two units that share it;
    a unit inside another, given outer first; blocks already fully_shard'ed by the user.
    Each the error it raises, or the units it synchronised and whether a step ran."""
    from torch.distributed.fsdp import fully_shard

    from spardl_grace.fsdp import flat_shard, hybrid_shard
    params = {**SPARDL, "compress_ratio": 0.1}

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.body = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.relu(self.body(self.embed(ids))))

    def step(model) -> None:
        ids = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(transport.rank))
        model(ids).sum().backward()

    def outcome(build) -> str | list[str]:
        try:
            sync = build()
        except ValueError as exc:
            return str(exc)
        return list(sync.hooks)

    tied = Tied()
    got = {"tied, default units": outcome(lambda: flat_shard(tied, params))}
    step(tied)
    other = Tied()
    got["tied, both in units"] = outcome(lambda: flat_shard(other, params,
                                                            units=[other.embed, other.head]))
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                 torch.nn.Linear(8, 4))
    got["nested, outer first"] = outcome(lambda: hybrid_shard(
        nested, _mesh(), params, units=[nested[0], nested[0][0]]))
    nested(torch.randn(4, 8)).sum().backward()
    mine = _model()
    for layer in (mine[0], mine[2]):
        fully_shard(layer, mesh=_mesh()["shard"])
    got["blocks sharded already"] = outcome(lambda: hybrid_shard(mine, _mesh(), params, units=[]))
    for shard in (lambda m: hybrid_shard(m, _mesh(), params), lambda m: flat_shard(m, params)):
        model = _model()
        early = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = shard(model)
        model(_batch(transport.rank, 0)).pow(2).sum().backward()
        try:
            early.step()
            got.setdefault("optimizer built before", []).append("stepped")
        except RuntimeError as exc:
            got.setdefault("optimizer built before", []).append(str(exc))
        before = _shards(model)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        got.setdefault("optimizer built after moves", []).append(
            any(not torch.equal(a, b) for a, b in zip(before, _shards(model))))
        del sync
    return got
