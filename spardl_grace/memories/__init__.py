"""GRACE's memories (error feedback) plus 'global_residual' for the sparse all-reduces."""

from .dgc import DgcMemory
from .efsignsgd import EFSignSGDMemory
from .none import NoneMemory
from .powersgd import PowerSGDMemory
from .residual import GlobalResidualMemory, ResidualMemory

__all__ = [
    "DgcMemory",
    "EFSignSGDMemory",
    "GlobalResidualMemory",
    "NoneMemory",
    "PowerSGDMemory",
    "ResidualMemory",
]
