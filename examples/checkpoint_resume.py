"""Checkpoint and resume with the compression state: a resumed run continues bit for bit.

    CHECKPOINT_DIR=/tmp torchrun --standalone --nproc-per-node 2 examples/checkpoint_resume.py

Trains --steps steps without stopping, then trains again from scratch, stops halfway, saves a
crash-safe checkpoint per rank, builds everything anew (as a restarted job would), loads it
and finishes. SparDL's residuals, step counters and warm-up progress travel in the compression
state; without them the resumed run would drop the gradient mass held back in the residuals.
"""
import os
import uuid

import torch
import torch.distributed as dist

import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from spardl_grace.checkpoint import check_same_step, load_checkpoint, save_checkpoint
from toy_task import flat_params, make_model, parse_args, replicas_identical, train_step

args = parse_args(__doc__, steps=40)
dist.init_process_group("gloo")
rank = dist.get_rank()
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

model, optimizer, grc = build()  # the restarted job
saved, loaded_from = load_checkpoint(path)
check_same_step(grc.transport, saved['step'], saved['run_id'])  # every rank, or all raise
model.load_state_dict(saved['model'])
optimizer.load_state_dict(saved['optimizer'])
optimizer.load_compression_state_dict(saved['compression'])
for step in range(saved['step'], args.steps):
    train_step(model, optimizer, rank, step)

identical = replicas_identical(grc.transport, model)
if rank == 0:
    print(f"resumed from {loaded_from.name} at step {saved['step']}; bit-identical to the "
          f"uninterrupted run: {torch.equal(flat_params(model), uninterrupted)}; "
          f"replicas identical: {identical}", flush=True)
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
