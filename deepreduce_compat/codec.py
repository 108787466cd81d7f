"""DeepReduceCodec: an index codec and a value codec behind spardl_grace's PayloadCodec, so any
sparse all-reduce (SparDL, TopkA, TopkDSA, gTop-k, Ok-Topk) can code its messages, and the
GRACE compressor wrappers can code theirs.

The sender codes the positions first, then sends the values found in the block at exactly the
positions the receiver will decode (a Bloom filter's policy may pick others than the selected
ones), then decodes its own value section: `encode` reports what the receiver gets, bit for
bit, so whatever coding drops or changes stays in the sender's residual.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from spardl_grace.payload import Encoded, PayloadCodec
from spardl_grace.registry import CodecKeys, register_codec_keys

from . import wire
from .index_codecs import (
    POLICIES,
    BloomIndex,
    DeltaIndex,
    HuffmanIndex,
    IndexCodec,
    RawIndex,
    RunLengthIndex,
)
from .value_codecs import (
    DeflateValues,
    DoubleExpValues,
    FP16Values,
    PolyFitValues,
    QSGDValues,
    RawValues,
    ValueCodec,
)

INDEX_CODECS = {
    "none": lambda p: RawIndex(),
    "delta": lambda p: DeltaIndex(),
    "rle": lambda p: RunLengthIndex(),
    "huffman": lambda p: HuffmanIndex(),
    "bloom": lambda p: BloomIndex(p["policy"], p["fpr"], p["seed"]),
}
VALUE_CODECS = {
    "none": lambda p: RawValues(),
    "fp16": lambda p: FP16Values(),
    "deflate": lambda p: DeflateValues(),
    "qsgd": lambda p: QSGDValues(p["quantum_num"], p["bucket_size"], p["seed"]),
    "polyfit": lambda p: PolyFitValues(p["poly_degree"]),
    "dexp": lambda p: DoubleExpValues(),
}
MODES = (None, "value", "index", "both")
DEFAULTS: dict[str, Any] = {
    "deepreduce": None,
    "index": "bloom",
    "value": "polyfit",
    "fpr": None,
    "policy": "p0",
    "poly_degree": 5,
    "quantum_num": 127,
    "bucket_size": 512,
    "seed": 0,
}


class DeepReduceCodec(PayloadCodec):
    """Codes a block's entries as header + index section + value section (see wire)."""

    def __init__(self, index: IndexCodec | None = None, value: ValueCodec | None = None):
        self.index = index or RawIndex()
        self.value = value or RawValues()
        self.name = f"deepreduce[{self.index.name}+{self.value.name}]"
        self.stats: dict[str, int] = defaultdict(int)

    def encode_bytes(self, block, indices, key):
        """The framed message (header, index section, value section) for `block`'s entries at
        `indices`."""
        return self._code(block, indices, key)[0]

    def encode(self, block, indices, key):
        """The message and what the receiver decodes from it, without decoding the message
        again: the index codec already returns the receiver's positions (a Bloom filter's
        query of the whole block is the costly part), and the values come from the same
        value-codec decode the receiver runs."""
        message, positions, value_section = self._code(block, indices, key)
        values = self.value.decode(value_section, positions.numel(), block.dtype, key)
        return Encoded(message, positions, values.to(block.device))

    def _code(self, block: torch.Tensor, indices: torch.Tensor, key: str):
        """(message, the positions the receiver decodes, the value section)."""
        indices = torch.sort(indices.to(torch.int64)).values
        index_section, positions = self.index.encode(indices, block.numel(), key)
        value_section = self.value.encode(block[positions], key)
        header = wire.Header(
            self.index.code, self.value.code, block.dtype, positions.numel(), block.numel()
        )
        message = wire.write(header, index_section, value_section)
        self.stats["entries"] += indices.numel()
        self.stats["raw_bytes"] += indices.numel() * (4 + block.element_size())
        self.stats["index_bytes"] += index_section.numel()
        self.stats["value_bytes"] += value_section.numel()
        self.stats["coded_bytes"] += message.numel()
        return message, positions, value_section

    def decode(self, data, block_size, dtype, device, key):
        """(int64 indices, values) from a framed message; ValueError when it is corrupted,
        truncated, or coded with other codecs."""
        header, index_section, value_section = wire.read(data)
        if (header.index_codec, header.value_codec) != (self.index.code, self.value.code):
            raise ValueError(
                f"message coded with codecs ({header.index_codec}, {header.value_codec}), "
                f"this is {self.name} ({self.index.code}, {self.value.code})"
            )
        if header.block_size != block_size or header.dtype != dtype:
            raise ValueError(
                f"message is for a block of {header.block_size} {header.dtype}, "
                f"expected {block_size} {dtype}"
            )
        positions = self.index.decode(index_section, header.entries, block_size, key)
        values = self.value.decode(value_section, header.entries, dtype, key)
        return positions.to(device), values.to(device)


def resolve(params: dict[str, Any]) -> dict[str, Any]:
    """DeepReduce's keys with defaults, validated (ValueError naming the valid choices)."""
    p = {**DEFAULTS, **{k: v for k, v in params.items() if k in DEFAULTS}}
    if p["deepreduce"] not in MODES:
        raise ValueError(
            f"unknown deepreduce mode {p['deepreduce']!r}; valid choices: "
            f"None, 'value', 'index', 'both'"
        )
    for key, table in (("index", INDEX_CODECS), ("value", VALUE_CODECS)):
        if p[key] not in table:
            raise ValueError(
                f"unknown {key} codec {p[key]!r}; valid choices: {', '.join(sorted(table))}"
            )
    if p["policy"] not in POLICIES:
        raise ValueError(
            f"unknown bloom policy {p['policy']!r}; valid choices: {', '.join(POLICIES)}"
        )
    for make in (*INDEX_CODECS.values(), *VALUE_CODECS.values()):
        make(p)  # the constructors validate fpr, poly_degree, quantum_num and bucket_size
    return p


def codec_from_params(params: dict[str, Any]) -> DeepReduceCodec | None:
    """The payload codec DeepReduce's keys describe (None when 'deepreduce' is None): 'index'
    codes the positions in modes 'index' and 'both', 'value' the values in 'value' and 'both'."""
    p = resolve(params)
    return None if p["deepreduce"] is None else _codec(p)


def codec_for_mode(params: dict[str, Any], mode: str) -> DeepReduceCodec:
    """The codec of DeepReduce's keys in `params` with 'deepreduce' set to `mode` ('value',
    'index' or 'both')."""
    return _codec(resolve({**params, "deepreduce": mode}))


def _codec(p: dict[str, Any]) -> DeepReduceCodec:
    """The codec of resolved keys `p` whose mode is not None."""
    mode = p["deepreduce"]
    index = INDEX_CODECS[p["index"] if mode in ("index", "both") else "none"](p)
    value = VALUE_CODECS[p["value"] if mode in ("value", "both") else "none"](p)
    return DeepReduceCodec(index, value)


# grace_from_params and resolve_params know DeepReduce's keys from here on.
register_codec_keys(CodecKeys("deepreduce_compat", DEFAULTS, resolve, codec_from_params))
