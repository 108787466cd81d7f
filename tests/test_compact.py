"""The compact wire (spardl_grace.compact): exact index round trips at every block-size edge,
16-bit values whose rounding error stays with the sender (the conservation identity exactly),
NaN and infinities delivered as such, bytes on the wire against the formulas, the same bits on
every rank and transport, and the 'wire' key's refusals."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_checks import check_consistent_and_conserving, run_steps
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.compact import CompactCodec, index_width, to_wire
from spardl_grace.communicators.schedules import bruck_rounds
from spardl_grace.payload import CRC_BYTES, ChecksummedCodec, frame_overhead
from spardl_grace.registry import SPARSE_ALLREDUCES
from spardl_grace.utils import bitpack

CODEC = CompactCodec()
BF16_MAX = torch.finfo(torch.bfloat16).max
F32_MAX = torch.finfo(torch.float32).max


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (torch.equal treats NaN as unequal)."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


# ----------------------------------------------------------------------- fixed-width packing
@settings(max_examples=400, deadline=None)
@given(st.integers(0, 32), st.integers(0, 300), st.randoms(use_true_random=False))
def test_fixed_width_packing_is_the_little_endian_bit_stream(width, count, rnd):
    """pack() must write what a bit-by-bit packer writes (numpy's, little bit order): the
    DeepReduce codecs' messages use it and must not change."""
    values = np.array([rnd.getrandbits(width) if width else 0 for _ in range(count)], dtype=np.int64)
    data = bitpack.pack(torch.from_numpy(values), width)
    bits = ((values[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    assert np.array_equal(data.numpy(), np.packbits(bits, bitorder="little"))
    assert torch.equal(bitpack.unpack(data, count, width), torch.from_numpy(values))


def test_fixed_width_packing_refuses_widths_beyond_32_and_wrong_sizes():
    with pytest.raises(ValueError, match="0..32"):
        bitpack.pack(torch.tensor([1]), 33)
    with pytest.raises(ValueError, match="cannot hold exactly 3 values of 5 bits"):
        bitpack.unpack(torch.zeros(3, dtype=torch.uint8), 3, 5)


# ----------------------------------------------------------------------- the codec's round trip
EDGES = sorted({1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 65535, 65536, 65537, 2**22, 2**22 + 1,
                3_686_400, 2**31})


@pytest.mark.parametrize("block", EDGES)
def test_indices_round_trip_exactly_at_every_block_size_edge(block):
    """The first, last and middle positions of blocks of 1, 2**k and 2**k + 1 entries up to the
    largest (2**31, int32's reach), and VGG-16's partition on 4 ranks."""
    positions = torch.tensor(sorted({0, block // 2, block - 1}), dtype=torch.int64)
    values = torch.randn(positions.numel())
    enc = CODEC.encode_sparse(positions, values, block, "k")
    assert enc.data.numel() == CODEC.fixed_size(positions.numel(), torch.float32, block)
    assert enc.data.numel() == 2 * positions.numel() + math.ceil(positions.numel() * index_width(block) / 8)
    idx, vals = CODEC.decode(enc.data, block, torch.float32, torch.device("cpu"), "k")
    assert torch.equal(idx, positions)
    assert torch.equal(vals, enc.values)
    assert index_width(block) == math.ceil(math.log2(block))


def test_a_block_past_int32_indices_is_refused():
    with pytest.raises(ValueError, match="split the tensor into buckets"):
        CODEC.encode_sparse(torch.tensor([0]), torch.ones(1), 2**31 + 1, "k")


@st.composite
def blocks_and_entries(draw):
    size = draw(st.one_of(st.integers(1, 70), st.integers(1, 5000), st.sampled_from(EDGES[:12])))
    chosen = draw(st.sets(st.integers(0, size - 1), max_size=min(size, 200)))
    order = draw(st.permutations(sorted(chosen)))  # senders need not sort their entries
    finite = st.floats(-F32_MAX, F32_MAX, allow_nan=False, width=32)
    special = st.sampled_from([float("nan"), float("inf"), float("-inf"), F32_MAX, -F32_MAX,
                               BF16_MAX, 1e-45, -0.0, 0.0])
    values = draw(st.lists(st.one_of(finite, special), min_size=len(order), max_size=len(order)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    return size, torch.tensor(order, dtype=torch.int64), torch.tensor(values, dtype=dtype)


@settings(max_examples=1000, deadline=None)
@given(blocks_and_entries())
def test_decode_yields_exactly_what_encode_reports(case):
    """Indices as sent, in the order sent; values the 16-bit rounding encode reports (what the
    sender subtracts), NaN and infinities included; the message has the fixed size."""
    size, positions, values = case
    enc = CODEC.encode_sparse(positions, values, size, "k")
    assert enc.data.numel() == CODEC.fixed_size(positions.numel(), values.dtype, size)
    idx, vals = CODEC.decode(enc.data, size, values.dtype, torch.device("cpu"), "k")
    assert torch.equal(idx, positions)
    assert same_bits(vals, enc.values)
    assert same_bits(enc.values, to_wire(values).to(values.dtype))
    block = torch.zeros(size, dtype=values.dtype)
    block[positions] = values
    assert torch.equal(CODEC.encode(block, positions, "k").data, enc.data)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-F32_MAX, F32_MAX, allow_nan=False, width=32), min_size=1, max_size=100))
def test_the_rounding_error_is_exactly_representable_so_the_sender_keeps_all_of_it(values):
    """sent + (value - sent) == value in float32 for every finite value, clamped ones too: the
    sender's residual holds exactly what the wire did not carry."""
    v = torch.tensor(values, dtype=torch.float32)
    sent = CODEC.encode_sparse(torch.arange(v.numel()), v, v.numel(), "k").values
    kept = v - sent
    assert torch.equal(sent + kept, v)
    assert torch.equal(kept.double(), v.double() - sent.double())  # no rounding in the subtraction
    assert torch.isfinite(sent).all()


def test_non_finite_values_arrive_as_such_and_large_finite_ones_stay_finite():
    v = torch.tensor([float("nan"), float("inf"), float("-inf"), F32_MAX, -F32_MAX, BF16_MAX, 3e38, 1.0])
    enc = CODEC.encode_sparse(torch.arange(8), v, 8, "k")
    _, got = CODEC.decode(enc.data, 8, torch.float32, torch.device("cpu"), "k")
    assert got[0].isnan() and got[1] == float("inf") and got[2] == float("-inf")
    assert got[3] == BF16_MAX and got[4] == -BF16_MAX and got[5] == BF16_MAX
    assert torch.isfinite(got[3:]).all() and got[7] == 1.0


def test_sixteen_bit_blocks_go_losslessly_in_their_own_type():
    for dtype in (torch.float16, torch.bfloat16):
        v = torch.randn(50).to(dtype)
        enc = CODEC.encode_sparse(torch.arange(50), v, 50, "k")
        assert torch.equal(enc.values, v)


def test_malformed_messages_raise_instead_of_decoding_wrong_entries():
    enc = CODEC.encode_sparse(torch.tensor([1, 900]), torch.ones(2), 1000, "k")  # 4 + 3 bytes
    with pytest.raises(ValueError, match="no whole number of entries"):
        CODEC.decode(enc.data[:-1], 1000, torch.float32, torch.device("cpu"), "k")
    with pytest.raises(ValueError, match="outside the block of 900"):  # same width, no 900
        CODEC.decode(enc.data, 900, torch.float32, torch.device("cpu"), "k")
    with pytest.raises(ValueError, match="floating-point values"):
        CODEC.encode_sparse(torch.tensor([0]), torch.tensor([3]), 10, "k")


def test_a_checksum_wraps_the_compact_wire_and_catches_a_flipped_bit():
    codec = ChecksummedCodec(CODEC)
    block = torch.randn(4000)
    chosen = torch.topk(block.abs(), 40).indices
    enc = codec.encode(block, chosen, "k")
    assert enc.data.numel() == codec.fixed_size(40, torch.float32, 4000) == 2 * 40 + 60 + CRC_BYTES
    idx, vals = codec.decode(enc.data, 4000, torch.float32, torch.device("cpu"), "k")
    assert torch.equal(idx, chosen) and torch.equal(vals, enc.values)
    flipped = enc.data.clone()
    flipped[10] ^= 4
    with pytest.raises(ValueError, match="CRC-32"):
        codec.decode(flipped, 4000, torch.float32, torch.device("cpu"), "k")


# ----------------------------------------------------------------------- in the all-reduces
def grid_grads(size: int, n: int, steps: int) -> list[list[torch.Tensor]]:
    """Gradients on a grid of 2**-12 below 2**8: every sum of a few of them, and every
    difference of one and its bfloat16 rounding, is exact in float32, while most of them are
    not bfloat16 values (so the wire rounds)."""
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(-2**20, 2**20, (n,), generator=g).float() * 2.0**-12
             for _ in range(steps)] for _ in range(size)]


def compact(comm: str, **extra) -> dict:
    params = {"communicator": comm, "compress_ratio": 0.05, "wire": "compact", **extra}
    if comm == "oktopk":
        params.update(oktopk_threshold_interval=2, oktopk_region_interval=3)
    return params


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("comm,extra", [(c, {}) for c in SPARSE_ALLREDUCES]
                         + [("spardl", {"teams": 2}), ("spardl", {"teams": "all"})])
def test_conservation_holds_exactly_with_sixteen_bit_values(comm, extra, size):
    """sum of compensated gradients == P * result + sum of new residuals, to the bit, where
    every sum is exact (P a power of two, grid-valued gradients); and the rounding error is
    really there, kept in some residual at a position that was sent."""
    if extra.get("teams") == "all":
        extra = {"teams": size}
    per_rank = run_steps(size, compact(comm, **extra), grads=grid_grads(size, 1000, 3), steps=3)
    rounded = False
    for step in range(3):
        records = [r[step] for r in per_rank]
        assert all(torch.equal(r["result"], records[0]["result"]) for r in records)
        compensated = sum(r["compensated"] for r in records)
        kept = sum(r["residual"] for r in records)
        assert torch.equal(compensated, size * records[0]["result"] + kept), f"step {step}"
        sent = records[0]["result"] != 0
        rounded |= bool((kept[sent] != 0).any())
    assert rounded


@pytest.mark.parametrize("size", [3, 5, 6])
@pytest.mark.parametrize("comm", SPARSE_ALLREDUCES)
def test_every_sparse_allreduce_conserves_and_agrees_with_the_compact_wire(comm, size):
    check_consistent_and_conserving(run_steps(size, compact(comm), 997, steps=4), size)


def test_the_compact_wire_is_not_the_exact_one():
    """Same inputs: the compact wire's result differs from the exact wire's (the key takes
    effect), by the rounding: later rounds select from rounded sums, so a near tie may go the
    other way, but the supports mostly agree and where both send, values agree to a few
    bfloat16 steps (2**-8 relative each)."""
    exact = run_steps(4, {"communicator": "spardl", "compress_ratio": 0.05, "wire": "exact"},
                      1000, steps=1)
    small = run_steps(4, compact("spardl"), 1000, steps=1)
    a, b = exact[0][0]["result"], small[0][0]["result"]
    assert not torch.equal(a, b)
    both = (a != 0) & (b != 0)
    assert both.sum() >= 0.9 * (a != 0).sum()
    assert torch.allclose(a[both], b[both], rtol=2**-6, atol=0)


@pytest.mark.parametrize("comm", SPARSE_ALLREDUCES)
def test_the_default_wire_is_the_compact_one(comm):
    """grace_from_params without 'wire' sends exactly what 'wire': 'compact' sends, bit for
    bit and byte for byte, and the codec says so."""
    params = compact(comm)
    del params["wire"]
    default = run_steps(3, params, 997, steps=2, counting=True)
    explicit = run_steps(3, compact(comm), 997, steps=2, counting=True)
    for mine, theirs in zip(default, explicit):
        for a, b in zip(mine, theirs):
            assert same_bits(a["result"], b["result"])
            assert [m.bytes_sent for m in a["messages"]] == [m.bytes_sent for m in b["messages"]]
    assert type(default[0][0]["grc"].codec).__name__ == "CompactCodec"


def test_spardl_bytes_on_the_wire_match_the_formula():
    """P = 6, one team: P - 1 SRS messages of k_b entries at 2 + w/8 bytes (w = ceil(log2 B))
    and Bruck's ceil(log2 P) rounds of k_b-entry pieces, framed."""
    size, n, rho = 6, 6000, 0.05
    per_rank = run_steps(size, compact("spardl", compress_ratio=rho), n, steps=2, counting=True)
    block = math.ceil(n / size)
    kb = math.floor(block * rho)
    piece = 2 * kb + math.ceil(kb * index_width(block) / 8)
    for records in per_rank:
        for rec in records:
            srs = [m for m in rec["messages"] if m.phase == "srs" and m.op == "send"]
            assert [m.bytes_sent for m in srs] == [piece] * (size - 1)
            sag = [m for m in rec["messages"] if m.phase == "sag" and m.op == "send"]
            assert [m.bytes_sent for m in sag] == [c * piece + frame_overhead(c)
                                                   for _, c in bruck_rounds(size)]
            assert rec["stats"]["bytes_sent"] == sum(m.bytes_sent for m in srs + sag)


def test_topka_bytes_on_the_wire_match_the_formula():
    size, n, rho = 4, 5000, 0.02
    per_rank = run_steps(size, compact("topka", compress_ratio=rho), n, steps=2, counting=True)
    k = math.ceil(n * rho)
    for records in per_rank:
        for rec in records:
            assert rec["stats"]["bytes_sent"] == (size - 1) * (2 * k + math.ceil(k * 13 / 8))


def test_spardl_messages_stay_one_round_trip_each_with_the_compact_wire():
    """Fixed widths keep every message's size known to its receiver: no size exchange."""
    from spardl_grace.transport import CountingTransport

    def fn(t):
        counting = CountingTransport(t)
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "communicator": "spardl", "compress_ratio": 0.02,
                                 "wire": "compact"}, transport=counting)
        grc.step(torch.randn(1000), "w")
        sends = sum(1 for m in counting.messages if m.op == "send")
        return counting.round_trips, sends
    for trips, sends in run_local(5, fn):
        assert sends == 4 + 3 and trips == sends


def test_the_wire_key_is_refused_where_it_cannot_take_effect():
    from deepreduce_compat import deepreduce_from_params
    base = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl"}
    with pytest.raises(ValueError, match="unknown wire 'half'; valid choices: compact, exact"):
        grace_from_params({**base, "wire": "half"}, transport=_one())
    with pytest.raises(ValueError, match="communicator 'allgather' sends none of them"):
        grace_from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                           "wire": "compact"}, transport=_one())
    with pytest.raises(ValueError, match="communicator 'dense' sends none of them"):
        grace_from_params({"compressor": "none", "communicator": "dense", "wire": "exact"},
                          transport=_one())
    with pytest.raises(ValueError, match="give 'wire' or choose a codec, not both"):
        deepreduce_from_params({**base, "wire": "compact", "deepreduce": "index", "index": "delta"},
                               transport=_one())
    with pytest.raises(ValueError, match="give 'wire' or choose a codec, not both"):
        grace_from_params({**base, "wire": "compact"}, transport=_one(), codec=CODEC)
    grc = grace_from_params({**base, "wire": "compact", "checksum": True}, transport=_one())
    assert isinstance(grc.codec, ChecksummedCodec) and isinstance(grc.codec.inner, CompactCodec)


def _one():
    from spardl_grace.transport.local import LocalTransport
    return LocalTransport.world(1)[0]


# ----------------------------------------------------------------------- real transports
CASES = [("spardl", 1000, 1), ("spardl", 1200, "all"), ("topka", 1000, 1), ("topkdsa", 1000, 1),
         ("gtopk", 1000, 1), ("oktopk", 1000, 1), ("gaussiank", 1000, 1)]


def compact_steps(transport) -> list[dict]:
    """Every sparse all-reduce with the compact wire for a few steps (real-transport scenario)."""
    import scenarios
    records = []
    for comm, n, teams in CASES:
        extra = {"teams": transport.size if teams == "all" else teams} if comm == "spardl" else {}
        for rec in scenarios.sparse_steps(transport, compact(comm, **extra), n, steps=3):
            records.append({"case": (comm, n, teams), **rec})
    return records


@pytest.mark.parametrize("backend,size", [("gloo", 4), ("mpi", 3), ("horovod-gloo", 4)])
def test_the_same_bits_on_every_rank_and_transport(launch, backend, size):
    """Each rank's result and residual equal, bit for bit, those of the same ranks run as
    threads over the local transport; every rank's result is the same."""
    results = launch(backend, size, "test_compact.compact_steps")
    local = run_local(size, compact_steps)
    for rank in range(size):
        assert len(results[rank]) == len(local[rank])
        for i, (got, want) in enumerate(zip(results[rank], local[rank])):
            assert got["case"] == want["case"]
            assert torch.equal(got["result"], results[0][i]["result"]), got["case"]
            assert torch.equal(got["result"], want["result"]), got["case"]
            assert torch.equal(got["residual"], want["residual"]), got["case"]
