"""Local AdamW steps and a sparse outer step (DiLoCo with SparseLoCo's compression), from
grace_from_params' keys: each rank's AdamW takes 4 steps on its own batches, then the ranks
average their moves since the last exchange through SparDL (top-k with error feedback, its
entries coded by DeepReduce: delta indices, QSGD values) and take the outer step. Nothing is
sent in between.

    torchrun --standalone --nproc-per-node 2 examples/diloco_sparse.py

'exchange': 'update' exchanges the optimizer's moves instead of gradients, so AdamW never
sees a sparse gradient; 'exchange_period' is DiLoCo's H; 'outer_lr' and 'outer_momentum' are
its outer SGD with Nesterov momentum (here plain averaging, which did best on a small
transformer); the codec keys make an entry cost 0.44 of the compact wire's bytes, so the
density can be twice as high at the same bytes (this setting had the lowest mean of the
5-seed sparse arms at about 1/24 of dense's bytes on the accuracy page's transformer). The ranks share parameters after each
exchange: evaluate and save then.
"""
import torch
import torch.distributed as dist

import deepreduce_compat  # noqa: F401  (registers the codec keys 'deepreduce', 'index', 'value')
import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank = dist.get_rank()

model = make_model()
spardl_grace.broadcast_parameters(model.state_dict(), root_rank=0)
grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                      'communicator': 'spardl', 'compress_ratio': 0.4,
                                      'deepreduce': 'both', 'index': 'delta', 'value': 'qsgd',
                                      'exchange': 'update', 'exchange_period': 4,
                                      'outer_lr': 1.0, 'outer_momentum': 0.0})
optimizer = spardl_grace.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              grc, named_parameters=model.named_parameters())

losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
report(rank, losses, replicas_identical(grc.transport, model),
       f"; bytes sent per step: {optimizer.last_stats['bytes_sent'] / 4:.0f}")
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
