"""FSDP2 with SparDL as its reduce-scatter: flat sharding over every rank.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_flat.py

For clusters with no fast links anywhere. FSDP2 shards the parameters over all ranks; each
unit's gradient reduce-scatter is SparDL's Spar-Reduce-Scatter: a rank sends the top entries of
the other ranks' shards and keeps the rest as its residual, and its own shard of the sum is its
own gradient there plus what the others sent. FSDP's parameter all-gathers stay dense.
"""
import torch
import torch.distributed as dist

import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import make_model, parse_args, report, train_step

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank = dist.get_rank()

model = make_model()
sync = spardl_grace.fsdp.flat_shard(model, {
    'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
    'compress_ratio': args.density})

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
full = torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])
identical = all(torch.equal(full, other)  # every rank gathers the same whole model
                for other in sync.grace.transport.allgather(full, "example.check"))
report(rank, losses, identical, f"; bytes sent by the reduce-scatters per step: "
       f"{sync.bytes_sent / args.steps:.0f}")
destroy_and_exit()
