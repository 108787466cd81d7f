"""Bit packing of non-negative integers at a fixed or a per-value width, vectorised (no loop
over elements), and the small int32 headers of codec sections. Bits are little-endian: bit t of
the stream is bit t % 8 of byte t // 8, and a value's bits go least significant first."""

from __future__ import annotations

import math

import torch

from ..transport.base import as_bytes, from_bytes

MAX_WIDTH = 63


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
    """`values` (non-negative, each < 2**width) as ceil(len*width/8) uint8."""
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"bit width must be in 0..{MAX_WIDTH}, got {width}")
    if width == 0 or values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    return pack_bits(((values.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1))


def packed_size(count: int, width: int) -> int:
    """Bytes that pack() writes for `count` values of `width` bits."""
    return math.ceil(count * width / 8)


def unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of pack: `count` int64 values of `width` bits; ValueError if data is too short."""
    if data.numel() != packed_size(count, width):
        raise ValueError(f"{data.numel()} bytes cannot hold exactly {count} values of {width} bits")
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    bits = unpack_bits(data)[: count * width]
    weights = 1 << torch.arange(width, device=data.device, dtype=torch.int64)
    return (bits.view(count, width) * weights).sum(dim=1)


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
