"""SparDL in a Horovod script: spardl_grace.DistributedOptimizer in place of Horovod's.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_optimizer.py

grace_from_params finds Horovod (hvd.init() ran) and communicates through it.
"""
import horovod.torch as hvd
import torch

import spardl_grace
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
hvd.init()

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                      'communicator': 'spardl', 'compress_ratio': args.density})
# was: optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
optimizer = spardl_grace.DistributedOptimizer(optimizer, grc,
                                              named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

losses = [train_step(model, optimizer, hvd.rank(), step) for step in range(args.steps)]
report(hvd.rank(), losses, replicas_identical(grc.transport, model),
       f"; bytes sent per step: {optimizer.last_stats['bytes_sent']:.0f}")
