"""Bit packing of non-negative integers at a fixed or a per-value width, vectorised (no loop
over elements), and the small int32 headers of codec sections. Bits are little-endian: bit t of
the stream is bit t % 8 of byte t // 8, and a value's bits go least significant first."""

from __future__ import annotations

import math

import torch

from ..transport.base import as_bytes, from_bytes

MAX_WIDTH = 63  # pack_varwidth's
FIXED_MAX_WIDTH = 32  # pack's: a value then spans at most two 32-bit words
_LOW32 = 0xFFFFFFFF


def width_for(max_value: int) -> int:
    """Bits needed to store every integer in 0..max_value (0 for max_value 0)."""
    return max(0, int(max_value).bit_length())


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A stream of 0/1 values as ceil(len/8) uint8, zero-padded."""
    padded = torch.zeros(math.ceil(bits.numel() / 8) * 8, dtype=torch.int64, device=bits.device)
    padded[: bits.numel()] = bits
    weights = 1 << torch.arange(8, device=bits.device, dtype=torch.int64)
    return (padded.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bits: the 8 * len(data) bits as int64 0/1 values."""
    shifts = torch.arange(8, device=data.device, dtype=torch.int64)
    return ((data.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1)


def pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` (non-negative, each < 2**width) as ceil(len*width/8) uint8, in the stream's bit
    order. A value starts in 32-bit word `start // 32` of the stream and may spill into the
    next: one scatter-add of the values, shifted to their offsets, into 64-bit accumulators (one
    per word; disjoint bits add as they OR), then each word is its accumulator's low half OR the
    previous accumulator's high half. A few int64 temporaries per value, none per bit."""
    _check_fixed_width(width)
    count = values.numel()
    if width == 0 or count == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    word, offset = _layout(count, width, values.device)
    nbytes = packed_size(count, width)
    nwords = (nbytes + 3) // 4
    acc = torch.zeros(nwords, dtype=torch.int64, device=values.device)
    acc.index_add_(0, word, values.to(torch.int64) << offset)  # < 2**63: offset + width <= 63
    words = acc & _LOW32
    words[1:] |= acc[:-1] >> 32
    # Words hold values below 2**32; int32 keeps their low 32 bits, little-endian in memory.
    return words.to(torch.int32).view(torch.uint8)[:nbytes]


def packed_size(count: int, width: int) -> int:
    """Bytes that pack() writes for `count` values of `width` bits."""
    return math.ceil(count * width / 8)


def unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of pack: `count` int64 values of `width` bits; ValueError if data is not exactly
    their packed size."""
    _check_fixed_width(width)
    if data.numel() != packed_size(count, width):
        raise ValueError(f"{data.numel()} bytes cannot hold exactly {count} values of {width} bits")
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    padded = torch.zeros((data.numel() + 3) // 4 * 4 + 4, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    words = padded.view(torch.int32).to(torch.int64) & _LOW32
    pairs = words[:-1] | (words[1:] << 32)  # word j and the word a value may spill into
    word, offset = _layout(count, width, data.device)
    # An arithmetic shift smears bit 63 into the top, but a value's bits end at bit 62 at most
    # (offset <= 31, width <= 32), so the mask never reaches the smeared bits.
    return (pairs.index_select(0, word) >> offset) & ((1 << width) - 1)


def _check_fixed_width(width: int) -> None:
    if not 0 <= width <= FIXED_MAX_WIDTH:
        raise ValueError(f"bit width must be in 0..{FIXED_MAX_WIDTH}, got {width}")


_LAYOUTS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _layout(count: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For values 0..count-1 of `width` bits: the 32-bit word each starts in and its bit offset
    there. Kept per (width, device) for the largest count asked so far (a message's count
    recurs step after step) and sliced for smaller ones: two int64 per value of that count."""
    held = _LAYOUTS.get((width, device))
    if held is None or held[0].numel() < count:
        start = torch.arange(count, device=device, dtype=torch.int64) * width
        held = _LAYOUTS[(width, device)] = (start >> 5, start & 31)
    return held[0][:count], held[1][:count]


def _bit_slots(widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every bit of a concatenation of values of `widths`: (its value, its bit number)."""
    owner = torch.repeat_interleave(torch.arange(widths.numel(), device=widths.device), widths)
    starts = torch.cumsum(widths, 0) - widths
    return owner, torch.arange(owner.numel(), device=widths.device) - starts[owner]


def pack_varwidth(values: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """values[i] in widths[i] bits (each < 2**widths[i], widths in 0..MAX_WIDTH), concatenated,
    as ceil(sum(widths)/8) uint8."""
    widths = widths.to(torch.int64)
    owner, bit = _bit_slots(widths)
    return pack_bits((values.to(torch.int64)[owner] >> bit) & 1)


def unpack_varwidth(data: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_varwidth; ValueError unless data has exactly ceil(sum(widths)/8) bytes."""
    widths = widths.to(torch.int64)
    total = int(widths.sum())
    if data.numel() != math.ceil(total / 8):
        raise ValueError(f"{data.numel()} bytes cannot hold exactly {total} bits")
    owner, bit = _bit_slots(widths)
    out = torch.zeros(widths.numel(), dtype=torch.int64, device=data.device)
    return out.index_add_(0, owner, unpack_bits(data)[:total] << bit)


def u32s(values: list[int], device) -> torch.Tensor:
    """Small header integers as int32 bytes."""
    return as_bytes(torch.tensor(values, dtype=torch.int64).to(torch.int32)).to(device)


def read_u32s(section: torch.Tensor, n: int) -> list[int]:
    """The first n int32 header integers of a section; ValueError if it is shorter."""
    if section.numel() < 4 * n:
        raise ValueError("codec section shorter than its header")
    return from_bytes(section[: 4 * n].cpu().clone(), torch.int32).tolist()
