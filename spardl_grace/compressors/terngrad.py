"""'terngrad': clips to 2.5 standard deviations, then sends a ternary {-1, 0, 1} int8 tensor and
one scale s = max|x|; each entry is +-s with probability |x| / s (unbiased after clipping).
Per-rank seeded randomness."""

import torch

from ..api import Compressor
from ..utils.seeding import generator


class TernGradCompressor(Compressor):
    """GRACE's 'terngrad': unbiased ternary quantisation after clipping (module docstring)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()
        clip = 2.5 * flat.std(correction=0) if flat.numel() > 1 else flat.abs().max()
        clipped = torch.maximum(torch.minimum(flat, clip), -clip)
        magnitude = clipped.abs()
        scale = magnitude.max().reshape(1)
        g = generator("cpu", "terngrad", self.seed, self.rank, name, self.next_step(name))
        rnd = torch.rand(flat.numel(), generator=g).to(flat.device) * scale
        ternary = torch.where(rnd < magnitude, clipped.sign(), torch.zeros_like(clipped))
        return [ternary.to(torch.int8), scale], (tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        ternary, scale = tensors
        shape, dtype = ctx
        return (ternary.float() * scale).to(dtype).view(shape)
