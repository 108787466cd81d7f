"""SparDL under mpirun, without Horovod or torch.distributed: the MPI transport (mpi4py).

    mpirun -np 2 python examples/mpirun_optimizer.py

grace_from_params finds MPI from mpirun's environment.
"""
import torch

import spardl_grace
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
model = make_model()
grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                      'communicator': 'spardl', 'compress_ratio': args.density})
spardl_grace.broadcast_parameters(model.state_dict(), root_rank=0, transport=grc.transport)
optimizer = spardl_grace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                              momentum=0.9),
                                              grc, named_parameters=model.named_parameters())

rank = grc.transport.rank
losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
report(rank, losses, replicas_identical(grc.transport, model))
