"""'onebit' (1-bit SGD): sends one uint8 per entry (x < 0) plus the mean of the negative and of
the non-negative entries; decompression puts each entry at the mean of its side."""

import torch

from ..api import Compressor


class OneBitCompressor(Compressor):
    """GRACE's 'onebit': one bit per entry and the mean of each side (module docstring)."""

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        negative = flat < 0
        n_neg = negative.sum()
        n_pos = flat.numel() - n_neg
        mean_neg = torch.where(negative, flat, 0).sum() / n_neg.clamp(min=1)
        mean_pos = torch.where(negative, 0, flat).sum() / n_pos.clamp(min=1)
        means = torch.stack([mean_neg, mean_pos]).to(flat.dtype)
        return [negative.to(torch.uint8), means], tensor.shape

    def decompress(self, tensors, ctx):
        negative, means = tensors
        return torch.where(negative.bool(), means[0], means[1]).view(ctx)
