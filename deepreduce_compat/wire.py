"""The DeepReduce wire format: one self-describing uint8 tensor per message.

    header (32 bytes, little-endian): magic b"DR", version u8, index codec id u8,
      value codec id u8, dtype id u8, reserved u16 (must be 0), entries u32, block size i64,
      index section bytes u32, value section bytes u32, CRC-32 of both sections u32;
    then the index section and the value section.

Everything a receiver needs to decode is in the message, and the checksum makes a corrupted
or truncated message raise ValueError instead of decoding garbage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from spardl_grace.payload import crc32

MAGIC = b"DR"
VERSION = 1
_HEADER = struct.Struct("<2sBBBBHIqIII")
HEADER_BYTES = _HEADER.size
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@dataclass(frozen=True)
class Header:
    """What the 32-byte header says besides the section lengths and the CRC-32: the index and
    value codec ids, the values' dtype, the number of entries and the block size."""

    index_codec: int
    value_codec: int
    dtype: torch.dtype
    entries: int
    block_size: int


def write(header: Header, index_section: torch.Tensor, value_section: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the header, then the index and value sections. ValueError for a
    dtype the wire format cannot name."""
    if header.dtype not in DTYPES:
        raise ValueError(
            f"DeepReduce codes values of dtype {[str(d) for d in DTYPES]}, got {header.dtype}"
        )
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        header.index_codec,
        header.value_codec,
        DTYPES.index(header.dtype),
        0,
        header.entries,
        header.block_size,
        index_section.numel(),
        value_section.numel(),
        crc32(index_section, value_section),
    )
    device = index_section.device
    return torch.cat(
        [
            torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device),
            index_section.to(device),
            value_section.to(device),
        ]
    )


def read(message: torch.Tensor) -> tuple[Header, torch.Tensor, torch.Tensor]:
    """(header, index section, value section); ValueError on anything malformed."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise ValueError("a DeepReduce message is a 1-D uint8 tensor")
    if message.numel() < HEADER_BYTES:
        raise ValueError(
            f"DeepReduce message of {message.numel()} bytes is shorter than its "
            f"{HEADER_BYTES}-byte header (truncated)"
        )
    fields = _HEADER.unpack(np.asarray(message[:HEADER_BYTES].cpu()).tobytes())
    (
        magic,
        version,
        index_codec,
        value_codec,
        dtype_id,
        reserved,
        entries,
        block,
        n_index,
        n_value,
        crc,
    ) = fields
    if magic != MAGIC:
        raise ValueError(f"not a DeepReduce message (magic {magic!r})")
    if version != VERSION:
        raise ValueError(f"DeepReduce wire version {version} is not supported (this is {VERSION})")
    if reserved:
        raise ValueError(
            f"DeepReduce message has non-zero reserved header bytes ({reserved}): corrupted"
        )
    if dtype_id >= len(DTYPES):
        raise ValueError(f"DeepReduce message has unknown dtype id {dtype_id}")
    if HEADER_BYTES + n_index + n_value != message.numel():
        raise ValueError(
            f"DeepReduce message is {message.numel()} bytes, its header announces "
            f"{HEADER_BYTES + n_index + n_value} (truncated or padded)"
        )
    index_section = message[HEADER_BYTES : HEADER_BYTES + n_index]
    value_section = message[HEADER_BYTES + n_index :]
    if crc32(index_section, value_section) != crc:
        raise ValueError("DeepReduce message checksum mismatch (corrupted)")
    if block < 0 or entries > block:
        raise ValueError(f"DeepReduce message claims {entries} entries in a block of {block}")
    return (
        Header(index_codec, value_codec, DTYPES[dtype_id], entries, block),
        index_section,
        value_section,
    )
