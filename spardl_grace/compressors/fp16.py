"""'fp16': sends floating-point tensors as float16 (half the bytes of fp32)."""

import torch

from ..api import Compressor


class FP16Compressor(Compressor):
    """GRACE's 'fp16': floating-point tensors sent as float16 and restored to their dtype;
    other tensors unchanged."""

    def compress(self, tensor, name):
        if tensor.is_floating_point():
            return [tensor.to(torch.float16)], tensor.dtype
        return [tensor], tensor.dtype

    def decompress(self, tensors, ctx):
        return tensors[0].to(ctx)
