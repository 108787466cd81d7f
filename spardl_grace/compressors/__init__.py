"""GRACE's compressors, one module each (the module docstring says what it sends)."""
from .none import NoneCompressor
from .fp16 import FP16Compressor
from .topk import TopKCompressor
from .randomk import RandomKCompressor
from .threshold import ThresholdCompressor
from .dgc import DgcCompressor
from .qsgd import QSGDCompressor
from .terngrad import TernGradCompressor
from .signsgd import SignSGDCompressor
from .signum import SignumCompressor
from .efsignsgd import EFSignSGDCompressor
from .onebit import OneBitCompressor
from .natural import NaturalCompressor
from .powersgd import PowerSGDCompressor

__all__ = ["NoneCompressor", "FP16Compressor", "TopKCompressor", "RandomKCompressor",
           "ThresholdCompressor", "DgcCompressor", "QSGDCompressor", "TernGradCompressor",
           "SignSGDCompressor", "SignumCompressor", "EFSignSGDCompressor", "OneBitCompressor",
           "NaturalCompressor", "PowerSGDCompressor"]
