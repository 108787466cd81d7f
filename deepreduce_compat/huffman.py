"""Canonical Huffman coding of small-alphabet symbol streams, vectorised in torch.

Code lengths come from the symbol counts (a heap over the alphabet, never over the stream) and
are limited to MAX_LENGTH bits. Codes are canonical, so the lengths alone describe them. The
stream is written with bitpack.pack_varwidth, each code most significant bit first.

Decoding a variable-length stream looks sequential: where symbol i starts depends on every
symbol before it. It is done without a loop over the stream: every bit position p is decoded
as if a code started there (one table lookup on the longest code's width of bits from p),
which gives next(p) = p + length; the start of symbol i is next^i(0), found for all i at once
by pointer doubling in ceil(log2(count)) rounds of gathers.
"""

from __future__ import annotations

import heapq

import torch

from spardl_grace.utils import bitpack

MAX_LENGTH = 15


def code_lengths(counts: list[int]) -> list[int]:
    """Huffman code length per symbol (0 for an absent symbol), at most MAX_LENGTH. A single
    present symbol gets length 1. Too-deep trees are rebuilt from halved counts, which keeps
    every present symbol and converges to a balanced tree."""
    present = [s for s, c in enumerate(counts) if c > 0]
    lengths = [0] * len(counts)
    if len(present) == 1:
        lengths[present[0]] = 1
    if len(present) <= 1:
        return lengths
    if len(present) > 1 << MAX_LENGTH:
        raise ValueError(f"{len(present)} symbols do not fit codes of {MAX_LENGTH} bits")
    weights = {s: counts[s] for s in present}
    while True:
        heap: list[tuple[int, int, tuple[int, ...]]] = [(w, s, (s,)) for s, w in weights.items()]
        heapq.heapify(heap)
        depth = dict.fromkeys(present, 0)
        while len(heap) > 1:
            w1, t1, a = heapq.heappop(heap)
            w2, t2, b = heapq.heappop(heap)
            for s in a + b:
                depth[s] += 1
            heapq.heappush(heap, (w1 + w2, min(t1, t2), a + b))
        if max(depth.values()) <= MAX_LENGTH:
            break
        weights = {s: (w + 1) // 2 for s, w in weights.items()}
    for s, d in depth.items():
        lengths[s] = d
    return lengths


def canonical_codes(lengths: list[int]) -> list[int]:
    """The canonical code of each symbol: symbols sorted by (length, symbol) take consecutive
    codes, shifted left whenever the length grows."""
    codes = [0] * len(lengths)
    code, previous = 0, 0
    for length, symbol in sorted((n, s) for s, n in enumerate(lengths) if n > 0):
        code <<= length - previous
        codes[symbol], previous = code, length
        code += 1
    return codes


def _reverse(value: int, width: int) -> int:
    return int(f"{value:0{width}b}"[::-1], 2) if width else 0


def encode(symbols: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, int]:
    """(packed stream, its length in bits) of `symbols` under the canonical code of `lengths`."""
    codes = canonical_codes(lengths)
    # pack_varwidth writes least significant bit first; reversing puts each code's MSB first.
    reversed_codes = torch.tensor(
        [_reverse(c, n) for c, n in zip(codes, lengths)], dtype=torch.int64, device=symbols.device
    )
    widths = torch.tensor(lengths, dtype=torch.int64, device=symbols.device)[symbols]
    return bitpack.pack_varwidth(reversed_codes[symbols], widths), int(widths.sum())


def _decode_table(lengths: list[int], window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, length) for every `window`-bit value; length 0 where no code matches."""
    symbol = torch.zeros(1 << window, dtype=torch.int64)
    length = torch.zeros(1 << window, dtype=torch.int64)
    for s, (code, n) in enumerate(zip(canonical_codes(lengths), lengths)):  # over the alphabet
        if n:
            first = code << (window - n)
            symbol[first : first + (1 << (window - n))] = s
            length[first : first + (1 << (window - n))] = n
    return symbol.to(device), length.to(device)


def decode(data: torch.Tensor, nbits: int, count: int, lengths: list[int]) -> torch.Tensor:
    """`count` symbols from a stream of `nbits` bits; ValueError unless the stream holds
    exactly `count` valid codes."""
    device = data.device
    if len(data) * 8 < nbits or len(data) != (nbits + 7) // 8:
        raise ValueError(f"huffman stream of {len(data)} bytes for {nbits} bits")
    if any(not 0 <= n <= MAX_LENGTH for n in lengths) or sum(2.0**-n for n in lengths if n) > 1.0:
        raise ValueError(f"huffman code lengths {lengths} do not describe a prefix code")
    if count == 0:
        if nbits:
            raise ValueError("huffman stream has bits but no symbols")
        return torch.zeros(0, dtype=torch.int64, device=device)
    longest = max(lengths)
    bits = torch.cat(
        [bitpack.unpack_bits(data)[:nbits], torch.zeros(longest, dtype=torch.int64, device=device)]
    )
    window = torch.zeros(nbits, dtype=torch.int64, device=device)
    for t in range(longest):  # over the bits of a window
        window |= bits[t : t + nbits] << (longest - 1 - t)
    table_symbol, table_length = _decode_table(lengths, longest, device)
    length = table_length[window]
    end, invalid = nbits, nbits + 1
    jump = torch.arange(nbits, device=device) + length
    jump = torch.where((length == 0) | (jump > nbits), invalid, jump)
    jump = torch.cat([jump, torch.tensor([end, invalid], device=device)])
    # start[i] = next^i(0) for i = 0..count; pointer doubling: jump holds next^(2^j).
    steps = torch.arange(count + 1, device=device)
    start = torch.zeros(count + 1, dtype=torch.int64, device=device)
    j = 0
    while (1 << j) <= count:
        start = torch.where(((steps >> j) & 1).bool(), jump[start], start)
        jump = jump[jump]
        j += 1
    if int(start[-1]) != end or bool((start[:-1] >= nbits).any()):
        raise ValueError(f"huffman stream of {nbits} bits does not hold exactly {count} codes")
    return table_symbol[window[start[:-1]]]
