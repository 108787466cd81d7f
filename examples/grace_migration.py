"""A GRACE user's script (grace_dl with its Horovod patch) after the move to spardl-grace: the
import of grace_from_params and the optimizer's name change, nothing else
(docs/guide/migrating.md shows the two lines). GRACE's keys and GRACE's compressors run as
they are; 'communicator': 'spardl' with 'memory': 'global_residual' switches to SparDL.

    horovodrun -np 2 -H localhost:2 --gloo python examples/grace_migration.py
"""
import horovod.torch as hvd
import torch

import spardl_grace
from spardl_grace import grace_from_params  # was: from grace_dl.torch.helper import grace_from_params
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
hvd.init()

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

params = {'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather',
          'compress_ratio': args.density}
grc = grace_from_params(params)
optimizer = spardl_grace.DistributedOptimizer(optimizer, grc,  # was: hvd.DistributedOptimizer
                                              named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

losses = [train_step(model, optimizer, hvd.rank(), step) for step in range(args.steps)]
report(hvd.rank(), losses, replicas_identical(grc.transport, model))
