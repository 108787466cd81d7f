"""SparDL inside Hugging Face Accelerate.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py

(torchrun because it trains on CPUs: `accelerate launch --cpu` starts one process. On GPUs,
drop cpu=True and run `accelerate launch --multi_gpu --num_processes 2 ...`.)

Your Accelerate script stays as it is; one line after accelerator.prepare registers SparDL as
the communication hook of the DDP module prepare built, and its compression state (every rank's
residuals) for accelerator.save_state / load_state. The script saves half-way and trains on,
then loads that state into a fresh model and trains the second half again: both ends are
bit-identical. CHECKPOINT_DIR (default: the temporary directory) must be shared by the ranks.
"""
import os
import tempfile

import torch
from accelerate import Accelerator

import spardl_grace.accelerate
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import flat_params, make_model, parse_args, replicas_identical, report, train_step

args = parse_args(__doc__)
saved = os.path.join(os.environ.get("CHECKPOINT_DIR", tempfile.gettempdir()), "accelerate_ddp")


def train(first_step: int, resume: bool):
    """Steps first_step.. of a fresh model, after load_state(saved) when resuming; the first
    run saves after half of the steps."""
    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = spardl_grace.accelerate.register_comm_hook(accelerator, model, {  # <- the added line
        'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
        'compress_ratio': args.density})
    if resume:
        accelerator.load_state(saved)
    losses = []
    for step in range(first_step, args.steps):
        losses.append(train_step(model, optimizer, accelerator.process_index, step))
        if not resume and step == args.steps // 2 - 1:
            accelerator.save_state(saved)
    return accelerator, model, state, losses


accelerator, model, state, losses = train(0, resume=False)
_, resumed, _, _ = train(args.steps // 2, resume=True)
transport = state.sync.grace.transport
report(accelerator.process_index, losses, replicas_identical(transport, model),
       f"; bytes sent per step: {state.last_stats['bytes_sent']:.0f}; resumed run "
       f"bit-identical: {torch.equal(flat_params(model), flat_params(resumed))}")
destroy_and_exit()  # see ddp_comm_hook.py
