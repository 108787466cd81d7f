"""FSDP2 inside a node, SparDL between nodes: hybrid sharding on a 2 x 2 device mesh.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_hybrid.py

Ranks 0-1 and 2-3 stand for two nodes. Inside a node, FSDP2 shards the parameters (its
all-gathers and reduce-scatters use the fast links); between the nodes only SparDL's sparse
messages travel: each unit's gradient shard is averaged across the nodes in its all-reduce hook,
with a residual per unit and rank. FSDP's native HSDP would all-reduce that shard dense.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import make_model, parse_args, report, train_step

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

model = make_model()
sync = spardl_grace.fsdp.hybrid_shard(model, mesh, {
    'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
    'compress_ratio': args.density})

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
shards = torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()])
identical = all(torch.equal(shards, other)  # the same shards on both nodes
                for other in sync.grace.transport.allgather(shards, "example.check"))
report(rank, losses, identical, f"; bytes sent across the nodes per step: "
       f"{sync.bytes_sent / args.steps:.0f}")
destroy_and_exit()
