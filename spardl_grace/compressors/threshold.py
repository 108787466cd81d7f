"""'threshold': sends every entry with |x| > threshold as [values, indices] (variable size)."""

import torch

from ..api import Compressor
from ._sparse import SparseCompressorMixin


class ThresholdCompressor(SparseCompressorMixin, Compressor):
    """GRACE's 'threshold': every entry with |x| > threshold, sent as [values, indices] of
    varying size."""

    def __init__(self, threshold: float):
        super().__init__(tensors_size_are_same=False)
        self.threshold = threshold

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        indices = torch.nonzero(flat.abs() > self.threshold).reshape(-1)
        return [flat[indices], indices], (flat.numel(), tensor.shape)
