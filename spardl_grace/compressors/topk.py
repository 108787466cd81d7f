"""'topk': sends the k = max(1, compress_ratio * numel) entries of largest magnitude as
[values, int64 indices] (exact top-k, GRACE's wire format)."""

from ..api import Compressor
from ..selection import count_for_ratio, topk_abs
from ._sparse import SparseCompressorMixin


class TopKCompressor(SparseCompressorMixin, Compressor):
    """GRACE's 'topk': the compress_ratio fraction of entries largest in magnitude, sent as
    [values, int64 indices] (the same size on every rank)."""

    def __init__(self, compress_ratio: float):
        super().__init__()
        self.compress_ratio = compress_ratio

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        indices = topk_abs(flat, count_for_ratio(flat.numel(), self.compress_ratio))
        return [flat[indices], indices], (flat.numel(), tensor.shape)
