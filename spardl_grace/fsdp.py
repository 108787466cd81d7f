"""Sharded training (FSDP2) with sparse gradient traffic: hybrid sharding, and SparDL as FSDP's
reduce-scatter (flat sharding).

Hybrid, for nodes with fast links inside and a slow link between them:

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

Flat, for clusters with no fast links anywhere:

    sync = spardl_grace.fsdp.flat_shard(model, {'compressor': 'topk',
        'memory': 'global_residual', 'communicator': 'spardl', 'compress_ratio': 0.01})

fully_shards over every rank and replaces each unit's reduce-scatter
(`FSDPModule.set_custom_reduce_scatter`) by SparDL's first phase, Spar-Reduce-Scatter: each
rank sends the top entries of the other ranks' blocks and keeps the rest as its residual, and
its own shard of the sum is its own block plus what the others sent. The parameters'
all-gathers stay dense, so the step's bytes fall by at most the reduce-scatter's share (about
half of FSDP's traffic in fp32).
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed

from .checkpoint import warn_if_resumed_afresh
from .frozen_adam import refuse_without_the_step
from .step_hooks import mark_replaced, watch
from .transport.torch_dist import TorchDistTransport


def check_layout(hook: Any, numel: int) -> None:
    """ValueError when a unit hands `hook` (a ReplicaHook or SparseReduceScatter) a gradient
    of another size than before: its residual belongs to one layout."""
    if hook.numel is None:
        hook.numel = numel
    elif numel != hook.numel:
        raise ValueError(
            f"unit '{hook.name}' handed a gradient of {numel} entries, {hook.numel} before, and "
            "its residual belongs to one layout: a parameter of it began or stopped training "
            "(requires_grad changed: shard the model anew, with hybrid_shard or flat_shard, "
            "when which parameters train changes), or FSDP left parameters without a gradient "
            "out of its reduce-scatter (set_reduce_scatter_unused_params(True), which "
            "hybrid_shard and flat_shard set on every unit, was turned off: keep it on)"
        )


def _param_group(module: Any) -> Any:
    """The FSDP parameter group of a fully_shard unit (None for a unit without parameters):
    where FSDP2 keeps what set_gradient_divide_factor, set_force_sum_reduction_for_comms and
    set_requires_all_reduce set. FSDP2 has setters for them and no getters, so they are read
    where the setters write them."""
    return module._get_fsdp_state()._fsdp_param_group


class ReplicaHook:
    """The all-reduce hook of one fully_shard unit: replaces the unit's reduced gradient shard
    (FSDP's reduce-scatter output, padding included) by its combination over the replicas, as
    the communicator `grace` computes it under the name `name` (its residual key), so that the
    gradient is HSDP's for the unit's settings:

    - scale: with FSDP's default divide factor FSDP has averaged over the shard dimension (or
      will divide by its size), and the replicas are averaged; after
      set_gradient_divide_factor(D) FSDP divides by D alone, so the replicas are summed (the
      average times their number: HSDP's sum, bit for bit where that number is a power of
      two, within one rounding otherwise). set_force_sum_reduction_for_comms changes when FSDP
      divides, not the result, so either way the gradient equals HSDP's;
    - accumulation: after set_requires_all_reduce(False) the hook keeps the shard in a partial
      sum of its own and hands FSDP zeros, and the next call with all-reduce required adds it
      and synchronises once, as HSDP defers its all-reduce to the last micro-batch."""

    def __init__(self, grace: Any, name: str, module: Any = None):
        self.grace = grace
        self.name = name
        self.module = module
        self.bytes_sent = 0  # by this rank, across the replicas, over every call
        self.numel: int | None = None  # of the unit's gradient shard, from the first call
        self._partial: torch.Tensor | None = None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        flat = reduce_output.view(-1)
        check_layout(self, flat.numel())
        group = _param_group(self.module) if self.module is not None else None
        if group is not None and not group.all_reduce_grads:
            self._partial = flat.clone() if self._partial is None else self._partial.add_(flat)
            flat.zero_()
            return
        if self._partial is not None:
            flat.add_(self._partial)
            self._partial = None
        result = self.grace.step(flat, self.name)
        if group is not None and group.gradient_divide_factor is not None:
            result = result * self.grace.transport.size
        flat.copy_(result)
        self.bytes_sent += int(self.grace.last_stats.get("bytes_sent", 0))


class SparseReduceScatter:
    """FSDP2's reduce-scatter (a torch.distributed.fsdp ReduceScatter) for one fully_shard
    unit: SparDL's Spar-Reduce-Scatter (`grace.reduce_scatter`) under the name `name` (its
    residual key). FSDP's SUM, AVG and PREMUL_SUM (set_gradient_divide_factor's: the sum times
    its factor) are honoured; its input is zero-padded to a multiple of the group's size, so
    each rank's block is its shard."""

    def __init__(self, grace: Any, name: str):
        self.grace = grace
        self.name = name
        self.bytes_sent = 0  # by this rank, over every call
        self.numel: int | None = None  # of the unit's reduce-scatter input, from the first call

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new, uninitialised buffer for FSDP's reduce-scatter input or output (FSDP fills
        the input, zero padding included, before the call)."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        from torch.distributed import ReduceOp

        if group is not None and group != self.grace.transport.user_group:
            raise ValueError(
                f"unit '{self.name}' reduce-scatters over another process group than the one "
                "flat_shard built its communicator on: shard every unit with flat_shard"
            )
        # A PREMUL_SUM op is a ReduceOp carrying its factor; `op.op` is its kind.
        kind = getattr(op, "op", op)
        if kind not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            raise ValueError(
                f"the sparse reduce-scatter honours FSDP's SUM, AVG and PREMUL_SUM (what "
                f"set_gradient_divide_factor asks for), got {op!r}"
            )
        check_layout(self, input_tensor.numel())
        shard = self.grace.reduce_scatter(input_tensor.reshape(-1), self.name)
        if kind == ReduceOp.AVG:
            shard /= self.grace.transport.size
        elif kind == ReduceOp.PREMUL_SUM:
            shard *= op.factor
        output_tensor.view(-1).copy_(shard)
        self.bytes_sent += int(self.grace.last_stats.get("bytes_sent", 0))
        return None


class ShardSync:
    """What hybrid_shard or flat_shard set up: the communicator (`grace`: across the replicas
    for hybrid_shard, over every rank for flat_shard) and each unit's hook or reduce-scatter by
    name (`hooks`).

    Its compression state (residuals, step counters, warm-up progress) is per rank. It is a
    Stateful for torch.distributed.checkpoint: put it in the state dict you save and load, as
    with the model's and the optimizer's,

        dcp.save({"model": model_sd, "optim": optim_sd, "spardl": sync}, checkpoint_id=path)

    and each rank's state is saved under its own key (as bytes) and comes back to that rank."""

    def __init__(
        self,
        grace: Any,
        hooks: Mapping[str, ReplicaHook | SparseReduceScatter],
        rank: int,
        model: torch.nn.Module | None = None,
    ):
        """`model`: the sharded model, whose optimizer's momentum momentum correction takes
        over for each step (spardl_grace.momentum)."""
        self.grace = grace
        self.hooks = dict(hooks)
        self._key = f"rank{rank}"
        self.momentum_correction = getattr(grace.memory, "momentum_correction", 0.0)
        self._resume_checked = False
        self._model = weakref.ref(model) if model is not None else None
        if model is not None:
            watch(model, self, "FSDP2")

    @property
    def grace_in_use(self) -> Any:
        """The communicator, once it has synchronised a gradient (None before: the step
        torch.distributed.checkpoint takes to create the optimizer's state comes first)."""
        return None if all(hook.numel is None for hook in self.hooks.values()) else self.grace

    def holds_parameters_of(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` updates any parameter of the sharded model."""
        model = self._model() if self._model is not None else None
        if model is None:
            return False
        # by identity: a set of tensors would compare them with ==, elementwise
        mine = {id(p) for p in model.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def check_resumed(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by spardl_grace.step_hooks before each step of an optimizer of the sharded
        model: at the first after a synchronisation, warns when the optimizer was resumed
        without this state (the step torch.distributed.checkpoint takes to create the
        optimizer's state, before any, tells nothing)."""
        if self._resume_checked or self.grace_in_use is None:
            return
        self._resume_checked = True
        saved = "this ShardSync (in what dcp.save saves)"
        warn_if_resumed_afresh(optimizer, self.grace.restored, saved)

    def optimizer_stepped(self) -> None:
        """Called by spardl_grace.step_hooks after each such step: nothing to do (only the
        DDP hook counts steps, for its check of accumulation without no_sync())."""

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's communicator has sent (across the replicas for hybrid_shard),
        every unit and step together."""
        return sum(hook.bytes_sent for hook in self.hooks.values())

    def _layout(self) -> dict[str, Any]:
        """What this rank's residuals belong to: the ranks, the communicator's (the replicas
        for hybrid_shard), and each unit's gradient size where it has synchronised."""
        return {
            "world_size": torch.distributed.get_world_size(),
            "communicator_ranks": self.grace.transport.size,
            "numels": {name: hook.numel for name, hook in self.hooks.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """{'rank<r>': this rank's compression state and its layout, torch.save'd into a
        BytesIO}."""
        buffer = io.BytesIO()
        torch.save({"grace": self.grace.state_dict(), "layout": self._layout()}, buffer)
        buffer.seek(0)
        return {self._key: buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from what state_dict() gave on this rank; ValueError when the checkpoint holds
        no state for this rank, or one of another layout (another number of ranks or
        replicas, or units of other sizes: torch.distributed.checkpoint reshards the model and
        the optimizer, but a residual belongs to one shard)."""
        if self._key not in state:
            raise ValueError(
                f"the checkpoint holds no compression state for {self._key} (it has "
                f"{sorted(state)}): it was written by another number of ranks"
            )
        buffer = state[self._key]
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        if "layout" not in saved:  # written before states carried their layout
            saved = {"grace": saved, "layout": None}
        layout, now = saved["layout"], self._layout()
        if layout is not None:
            same = all(layout[key] == now[key] for key in ("world_size", "communicator_ranks"))
            same = same and set(layout["numels"]) == set(now["numels"])
            if not same or any(
                n is not None and now["numels"][name] not in (None, n)
                for name, n in layout["numels"].items()
            ):
                raise ValueError(
                    f"this compression state was saved under another sharding ({layout} there, "
                    f"{now} here): residuals belong to one shard of one layout, so they do not "
                    "carry over a change of ranks, replicas or units. Resume on the layout it "
                    "was saved on, or leave the ShardSync out of what you load"
                )
            for name, n in layout["numels"].items():
                self.hooks[name].numel = n
        self.grace.load_state_dict(saved["grace"])


def _check_mesh(mesh: Any, replicate: str, shard: str) -> None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or set(names) != {replicate, shard}:
        raise ValueError(
            f"hybrid_shard needs a 2-D device mesh with dimensions named {replicate!r} (across "
            f"nodes) and {shard!r} (inside a node), e.g. init_device_mesh('cpu', (nodes, "
            f"per_node), mesh_dim_names=({replicate!r}, {shard!r})); got {mesh.ndim}-D "
            f"with names {names}. A mesh of your own names (torchtitan's 'dp_replicate', "
            "'dp_shard') works as it is: name them with hybrid_shard(..., replicate=NAME, "
            "shard=NAME), and a larger mesh by its 2-D slice, mesh['dp_replicate', 'dp_shard']"
        )


def _fully_shard_units(
    model: torch.nn.Module,
    units: Iterable[torch.nn.Module] | torch.nn.ModuleDict | None,
    mesh: Any,
    fully_shard_kwargs: Mapping[str, Any],
    caller: str,
) -> dict[str, Any]:
    """fully_shard each of `units` (default: _default_units) and then `model` over `mesh`,
    each with FSDP's reduce_scatter_unused_params on; the FSDP modules by residual key: each unit's
    module path, and '<root>' for the model (its parameters of no unit). ValueError for a unit
    that is not a submodule."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    names = {id(module): name for name, module in model.named_modules()}
    sharded = [
        name or "the model" for name, m in model.named_modules() if isinstance(m, FSDPModule)
    ]
    if sharded:
        # fully_shard refuses a module twice only where it is asked to, and a unit the user
        # sharded over one mesh dimension would be left out of the synchronisation between
        # replicas, its shards drifting apart from node to node.
        raise ValueError(
            f"{caller} shards the model itself, and {', '.join(sharded[:5])} "
            f"{'is' if len(sharded) == 1 else 'are'} fully_shard'ed already: call {caller} on "
            "the model as it was built, naming those modules in units"
        )
    if units is None:
        chosen = _default_units(model)
    else:
        # A ModuleDict iterates over its keys (torchtitan keeps its blocks in one).
        chosen = list(units.values() if isinstance(units, torch.nn.ModuleDict) else units)
    for unit in chosen:
        if not isinstance(unit, torch.nn.Module):
            raise TypeError(
                f"{caller}'s units are modules (a ModuleList, a ModuleDict or any iterable "
                f"of submodules of the model), got a {type(unit).__name__}"
            )
        if id(unit) not in names or unit is model:
            raise ValueError(f"{caller}'s units must be submodules of the model")
    _check_no_parameter_shared(chosen, names, caller)
    # A unit inside another is sharded first, as FSDP2 needs (it refused the overlapping mesh).
    chosen.sort(key=lambda unit: -names[id(unit)].count("."))
    for unit in chosen:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    modules: dict[str, Any] = {**{names[id(unit)]: unit for unit in chosen}, "<root>": model}
    for module in modules.values():
        # FSDP leaves a parameter without a gradient out of its reduce-scatter, which would
        # change the unit's shard, and so its residual's layout, from step to step (an FSDP2
        # without the setting: check_layout says so where it happens).
        if hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True, recurse=False)
    return modules


def _check_no_parameter_shared(
    chosen: list[torch.nn.Module], names: dict[int, str], caller: str
) -> None:
    """ValueError naming two units that share a parameter (tied weights: an embedding and the
    output layer), which fully_shard cannot split between units."""
    within = {id(unit): {id(m) for m in unit.modules()} for unit in chosen}
    owner: dict[int, torch.nn.Module] = {}
    for unit in chosen:
        for p in unit.parameters():
            other = owner.setdefault(id(p), unit)
            nested = id(other) in within[id(unit)] or id(unit) in within[id(other)]
            if other is not unit and not nested:
                raise ValueError(
                    f"{caller}'s units '{names[id(other)]}' and '{names[id(unit)]}' share a "
                    "parameter (tied weights), which one FSDP unit must hold: leave both out "
                    "of units, so it stays with the model's root (units=the blocks)"
                )


def _default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each direct child of `model` that has parameters, a container's (ModuleList,
    ModuleDict: they have no forward of their own, so fully_shard refuses them) replaced by its
    children, as torchtitan and Hugging Face models keep their blocks in one; children that
    share a parameter with another child (tied weights) stay with the root."""
    units = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            units += _default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    seen: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    return [u for u in units if all(seen[id(p)] == 1 for p in u.parameters())]


def hybrid_shard(
    model: torch.nn.Module,
    mesh: Any,
    params: Mapping[str, Any],
    units: Iterable[torch.nn.Module] | torch.nn.ModuleDict | None = None,
    *,
    replicate: str = "replicate",
    shard: str = "shard",
    **fully_shard_kwargs: Any,
) -> ShardSync:
    """fully_shard each of `units` (a ModuleList, a ModuleDict or any iterable of submodules;
    default: every direct child of `model` that has parameters, the modules of a ModuleList or
    ModuleDict child in its place) and then `model` over
    mesh[shard], and combine each unit's gradient shard across mesh[replicate] as HSDP would
    (ReplicaHook: its divide factor, force-sum and set_requires_all_reduce honoured) with the
    communicator grace_from_params(params) builds on that dimension's process group. Returns
    the ShardSync. `fully_shard_kwargs` go to every fully_shard call (mp_policy,
    reshard_after_forward, ...). ValueError for a mesh that is not
    2-D with those dimension names, and for params grace_from_params refuses. A parameter
    without a gradient in a step (every rank's or some ranks') is reduced as zeros, since each
    unit keeps FSDP's reduce_scatter_unused_params on (the shard's layout keys its residual):
    it gets a gradient of zeros plus what its residual sends, where FSDP alone would give it
    none."""
    from .registry import grace_from_params, refuse_update_exchange, resolve_params

    resolved = resolve_params(params)
    refuse_without_the_step(resolved["adam_freeze_step"], "FSDP2")
    refuse_update_exchange(resolved["exchange"], "FSDP2")
    _check_mesh(mesh, replicate, shard)
    if resolved["compressor"] == "powersgd":
        raise ValueError(
            "compressor 'powersgd' approximates each parameter's gradient matrix, and FSDP2 "
            "hands hybrid_shard a flat shard of a unit's gradients, which it would send "
            "uncompressed: choose a sparse communicator ('spardl') or another compressor"
        )
    transport = TorchDistTransport(group=mesh[replicate].get_group())
    grace = grace_from_params(dict(params), transport=transport)
    before = list(model.parameters())
    modules = _fully_shard_units(model, units, mesh[shard], fully_shard_kwargs, "hybrid_shard")
    _mark_replaced(model, before, "hybrid_shard")
    hooks = {name: ReplicaHook(grace, name, module) for name, module in modules.items()}
    for name, module in modules.items():
        module.set_all_reduce_hook(hooks[name])
    return ShardSync(grace, hooks, torch.distributed.get_rank(), model)


def flat_shard(
    model: torch.nn.Module,
    params: Mapping[str, Any],
    units: Iterable[torch.nn.Module] | torch.nn.ModuleDict | None = None,
    *,
    mesh: Any = None,
    **fully_shard_kwargs: Any,
) -> ShardSync:
    """fully_shard each of `units` (a ModuleList, a ModuleDict or any iterable of submodules;
    default: every direct child of `model` that has parameters, the modules of a ModuleList or
    ModuleDict child in its place) and then `model` over the 1-D
    `mesh` (default: every rank), and make SparDL's
    Spar-Reduce-Scatter each unit's reduce-scatter (a SparseReduceScatter), with the
    communicator grace_from_params(params) builds on the mesh's process group. Returns the
    ShardSync. `params` must choose the 'spardl' communicator (one team). `fully_shard_kwargs`
    go to every fully_shard call (mp_policy with a reduce_dtype, reshard_after_forward, ...).
    ValueError for another communicator, teams other than 1, or a mesh that is not 1-D."""
    from torch.distributed.device_mesh import init_device_mesh

    from .communicators.spardl import SparDL
    from .registry import grace_from_params, refuse_update_exchange, resolve_params

    resolved = resolve_params(params)
    refuse_without_the_step(resolved["adam_freeze_step"], "FSDP2")
    refuse_update_exchange(resolved["exchange"], "FSDP2")
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(
            f"flat_shard shards over a 1-D device mesh, got a {mesh.ndim}-D one; for a 2-D "
            "mesh (nodes x ranks per node) use hybrid_shard"
        )
    if params.get("communicator") != "spardl" or params.get("teams", 1) != 1:
        raise ValueError(
            "flat_shard's reduce-scatter is SparDL's first phase, in one team: choose "
            f"communicator 'spardl' with teams 1, got communicator "
            f"{params.get('communicator')!r}, teams {params.get('teams', 1)!r}"
        )
    if mesh is None:
        mesh = init_device_mesh(_device_type(model), (torch.distributed.get_world_size(),))
    transport = TorchDistTransport(group=mesh.get_group())
    grace = cast(SparDL, grace_from_params(dict(params), transport=transport))
    before = list(model.parameters())
    modules = _fully_shard_units(model, units, mesh, fully_shard_kwargs, "flat_shard")
    _mark_replaced(model, before, "flat_shard")
    comms = {name: SparseReduceScatter(grace, name) for name in modules}
    for name, module in modules.items():
        # torch exports the ReduceScatter interface only from a private module:
        # SparseReduceScatter implements it (allocate, __call__) without subclassing it.
        module.set_custom_reduce_scatter(comms[name])
    return ShardSync(grace, comms, torch.distributed.get_rank(), model)


def _mark_replaced(model: torch.nn.Module, before: Sequence[torch.Tensor], where: str) -> None:
    """An optimizer built before the sharding holds `before`, the parameters fully_shard
    replaced: its first step raises (spardl_grace.step_hooks.mark_replaced) rather than train
    nothing."""
    now = {id(p) for p in model.parameters()}
    mark_replaced([p for p in before if id(p) not in now], where)


def _device_type(model: torch.nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"
