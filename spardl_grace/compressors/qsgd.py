"""'qsgd': stochastic quantisation to quantum_num levels of |x| / ||x||_2; sends the signed
levels (int8 when quantum_num < 128, int16 otherwise) and the norm. Unbiased. The rounding
randomness comes from a per-rank generator seeded by (rank, name, step)."""

import torch

from ..api import Compressor
from ..utils.seeding import generator


class QSGDCompressor(Compressor):
    """GRACE's 'qsgd': unbiased stochastic quantisation to quantum_num levels (module
    docstring)."""

    def __init__(self, quantum_num: int, seed: int = 0):
        super().__init__(tensors_size_are_same=True)
        self.quantum_num = quantum_num
        self.seed = seed

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()
        norm = flat.norm().reshape(1)
        g = generator("cpu", "qsgd", self.seed, self.rank, name, self.next_step(name))
        scaled = (
            flat.abs() * (self.quantum_num / norm) if norm.item() > 0 else torch.zeros_like(flat)
        )
        lower = scaled.floor()
        rnd = torch.rand(flat.numel(), generator=g).to(flat.device)
        level = lower + (rnd < scaled - lower).float()
        dtype = torch.int8 if self.quantum_num < 128 else torch.int16
        return [(level * flat.sign()).to(dtype), norm], (tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        levels, norm = tensors
        shape, dtype = ctx
        return (levels.float() * (norm / self.quantum_num)).to(dtype).view(shape)
