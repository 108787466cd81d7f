"""'dgc' (Deep Gradient Compression): estimates the top-(compress_ratio) threshold from a 1%
random sample, adjusts it (x1.3 / x0.7, up to 10 times) until the selected count is within
[0.7, 1.3] of the target, and sends the selected [values, indices] (variable size). The
sample positions come from a per-rank seeded generator, so runs are reproducible."""

import torch

from ..api import Compressor
from ..selection import not_below
from ..utils.seeding import generator
from ._sparse import SparseCompressorMixin


class DgcCompressor(SparseCompressorMixin, Compressor):
    """GRACE's 'dgc': entries above a threshold estimated from a random sample (module
    docstring), sent as [values, indices] of varying size."""

    def __init__(self, compress_ratio: float, sample_ratio: float = 0.01, seed: int = 0):
        super().__init__(tensors_size_are_same=False)
        self.compress_ratio = compress_ratio
        self.sample_ratio = sample_ratio
        self.seed = seed

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        numel = flat.numel()
        magnitude = flat.abs()
        g = generator("cpu", "dgc", self.seed, self.rank, name, self.next_step(name))
        n_sample = max(1, int(numel * self.sample_ratio))
        sample = magnitude[torch.randint(0, numel, (n_sample,), generator=g).to(flat.device)]
        k_sample = max(1, int(n_sample * self.compress_ratio))
        threshold = torch.topk(sample, k_sample, sorted=False).values.min()
        target = numel * self.compress_ratio
        mask = not_below(magnitude, threshold)
        for _ in range(10):
            selected = int(mask.sum())
            if selected > 1.3 * target:
                threshold = threshold * 1.3
            elif selected < 0.7 * target:
                threshold = threshold * 0.7
            else:
                break
            mask = not_below(magnitude, threshold)
        indices = torch.nonzero(mask).reshape(-1)
        return [flat[indices], indices], (numel, tensor.shape, mask)

    def decompress(self, tensors, ctx):
        """The dense tensor from [values, indices] (ctx also holds the selection mask, which the
        dgc memory uses)."""
        return super().decompress(tensors, ctx[:2])
