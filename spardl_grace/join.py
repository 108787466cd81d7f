"""Uneven inputs under DistributedOptimizer: ranks whose data run out at different steps.

    with spardl_grace.join_uneven_inputs(optimizer) as joined:
        for x, y in loader:            # a different number of batches on each rank
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    joined.last_rank                   # the rank that ran out last: every rank now holds its model

What Horovod's hvd.join() and torch's Join do for their own collectives, on the library's
channel, under any launcher (horovodrun, torchrun, mpirun). Inside the block, each step that
synchronises begins with one all-reduce of one number: how many ranks still have data. A rank
whose loop has ended waits at the block's exit and takes part in the others' steps with zero
gradients (zero moves with 'exchange': 'update'), without an optimizer step: its residuals
and step counters move on as the others' do, so every rank stays at the same step, and the
average is still over all ranks, as DDP's Join divides by the initial world size. Once every
rank has ended, every rank takes the parameters and the optimizer state of the rank that ended
last (the highest rank among those that ended at the last step), so the replicas are the same
bits when the block ends; residuals stay each rank's own.

The DDP hook needs none of this: torch's Join([ddp_model]) runs the hook with DDP's zero
buckets on the ranks that ended (see the integrations guide).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from .broadcast import broadcast_optimizer_state, broadcast_parameters


class UnevenInputs:
    """The block join_uneven_inputs(optimizer) returns; after it ends, `last_rank` is the rank
    whose parameters and optimizer state every rank took (hvd.join()'s return value) and
    `steps_without_data` the steps this rank took part in after its own loop ended."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not hasattr(optimizer, "_sync") or not hasattr(optimizer, "_slots"):
            raise TypeError(
                "join_uneven_inputs takes a spardl_grace.DistributedOptimizer, got "
                f"{type(optimizer).__name__}: under the DDP hook use torch's "
                "torch.distributed.algorithms.Join([ddp_model])"
            )
        if not optimizer._slots:
            raise ValueError(
                "join_uneven_inputs: the optimizer has no parameter that needs a gradient, so "
                "its steps never synchronise and there is nothing to join"
            )
        self.optimizer: Any = optimizer
        self.last_rank: int | None = None
        self.steps_without_data = 0

    def __enter__(self) -> UnevenInputs:
        optimizer = self.optimizer
        if optimizer._joining:
            raise ValueError("join_uneven_inputs: this optimizer is already inside such a block")
        if optimizer._pending:
            raise ValueError(
                "join_uneven_inputs: a step is under way (backward() ran, step() did not): "
                "enter the block before the loop"
            )
        optimizer._joining = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        optimizer = self.optimizer
        optimizer._joining = False
        if kind is not None:
            return
        last = True
        while optimizer._count_ranks_with_data(False):
            last = False
            optimizer._step_without_data()
            self.steps_without_data += 1
        transport = optimizer._sync.grace.transport
        ended_last = torch.zeros(transport.size, dtype=torch.int64)
        ended_last[transport.rank] = int(last)
        flags = transport.allreduce(ended_last, "join.ended_last")
        root = int(torch.nonzero(flags).max())
        broadcast_parameters([(name, p) for p, name in optimizer._names.items()], root, transport)
        broadcast_optimizer_state(optimizer, root, transport)
        # The state came from root's steps, which its own first step checked.
        optimizer._resume_checked = True
        self.last_rank = transport.global_rank(root)


def join_uneven_inputs(optimizer: torch.optim.Optimizer) -> UnevenInputs:
    """A block inside which ranks may run out of data at different steps (see the module
    docstring): every rank enters it before its loop, with the DistributedOptimizer that
    synchronises the loop's steps; one block per optimizer. A block left by an exception does
    not wait for the others (their next step then fails with the transport's timeout, as
    without the block). TypeError for an optimizer that is not a DistributedOptimizer (the DDP
    hook takes torch's Join), ValueError for one without trainable parameters or already in a
    block."""
    return UnevenInputs(optimizer)
