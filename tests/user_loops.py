"""Training loops as users write them, run under real launchers (tests/mp_worker.py with a
scenario named 'user_loops.NAME'; the test harness's own transport is ignored: each script
builds what a user builds, with grace_from_params and the launcher's own API).

Each scenario returns the final parameters; the tests compare them across ranks and against
the same loop without the user's extra collectives."""
from __future__ import annotations

import torch

import spardl_grace
from training_scenarios import batches, flat_params

STEPS = 6
PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05, "min_entries": 0}


def _launcher() -> str:
    """'torchrun', 'horovod' or 'mpirun': which API a user's script would call."""
    import sys
    if "horovod.torch" in sys.modules and sys.modules["horovod.torch"].is_initialized():
        return "horovod"
    import torch.distributed as dist
    return "torchrun" if dist.is_initialized() else "mpirun"


def _model() -> torch.nn.Module:
    """Four layers: several buckets, so the communication thread runs during backward."""
    model = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


class _UserCollectives:
    """The user's own communication, through the launcher's API as a user calls it."""

    def __init__(self):
        self.kind = _launcher()
        if self.kind == "horovod":
            import horovod.torch as hvd
            self.hvd = hvd
        elif self.kind == "mpirun":
            from mpi4py import MPI
            self.comm = MPI.COMM_WORLD

    def allreduce(self, value: float) -> float:
        if self.kind == "torchrun":
            import torch.distributed as dist
            t = torch.tensor([value])
            dist.all_reduce(t)
            return float(t)
        if self.kind == "horovod":
            return float(self.hvd.allreduce(torch.tensor([value]), op=self.hvd.Sum))
        return float(self.comm.allreduce(value))

    def barrier(self) -> None:
        if self.kind == "torchrun":
            import torch.distributed as dist
            dist.barrier()
        elif self.kind == "horovod":
            self.hvd.barrier()
        else:
            self.comm.Barrier()

    def broadcast_object(self, obj):
        if self.kind == "torchrun":
            import torch.distributed as dist
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        if self.kind == "horovod":
            return self.hvd.broadcast_object(obj, root_rank=0)
        return self.comm.bcast(obj, root=0)

    @property
    def rank(self) -> int:
        if self.kind == "torchrun":
            import torch.distributed as dist
            return dist.get_rank()
        return self.hvd.rank() if self.kind == "horovod" else self.comm.Get_rank()

    @property
    def size(self) -> int:
        if self.kind == "torchrun":
            import torch.distributed as dist
            return dist.get_world_size()
        return self.hvd.size() if self.kind == "horovod" else self.comm.Get_size()


def _optimizer_loop(between_backward_and_step) -> dict:
    user = _UserCollectives()
    model = _model()
    grc = spardl_grace.grace_from_params(dict(PARAMS))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = spardl_grace.DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())
    logged = []
    for step, (x, y) in enumerate(batches(user.rank, user.size, STEPS)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        logged.append(between_backward_and_step(user, step, loss.item()))
        opt.step()
    return {"params": flat_params(model), "logged": logged,
            "auto_density": opt.last_stats.get("auto_density")}  # None unless 'auto'


def plain(_transport) -> dict:
    """The loop with nothing between backward and step: what the others must equal."""
    return _optimizer_loop(lambda user, step, loss: None)


def allreduce_between_backward_and_step(_transport) -> dict:
    """The loss all-reduced for logging while the library's buckets are in flight."""
    return _optimizer_loop(lambda user, step, loss: user.allreduce(loss) / user.size)


def barrier_between_backward_and_step(_transport) -> dict:
    def between(user, step, loss):
        user.barrier()
    return _optimizer_loop(between)


def object_broadcast_between_backward_and_step(_transport) -> dict:
    """An object broadcast (a config, a random seed) between backward and step."""
    return _optimizer_loop(lambda user, step, loss: user.broadcast_object({"step": step,
                                                                           "from": user.rank}))


BETWEEN_BACKWARD_AND_STEP = (plain, allreduce_between_backward_and_step,
                             barrier_between_backward_and_step,
                             object_broadcast_between_backward_and_step)


def collectives_between_backward_and_step(transport) -> dict:
    """Every pattern above in one job, one after the other."""
    return {f.__name__: f(transport) for f in BETWEEN_BACKWARD_AND_STEP}


def private_channels(transport) -> dict:
    """Under torchrun (3 ranks): transports over the parts of a partition ([0, 1] and [2]),
    each on a group of its own; ranks asking for overlapping groups all refuse; the shared
    transport is made once; every default transport has a group of its own."""
    import torch.distributed as dist

    from spardl_grace.transport import default_transport, shared_transport
    from spardl_grace.transport.torch_dist import TorchDistTransport
    rank = dist.get_rank()
    pair, alone, other_pair = dist.new_group([0, 1]), dist.new_group([2]), dist.new_group([1, 2])
    part = TorchDistTransport(pair if rank < 2 else alone)
    summed = part.allreduce(torch.tensor([float(rank + 1)]), "part")
    try:
        TorchDistTransport(pair if rank < 2 else other_pair)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    first, second = default_transport(), default_transport()
    return {"part_size": part.size, "part_sum": float(summed), "refused": refused,
            "shared_once": shared_transport() is shared_transport(),
            "distinct": len({id(part.group), id(first.group), id(second.group),
                             id(dist.group.WORLD)}) == 4}


class _PDataSGD(torch.optim.Optimizer):
    """Research code's optimizer: a torch.optim subclass that updates through p.data."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _ddp_loop(update, set_to_none: bool = True) -> dict:
    """DDP with the hook, SparDL at 0.05; `update(model)` applies the step."""
    import warnings

    import torch.distributed as dist
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = spardl_grace.CommHookState(dict(PARAMS), ddp)
    ddp.register_comm_hook(state, spardl_grace.comm_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(dist.get_rank(), dist.get_world_size(), STEPS):
            model.zero_grad(set_to_none=set_to_none)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            update(model)
    return {"params": flat_params(model), "steps": state.sync.steps,
            "warnings": [str(w.message) for w in caught if "spardl_grace" in str(w.message)]}


def handwritten_optimizers_under_the_ddp_hook(_transport) -> dict:
    """A torch.optim subclass and a bare function, both updating p.data (the hook raised
    'synchronised twice without an optimizer step' on the second step: it read p._version,
    which p.data.add_() never bumps); and plain SGD, which both must equal. The bare function
    gives the hook no step to see: with the gradients set to None before each backward there
    is no accumulation to fear, and with them zeroed in place the hook cannot tell, so it warns
    once."""
    def bare(model):
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.05)

    out = {}
    for name, make in (("sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.05)),
                       ("subclass", lambda m: _PDataSGD(m.parameters(), lr=0.05))):
        holder: dict = {}

        def update(model, make=make, holder=holder):
            if "opt" not in holder:
                holder["opt"] = make(model)
            holder["opt"].step()
        out[name] = _ddp_loop(update)
    out["bare"] = _ddp_loop(bare)
    out["bare_zeroed_in_place"] = _ddp_loop(bare, set_to_none=False)
    return out


def a_skipped_step_under_the_ddp_hook(_transport) -> dict:
    """LLM training's loss-spike guard: at step 2 the loop drops the step, zero_grad() and
    continue, with no optimizer step (the hook raised 'synchronised the gradients twice' at the
    next backward). With set_to_none=False the zeroed gradients look like an accumulation, and
    the error says how to skip; gradient_as_bucket_view too; and an accumulation in which one
    parameter's gradient alone was set to None still raises."""
    import torch.distributed as dist

    def run(set_to_none: bool, bucket_view: bool = False, one_reset: bool = False) -> dict:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        state = spardl_grace.CommHookState(dict(PARAMS), ddp)
        ddp.register_comm_hook(state, spardl_grace.comm_hook)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        try:
            for step, (x, y) in enumerate(batches(dist.get_rank(), dist.get_world_size(),
                                                  STEPS)):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                if step != 2:
                    sgd.step()
                if one_reset and step == 2:  # accumulation, one gradient reset: no skip
                    model[-1].bias.grad = None
                else:
                    sgd.zero_grad(set_to_none=set_to_none)
        except ValueError as exc:
            return {"error": str(exc)}
        return {"params": flat_params(model), "steps": state.sync.steps}

    return {"skipped": run(True), "bucket_view": run(True, bucket_view=True),
            "zeroed_in_place": run(False), "one_reset": run(True, one_reset=True)}


def _distributed_optimizer(model, lr: float = 0.05):
    grc = spardl_grace.grace_from_params(dict(PARAMS))
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return spardl_grace.DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())


def evaluation_mid_epoch(_transport) -> dict:
    """Every other step the model is evaluated and its accuracy all-reduced (the user's
    collective, on the launcher's API) before training goes on."""
    user = _UserCollectives()
    model = _model()
    opt = _distributed_optimizer(model)
    accuracies = []
    for step, (x, y) in enumerate(batches(user.rank, user.size, STEPS)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                correct = float((model(x).argmax(1) == y).float().mean())
            accuracies.append(user.allreduce(correct) / user.size)
            model.train()
    return {"params": flat_params(model), "logged": accuracies}


def gan(_transport) -> dict:
    """Two models, two DistributedOptimizers (a GAN): the discriminator's step, then the
    generator's through the frozen discriminator."""
    user = _UserCollectives()
    g = torch.Generator().manual_seed(7)
    generator = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 784))
    discriminator = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 1))
    for p in [*generator.parameters(), *discriminator.parameters()]:
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    opt_g, opt_d = _distributed_optimizer(generator), _distributed_optimizer(discriminator)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    noise = torch.Generator().manual_seed(100 + user.rank)
    for x, _ in batches(user.rank, user.size, STEPS):
        z = torch.randn(len(x), 16, generator=noise)
        opt_d.zero_grad()
        fake = generator(z)
        loss_d = bce(discriminator(x), torch.ones(len(x), 1)) + \
            bce(discriminator(fake.detach()), torch.zeros(len(x), 1))
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        discriminator.requires_grad_(False)
        bce(discriminator(fake), torch.ones(len(x), 1)).backward()
        discriminator.requires_grad_(True)
        opt_g.step()
    return {"params": torch.cat([flat_params(generator), flat_params(discriminator)]),
            "logged": []}


def amp_with_grad_scaler_and_clipping(_transport) -> dict:
    """bfloat16 autocast, a GradScaler, and clipping of the averaged gradients: synchronize(),
    unscale, clip, then step inside skip_synchronize() (Horovod's recipe)."""
    user = _UserCollectives()
    model = _model()
    opt = _distributed_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for x, y in batches(user.rank, user.size, STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return {"params": flat_params(model), "logged": []}


class _Branchy(torch.nn.Module):
    """A head used only on odd steps: its parameters get no gradient on even ones."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.other = _model(), torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)

    def forward(self, x, odd: bool):
        return (self.head if odd else self.other)(self.body(x))


def unused_parameters(_transport) -> dict:
    """Parameters that get no gradient on some steps, through DistributedOptimizer and through
    DDP (find_unused_parameters=True) with the hook."""
    user = _UserCollectives()
    out = []
    for wrap in ("optimizer", "ddp") if user.kind == "torchrun" else ("optimizer",):
        torch.manual_seed(3)
        model = _Branchy()
        if wrap == "optimizer":
            opt, net = _distributed_optimizer(model), model
        else:
            net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            state = spardl_grace.CommHookState(dict(PARAMS), net)
            net.register_comm_hook(state, spardl_grace.comm_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step, (x, y) in enumerate(batches(user.rank, user.size, STEPS)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x, step % 2 == 1), y).backward()
            opt.step()
        out.append(flat_params(model))
    return {"params": torch.cat(out), "logged": []}


def _compiled_loop(backward) -> dict:
    """torch.compile(model), its optimizer wrapped by DistributedOptimizer, `backward(loss)`
    run on each step's loss."""
    user = _UserCollectives()
    model = _model()
    compiled = torch.compile(model)
    opt = _distributed_optimizer(model)
    for x, y in batches(user.rank, user.size, STEPS):
        opt.zero_grad()
        backward(torch.nn.functional.cross_entropy(compiled(x), y))
        opt.step()
    return {"params": flat_params(model), "logged": []}


def compiled_model(_transport) -> dict:
    """A model wrapped by torch.compile, its optimizer by DistributedOptimizer: the same bits
    as the loop without compile (plain())."""
    return _compiled_loop(lambda loss: loss.backward())


def compiled_autograd(_transport) -> dict:
    """torchtitan's compiled autograd (the backward traced and compiled, as its
    maybe_enable_compiled_autograd does) with DistributedOptimizer: the library's gradient
    hooks run inside the compiled backward. And the DDP hook under DDP's Python reducer, which
    compiled autograd needs: refused at construction (an AttributeError at the first backward
    before)."""
    from torch._dynamo import compiled_autograd as ca
    from torch._dynamo.utils import counters

    def backward(loss):
        with ca._enable(torch.compile(dynamic=False)):
            loss.backward()

    out = _compiled_loop(backward)
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        try:
            spardl_grace.CommHookState(dict(PARAMS), ddp)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
    return {**out, "captures": counters["compiled_autograd"]["captures"], "refused": refused}


def own_subgroup_for_metrics(_transport) -> dict:
    """The user makes a subgroup of ranks 0 and 1 (after the library made its channel) and
    all-reduces the loss on it between backward and step; rank 2 does not take part."""
    import torch.distributed as dist
    user = _UserCollectives()
    model = _model()
    opt = _distributed_optimizer(model)
    pair = dist.new_group([0, 1])
    logged = []
    for x, y in batches(user.rank, user.size, STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if user.rank < 2:
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t, group=pair)
            logged.append(float(t))
        opt.step()
    return {"params": flat_params(model), "logged": logged if user.rank < 2 else None}


MORE_PATTERNS = (evaluation_mid_epoch, gan, amp_with_grad_scaler_and_clipping, unused_parameters)


def more_patterns(transport) -> dict:
    """The patterns every launcher has, and under torchrun compile, compiled autograd and a
    user's subgroup."""
    patterns = list(MORE_PATTERNS)
    if _UserCollectives().kind == "torchrun":
        patterns += [compiled_model, compiled_autograd, own_subgroup_for_metrics]
    return {"plain": plain(transport), **{f.__name__: f(transport) for f in patterns}}


AUTO = {"compressor": "topk", "memory": "global_residual", "communicator": "auto",
        "auto_measure_steps": 2, "min_entries": 0}


def _with_params(params: dict, scenario, transport) -> dict:
    """`scenario(transport)` with the loops above built from `params` in place of PARAMS."""
    global PARAMS
    saved = PARAMS
    PARAMS = params
    try:
        return scenario(transport)
    finally:
        PARAMS = saved


def auto_patterns(transport) -> dict:
    """The loops above with communicator 'auto' (2 dense measuring steps, the link probed on
    the library's channel, then its plan): with one candidate the plan is fixed, so the loops
    that add the user's collectives between backward and step must end with the plain loop's
    bits; with every candidate the plan follows the timings, so only the ranks must agree."""
    return {"pinned": _with_params({**AUTO, "auto_candidates": ["spardl@0.05"]},
                                   collectives_between_backward_and_step, transport),
            "chosen": _with_params(dict(AUTO), more_patterns, transport)}


MOMENTUM_CORRECTION = {**PARAMS, "momentum_correction": 0.9}


def momentum_correction_patterns(transport) -> dict:
    """The user's SGD(momentum=0.9) as built, taken over by momentum correction without DGC's
    masking (the velocity kept) and with it: the loops that add the user's collectives
    between backward and step, then the plain loop masked, for the tests to tell apart."""
    return {"unmasked": _with_params({**MOMENTUM_CORRECTION, "momentum_masking": False},
                                     collectives_between_backward_and_step, transport),
            "masked": _with_params(dict(MOMENTUM_CORRECTION), plain, transport)}


def _nanogpt_job(saved: dict | None, load: str, steps: int) -> dict:
    """One job of nanoGPT's loop under the DDP hook (AdamW): built afresh, resumed from
    `saved` as `load` says ('model+optimizer', 'own state', "rank 0's state" on every rank),
    then `steps` steps. Returns what it would checkpoint, the library's warnings (those about
    the choice of AdamW on SparDL's gradient apart), and the error a step raised (it stops
    there)."""
    import copy
    import warnings

    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook = spardl_grace.CommHookState(dict(PARAMS), ddp)
    ddp.register_comm_hook(hook, spardl_grace.comm_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    start = 0
    if saved is not None:
        saved = copy.deepcopy(saved)  # as from a file: the optimizer takes its tensors as they are
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        if load == "own state":
            hook.load_state_dict(saved["hook"][rank])
        elif load == "rank 0's state":
            hook.load_state_dict(saved["hook"][0])
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in list(batches(rank, size, start + steps))[start:]:
            optimizer.zero_grad(set_to_none=True)
            try:
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
            except Exception as exc:  # the hook's error, as DDP's backward raises it
                error = str(exc)
                break
            optimizer.step()
    hooks = [None] * size
    dist.all_gather_object(hooks, hook.state_dict())
    return {"model": copy.deepcopy(model.state_dict()), "step": start + steps,
            "optimizer": copy.deepcopy(optimizer.state_dict()), "hook": hooks,
            "params": flat_params(model), "error": error,
            "warnings": [str(w.message) for w in caught if "spardl_grace" in str(w.message)
                         and "steps on" not in str(w.message)],
            "adam_advice": [str(w.message) for w in caught if "steps on" in str(w.message)]}


def nanogpt_checkpoints(_transport) -> dict:
    """nanoGPT's checkpoint (rank 0 saves the model and the optimizer) under the DDP hook, a
    new job resuming it three ways, against 6 steps unbroken: without the hook's state it
    resumes afresh and warns; with each rank's own it continues bit for bit, silently; with
    rank 0's on every rank (rank 1 would count rank 0's unsent gradient twice) every rank
    raises at its first step."""
    first = _nanogpt_job(None, "", 3)
    return {"unbroken": _nanogpt_job(None, "", 6)["params"],
            **{load: {k: v for k, v in _nanogpt_job(first, load, 3).items()
                      if k in ("params", "error", "warnings", "adam_advice")}
               for load in ("model+optimizer", "own state", "rank 0's state")}}


def auto_under_adamw_and_the_ddp_hook(_transport) -> dict:
    """nanoGPT's AdamW with 'auto' under the DDP hook: at its first step it keeps to the
    candidates that send every entry, warning nothing."""
    import warnings

    import torch.distributed as dist
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = spardl_grace.CommHookState(dict(AUTO), ddp)
    ddp.register_comm_hook(state, spardl_grace.comm_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(dist.get_rank(), dist.get_world_size(), STEPS):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
    auto = state.sync.grace
    return {"params": flat_params(model), "candidates": auto.candidates,
            "choice": auto.plan.get("choice"),
            "warnings": [str(w.message) for w in caught if "spardl_grace" in str(w.message)]}


def _unused_later_mass(params: dict) -> dict:
    """DDP with find_unused_parameters=True over a layer every rank uses for 4 of 12 SGD
    steps, then none: what the steps applied to it plus the ranks' mean residual, against the
    sum of its averaged gradients (the same when no mass is lost), and the parameters."""
    import torch.distributed as dist

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.body, self.extra = torch.nn.Linear(32, 10), torch.nn.Linear(32, 10)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)

        def forward(self, x, use_extra):
            return self.body(x) + (self.extra(x) if use_extra else 0)

    net, lr = Net(), 0.1
    before, computed = net.extra.weight.detach().clone(), torch.zeros(10, 32)

    def note(grad: torch.Tensor) -> None:  # returns None: the gradient stays as it is
        computed.add_(grad)

    net.extra.weight.register_hook(note)
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    state = spardl_grace.CommHookState(dict(params), ddp)
    ddp.register_comm_hook(state, spardl_grace.comm_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(12):
        optimizer.zero_grad()
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
        torch.nn.functional.cross_entropy(ddp(x, step < 4), y).backward()
        optimizer.step()
    residual = state.state_dict()["grace"]["memory"]["residuals"]["extra.weight"].view(10, 32)
    for total in (computed, residual := residual.clone()):
        dist.all_reduce(total)
        total /= dist.get_world_size()
    applied = (before - net.extra.weight.detach()) / lr
    return {"lost": float((applied + residual - computed).abs().max()),
            "kept": float(residual.abs().sum()), "params": flat_params(net)}


def unused_later_under_find_unused_parameters(_transport) -> dict:
    """_unused_later_mass for SparDL on the exact wire and GRACE's top-k over allgather."""
    return {"spardl": _unused_later_mass({**PARAMS, "wire": "exact"}),
            "allgather": _unused_later_mass({"compressor": "topk", "memory": "residual",
                                             "communicator": "allgather",
                                             "compress_ratio": 0.05})}
