"""A Horovod user's script after the move to spardl-grace: Horovod's documented calls, with
the optimizer's name changed and nothing else (docs/guide/migrating.md shows the two lines).

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_migration.py [--fp16-allreduce]

Without a communicator, spardl_grace.DistributedOptimizer synchronises with SparDL at density
0.01 on the compact wire, whose bfloat16 values already are what --fp16-allreduce asks for.
"""
import argparse

import horovod.torch as hvd
import torch

import spardl_grace
from toy_task import make_model, replicas_identical, report, train_step

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--fp16-allreduce", action="store_true", default=False)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size() / 2, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = spardl_grace.DistributedOptimizer(optimizer,  # was: hvd.DistributedOptimizer
                                              named_parameters=model.named_parameters(),
                                              compression=compression,
                                              op=hvd.Average,
                                              gradient_predivide_factor=1.0)

losses = [train_step(model, optimizer, hvd.rank(), step) for step in range(args.steps)]
report(hvd.rank(), losses, replicas_identical(optimizer.grace.transport, model),
       f"; bytes sent per step: {optimizer.last_stats['bytes_sent']:.0f}")
