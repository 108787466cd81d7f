"""spardl-grace: sparse, compressed gradient synchronisation for PyTorch behind the GRACE API.

    from spardl_grace import grace_from_params
    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'compress_ratio': 0.01})
    p.grad = grc.step(p.grad, name)                                  # GRACE's loop, or
    optimizer = DistributedOptimizer(optimizer, grc, named_parameters=model.named_parameters())
    ddp.register_comm_hook(CommHookState(grc, ddp), comm_hook)         # DDP
"""
from .api import Communicator, Compressor, Memory, SparseAllreduce
from .broadcast import broadcast_parameters
from .ddp import CommHookState, comm_hook
from .optimizer import DistributedOptimizer
from .payload import IdentityCodec, PayloadCodec
from .registry import COMMUNICATORS, COMPRESSORS, MEMORIES, grace_from_params, resolve_params
from .transport import CountingTransport, Transport, TransportError, TransportTimeout, run_local
from .grace_dl_compat import register_with_grace_dl
from .version import __version__

register_with_grace_dl()

__all__ = ["Compressor", "Memory", "Communicator", "SparseAllreduce", "PayloadCodec",
           "IdentityCodec", "grace_from_params", "resolve_params", "COMPRESSORS", "MEMORIES",
           "COMMUNICATORS", "Transport", "TransportError", "TransportTimeout", "CountingTransport",
           "run_local", "DistributedOptimizer", "CommHookState", "comm_hook",
           "broadcast_parameters", "register_with_grace_dl"]
