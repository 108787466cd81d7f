"""Value codecs: the values of a sparse message (in position order) as bytes.

Lossless: 'none' (raw), 'deflate' (zlib). Lossy: 'fp16', 'qsgd', 'polyfit', 'dexp'. A lossy codec's
sender never guesses what the receiver gets: DeepReduceCodec decodes its own message, so the
error goes to the residual exactly.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from spardl_grace.payload import CodecPart
from spardl_grace.transport.base import as_bytes, from_bytes
from spardl_grace.utils import bitpack
from spardl_grace.utils.seeding import generator


def _tensor(data: bytes, device) -> torch.Tensor:
    """Python bytes (possibly empty) as a uint8 tensor on `device`."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ValueCodec(CodecPart):
    """Codes the values of a sparse message (in position order) into a uint8 section and back.
    `name` is the config key, `code` the id in the wire header."""

    name = "value"
    code = 0

    def encode(self, values: torch.Tensor, key: str) -> torch.Tensor:
        """The uint8 section for `values`; `key` seeds any randomness, the same on the receiver."""
        raise NotImplementedError

    def decode(
        self, section: torch.Tensor, count: int, dtype: torch.dtype, key: str
    ) -> torch.Tensor:
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
            raise ValueError(
                f"deflate value section inflates to {len(raw)} bytes for {count} {dtype}"
            )
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
        return torch.cat(
            [as_bytes(norms.reshape(-1)), bitpack.pack(code.reshape(-1)[:count], self.width)]
        )

    def decode(self, section, count, dtype, key):
        buckets = math.ceil(count / self.bucket)
        if section.numel() != 4 * buckets + bitpack.packed_size(count, self.width):
            raise ValueError(f"qsgd value section of {section.numel()} bytes for {count} values")
        norms = from_bytes(section[: 4 * buckets].clone(), torch.float32)
        code = bitpack.unpack(section[4 * buckets :], count, self.width)
        level = (code >> 1).to(torch.float32)
        if count and int(level.max()) > self.levels:
            raise ValueError("qsgd value section has levels above quantum_num")
        sign = 1.0 - 2.0 * (code & 1).to(torch.float32)
        norm = torch.repeat_interleave(norms, self.bucket)[:count]
        return (sign * level / self.levels * norm).to(dtype)


SEGMENT_RATIOS = (
    1 / 100000,
    1 / 30000,
    1 / 10000,
    1 / 3000,
    1 / 1000,
    1 / 300,
    1 / 100,
    1 / 30,
    1 / 10,
    1 / 5,
)
MIN_EDGE = 30  # edge segments shorter than this are merged into the middle one


def segment_lengths(count: int, largest_first: bool = True) -> list[int]:
    """DeepReduce's segmentation of `count` values of one sign sorted by magnitude: the finest
    segments at the large-magnitude end, where sorted gradient values bend sharply (count/100000,
    count/30000, ..., count/5, each kept only if longer than MIN_EDGE), then one segment for the
    rest, towards zero. `largest_first`: the values run from the largest magnitude down (the
    positives sorted descending); otherwise up to it (the negatives sorted descending)."""
    edges = [int(count * r) for r in SEGMENT_RATIOS if int(count * r) > MIN_EDGE]
    lengths = [n for n in [*edges, count - sum(edges)] if n > 0]
    return lengths if largest_first else lengths[::-1]


class CurveFitValues(ValueCodec):
    """Curve fitting of sorted values: sort the values descending, split them into positives
    and the rest (the jump across zero would spoil one fit), cut each part into DeepReduce's
    segments (finest at the large magnitudes), fit each segment with `params` float32
    coefficients on x normalised to a fixed interval, and send the segment lengths and the
    coefficients; segments too short to fit are sent raw. `encode` adds the permutation back
    to position order (ceil(log2 r) bits per value); `encode_ordered` leaves it out for a
    caller that sends the positions in the values' sorted order instead, as DeepReduce's
    value-only mode does. Subclasses say how a segment is fitted and evaluated."""

    params = 1

    def fit(self, segment: torch.Tensor) -> torch.Tensor:
        """`params` float32 coefficients for a float64 segment of more than `params` values."""
        raise NotImplementedError

    def evaluate(self, coef: torch.Tensor, length: int) -> torch.Tensor:
        """The float64 curve of float32 `coef` at `length` points."""
        raise NotImplementedError

    @staticmethod
    def sort_order(values: torch.Tensor) -> torch.Tensor:
        """The order (descending, stable) in which encode_ordered takes `values`."""
        return torch.argsort(values.float(), descending=True, stable=True)

    def encode_ordered(self, ordered: torch.Tensor) -> torch.Tensor:
        """The section for values already in sort_order: segment lengths and coefficients."""
        ordered = ordered.to(torch.float64)
        positives = int((ordered > 0).sum())
        lengths = segment_lengths(positives) + segment_lengths(
            ordered.numel() - positives, largest_first=False
        )
        parts = [
            segment.to(torch.float32) if segment.numel() <= self.params else self.fit(segment)
            for segment in torch.split(ordered, lengths)
        ]
        floats = (
            torch.cat(parts)
            if parts
            else torch.empty(0, dtype=torch.float32, device=ordered.device)
        )
        return torch.cat(
            [bitpack.u32s([self.params, len(lengths), *lengths], ordered.device), as_bytes(floats)]
        )

    def decode_ordered(
        self, section: torch.Tensor, count: int, exact: bool = True
    ) -> tuple[torch.Tensor, int]:
        """(the `count` fitted values in sort order as float64, the bytes of `section` they
        took); with `exact`, ValueError unless they took all of it."""
        params, segments = bitpack.read_u32s(section, 2)
        if params != self.params or segments < 0 or segments > count + 1:
            raise ValueError(
                f"{self.name} section ({params} coefficients, {segments} segments) "
                f"does not match this codec ({self.params}) or {count} values"
            )
        lengths = bitpack.read_u32s(section, 2 + segments)[2:]
        if any(n <= 0 for n in lengths) or sum(lengths) != count:
            raise ValueError(f"{self.name} segment lengths {lengths} do not add up to {count}")
        sizes = [n if n <= params else params for n in lengths]
        start = 4 * (2 + segments)
        used = start + 4 * sum(sizes)
        if section.numel() < used or (exact and section.numel() != used):
            raise ValueError(
                f"{self.name} section of {section.numel()} bytes does not match its header"
            )
        floats = from_bytes(section[start:used].clone(), torch.float32)
        ordered = [
            chunk.to(torch.float64) if n <= params else self.evaluate(chunk, n)
            for n, chunk in zip(lengths, torch.split(floats, sizes))
        ]
        if not ordered:
            return torch.zeros(0, dtype=torch.float64, device=section.device), used
        return torch.cat(ordered), used

    def encode(self, values, key):
        order = self.sort_order(values)
        width = bitpack.width_for(max(values.numel() - 1, 0))
        return torch.cat([self.encode_ordered(values[order]), bitpack.pack(order, width)])

    def decode(self, section, count, dtype, key):
        ordered, used = self.decode_ordered(section, count, exact=False)
        width = bitpack.width_for(max(count - 1, 0))
        if section.numel() != used + bitpack.packed_size(count, width):
            raise ValueError(
                f"{self.name} section of {section.numel()} bytes does not match its header"
            )
        order = bitpack.unpack(section[used:], count, width)
        if count and (int(order.max()) >= count or torch.unique(order).numel() != count):
            raise ValueError(f"{self.name} permutation is not a permutation")
        out = torch.zeros(count, dtype=torch.float64, device=section.device)
        if count:
            out[order] = ordered
        return out.to(dtype)


def _unit_interval(length: int, low: float, device) -> torch.Tensor:
    if length == 1:
        return torch.zeros(1, dtype=torch.float64, device=device)
    return torch.linspace(low, 1.0, length, dtype=torch.float64, device=device)


class PolyFitValues(CurveFitValues):
    """'polyfit': a polynomial of degree `poly_degree` per segment, least squares on x in
    [-1, 1] (float64 solve, float32 coefficients)."""

    name, code = "polyfit", 4

    def __init__(self, poly_degree: int = 5):
        if not isinstance(poly_degree, int) or not 0 <= poly_degree <= 16:
            raise ValueError(f"poly_degree must be an int in 0..16, got {poly_degree!r}")
        self.degree, self.params = poly_degree, poly_degree + 1

    def _basis(self, length: int, device) -> torch.Tensor:
        return torch.vander(_unit_interval(length, -1.0, device), self.params, increasing=True)

    def fit(self, segment):
        basis = self._basis(segment.numel(), segment.device)
        return (
            torch.linalg.lstsq(basis, segment.reshape(-1, 1)).solution.reshape(-1).to(torch.float32)
        )

    def evaluate(self, coef, length):
        return self._basis(length, coef.device) @ coef.to(torch.float64)


DEXP_RATES = (-24.0, -12.0, -6.0, -3.0, -1.5, 0.0, 1.5, 3.0, 6.0, 12.0, 24.0)
DEXP_SAMPLES = 4096


class DoubleExpValues(CurveFitValues):
    """'dexp': a * exp(b x) + c * exp(d x) per segment, x in [0, 1] (DeepReduce's double
    exponential). Variable projection: for every pair of rates b < d from DEXP_RATES the
    amplitudes (a, c) are an exact linear least-squares fit; the pair whose fit, rounded to
    float32, has the smallest error on up to DEXP_SAMPLES evenly spaced values wins, and its
    amplitudes are then fitted on the whole segment. A grid instead of Gauss-Newton: no
    starting guess to get wrong, no iteration to diverge, the same on every device."""

    name, code, params = "dexp", 5, 4

    @staticmethod
    def _basis(x: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        """(pairs, len(x), 2) columns exp(b x), exp(d x) for rates (pairs, 2)."""
        return torch.exp(x.reshape(1, -1, 1) * rates.reshape(-1, 1, 2))

    def fit(self, segment):
        device = segment.device
        grid = torch.tensor(DEXP_RATES, dtype=torch.float64, device=device)
        rates = torch.combinations(grid, 2)
        x = _unit_interval(segment.numel(), 0.0, device)
        sample = (
            torch.linspace(
                0, segment.numel() - 1, min(segment.numel(), DEXP_SAMPLES), device=device
            )
            .round()
            .long()
        )
        basis = self._basis(x[sample], rates)
        target = segment[sample].reshape(1, -1, 1).expand(rates.shape[0], -1, -1)
        amplitudes = torch.linalg.lstsq(basis, target).solution.to(torch.float32).to(torch.float64)
        error = ((basis @ amplitudes - target) ** 2).sum(dim=(1, 2))
        best = rates[int(torch.argmin(torch.nan_to_num(error, nan=float("inf"))))].reshape(1, 2)
        whole = self._basis(x, best)[0]
        a, c = torch.linalg.lstsq(whole, segment.reshape(-1, 1)).solution.reshape(-1)
        return torch.stack([a, best[0, 0], c, best[0, 1]]).to(torch.float32)

    def evaluate(self, coef, length):
        a, b, c, d = coef.to(torch.float64)
        x = _unit_interval(length, 0.0, coef.device)
        return a * torch.exp(b * x) + c * torch.exp(d * x)
