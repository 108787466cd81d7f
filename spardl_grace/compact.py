"""The compact wire: a sparse message's entries in 16-bit values and fixed-width indices.

A message of the sparse all-reduces carries entries of one block (SparDL's partition, the whole
tensor for TopkA, a region for TopkDSA and Ok-Topk) as block-relative indices. Both ends know
the block's length B, so an index needs only w = ceil(log2 B) bits; the compact wire packs every
index at that width and sends every value in 16 bits:

    | count x 16-bit value | count indices at w bits each, packed (ceil(count * w / 8) bytes) |

On VGG-16 with 4 ranks (blocks of 3.7M entries, w = 22) that is 4.75 bytes an entry against
the exact wire's 8. Widths are fixed, so a message of k entries has a size both ends can
compute (`fixed_size`) and SparDL's messages need no size exchange.

Values go as bfloat16, not float16: bfloat16 has float32's exponent range, so a large value
(a loss-scaled gradient under torch.amp's GradScaler, whose scale starts at 2**16, or a sum
over ranks) never becomes infinite on the way and an infinity or NaN still arrives as one,
where float16 would turn finite values above 65504 into infinities. Its coarser mantissa (8
significant bits) costs nothing in the long run: `encode` reports the rounded values, the
Exchange's sender subtracts exactly those, and the rounding error stays in the sender's
residual to be sent later (the difference of a float and its rounding to fewer bits is exact,
so the conservation identity still holds exactly). Finite values beyond bfloat16's largest
finite value are sent as that value, the rest staying behind likewise. Blocks already in a
16-bit float type go in their own type, losslessly.
"""

from __future__ import annotations

import torch

from .payload import INT32_MAX, Encoded, PayloadCodec
from .transport.base import as_bytes, from_bytes
from .utils import bitpack

VALUE_BYTES = 2
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_BF16_MAX = torch.finfo(torch.bfloat16).max
_BF16_INF_BITS = 0x7F80  # bfloat16's +infinity; NaNs lie above it


def index_width(block_size: int) -> int:
    """Bits per index in a block of `block_size` entries: ceil(log2(block_size)), 0 for 0 or 1."""
    return max(0, block_size - 1).bit_length()


def message_bytes(count: int, block_size: int) -> int:
    """Payload bytes of a compact message of `count` entries of a block of `block_size`
    entries: 2 an entry and the indices packed at index_width(block_size) bits, rounded up
    to a whole byte."""
    return VALUE_BYTES * count + bitpack.packed_size(count, index_width(block_size))


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit type that a block of `dtype` sends its values in."""
    if not dtype.is_floating_point:
        raise ValueError(
            f"the compact wire codes floating-point values, got {dtype}: use wire 'exact'"
        )
    return dtype if dtype in _SIXTEEN_BIT else torch.bfloat16


def to_wire(values: torch.Tensor) -> torch.Tensor:
    """`values` in their wire_dtype: rounded to nearest, finite values clamped to the largest
    finite bfloat16 instead of rounding to infinity; infinities and NaN unchanged."""
    target = wire_dtype(values.dtype)
    if values.dtype == target:
        return values
    wire = values.to(target)
    # Only a message that rounded to an infinity or NaN can hold a finite value rounded up to
    # infinity: those bit patterns (exponent all ones) are the largest magnitudes, so one max
    # over the 16-bit words tells, and the common message pays nothing more.
    if values.numel() and int((wire.view(torch.int16) & 0x7FFF).amax()) >= _BF16_INF_BITS:
        clamped = values.clamp(-_BF16_MAX, _BF16_MAX)  # keeps NaN; turns infinities finite ...
        wire = torch.where(values.isinf(), values, clamped).to(target)  # ... so put those back
    return wire


class CompactCodec(PayloadCodec):
    """The compact wire (see the module's docstring): 2 + w/8 bytes an entry for blocks of up to
    2**w entries, lossless in the indices, values rounded to bfloat16 with the rounding error
    left to the sender's residual."""

    name = "compact"

    def encode_bytes(self, block, indices, key):
        """The message for `block`'s entries at `indices`."""
        return self.encode(block, indices, key).data

    def encode(self, block, indices, key):
        """The message, with the values the receiver will decode (the rounded ones) and the
        indices as given."""
        return self.encode_sparse(indices, block.index_select(0, indices), block.numel(), key)

    def encode_sparse(self, indices, values, size, key):
        """The message for the entries (`indices`, `values`) of a block of `size` entries."""
        if size > INT32_MAX + 1:
            raise ValueError(
                f"a block of {size} entries is larger than the compact wire's indices reach "
                f"({INT32_MAX + 1}): split the tensor into buckets of at most that many entries"
            )
        wire = to_wire(values)
        data = torch.cat([as_bytes(wire), bitpack.pack(indices, index_width(size))])
        return Encoded(data, indices, wire.to(values.dtype))

    def fixed_size(self, count, dtype, block_size):
        """2 * count bytes of values and count indices of index_width(block_size) bits."""
        return VALUE_BYTES * count + bitpack.packed_size(count, index_width(block_size))

    def decode(self, data, block_size, dtype, device, key):
        """(int64 indices, values in `dtype`); ValueError if the message's size fits no count of
        entries of this block or an index lies outside it."""
        width = index_width(block_size)
        # 8 * size lies in [(16 + w) * count, (16 + w) * count + 7]: at most one count fits.
        count = 8 * data.numel() // (8 * VALUE_BYTES + width)
        if self.fixed_size(count, dtype, block_size) != data.numel():
            raise ValueError(
                f"compact message of {data.numel()} bytes is no whole number of entries of "
                f"{VALUE_BYTES} + {width}/8 bytes (block of {block_size})"
            )
        split = VALUE_BYTES * count
        values = from_bytes(data[:split], wire_dtype(dtype)).to(device=device, dtype=dtype)
        indices = bitpack.unpack(data[split:].to(device), count, width)
        # Every width-bit index lies in a block of 2**width entries: only smaller ones check.
        if count and block_size < 1 << width and int(indices.max()) >= block_size:
            raise ValueError(f"compact message has indices outside the block of {block_size}")
        return indices, values
