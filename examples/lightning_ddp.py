"""SparDL inside PyTorch Lightning's DDPStrategy.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py
    python examples/lightning_ddp.py          # or let Lightning start the 2 processes

Your Lightning script stays as it is; one callback changes (marked below). It registers
SparDL as the communication hook of the DDP module Lightning builds, and keeps every rank's
residuals in Lightning's checkpoints, so trainer.fit(model, ckpt_path=...) resumes bit for bit.
"""
import lightning.pytorch as pl
import torch

import spardl_grace.lightning
from spardl_grace.transport.torch_dist import destroy_and_exit
from toy_task import batch, make_model, parse_args, replicas_identical, report

args = parse_args(__doc__)


class ToyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model()
        self.losses: list[float] = []

    def training_step(self, data, index):
        x, y = data
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


# The samples both ranks' batches come from; Lightning gives each rank its half.
x, y = zip(*(batch(rank, step) for step in range(args.steps) for rank in (0, 1)))
data = torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y))
module = ToyModule()
sparse = spardl_grace.lightning.GradientCompression({   # <- the changed line
    'compressor': 'topk', 'memory': 'global_residual', 'communicator': 'spardl',
    'compress_ratio': args.density})
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                     callbacks=[sparse], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
report(trainer.global_rank, module.losses,
       replicas_identical(sparse.state.sync.grace.transport, module.model),
       f"; bytes sent per step: {sparse.state.last_stats['bytes_sent']:.0f}")
destroy_and_exit()  # see ddp_comm_hook.py
