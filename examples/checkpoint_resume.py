"""Checkpoint and resume with the compression state: a resumed run continues bit for bit.

    CHECKPOINT_DIR=/tmp torchrun --standalone --nproc-per-node 2 examples/checkpoint_resume.py

Trains --steps steps without stopping, then trains again from scratch, stops halfway, saves a
crash-safe checkpoint per rank, builds everything anew (as a restarted job would), resumes
from the newest checkpoint every rank holds (load_agreed_checkpoint: None, and a fresh start,
when no rank holds one) and finishes. SparDL's residuals, step counters and warm-up progress
travel in the compression state; without them the resumed run would drop the gradient mass
held back in the residuals. The ranks join through spardl_grace.launch.join, which also keeps
torchrun's restart rounds apart (--max-restarts; see the reliability guide).
"""
import os
import uuid

import torch

import spardl_grace
from spardl_grace.checkpoint import load_agreed_checkpoint, save_checkpoint
from spardl_grace.launch import join
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import flat_params, make_model, parse_args, replicas_identical, train_step

args = parse_args(__doc__, steps=40)
rank = join().rank
path = os.path.join(os.environ.get("CHECKPOINT_DIR", "."), f"checkpoint-rank{rank}.pt")


def build():
    """Model, optimizer and communicator as a freshly started job builds them."""
    model = make_model()
    grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                          'communicator': 'spardl',
                                          'compress_ratio': args.density})
    optimizer = spardl_grace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                                  momentum=0.9),
                                                  grc, named_parameters=model.named_parameters())
    return model, optimizer, grc


model, optimizer, _ = build()
for step in range(args.steps):
    train_step(model, optimizer, rank, step)
uninterrupted = flat_params(model)

model, optimizer, grc = build()
half = args.steps // 2
for step in range(half):
    train_step(model, optimizer, rank, step)
run_id = uuid.UUID(int=0).hex  # a real job draws one and keeps it across restarts
save_checkpoint({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                 'compression': optimizer.compression_state_dict(),
                 'step': half, 'run_id': run_id}, path)

model, optimizer, grc = build()  # the restarted job: the same code starts fresh or resumes
resumed = load_agreed_checkpoint(grc.transport, path)  # the newest step every rank holds
first = 0
if resumed is not None:
    saved, loaded_from = resumed
    model.load_state_dict(saved['model'])
    optimizer.load_state_dict(saved['optimizer'])
    optimizer.load_compression_state_dict(saved['compression'])
    first = saved['step']
for step in range(first, args.steps):
    train_step(model, optimizer, rank, step)

identical = replicas_identical(grc.transport, model)
if rank == 0:
    print(f"resumed from {loaded_from.name} at step {first}; bit-identical to the "
          f"uninterrupted run: {torch.equal(flat_params(model), uninterrupted)}; "
          f"replicas identical: {identical}", flush=True)
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
