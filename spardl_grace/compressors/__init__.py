"""GRACE's compressors, one module each (the module docstring says what it sends)."""

from .dgc import DgcCompressor
from .efsignsgd import EFSignSGDCompressor
from .fp16 import FP16Compressor
from .natural import NaturalCompressor
from .none import NoneCompressor
from .onebit import OneBitCompressor
from .powersgd import PowerSGDCompressor
from .qsgd import QSGDCompressor
from .randomk import RandomKCompressor
from .signsgd import SignSGDCompressor
from .signum import SignumCompressor
from .terngrad import TernGradCompressor
from .threshold import ThresholdCompressor
from .topk import TopKCompressor

__all__ = [
    "DgcCompressor",
    "EFSignSGDCompressor",
    "FP16Compressor",
    "NaturalCompressor",
    "NoneCompressor",
    "OneBitCompressor",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "SignSGDCompressor",
    "SignumCompressor",
    "TernGradCompressor",
    "ThresholdCompressor",
    "TopKCompressor",
]
