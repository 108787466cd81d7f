"""'signsgd': sends one uint8 per entry (x >= 0); the aggregate is the majority vote, not an
average (average=False)."""

import torch

from ..api import Compressor


def majority_vote(tensors):
    """The elementwise majority of ±1 sign tensors: +1 where their sum is >= 0, else -1."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return (total >= 0).to(total.dtype) * 2 - 1


class SignSGDCompressor(Compressor):
    """GRACE's 'signsgd': one uint8 sign per entry, aggregated by majority vote (not averaged)."""

    def __init__(self):
        super().__init__(average=False)

    def compress(self, tensor, name):
        return [(tensor >= 0).to(torch.uint8)], (tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        shape, dtype = ctx
        return (tensors[0].to(dtype) * 2 - 1).view(shape)

    def aggregate(self, tensors):
        return majority_vote(tensors)
