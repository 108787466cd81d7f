"""spardl-grace: sparse, compressed gradient synchronisation for PyTorch behind the GRACE API.

from spardl_grace import grace_from_params
grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                         'communicator': 'spardl', 'compress_ratio': 0.01})
p.grad = grc.step(p.grad, name)                                  # GRACE's loop, or
optimizer = DistributedOptimizer(optimizer, grc, named_parameters=model.named_parameters())
ddp.register_comm_hook(CommHookState(grc, ddp), comm_hook)         # DDP
"""

import importlib
import warnings
from typing import Any

from . import fsdp, grace_dl_compat
from .api import Communicator, Compressor, Memory
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .ddp import CommHookState, comm_hook
from .join import join_uneven_inputs
from .optimizer import DistributedOptimizer
from .registry import grace_from_params
from .version import __version__

grace_dl_compat.register_with_grace_dl()

__all__ = [
    "CommHookState",
    "Communicator",
    "Compressor",
    "DistributedOptimizer",
    "Memory",
    "__version__",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm_hook",
    "fsdp",
    "grace_from_params",
    "join_uneven_inputs",
]

#: names the top level held before 0.3, now in their submodules: name -> submodule
MOVED = {
    "COMMUNICATORS": "registry",
    "COMPRESSORS": "registry",
    "MEMORIES": "registry",
    "resolve_params": "registry",
    "CountingTransport": "transport",
    "Transport": "transport",
    "TransportError": "transport",
    "TransportTimeout": "transport",
    "run_local": "transport",
    "IdentityCodec": "payload",
    "PayloadCodec": "payload",
    "SparseAllreduce": "api",
    "Synchronizer": "api",
    "broadcast_object": "broadcast",
    "register_with_grace_dl": "grace_dl_compat",
}


def __getattr__(name: str) -> Any:
    """The old top-level names, for one more release, with a DeprecationWarning naming the
    new place."""
    if name in MOVED:
        module = f"{__name__}.{MOVED[name]}"
        warnings.warn(
            f"spardl_grace.{name} moved to {module}.{name}; the top-level name goes in the "
            "next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
