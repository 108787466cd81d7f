"""SparDL through DistributedDataParallel's communication hook.

    torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py

Your DDP script stays as it is; two lines register the hook. DDP's bucket_cap_mb decides the
fusion: one large bucket gives SparDL the whole model at once (fewest messages, selection
balanced over all parameters).
"""
import torch
import torch.distributed as dist

import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank = dist.get_rank()

model = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=1024)
grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                      'communicator': 'spardl', 'compress_ratio': args.density})
hook_state = spardl_grace.CommHookState(grc, model)
model.register_comm_hook(hook_state, spardl_grace.comm_hook)

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
losses = [train_step(model, optimizer, rank, step) for step in range(args.steps)]
report(rank, losses, replicas_identical(grc.transport, model),
       f"; bytes sent per step: {hook_state.last_stats['bytes_sent']:.0f}")
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
