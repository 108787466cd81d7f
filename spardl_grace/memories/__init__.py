"""GRACE's memories (error feedback) plus 'global_residual' for the sparse all-reduces."""
from .none import NoneMemory
from .residual import GlobalResidualMemory, ResidualMemory
from .dgc import DgcMemory
from .efsignsgd import EFSignSGDMemory
from .powersgd import PowerSGDMemory

__all__ = ["NoneMemory", "ResidualMemory", "GlobalResidualMemory", "DgcMemory", "EFSignSGDMemory",
           "PowerSGDMemory"]
