"""GRACE's own training loop: each gradient through grc.step(), then the plain optimizer.

    torchrun --standalone --nproc-per-node 2 examples/grace_loop.py

This is how GRACE's dist examples (grace_dl.dist) use a communicator. Coming from GRACE, only
the import of grace_from_params changes. Fusing the whole model into one tensor gives SparDL
one selection over all parameters and fewer messages (see spardl_grace.fusion).
"""
import torch
import torch.distributed as dist

import spardl_grace
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import batch, make_model, parse_args, replicas_identical, report

args = parse_args(__doc__)
dist.init_process_group("gloo")
rank = dist.get_rank()

model = make_model()
spardl_grace.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
grc = spardl_grace.grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                      'communicator': 'spardl', 'compress_ratio': args.density})

losses = []
for step in range(args.steps):
    x, y = batch(rank, step)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        p.grad = grc.step(p.grad, name)  # the average over ranks of what SparDL selected
    optimizer.step()
    losses.append(loss.item())
report(rank, losses, replicas_identical(grc.transport, model))
# torch 2.13's gloo can abort a process that exits normally after its last collective
# ("terminate called without an active exception"); this ends the process without that race.
destroy_and_exit()
