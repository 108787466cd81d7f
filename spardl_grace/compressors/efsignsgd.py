"""'efsignsgd' (error-feedback signSGD): sends sign bits (uint8) and the mean magnitude, i.e.
mean(|x|) * sign(x). Pair it with memory 'efsignsgd', which feeds lr * g plus the residual,
so the aggregate is divided by lr. GRACE sums over workers here; we average (average=True) so
the step size does not grow with the number of workers."""

import torch

from ..api import Compressor


class EFSignSGDCompressor(Compressor):
    """GRACE's 'efsignsgd': sign bits and the mean magnitude; pair with memory 'efsignsgd'."""

    def __init__(self, lr: float):
        super().__init__(average=True)
        self.learning_rate = lr

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        mean = flat.abs().mean().reshape(1) if flat.numel() else flat.new_zeros(1)
        return [(flat >= 0).to(torch.uint8), mean], (tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        signs, mean = tensors
        shape, dtype = ctx
        return ((signs.to(dtype) * 2 - 1) * mean.to(dtype)).view(shape)

    def aggregate(self, tensors):
        return super().aggregate(tensors) / self.learning_rate
