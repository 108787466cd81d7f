"""Ranks whose data run out at different steps, run in-process (run_local) and under real
launchers (tests/mp_worker.py with 'uneven_scenarios.NAME').

Each scenario trains two epochs: in the first, rank r has 2 * (P - r) batches (rank 0 the
most), in the second 2 * (r + 1) (the last rank the most), so each epoch ends on another rank.
The reference pads each rank's loop to the longest with steps that synchronise zero gradients
and take no optimizer step, then gives every rank the parameters and optimizer state of the
rank with the most batches: what a rank that ran out contributes, written out by hand."""
from __future__ import annotations

import torch
from training_scenarios import batches, flat_params, mlp

import spardl_grace
from spardl_grace.broadcast import broadcast_object

PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05, "min_entries": 0}
EPOCHS = 2


def batches_in_epoch(epoch: int, rank: int, size: int) -> int:
    return 2 * (size - rank) if epoch == 0 else 2 * (rank + 1)


def _optimizer(transport, params: dict):
    model = mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    grc = spardl_grace.grace_from_params(dict(params), transport)
    # Several buckets: a rank that ran out sends each of them, in order.
    opt = spardl_grace.DistributedOptimizer(adamw, grc, named_parameters=model.named_parameters(),
                                            bucket_cap_mb=0.02)
    return model, opt


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _outcome(model, opt, **more) -> dict:
    return {"params": flat_params(model), "optimizer": opt.state_dict()["state"],
            "compression": opt.compression_state_dict(), **more}


def _per_batch_schedule(opt):
    """A learning rate that falls at every step: a scheduler stepped per batch."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))


def joined(transport, params: dict = PARAMS, scheduler: str = "none") -> dict:
    """Each epoch inside spardl_grace.join_uneven_inputs. `scheduler`: 'none', or a scheduler
    stepped per batch, given to the block ('stateful') or not ('own')."""
    model, opt = _optimizer(transport, params)
    sched = _per_batch_schedule(opt) if scheduler != "none" else None
    joins = []
    for epoch in range(EPOCHS):
        stateful = [sched] if scheduler == "stateful" else []
        with spardl_grace.join_uneven_inputs(opt, stateful=stateful) as block:
            for x, y in batches(transport.rank, transport.size,
                                batches_in_epoch(epoch, transport.rank, transport.size)):
                _step(model, opt, x, y)
                if sched is not None:
                    sched.step()
        joins.append((block.last_rank, block.steps_without_data))
    return _outcome(model, opt, joins=joins, schedule=_schedule_of(opt, sched))


def _schedule_of(opt, sched) -> dict | None:
    return None if sched is None else {"lr": opt.param_groups[0]["lr"],
                                       "steps": sched.state_dict()["last_epoch"]}


def padded_with_zero_gradients(transport, params: dict = PARAMS,
                               scheduler: str = "none") -> dict:
    """The reference (see the module docstring); a scheduler steps with the real steps and
    every rank takes the rank's with the most batches."""
    model, opt = _optimizer(transport, params)
    sched = _per_batch_schedule(opt) if scheduler != "none" else None
    rank, size = transport.rank, transport.size
    for epoch in range(EPOCHS):
        counts = [batches_in_epoch(epoch, r, size) for r in range(size)]
        for x, y in batches(rank, size, counts[rank]):
            _step(model, opt, x, y)
            if sched is not None:
                sched.step()
        for _ in range(max(counts) - counts[rank]):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.synchronize()
            opt._synchronized = opt._gradients_synchronized = False  # and no step
        root = counts.index(max(counts))
        spardl_grace.broadcast_parameters(model.named_parameters(), root, transport)
        spardl_grace.broadcast_optimizer_state(opt, root, transport)
        if sched is not None:
            sched.load_state_dict(broadcast_object(sched.state_dict(), root, transport,
                                                   "schedule"))
    return _outcome(model, opt, schedule=_schedule_of(opt, sched))


def joined_and_padded(transport) -> dict:
    """Both, one after the other, in one launch."""
    return {"joined": joined(transport), "padded": padded_with_zero_gradients(transport)}


#: batches by rank (3 ranks) in each epoch: the last rank ends last, then rank 0 with rank 1
#: empty; and an epoch in which rank 0 has none before any other
DDP_EPOCHS = ([2, 4, 6], [6, 0, 2])
EMPTY_FIRST = ([0, 2, 4], [2, 4, 6])


def _ddp_job(padded: bool, epochs: tuple[list[int], ...] = DDP_EPOCHS,
             stateful: bool = True) -> dict:
    """DDP with the hook and SGD with momentum under a scheduler stepped per batch, an epoch of
    each `epochs`' batches, inside torch's Join with SameOptimizerState, or padded with
    zero-gradient steps (an lr-0 SGD steps them, so the hook sees an optimizer step) and then
    given the last rank's parameters, momentum and schedule by hand."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    from spardl_grace.join import SameOptimizerState

    rank = dist.get_rank()
    model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    state = spardl_grace.CommHookState(dict(PARAMS), ddp)
    ddp.register_comm_hook(state, spardl_grace.comm_hook)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = _per_batch_schedule(sgd)
    still = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for counts in epochs:
            data = list(batches(rank, len(counts), counts[rank]))
            along = SameOptimizerState(sgd, stateful=[sched] if stateful else [])
            with Join([ddp, along], enable=not padded):
                for x, y in data:
                    sgd.zero_grad()
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
                    sgd.step()
                    sched.step()
                for _ in range((max(counts) - counts[rank]) * padded):
                    still.zero_grad()
                    (ddp(torch.zeros(1, 784)).sum() * 0).backward()
                    still.step()
            if padded:
                root = len(counts) - 1 - counts[::-1].index(max(counts))
                spardl_grace.broadcast_parameters(model.named_parameters(), root)
                spardl_grace.broadcast_optimizer_state(sgd, root)
                sched.load_state_dict(broadcast_object(sched.state_dict(), root))
    return {"params": flat_params(model), "steps": state.synchronized_steps,
            "schedule": _schedule_of(sgd, sched),
            "momentum": [s["momentum_buffer"] for s in sgd.state_dict()["state"].values()],
            "warnings": [str(w.message) for w in caught if "spardl_grace" in str(w.message)]}


def ddp_join(_transport) -> dict:
    """Under torchrun: torch's Join with the hook, and the padded reference; and Join where a
    rank's first epoch is empty (DDP's buckets are then rebuilt from that rank's empty record,
    so the padded loop, whose rank 0 runs a backward, has other buckets: no reference); and
    Join with the scheduler left out of SameOptimizerState."""
    return {"joined": _ddp_job(padded=False), "padded": _ddp_job(padded=True),
            "empty_first": _ddp_job(padded=False, epochs=EMPTY_FIRST),
            "scheduler_left_out": _ddp_job(padded=False, stateful=False)}



def gan_joined(_transport, transport=None) -> dict:
    """A generator and a discriminator, each with a DistributedOptimizer built the default way
    (grace_from_params(params): a channel each), stepped in turn inside one block; rank r has
    2 + 2r batches. `transport`: one for both, in-process."""
    def optimizer(model, ratio):
        grc = spardl_grace.grace_from_params({**PARAMS, "compress_ratio": ratio}, transport)
        return spardl_grace.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), grc,
            named_parameters=model.named_parameters(), bucket_cap_mb=0.02)

    rank = transport.rank if transport is not None else _rank()
    size = transport.size if transport is not None else _size()
    gen, disc = mlp(), mlp()
    opt_g, opt_d = optimizer(gen, 0.05), optimizer(disc, 0.1)
    critic = torch.nn.Linear(10, 1)
    with torch.no_grad():
        critic.weight.fill_(0.1)
        critic.bias.zero_()
    with spardl_grace.join_uneven_inputs(opt_g, opt_d) as block:
        for x, y in batches(rank, size, 2 + 2 * rank):
            opt_d.zero_grad()
            torch.nn.functional.cross_entropy(disc(x), y).backward()
            opt_d.step()
            opt_g.zero_grad()
            critic(gen(x) * disc(x).detach()).mean().backward()
            opt_g.step()
    return {"gen": flat_params(gen), "disc": flat_params(disc), "last_rank": block.last_rank,
            "steps_without_data": block.steps_without_data,
            "steps": (opt_g._sync.steps, opt_d._sync.steps)}


def _rank() -> int:
    return spardl_grace.transport.shared_transport().rank


def _size() -> int:
    return spardl_grace.transport.shared_transport().size
