"""Index codecs: a sorted set of unique positions in a block of `size` entries, as bytes.

Every codec returns, with its bytes, exactly the positions the receiver will decode (sorted):
the lossless codecs return the input; a Bloom filter may return other positions (its false
positives, or a subset chosen by a policy), and the caller then sends the values found at
those positions, so nothing is lost that the residual does not keep.
"""

from __future__ import annotations

import math

import torch

from spardl_grace.payload import CodecPart
from spardl_grace.transport.base import as_bytes, from_bytes
from spardl_grace.utils import bitpack
from spardl_grace.utils.seeding import generator, stable_seed

from . import huffman

PRIME = 2**31 - 1  # hash modulus: a*x + b stays below 2**62 for x < 2**31
POLICIES = ("p0", "leftmost", "random", "conflict_sets")
QUERY_CHUNK = 1 << 16  # positions a CPU Bloom query takes at a time


class IndexCodec(CodecPart):
    """Codes sorted unique int64 positions in range(size)."""

    name = "index"
    code = 0

    def encode(
        self, indices: torch.Tensor, size: int, key: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 section, the sorted positions the receiver will decode)."""
        raise NotImplementedError

    def decode(self, section: torch.Tensor, count: int, size: int, key: str) -> torch.Tensor:
        """`count` sorted int64 positions; ValueError on a malformed section."""
        raise NotImplementedError


def _check_positions(positions: torch.Tensor, count: int, size: int, what: str) -> torch.Tensor:
    if positions.numel() != count:
        raise ValueError(f"{what} decoded {positions.numel()} positions, the header says {count}")
    if count and (
        int(positions[0]) < 0
        or int(positions[-1]) >= size
        or bool((torch.diff(positions) <= 0).any())
    ):
        raise ValueError(f"{what} decoded positions outside 0..{size - 1} or not increasing")
    return positions


class RawIndex(IndexCodec):
    """'none': int32 positions, 4 bytes each."""

    name, code = "none", 0

    def encode(self, indices, size, key):
        return as_bytes(indices.to(torch.int32)), indices

    def decode(self, section, count, size, key):
        if section.numel() != 4 * count:
            raise ValueError(f"raw index section of {section.numel()} bytes for {count} positions")
        positions = from_bytes(section.clone(), torch.int32).to(torch.int64)
        return _check_positions(positions, count, size, "raw index")


class DeltaIndex(IndexCodec):
    """'delta': the gaps between consecutive positions, bit-packed at the width of the largest."""

    name, code = "delta", 1

    def encode(self, indices, size, key):
        gaps = _gaps(indices)
        width = bitpack.width_for(int(gaps.max())) if gaps.numel() else 0
        return torch.cat(
            [bitpack.u32s([width], indices.device), bitpack.pack(gaps, width)]
        ), indices

    def decode(self, section, count, size, key):
        (width,) = bitpack.read_u32s(section, 1)
        if not 0 <= width <= 32:
            raise ValueError(f"delta index width {width} is out of range")
        gaps = bitpack.unpack(section[4:], count, width)
        return _check_positions(_positions(gaps), count, size, "delta index")


class RunLengthIndex(IndexCodec):
    """'rle': the block as a bitmap, coded as alternating run lengths (zeros first), bit-packed."""

    name, code = "rle", 2

    def encode(self, indices, size, key):
        if indices.numel() == 0:
            return bitpack.u32s([0, 0], indices.device), indices
        starts = torch.ones(indices.numel(), dtype=torch.bool, device=indices.device)
        starts[1:] = torch.diff(indices) != 1
        run_starts = indices[starts]
        ones = torch.diff(
            torch.nonzero(starts).reshape(-1), append=indices.new_tensor([indices.numel()])
        )
        previous_end = torch.cat([indices.new_zeros(1), run_starts[:-1] + ones[:-1]])
        zeros = run_starts - previous_end
        runs = torch.stack([zeros, ones], dim=1).reshape(-1)
        width = bitpack.width_for(int(runs.max()))
        return torch.cat(
            [bitpack.u32s([width, runs.numel() // 2], indices.device), bitpack.pack(runs, width)]
        ), indices

    def decode(self, section, count, size, key):
        width, pairs = bitpack.read_u32s(section, 2)
        if not 0 <= width <= 32 or pairs < 0:
            raise ValueError(f"rle index header (width {width}, {pairs} runs) is out of range")
        runs = bitpack.unpack(section[8:], 2 * pairs, width).view(-1, 2)
        zeros, ones = runs[:, 0], runs[:, 1]
        starts = torch.cumsum(zeros + torch.cat([ones.new_zeros(1), ones[:-1]]), 0)
        if int(ones.sum()) != count:
            raise ValueError(
                f"rle index runs hold {int(ones.sum())} positions, the header says {count}"
            )
        offsets = torch.arange(count, device=section.device) - torch.repeat_interleave(
            torch.cumsum(ones, 0) - ones, ones
        )
        positions = torch.repeat_interleave(starts, ones) + offsets
        return _check_positions(positions, count, size, "rle index")


def _gaps(indices: torch.Tensor) -> torch.Tensor:
    """The first position, then each distance to the previous one minus one (all >= 0)."""
    return torch.diff(indices, prepend=indices.new_tensor([-1])) - 1


def _positions(gaps: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(gaps + 1, 0) - 1


class HuffmanIndex(IndexCodec):
    """'huffman': each gap g (as in 'delta') is sent as the Huffman code of its bit length
    w = bit_length(g), followed, in a second stream, by the w - 1 bits below its leading one
    (the leading one is implied; DEFLATE codes its distances the same way). Gaps of similar
    size share a short code, so a sparse set whose gaps vary little costs a few bits per
    position plus 17 bytes of code lengths (4 bits each)."""

    name, code = "huffman", 4
    SYMBOLS = 33  # bit lengths 0..32

    def encode(self, indices, size, key):
        gaps = _gaps(indices)
        width = torch.frexp(gaps.to(torch.float64)).exponent.to(torch.int64)  # exact below 2**53
        if gaps.numel() and int(width.max()) >= self.SYMBOLS:
            raise ValueError(f"huffman index codes gaps below 2**32, got a block of {size}")
        lengths = huffman.code_lengths(torch.bincount(width, minlength=self.SYMBOLS).tolist())
        stream, nbits = huffman.encode(width, lengths)
        extra = (width - 1).clamp_min(0)
        mantissas = bitpack.pack_varwidth(gaps - (1 << extra) * (width > 0), extra)
        header = torch.cat(
            [
                bitpack.u32s([nbits], indices.device),
                bitpack.pack(torch.tensor(lengths, device=indices.device), 4),
            ]
        )
        return torch.cat([header, stream, mantissas]), indices

    def decode(self, section, count, size, key):
        (nbits,) = bitpack.read_u32s(section, 1)
        start = 4 + bitpack.packed_size(self.SYMBOLS, 4)
        if nbits < 0 or section.numel() < start + (nbits + 7) // 8:
            raise ValueError(f"huffman index section of {section.numel()} bytes for {nbits} bits")
        lengths = bitpack.unpack(section[4:start], self.SYMBOLS, 4).tolist()
        stream_end = start + (nbits + 7) // 8
        width = huffman.decode(section[start:stream_end], nbits, count, lengths)
        extra = (width - 1).clamp_min(0)
        mantissas = bitpack.unpack_varwidth(section[stream_end:], extra)
        gaps = mantissas + (1 << extra) * (width > 0)
        return _check_positions(_positions(gaps), count, size, "huffman index")


class BloomIndex(IndexCodec):
    """'bloom': a Bloom filter of the positions. m = ceil(-r ln(eps) / ln(2)^2) bits and
    h = ceil(log2(1/eps)) hash functions h_i(x) = floor(((a_i x + b_i) mod (2^31 - 1)) m / 2^31),
    with (a_i, b_i) drawn from `seed`: every rank derives the same functions, nothing is
    shipped. The residue mod 2^31 - 1 is taken with shifts and masks and mapped onto the m bits
    by a multiply and a shift, so no hash needs a division. eps is `fpr`, or 0.1 r/size when
    None. The receiver queries every position of the block, one hash function at a time on the
    positions still positive (each function clears about half of them when the filter is half
    full, so the block costs about two hash evaluations a position, not h); the positives
    contain the r true positions plus about eps (size - r) false ones. Policies:
      p0            all positives (exact reconstruction, values also sent for false positives);
      leftmost      the first r positives;
      random        r positives drawn with a generator keyed by (seed, message key);
      conflict_sets r positives, preferring those whose smallest conflict set (the positives
                    sharing one of their bits) is smallest: a positive alone on a bit is surely
                    true. A vectorised form of DeepReduce's greedy conflict-set policy.
    """

    name, code = "bloom", 3

    def __init__(self, policy: str = "p0", fpr: float | None = None, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(
                f"unknown bloom policy {policy!r}; valid choices: {', '.join(POLICIES)}"
            )
        if fpr is not None and not 0 < fpr < 1:
            raise ValueError(f"fpr must be in (0, 1), got {fpr!r}")
        self.policy, self.fpr, self.seed = policy, fpr, seed

    def geometry(self, count: int, size: int) -> tuple[int, int]:
        """(m bits, h hash functions) for `count` positions in a block of `size`."""
        eps = self.fpr if self.fpr is not None else min(0.5, 0.1 * max(count, 1) / max(size, 1))
        bits = max(8, math.ceil(-max(count, 1) * math.log(eps) / math.log(2) ** 2))
        return bits, max(1, math.ceil(math.log2(1 / eps)))

    def _coefficients(self, hashes: int, device) -> torch.Tensor:
        """(hashes, 2) int64: a_i in 1..P-1 and b_i in 0..P-1, the same on every rank."""
        g = torch.Generator().manual_seed(stable_seed("bloom", self.seed))
        a = torch.randint(1, PRIME, (hashes,), generator=g, dtype=torch.int64)
        b = torch.randint(0, PRIME, (hashes,), generator=g, dtype=torch.int64)
        return torch.stack([a, b], dim=1).to(device)

    @staticmethod
    def _hash(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
        """floor(((a x + b) mod P) bits / 2^31) for positions x < 2^31: a x + b < 2^62, folded
        twice at bit 31 (2^31 = 1 mod P) into 0..P, where P itself (= 0 mod P) cannot occur,
        then scaled onto 0..bits-1 (a product below 2^63)."""
        t = x * a
        t += b
        s = t & PRIME
        s += t >> 31
        t = s & PRIME
        t += s >> 31
        t *= bits
        return t >> 31

    def _hashes(self, x: torch.Tensor, bits: int, hashes: int) -> torch.Tensor:
        """(hashes, len(x)) bit positions."""
        coefficients = self._coefficients(hashes, x.device)
        return torch.stack([self._hash(x, a, b, bits) for a, b in coefficients])

    def _positives(self, bitmap: torch.Tensor, size: int, hashes: int) -> torch.Tensor:
        """Every position of the block the filter reports, in order. On the CPU the block is
        queried in chunks of QUERY_CHUNK positions, whose temporaries stay in the cache."""
        coefficients = self._coefficients(hashes, bitmap.device)
        chunk = size if bitmap.device.type != "cpu" else QUERY_CHUNK
        found = []
        for start in range(0, size, chunk):
            positives = torch.arange(
                start, min(size, start + chunk), device=bitmap.device, dtype=torch.int64
            )
            for a, b in coefficients:  # loop over hash functions
                positives = positives[bitmap[self._hash(positives, a, b, bitmap.numel())]]
            found.append(positives)
        return (
            torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=bitmap.device)
        )

    def _choose(
        self, positives: torch.Tensor, count: int, bits: int, hashes: int, key: str
    ) -> torch.Tensor:
        if self.policy == "p0" or positives.numel() <= count:
            return positives
        if self.policy == "leftmost":
            return positives[:count]
        if self.policy == "random":
            g = generator("cpu", "bloom-random", self.seed, key)
            pick = torch.randperm(positives.numel(), generator=g)[:count].to(positives.device)
            return torch.sort(positives[pick]).values
        rows = self._hashes(positives, bits, hashes)
        n = positives.numel()
        ranks = torch.arange(n, device=rows.device)
        # A positive belongs once to the conflict set of each distinct bit it sets.
        pairs = torch.unique((rows * n + ranks).reshape(-1))
        group_size = torch.bincount(pairs // n, minlength=bits)
        priority = group_size[rows].min(dim=0).values
        order = torch.argsort(priority * n + ranks)
        return torch.sort(positives[order[:count]]).values

    def encode(self, indices, size, key):
        bits, hashes = self.geometry(indices.numel(), size)
        bitmap = torch.zeros(bits, dtype=torch.bool, device=indices.device)
        if indices.numel():
            bitmap[self._hashes(indices, bits, hashes).reshape(-1)] = True
        positives = self._positives(bitmap, size, hashes)
        chosen = self._choose(positives, indices.numel(), bits, hashes, key)
        header = bitpack.u32s(
            [POLICIES.index(self.policy), hashes, bits, indices.numel()], indices.device
        )
        return torch.cat([header, bitpack.pack(bitmap.to(torch.int64), 1)]), chosen

    def decode(self, section, count, size, key):
        policy, hashes, bits, true_count = bitpack.read_u32s(section, 4)
        if policy != POLICIES.index(self.policy):
            raise ValueError(f"bloom message uses policy {policy}, this codec {self.policy!r}")
        if not 1 <= hashes <= 64 or bits < 8 or true_count < 0 or true_count > size:
            raise ValueError(f"bloom header (h {hashes}, m {bits}, r {true_count}) is out of range")
        bitmap = bitpack.unpack(section[16:], bits, 1).to(torch.bool)
        positives = self._positives(bitmap, size, hashes)
        chosen = self._choose(positives, true_count, bits, hashes, key)
        return _check_positions(chosen, count, size, "bloom index")
