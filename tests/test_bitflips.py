"""Flipped bits in messages (benchmarks.bitflips): with a checksum on the payload (the
identity codec with 'checksum': True, or DeepReduce's codecs) every flip makes a rank raise,
never a silent wrong result; the checksum changes nothing else (bit-identical results,
exactly 4 more bytes per message)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bitflips
from spardl_grace import grace_from_params
from spardl_grace.payload import IdentityCodec
from spardl_grace.transport import CountingTransport, run_local
from spardl_grace.payload import CRC_BYTES, ChecksummedCodec

SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.data())
def test_a_checksummed_message_round_trips_and_any_flipped_bit_raises(n, data):
    g = torch.Generator().manual_seed(n)
    block = torch.randn(n, generator=g)
    count = data.draw(st.integers(0, n))
    indices = torch.randperm(n, generator=g)[:count]
    codec = ChecksummedCodec(IdentityCodec())
    encoded = codec.encode(block, indices, "k")
    assert encoded.data.numel() == codec.fixed_size(count, block.dtype, block.numel()) == 8 * count + CRC_BYTES
    got_indices, got_values = codec.decode(encoded.data, n, block.dtype, block.device, "k")
    assert torch.equal(got_indices, indices) and torch.equal(got_values, block[indices])
    bit = data.draw(st.integers(0, 8 * encoded.data.numel() - 1))
    flipped = encoded.data.clone()
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ValueError, match="CRC-32|no CRC-32"):
        codec.decode(flipped, n, block.dtype, block.device, "k")


def test_the_checksum_changes_no_result_and_adds_4_bytes_per_message():
    def fn(t, checksum):
        counting = CountingTransport(t)
        grc = grace_from_params({**SPARDL, "checksum": checksum}, transport=counting)
        g = torch.Generator().manual_seed(t.rank)
        results = []
        for _ in range(3):
            results.append(grc.step(torch.randn(4000, generator=g), "w").clone())
        p2p = [m for m in counting.messages if m.op == "sendrecv"]
        return results, sum(m.bytes_sent for m in p2p), len(p2p), counting.round_trips

    plain = run_local(4, fn, False)
    checked = run_local(4, fn, True)
    for (a, sent_a, n_a, trips_a), (b, sent_b, n_b, trips_b) in zip(plain, checked):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert n_a == n_b and trips_a == trips_b  # still one round trip per message
        assert sent_b == sent_a + CRC_BYTES * n_b


def test_checksum_is_refused_where_no_sparse_message_is_sent():
    with pytest.raises(ValueError, match="'checksum' guards the messages of the sparse"):
        run_local(1, lambda t: grace_from_params({"communicator": "dense", "checksum": True},
                                                 transport=t))
    with pytest.raises(ValueError, match="checksum must be True or False, got 1"):
        run_local(1, lambda t: grace_from_params({**SPARDL, "checksum": 1}, transport=t))


@pytest.mark.parametrize("config", ["identity + checksum", "compact + checksum",
                                    "deepreduce delta + fp16", "deepreduce bloom + polyfit"])
def test_every_flip_in_a_checksummed_payload_is_detected(config):
    result = bitflips.main(["--configs", config, "--trials", "8", "--seed", "3"])
    summary = result["summary"][config]
    assert summary["injected"] == 8
    assert summary["detected"] == 8, result["trials"][config]
    assert summary["detection_s_max"] < 5.0  # raised where it was read, not after a timeout


def test_without_a_checksum_flips_can_go_unnoticed():
    """The identity payload has no redundancy: a flipped value bit is a wrong result that no
    rank notices (why 'checksum' exists); flipped index bits are caught by the bounds check."""
    result = bitflips.main(["--configs", "identity", "--trials", "12", "--seed", "0"])
    summary = result["summary"]["identity"]
    assert summary["silent"] > 0 and summary["detected"] > 0 and summary["other"] == 0


def test_the_bit_flip_transport_flips_one_bit_of_the_chosen_message():
    def fn(t):
        flip = bitflips.BitFlipTransport(t, nth=1, bit=13)
        out = [flip.sendrecv(torch.full((4,), t.rank, dtype=torch.uint8), (t.rank + 1) % 2,
                             (t.rank + 1) % 2, f"m{i}") for i in range(3)]
        return out, flip.received, flip.flipped_at is not None

    for rank, (out, received, flipped) in enumerate(run_local(2, fn)):
        other = 1 - rank
        assert received == 3 and flipped
        assert torch.equal(out[0], torch.full((4,), other, dtype=torch.uint8))
        changed = out[1] ^ torch.full((4,), other, dtype=torch.uint8)
        assert changed.tolist() == [0, 1 << 5, 0, 0]
        assert torch.equal(out[2], torch.full((4,), other, dtype=torch.uint8))
