"""'natural' (natural compression, Horvath et al.): rounds each |x| stochastically to one of the
two nearest powers of two (unbiased) and sends one uint8 per entry: bit 7 is the sign, bits
0-6 the exponent + 64, and 0 means zero. Exponents below 2^-63 flush to zero (with the same
unbiased rule against 2^-63); above 2^63 they saturate. Per-rank seeded randomness."""

import torch

from ..api import Compressor
from ..utils.seeding import generator

_BIAS = 64
_MIN_EXP = 1 - _BIAS  # code 1
_MAX_EXP = 127 - _BIAS


class NaturalCompressor(Compressor):
    """'natural': unbiased stochastic rounding to powers of two, one byte per entry (module
    docstring)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()
        magnitude = flat.abs()
        _, exponent = torch.frexp(magnitude)  # magnitude = mantissa * 2^exponent
        low_exp = exponent - 1  # 2^low_exp <= magnitude < 2^(low_exp+1)
        low = torch.ldexp(torch.ones_like(magnitude), low_exp)
        g = generator("cpu", "natural", self.seed, self.rank, name, self.next_step(name))
        rnd = torch.rand(flat.numel(), generator=g).to(flat.device)
        round_up = rnd < (magnitude - low) / low  # P(up) makes the rounding unbiased
        exp = low_exp + round_up.to(low_exp.dtype)
        floor_value = 2.0**_MIN_EXP
        keep_tiny = rnd < magnitude / floor_value
        exp = torch.where(exp < _MIN_EXP, torch.full_like(exp, _MIN_EXP), exp)
        zero = (magnitude == 0) | ((low_exp < _MIN_EXP) & ~keep_tiny)
        code = (exp.clamp(max=_MAX_EXP) + _BIAS).to(torch.uint8)
        code = torch.where(zero, torch.zeros_like(code), code)
        code = code | ((flat < 0) & ~zero).to(torch.uint8) * 128
        return [code], (tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        shape, dtype = ctx
        code = tensors[0]
        exp = (code & 127).to(torch.int32) - _BIAS
        value = torch.ldexp(torch.ones(code.shape, device=code.device), exp)
        value = torch.where((code & 127) == 0, torch.zeros_like(value), value)
        value = torch.where(code >= 128, -value, value)
        return value.to(dtype).view(shape)
