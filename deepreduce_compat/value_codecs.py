"""Value codecs: the values of a sparse message (in position order) as bytes.

Lossless: 'none' (raw), 'deflate' (zlib). Lossy: 'fp16', 'qsgd', 'polyfit'. A lossy codec's
sender never guesses what the receiver gets: DeepReduceCodec decodes its own message, so the
error goes to the residual exactly.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from spardl_grace.transport.base import as_bytes, from_bytes
from spardl_grace.utils.seeding import generator

from spardl_grace.utils import bitpack


def _tensor(data: bytes, device) -> torch.Tensor:
    """Python bytes (possibly empty) as a uint8 tensor on `device`."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ValueCodec:
    name = "value"
    code = 0

    def encode(self, values: torch.Tensor, key: str) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, section: torch.Tensor, count: int, dtype: torch.dtype, key: str) -> torch.Tensor:
        """`count` values of `dtype`; ValueError on a malformed section."""
        raise NotImplementedError


class RawValues(ValueCodec):
    """'none': the values in their dtype."""
    name, code = "none", 0

    def encode(self, values, key):
        return as_bytes(values)

    def decode(self, section, count, dtype, key):
        if section.numel() != count * _itemsize(dtype):
            raise ValueError(f"raw value section of {section.numel()} bytes for {count} {dtype}")
        return from_bytes(section.clone(), dtype)


class FP16Values(ValueCodec):
    """'fp16': values rounded to half precision (2 bytes each)."""
    name, code = "fp16", 1

    def encode(self, values, key):
        return as_bytes(values.to(torch.float16))

    def decode(self, section, count, dtype, key):
        if section.numel() != 2 * count:
            raise ValueError(f"fp16 value section of {section.numel()} bytes for {count} values")
        return from_bytes(section.clone(), torch.float16).to(dtype)


class DeflateValues(ValueCodec):
    """'deflate': zlib (level 6) on the raw bytes; lossless."""
    name, code = "deflate", 2

    def encode(self, values, key):
        packed = zlib.compress(np.asarray(as_bytes(values).cpu()).tobytes(), 6)
        return _tensor(packed, values.device)

    def decode(self, section, count, dtype, key):
        try:
            raw = zlib.decompress(np.asarray(section.cpu()).tobytes())
        except zlib.error as exc:
            raise ValueError(f"deflate value section does not inflate: {exc}") from exc
        if len(raw) != count * _itemsize(dtype):
            raise ValueError(f"deflate value section inflates to {len(raw)} bytes for {count} {dtype}")
        return from_bytes(_tensor(raw, section.device), dtype)


class QSGDValues(ValueCodec):
    """'qsgd': per bucket of `bucket_size` values, the fp32 norm and, per value, a sign bit and
    a level in 0..quantum_num drawn by stochastic rounding (unbiased); ceil(log2(s+1)) + 1 bits
    per value. The rounding draws come from a generator keyed by the message key."""
    name, code = "qsgd", 3

    def __init__(self, quantum_num: int = 127, bucket_size: int = 512, seed: int = 0):
        if not isinstance(quantum_num, int) or not 1 <= quantum_num <= 32767:
            raise ValueError(f"quantum_num must be an int in 1..32767, got {quantum_num!r}")
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be an int >= 1, got {bucket_size!r}")
        self.levels, self.bucket, self.seed = quantum_num, bucket_size, seed
        self.width = bitpack.width_for(quantum_num) + 1

    def encode(self, values, key):
        count = values.numel()
        buckets = math.ceil(count / self.bucket)
        padded = torch.zeros(buckets * self.bucket, dtype=torch.float32, device=values.device)
        padded[:count] = values.float()
        grid = padded.view(buckets, self.bucket)
        norms = grid.norm(dim=1, keepdim=True)
        scaled = grid.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny) * self.levels
        g = generator("cpu", "qsgd", self.seed, key)
        noise = torch.rand(scaled.shape, generator=g).to(values.device)
        level = torch.clamp(torch.floor(scaled + noise), max=self.levels).to(torch.int64)
        code = (level << 1) | (grid < 0).to(torch.int64)
        return torch.cat([as_bytes(norms.reshape(-1)),
                          bitpack.pack(code.reshape(-1)[:count], self.width)])

    def decode(self, section, count, dtype, key):
        buckets = math.ceil(count / self.bucket)
        if section.numel() != 4 * buckets + bitpack.packed_size(count, self.width):
            raise ValueError(f"qsgd value section of {section.numel()} bytes for {count} values")
        norms = from_bytes(section[:4 * buckets].clone(), torch.float32)
        code = bitpack.unpack(section[4 * buckets:], count, self.width)
        level = (code >> 1).to(torch.float32)
        if count and int(level.max()) > self.levels:
            raise ValueError("qsgd value section has levels above quantum_num")
        sign = 1.0 - 2.0 * (code & 1).to(torch.float32)
        norm = torch.repeat_interleave(norms, self.bucket)[:count]
        return (sign * level / self.levels * norm).to(dtype)


SEGMENT_RATIOS = (1 / 100000, 1 / 30000, 1 / 10000, 1 / 3000, 1 / 1000, 1 / 300, 1 / 100,
                  1 / 30, 1 / 10, 1 / 5)
MIN_EDGE = 30  # edge segments shorter than this are merged into the middle one


def segment_lengths(count: int) -> list[int]:
    """DeepReduce's segmentation of `count` sorted values: geometric edge segments at both ends
    (where sorted gradient values bend sharply) and one long middle segment."""
    edges = [int(count * r) for r in SEGMENT_RATIOS if int(count * r) > MIN_EDGE]
    lengths = edges[::-1] + [count - 2 * sum(edges)] + edges
    return [n for n in lengths if n > 0]


class PolyFitValues(ValueCodec):
    """'polyfit': sort the values descending, split them into positives and the rest, cut each
    part into DeepReduce's segments, fit each segment with a polynomial of degree
    `poly_degree` by least squares on x normalised to [-1, 1] (float64 solve, float32
    coefficients), and send the segment lengths, the coefficients, and the permutation back to
    position order (ceil(log2 r) bits per value). Segments shorter than degree + 1 are sent raw."""
    name, code = "polyfit", 4

    def __init__(self, poly_degree: int = 5):
        if not isinstance(poly_degree, int) or not 0 <= poly_degree <= 16:
            raise ValueError(f"poly_degree must be an int in 0..16, got {poly_degree!r}")
        self.degree = poly_degree

    def _basis(self, length: int, device) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, length, dtype=torch.float64, device=device) if length > 1 \
            else torch.zeros(1, dtype=torch.float64, device=device)
        return torch.vander(x, self.degree + 1, increasing=True)

    def encode(self, values, key):
        count = values.numel()
        order = torch.argsort(values.float(), descending=True, stable=True)
        ordered = values[order].to(torch.float64)
        positives = int((ordered > 0).sum())
        # Positives and the rest are fitted apart: the jump across zero would spoil one fit.
        lengths = segment_lengths(positives) + segment_lengths(count - positives)
        parts = []
        for segment in torch.split(ordered, lengths):
            if segment.numel() <= self.degree:
                parts.append(segment.to(torch.float32))
            else:
                basis = self._basis(segment.numel(), segment.device)
                coef = torch.linalg.lstsq(basis, segment.reshape(-1, 1)).solution.reshape(-1)
                parts.append(coef.to(torch.float32))
        width = bitpack.width_for(max(count - 1, 0))
        floats = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=values.device)
        return torch.cat([bitpack.u32s([self.degree, len(lengths), *lengths], values.device),
                          as_bytes(floats), bitpack.pack(order, width)])

    def decode(self, section, count, dtype, key):
        degree, segments = bitpack.read_u32s(section, 2)
        if degree != self.degree or segments < 0 or segments > count + 1:
            raise ValueError(f"polyfit section (degree {degree}, {segments} segments) does not "
                             f"match this codec (degree {self.degree}) or {count} values")
        lengths = bitpack.read_u32s(section, 2 + segments)[2:]
        if any(n <= 0 for n in lengths) or sum(lengths) != count:
            raise ValueError(f"polyfit segment lengths {lengths} do not add up to {count}")
        n_floats = sum(n if n <= degree else degree + 1 for n in lengths)
        start = 4 * (2 + segments)
        width = bitpack.width_for(max(count - 1, 0))
        if section.numel() != start + 4 * n_floats + bitpack.packed_size(count, width):
            raise ValueError(f"polyfit section of {section.numel()} bytes does not match its header")
        floats = from_bytes(section[start:start + 4 * n_floats].clone(), torch.float32)
        order = bitpack.unpack(section[start + 4 * n_floats:], count, width)
        if count and (int(order.max()) >= count or torch.unique(order).numel() != count):
            raise ValueError("polyfit permutation is not a permutation")
        ordered, used = [], 0
        for n in lengths:
            if n <= degree:
                ordered.append(floats[used:used + n].to(torch.float64))
                used += n
            else:
                coef = floats[used:used + degree + 1].to(torch.float64)
                ordered.append(self._basis(n, section.device) @ coef)
                used += degree + 1
        out = torch.zeros(count, dtype=torch.float64, device=section.device)
        if count:
            out[order] = torch.cat(ordered)
        return out.to(dtype)
