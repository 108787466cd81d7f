"""SparDL with DeepReduce's codecs on every message: Bloom-filter indices and curve-fitted
values, against uncoded SparDL (the exact wire: int32 indices, float32 values) trained side by
side in the same processes.

    torchrun --standalone --nproc-per-node 2 examples/deepreduce_codecs.py

Lossy codecs stay exact where it matters: the sender subtracts from its residual exactly what
the receivers decode, so nothing is lost, and every rank applies the same update.
"""
import torch
import torch.distributed as dist

import spardl_grace
from deepreduce_compat import deepreduce_from_params
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank = dist.get_rank()

for label, codec in [("uncoded", {'wire': 'exact'}),
                     ("bloom + polyfit", {'deepreduce': 'both', 'index': 'bloom',
                                          'value': 'polyfit', 'policy': 'p0'})]:
    model = make_model()
    grc = deepreduce_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                  'communicator': 'spardl', 'compress_ratio': args.density,
                                  **codec})
    optimizer = spardl_grace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                                  momentum=0.9),
                                                  grc, named_parameters=model.named_parameters())
    losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
    report(rank, losses, replicas_identical(grc.transport, model),
           f"; {label}: {optimizer.last_stats['bytes_sent']:.0f} bytes sent per step")
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
