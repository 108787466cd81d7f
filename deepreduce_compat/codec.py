"""DeepReduceCodec: an index codec and a value codec behind spardl_grace's PayloadCodec, so any
sparse all-reduce (SparDL, TopkA, TopkDSA, gTop-k, Ok-Topk) can code its messages, and the
GRACE compressor wrappers can code theirs.

The sender codes the positions first, then sends the values found in the block at exactly the
positions the receiver will decode (a Bloom filter's policy may pick others than the selected
ones), then decodes its own value section: `encode` reports what the receiver gets, bit for
bit, so whatever coding drops or changes stays in the sender's residual.

A curve fit of the values (polyfit, dexp) sorts them; with raw positions (value-only mode) the
positions then travel in the values' sorted order, as DeepReduce's value-only mode sends them,
and no permutation is needed (4 bytes an entry plus the coefficients). With an index codec,
which codes sorted positions, the value section carries the permutation back to position order.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from typing import Any

import torch

from spardl_grace.payload import Encoded, PayloadCodec
from spardl_grace.registry import CodecKeys, register_codec_keys
from spardl_grace.transport.base import as_bytes, from_bytes

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
    CurveFitValues,
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
# The names DeepReduce's code knows for the same codecs: its CPU variants (its C Bloom filter,
# numpy's polynomial fit) and its zlib value codec. Its 'gzip' codes values only.
INDEX_ALIASES = {"bloom_cpu": "bloom"}
VALUE_ALIASES = {"gzip": "deflate", "polyfit_cpu": "polyfit"}
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
    # DeepReduce's code reads these too; see resolve() for what each does here.
    "micro-benchmark": False,
    "sort": False,
    "hash_table": None,
    "dense_tensor": None,
    "buckets_num": None,
}


MICRO_BENCHMARK_LOGGER = "deepreduce_compat.micro_benchmark"


def _micro_benchmark_log() -> logging.Logger:
    """The logger 'micro-benchmark' writes to. DeepReduce prints these lines, so when the
    application has configured no logging they go to stderr at INFO."""
    log = logging.getLogger(MICRO_BENCHMARK_LOGGER)
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    return log


class DeepReduceCodec(PayloadCodec):
    """Codes a block's entries as header + index section + value section (see wire).
    `micro_benchmark`: log, for every message, what DeepReduce's 'micro-benchmark' prints:
    index and value coding times, and each section's bits over the block's at 32 bits an
    entry (idx_relative_volume, val_relative_volume)."""

    def __init__(
        self,
        index: IndexCodec | None = None,
        value: ValueCodec | None = None,
        micro_benchmark: bool = False,
    ):
        self.index = index or RawIndex()
        self.value = value or RawValues()
        self.name = f"deepreduce[{self.index.name}+{self.value.name}]"
        self.stats: dict[str, int] = defaultdict(int)
        self._micro_benchmark = _micro_benchmark_log() if micro_benchmark else None

    def encode_bytes(self, block, indices, key):
        """The framed message (header, index section, value section) for `block`'s entries at
        `indices`."""
        return self._code(block, indices, key)[0]

    def encode(self, block, indices, key):
        """The message and what the receiver decodes from it, without decoding the message
        again: the index codec already returns the receiver's positions (a Bloom filter's
        query of the whole block is the costly part), and the values come from the same
        value-codec decode the receiver runs."""
        message, header, positions, index_section, value_section = self._code(block, indices, key)
        if self.in_value_order:
            _, values = self._in_value_order(header, index_section, value_section)
        else:
            values = self.value.decode(value_section, positions.numel(), block.dtype, key)
        return Encoded(message, positions, values.to(block.device))

    @property
    def in_value_order(self) -> bool:
        """Whether positions travel in the values' sorted order (raw positions and a curve fit:
        no permutation needed)."""
        return isinstance(self.index, RawIndex) and isinstance(self.value, CurveFitValues)

    def _code(self, block: torch.Tensor, indices: torch.Tensor, key: str):
        """(message, its header, the positions the receiver decodes, the index section, the
        value section)."""
        indices = torch.sort(indices.to(torch.int64)).values
        _check_positions(indices, block.numel())
        start = time.perf_counter()
        if self.in_value_order:
            assert isinstance(self.value, CurveFitValues)
            selected = block[indices]
            order = self.value.sort_order(selected)
            index_section = as_bytes(indices[order].to(torch.int32))
            positions = indices
            coded = time.perf_counter()
            value_section = self.value.encode_ordered(selected[order])
        else:
            index_section, positions = self.index.encode(indices, block.numel(), key)
            coded = time.perf_counter()
            value_section = self.value.encode(block[positions], key)
        if self._micro_benchmark is not None:
            self._micro_benchmark.info(f"idx_compression time:{coded - start}")
            self._micro_benchmark.info(f"val_compression time:{time.perf_counter() - coded}")
        header = wire.Header(
            self.index.code, self.value.code, block.dtype, positions.numel(), block.numel()
        )
        message = wire.write(header, index_section, value_section)
        self.stats["entries"] += indices.numel()
        self.stats["raw_bytes"] += indices.numel() * (4 + block.element_size())
        self.stats["index_bytes"] += index_section.numel()
        self.stats["value_bytes"] += value_section.numel()
        self.stats["coded_bytes"] += message.numel()
        return message, header, positions, index_section, value_section

    def decode(self, data, block_size, dtype, device, key):
        """(int64 indices, values) from a framed message; ValueError when it is corrupted,
        truncated, or coded for another block or with other codecs."""
        header, index_section, value_section = wire.read(
            data, self.index.code, self.value.code, dtype, block_size
        )
        start = time.perf_counter()
        if self.in_value_order:
            positions, values = self._in_value_order(header, index_section, value_section)
            decoded = start
        else:
            positions = self.index.decode(index_section, header.entries, block_size, key)
            decoded = time.perf_counter()
            values = self.value.decode(value_section, header.entries, dtype, key)
        if self._micro_benchmark is not None:
            log, dense_bits = self._micro_benchmark, 32 * block_size
            log.info(f"idx_decompression time:{decoded - start}")
            log.info(f"val_decompression time:{time.perf_counter() - decoded}")
            log.info(f"idx_relative_volume: {8 * index_section.numel() / dense_bits:.4f}")
            log.info(f"val_relative_volume: {8 * value_section.numel() / dense_bits:.4f}")
        return positions.to(device), values.to(device)

    def _in_value_order(self, header: wire.Header, index_section, value_section):
        """(sorted positions, their values) from the sections of a message whose int32
        positions follow the values' sorted order."""
        assert isinstance(self.value, CurveFitValues)
        count, block_size = header.entries, header.block_size
        if index_section.numel() != 4 * count:
            raise ValueError(f"index section of {index_section.numel()} bytes for {count} int32")
        in_order = from_bytes(index_section.clone(), torch.int32).to(torch.int64)
        fitted, _ = self.value.decode_ordered(value_section, count)
        by_position = torch.argsort(in_order)
        positions = in_order[by_position]
        if count and (
            int(positions[0]) < 0
            or int(positions[-1]) >= block_size
            or bool((torch.diff(positions) <= 0).any())
        ):
            raise ValueError(f"positions outside 0..{block_size - 1} or repeated")
        return positions, fitted[by_position].to(header.dtype)


def resolve(params: dict[str, Any]) -> dict[str, Any]:
    """DeepReduce's keys with defaults, validated (ValueError naming the valid choices).

    Every key DeepReduce's code reads is accepted. 'micro-benchmark' logs what DeepReduce
    prints (coding times, the index and value volumes relative to the dense tensor) through
    the logger MICRO_BENCHMARK_LOGGER. 'sort' (the values arrive sorted, so DeepReduce's
    polyfit skips its sort) changes nothing: the values are always sorted here, which gives
    the same fit. 'hash_table' (DeepReduce's precomputed Bloom hashes, loaded from a file)
    and 'dense_tensor' (the gradient, which its IndexCompressor stores in the params for the
    Bloom policies) are not needed: the hashes are computed, and the codec reads the values
    from the block it codes.
    'buckets_num' is read by neither DeepReduce's nor GRACE's code (their QSGD takes
    'bucket_size') and changes nothing here either; setting it warns."""
    p = {**DEFAULTS, **{k: v for k, v in params.items() if k in DEFAULTS}}
    if p["deepreduce"] not in MODES:
        raise ValueError(
            f"unknown deepreduce mode {p['deepreduce']!r}; valid choices: "
            f"None, 'value', 'index', 'both'"
        )
    if p["index"] == "gzip":
        raise ValueError(
            "'gzip' codes values in DeepReduce (its Gzip compresses the values): use "
            f"'value': 'gzip' (deflate); index codecs: {', '.join(sorted(INDEX_CODECS))}"
        )
    p["index"] = INDEX_ALIASES.get(p["index"], p["index"])
    p["value"] = VALUE_ALIASES.get(p["value"], p["value"])
    for key, table, aliases in (
        ("index", INDEX_CODECS, INDEX_ALIASES),
        ("value", VALUE_CODECS, VALUE_ALIASES),
    ):
        if p[key] not in table:
            raise ValueError(
                f"unknown {key} codec {p[key]!r}; valid choices: "
                f"{', '.join(sorted([*table, *aliases]))}"
            )
    if p["policy"] not in POLICIES:
        raise ValueError(
            f"unknown bloom policy {p['policy']!r}; valid choices: {', '.join(POLICIES)}"
        )
    for flag in ("micro-benchmark", "sort"):
        if not isinstance(p[flag], bool):
            raise ValueError(f"'{flag}' must be True or False, got {p[flag]!r}")
    if p["buckets_num"] is not None:
        warnings.warn(
            "'buckets_num' is read by neither DeepReduce's nor GRACE's code and changes "
            "nothing here either: QSGD's buckets are set by 'bucket_size'",
            UserWarning,
            stacklevel=3,
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
    return DeepReduceCodec(index, value, p["micro-benchmark"])


# grace_from_params and resolve_params know DeepReduce's keys from here on.
register_codec_keys(CodecKeys("deepreduce_compat", DEFAULTS, resolve, codec_from_params))


def _check_positions(indices: torch.Tensor, numel: int) -> None:
    """ValueError unless the sorted `indices` are distinct positions of a block of `numel`
    entries: delta and Huffman coding would decode a repeated or negative one as another
    position, in silence (one check, one device synchronisation)."""
    if not indices.numel():
        return
    bad = (indices[0] < 0) | (indices[-1] >= numel) | (indices[1:] == indices[:-1]).any()
    if bool(bad):
        raise ValueError(
            f"DeepReduce codes distinct positions in 0..{numel - 1} of the block; got "
            f"{indices.numel()} positions from {int(indices[0])} to {int(indices[-1])}, "
            f"{indices.numel() - int(torch.unique_consecutive(indices).numel())} repeated: "
            "give the sparsifier's indices, each once"
        )
