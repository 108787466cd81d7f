"""The DeepReduce wire format: one uint8 tensor per message, with a header of 6 bytes for the
small messages of small layers (32 until version 1, 1.8 bytes an entry on an 18-entry message).

    CRC-32 (u32, little-endian) | entries (varint) | index section bytes (varint) |
    index section | value section

A varint is LEB128: 7 bits a byte, low bits first, the high bit set on every byte but the
last (one byte below 128, three below 2**21). What the receiver already knows is not sent but
checked: the CRC-32 covers the wire version, the index and value codec ids, the values' dtype
and the block size as well as everything after it, so a message coded for another block,
dtype or codec, and a corrupted or truncated one, raise ValueError instead of decoding garbage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from spardl_grace.payload import crc32

VERSION = 2
_CRC = struct.Struct("<I")
_CONTEXT = struct.Struct("<BBBBq")  # version, index codec, value codec, dtype id, block size
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@dataclass(frozen=True)
class Header:
    """What a message is checked against besides its sections: the index and value codec ids,
    the values' dtype, the number of entries and the block size."""

    index_codec: int
    value_codec: int
    dtype: torch.dtype
    entries: int
    block_size: int


def varint(value: int) -> bytes:
    """`value` (>= 0) in LEB128."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(data: bytes, start: int) -> tuple[int, int]:
    """(the varint at `start`, where the next field begins); ValueError when it runs past the
    end or past 64 bits."""
    value = shift = 0
    for position in range(start, min(len(data), start + 10)):
        value |= (data[position] & 0x7F) << shift
        if not data[position] & 0x80:
            return value, position + 1
        shift += 7
    raise ValueError("DeepReduce message header ends inside a length (truncated or corrupted)")


def header_bytes(entries: int, index_bytes: int) -> int:
    """Bytes of the header of a message with `entries` entries and an index section of
    `index_bytes`."""
    return _CRC.size + len(varint(entries)) + len(varint(index_bytes))


def _context(header: Header) -> torch.Tensor:
    if header.dtype not in DTYPES:
        raise ValueError(
            f"DeepReduce codes values of dtype {[str(d) for d in DTYPES]}, got {header.dtype}"
        )
    packed = _CONTEXT.pack(
        VERSION,
        header.index_codec,
        header.value_codec,
        DTYPES.index(header.dtype),
        header.block_size,
    )
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def write(header: Header, index_section: torch.Tensor, value_section: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the header, then the index and value sections. ValueError for a
    dtype the wire format cannot name."""
    lengths = torch.frombuffer(
        bytearray(varint(header.entries) + varint(index_section.numel())), dtype=torch.uint8
    )
    crc = crc32(_context(header), lengths, index_section, value_section)
    device = index_section.device
    return torch.cat(
        [
            torch.frombuffer(bytearray(_CRC.pack(crc)), dtype=torch.uint8).to(device),
            lengths.to(device),
            index_section.to(device),
            value_section.to(device),
        ]
    )


def read(
    message: torch.Tensor,
    index_codec: int,
    value_codec: int,
    dtype: torch.dtype,
    block_size: int,
) -> tuple[Header, torch.Tensor, torch.Tensor]:
    """(header, index section, value section) of a message that the receiver expects coded
    with these codecs, for a block of `block_size` entries of `dtype`; ValueError on anything
    malformed, and on a message coded for another block, dtype or codec."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise ValueError("a DeepReduce message is a 1-D uint8 tensor")
    head = np.asarray(message[: _CRC.size + 20].cpu()).tobytes()
    if len(head) < _CRC.size:
        raise ValueError(f"DeepReduce message of {message.numel()} bytes has no header (truncated)")
    (crc,) = _CRC.unpack(head[: _CRC.size])
    entries, after = read_varint(head, _CRC.size)
    index_bytes, start = read_varint(head, after)
    if start + index_bytes > message.numel():
        raise ValueError(
            f"DeepReduce message of {message.numel()} bytes announces a {index_bytes}-byte "
            "index section after its header (truncated or corrupted)"
        )
    index_section = message[start : start + index_bytes]
    value_section = message[start + index_bytes :]
    header = Header(index_codec, value_codec, dtype, entries, block_size)
    lengths = message[_CRC.size : start]
    if crc32(_context(header), lengths.cpu(), index_section, value_section) != crc:
        raise ValueError(
            "DeepReduce message checksum mismatch: corrupted, or coded for another block "
            f"size, dtype or codec than this receiver's (a block of {block_size} {dtype})"
        )
    if entries > block_size:
        raise ValueError(f"DeepReduce message claims {entries} entries in a block of {block_size}")
    return header, index_section, value_section
