"""spardl-grace: sparse, compressed gradient synchronisation for PyTorch behind the GRACE API.

from spardl_grace import grace_from_params
grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                         'communicator': 'spardl', 'compress_ratio': 0.01})
p.grad = grc.step(p.grad, name)                                  # GRACE's loop, or
optimizer = DistributedOptimizer(optimizer, grc, named_parameters=model.named_parameters())
ddp.register_comm_hook(CommHookState(grc, ddp), comm_hook)         # DDP
"""

from . import fsdp
from .api import Communicator, Compressor, Memory, SparseAllreduce, Synchronizer
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ddp import CommHookState, comm_hook
from .grace_dl_compat import register_with_grace_dl
from .optimizer import DistributedOptimizer
from .payload import IdentityCodec, PayloadCodec
from .registry import COMMUNICATORS, COMPRESSORS, MEMORIES, grace_from_params, resolve_params
from .transport import CountingTransport, Transport, TransportError, TransportTimeout, run_local
from .version import __version__

register_with_grace_dl()

__all__ = [
    "COMMUNICATORS",
    "COMPRESSORS",
    "MEMORIES",
    "CommHookState",
    "Communicator",
    "Compressor",
    "CountingTransport",
    "DistributedOptimizer",
    "IdentityCodec",
    "Memory",
    "PayloadCodec",
    "SparseAllreduce",
    "Synchronizer",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "__version__",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
    "fsdp",
    "grace_from_params",
    "register_with_grace_dl",
    "resolve_params",
    "run_local",
]
