"""Training scenarios for the integrations (DistributedOptimizer, the DDP comm hook,
checkpoints), run in-process (run_local) and under real launchers (tests/mp_worker.py with a
scenario named 'training_scenarios.NAME').

The data is real: each rank trains on its own shard of Fashion-MNIST (the Debian package)."""
from __future__ import annotations

import functools
import threading

import torch

from spardl_grace import (CommHookState, DistributedOptimizer, broadcast_parameters, comm_hook,
                          grace_from_params)
from spardl_grace.transport.counting import CountingTransport

# No floor on the entries sent (min_entries 0): the library's default floor would send these
# small models nearly dense, and the scenarios are about the sparse path.
ALGORITHMS = {
    "spardl": {"communicator": "spardl", "memory": "global_residual", "min_entries": 0},
    "gtopk": {"communicator": "gtopk", "memory": "global_residual", "min_entries": 0},
    "oktopk": {"communicator": "oktopk", "memory": "global_residual", "min_entries": 0,
               "oktopk_threshold_interval": 4, "oktopk_region_interval": 8},
    "topka": {"communicator": "topka", "memory": "global_residual", "min_entries": 0},
}
DENSITY = 0.05
BATCH = 32


def params_for(algorithm: str, density: float = DENSITY) -> dict:
    return {"compressor": "topk", "compress_ratio": density, **ALGORITHMS[algorithm]}


@functools.lru_cache(maxsize=1)
def _images() -> tuple[torch.Tensor, torch.Tensor]:
    from testbed.datasets import load_fashion_mnist
    images, labels = load_fashion_mnist("train")
    return images[:4096].reshape(4096, -1), labels[:4096]


def batches(rank: int, size: int, steps: int, batch: int = BATCH):
    """`steps` batches from rank's shard, the same on every call."""
    images, labels = _images()
    shard = torch.arange(rank, len(images), size)
    order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(rank))]
    for s in range(steps):
        idx = order[(s * batch) % (len(order) - batch):][:batch]
        yield images[idx], labels[idx]


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """784-32-10; the same initial weights on every rank and thread."""
    model = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(dtype)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def train(model, optimizer, rank: int, size: int, steps: int, start: int = 0) -> list[float]:
    """Plain training loop (the optimizer synchronises); losses per step."""
    losses = []
    dtype = next(model.parameters()).dtype
    for x, y in list(batches(rank, size, start + steps))[start:]:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_with_closure(model, optimizer, rank: int, size: int, steps: int) -> None:
    """train()'s loop with the forward and backward in a closure given to step(), as
    Lightning's automatic optimisation runs it: by keyword on even steps, positionally on odd
    ones."""
    for step, (x, y) in enumerate(batches(rank, size, steps)):
        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        if step % 2:
            optimizer.step(closure)
        else:
            optimizer.step(closure=closure)


def make_optimizer(model, grc, **kwargs):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters(), **kwargs)


def optimizer_training(transport, algorithms=tuple(ALGORITHMS), steps: int = 20) -> dict:
    """Every algorithm through DistributedOptimizer: final parameters and losses."""
    out = {}
    for algorithm in algorithms:
        model = mlp()
        broadcast_parameters(model.state_dict(), 0, transport)
        grc = grace_from_params(params_for(algorithm), transport=transport)
        losses = train(model, make_optimizer(model, grc), transport.rank, transport.size, steps)
        out[algorithm] = {"params": flat_params(model), "losses": torch.tensor(losses)}
    return out


def ddp_matches_optimizer(transport, steps: int = 12, dense_warmup_steps: int = 2) -> dict:
    """The same SparDL training through DDP + comm_hook and through DistributedOptimizer
    (needs torch.distributed: torchrun)."""
    ddp_model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    state = CommHookState(grace_from_params(params_for("spardl"), transport=transport), ddp,
                          dense_warmup_steps=dense_warmup_steps)
    ddp.register_comm_hook(state, comm_hook)
    ddp_losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
                       transport.rank, transport.size, steps)
    model = mlp()
    grc = grace_from_params(params_for("spardl"), transport=transport)
    losses = train(model, make_optimizer(model, grc, dense_warmup_steps=dense_warmup_steps),
                   transport.rank, transport.size, steps)
    return {"ddp": flat_params(ddp_model), "optimizer": flat_params(model),
            "ddp_losses": torch.tensor(ddp_losses), "losses": torch.tensor(losses),
            "residual_names": sorted(state.sync.grace.memory.residuals)}


def ddp_momentum_correction(transport, steps: int = 8) -> dict:
    """Momentum correction 0.9 with the user's SGD(momentum=0.9, weight_decay=1e-3) as built,
    through DDP + comm_hook (stepped plainly and with a closure) and through
    DistributedOptimizer, with DGC's masking and without ('momentum_masking': False); then
    nesterov=True under the hook (needs torch.distributed: torchrun)."""
    mc = {**params_for("spardl"), "momentum_correction": 0.9}

    def sgd(params, **kwargs):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, **kwargs)
    out = {}
    for suffix, masking in (("", True), ("_unmasked", False)):
        params = {**mc, "momentum_masking": masking}
        ddp_model = mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
        ddp.register_comm_hook(CommHookState(params, ddp), comm_hook)
        users = sgd(ddp.parameters())
        train(ddp, users, transport.rank, transport.size, steps)
        model = mlp()
        grc = grace_from_params(params, transport=transport)
        train(model, DistributedOptimizer(sgd(model.parameters()), grc,
                                          named_parameters=model.named_parameters()),
              transport.rank, transport.size, steps)
        closure_model = mlp()
        closure_ddp = torch.nn.parallel.DistributedDataParallel(closure_model)
        closure_ddp.register_comm_hook(CommHookState(params, closure_ddp), comm_hook)
        train_with_closure(closure_ddp, sgd(closure_ddp.parameters()), transport.rank,
                           transport.size, steps)
        group = users.param_groups[0]
        out.update({f"ddp{suffix}": flat_params(ddp_model),
                    f"closure{suffix}": flat_params(closure_model),
                    f"optimizer{suffix}": flat_params(model),
                    f"group{suffix}": (group["momentum"], group["weight_decay"],
                                       group["nesterov"]),
                    f"buffers{suffix}": sum(len(users.state[p]) for p in ddp.parameters())})
    out["nesterov"] = _first_step_error(transport, mc,
                                        lambda m: sgd(m.parameters(), nesterov=True))
    return out


def _first_step_error(transport, params: dict, make_optimizer) -> str:
    """The ValueError of one DDP + comm_hook step with `params` and the optimizer
    make_optimizer(ddp) builds ("" if it trains)."""
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    ddp.register_comm_hook(CommHookState(params, ddp), comm_hook)
    try:
        train(ddp, make_optimizer(ddp), transport.rank, transport.size, 1)
    except ValueError as exc:
        return str(exc)
    return ""


def ddp_frozen_adam(transport, steps: int = 8, freeze: int = 3) -> dict:
    """'adam_freeze_step' with the user's AdamW through DDP + comm_hook and through
    DistributedOptimizer, and under the hook stepped with a closure (as Lightning steps it);
    then SGD under the hook with the key (needs torch.distributed)."""
    params = {**params_for("spardl"), "adam_freeze_step": freeze}

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    ddp_model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    state = CommHookState(params, ddp)
    ddp.register_comm_hook(state, comm_hook)
    users = adamw(ddp)
    train(ddp, users, transport.rank, transport.size, steps)
    model = mlp()
    train(model, DistributedOptimizer(adamw(model), grace_from_params(params, transport=transport),
                                      named_parameters=model.named_parameters()),
          transport.rank, transport.size, steps)
    closure_model = mlp()
    closure_ddp = torch.nn.parallel.DistributedDataParallel(closure_model)
    closure_ddp.register_comm_hook(CommHookState(params, closure_ddp), comm_hook)
    closure_users = adamw(closure_ddp)
    train_with_closure(closure_ddp, closure_users, transport.rank, transport.size, steps)
    sgd = _first_step_error(transport, params, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    first = next(ddp_model.parameters())
    return {"ddp": flat_params(ddp_model), "optimizer": flat_params(model), "sgd": sgd,
            "closure": flat_params(closure_model),
            "closure_steps": float(closure_users.state[next(closure_model.parameters())]["step"]),
            "frozen_at": float(users.state[first]["variance_frozen_at"]),
            "grads_kept": all(p.grad is not None for p in ddp_model.parameters())}


class _GatedTransport(CountingTransport):
    """Holds every message until `gate` is set, and records the threads that communicate.
    It gates the communication thread's messages, so dense steps are not queued in the
    backend past it (queued_dense tests those)."""

    queues_collectives = False

    def __init__(self, inner, gate: threading.Event):
        super().__init__(inner)
        self.gate = gate
        self.threads: set[str] = set()

    def _hold(self) -> None:
        self.threads.add(threading.current_thread().name)
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")

    def sendrecv(self, *args, **kwargs):
        self._hold()
        return super().sendrecv(*args, **kwargs)

    def allgather(self, *args, **kwargs):
        self._hold()
        return super().allgather(*args, **kwargs)

    def alltoall(self, *args, **kwargs):
        self._hold()
        return super().alltoall(*args, **kwargs)

    def allreduce(self, *args, **kwargs):
        self._hold()
        return super().allreduce(*args, **kwargs)

    def broadcast(self, *args, **kwargs):
        self._hold()
        return super().broadcast(*args, **kwargs)


class _WithUnused(torch.nn.Module):
    """784-32-32-10 with a layer that forward never uses (DDP's find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.body.insert(2, torch.nn.Linear(32, 32))
        self.body.insert(3, torch.nn.ReLU())
        self.unused = torch.nn.Linear(10, 10)
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in [*self.body[2].parameters(), *self.unused.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, x):
        return self.body(x)


def ddp_overlap(transport, steps: int = 8) -> dict:
    """SparDL through the DDP hook on several small DDP buckets with an unused parameter
    (find_unused_parameters=True), with and without overlap (needs torch.distributed:
    torchrun). Every message is held until the first hook has returned, so whether that hook
    left its future pending does not depend on timing."""
    out = {}
    for overlap in (True, False):
        gate = threading.Event()
        if not overlap:
            gate.set()  # the hook itself communicates: nothing may hold it
        gated = _GatedTransport(transport, gate)
        model = _WithUnused()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02,
                                                        find_unused_parameters=True)
        state = CommHookState(grace_from_params(params_for("spardl"), transport=gated), ddp,
                              dense_warmup_steps=2, overlap=overlap)
        calls: list[tuple[bool, bool]] = []

        def hook(state, bucket):  # unannotated: DDP rejects this module's string annotations
            future = comm_hook(state, bucket)
            calls.append((bucket.is_last(), future.done()))
            gate.set()
            return future

        ddp.register_comm_hook(state, hook)
        losses = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
                       transport.rank, transport.size, steps)
        out[overlap] = {"params": flat_params(model), "losses": torch.tensor(losses),
                        "calls": calls, "threads": sorted(gated.threads), "steps": state.sync.steps}
    return out


DENSE = {"compressor": "none", "memory": "none", "communicator": "dense"}


def queued_dense(transport, steps: int = 6) -> dict:
    """Dense training on several buckets through DistributedOptimizer and through the DDP
    hook, with overlap (every step's all-reduces queued in gloo) and without (each bucket
    all-reduced before submit returns), needs torch.distributed: torchrun."""
    out = {}
    for overlap in (True, False):
        model = mlp()
        optimizer = make_optimizer(model, grace_from_params(DENSE, transport=transport),
                                   bucket_cap_mb=0.05, overlap=overlap)
        train(model, optimizer, transport.rank, transport.size, steps)
        ddp_model = mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, bucket_cap_mb=0.05)
        state = CommHookState(grace_from_params(DENSE, transport=transport), ddp, overlap=overlap)
        ddp.register_comm_hook(state, comm_hook)
        train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
              transport.rank, transport.size, steps)
        out[overlap] = {"optimizer": flat_params(model), "hook": flat_params(ddp_model),
                        "optimizer_stats": dict(optimizer.last_stats),
                        "hook_stats": dict(state.last_stats), "buckets": len(optimizer.buckets)}
    return out

