"""GRACE (grace_dl) users' isinstance checks: this library's Compressor, Memory and
Synchronizer (every communicator, GRACE's and the sparse all-reduces) register as virtual
subclasses of grace_dl's ABCs when grace_dl is importable.

grace_dl is installed from its repository, not from the package index, so it is optional:
without it nothing happens. Registration runs when spardl_grace is imported; a grace_dl
imported later is registered by calling register_with_grace_dl() again.
"""

from __future__ import annotations

import importlib

from .api import Compressor, Memory, Synchronizer

#: grace_dl's flavours that define the three ABCs (torch.distributed's and Horovod's)
GRACE_MODULES = ("grace_dl.dist", "grace_dl.torch")


def register_with_grace_dl() -> list[str]:
    """Register Compressor, Memory and Synchronizer (GRACE's communicators and the sparse
    all-reduces alike) with grace_dl's Compressor, Memory and Communicator in every importable
    module of GRACE_MODULES; the modules registered with."""
    registered = []
    for module_name in GRACE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for ours, name in (
            (Compressor, "Compressor"),
            (Memory, "Memory"),
            (Synchronizer, "Communicator"),
        ):
            theirs = getattr(module, name, None)
            register = getattr(theirs, "register", None)
            if isinstance(theirs, type) and callable(register):
                register(ours)
        registered.append(module_name)
    return registered
