"""'randomk': sends k = max(1, compress_ratio * numel) values at positions drawn from a generator
seeded by (name, step) and shared by every rank, so only values travel and ranks agree on the
positions without exchanging them (all-reduce compatible). Never touches the global RNG."""

import torch

from ..api import Compressor
from ..selection import count_for_ratio
from ..utils.seeding import generator
from ._sparse import desparsify


class RandomKCompressor(Compressor):
    """GRACE's 'randomk': values at k positions shared by every rank through a seeded
    generator, so only the values travel."""

    def __init__(self, compress_ratio: float, seed: int = 0):
        super().__init__()
        self.compress_ratio = compress_ratio
        self.seed = seed

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        numel = flat.numel()
        k = count_for_ratio(numel, self.compress_ratio)
        g = generator("cpu", "randomk", self.seed, name, self.next_step(name))
        indices = torch.randperm(numel, generator=g)[:k].to(flat.device)
        return [flat[indices]], (indices, numel, tensor.shape)

    def decompress(self, tensors, ctx):
        indices, numel, shape = ctx
        return desparsify(tensors[0], indices, numel).view(shape)
