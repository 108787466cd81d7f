"""A rank that ends as users' scripts end, without os._exit:

    torchrun --standalone --nproc-per-node 2 tests/exit_release_worker.py OUTDIR

An exit handler registered before the library's first transport runs after the library's own
(atexit runs the last registered first), and writes to OUTDIR/rank{r}.txt whether the library
had released its process group by then."""
from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spardl_grace.transport.torch_dist import TorchDistTransport

outdir = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
transports: list[TorchDistTransport] = []
atexit.register(lambda: (outdir / f"rank{rank}.txt").write_text(
    str(transports[0]._group is None)))
transports.append(TorchDistTransport(timeout=30))
transports[0].allreduce(torch.ones(1), "exit.probe")
dist.destroy_process_group()
