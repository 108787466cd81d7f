"""The codec seam of the registry: spardl_grace knows no codec package; deepreduce_compat
registers DeepReduce's keys when imported, and any PayloadCodec can be given as codec=."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepreduce_compat import codec_from_params
from deepreduce_compat.codec import DeepReduceCodec
from deepreduce_compat.index_codecs import DeltaIndex
from deepreduce_compat.value_codecs import FP16Values
from spardl_grace import grace_from_params
from spardl_grace.payload import IdentityCodec
from spardl_grace.registry import resolve_params
from spardl_grace.transport import run_local
from spardl_grace import registry
from spardl_grace.registry import CodecKeys, register_codec_keys

ROOT = Path(__file__).resolve().parent.parent
SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05}


def test_the_core_imports_no_codec_package_and_says_how_to_get_its_keys():
    code = ("import sys, spardl_grace\n"
            "assert not [m for m in sys.modules if m.startswith('deepreduce_compat')], 'imported'\n"
            "try:\n"
            "    spardl_grace.registry.resolve_params({'deepreduce': 'both'})\n"
            "except ValueError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unknown parameter(s) ['deepreduce']" in out.stdout
    assert "import deepreduce_compat" in out.stdout


def _results(size: int, params: dict, codec=None) -> list[list[torch.Tensor]]:
    def fn(t):
        grc = grace_from_params({**params, "world_size": size}, transport=t, codec=codec)
        g = torch.Generator().manual_seed(t.rank)
        return [grc.step(torch.randn(1000, generator=g), "w").clone() for _ in range(3)]
    return run_local(size, fn)


def test_a_codec_given_as_codec_equals_the_one_its_keys_choose():
    keys = {"deepreduce": "both", "index": "delta", "value": "fp16"}
    by_keys = _results(3, {**SPARDL, **keys})
    given = _results(3, SPARDL, codec=DeepReduceCodec(DeltaIndex(), FP16Values()))
    uncoded = _results(3, SPARDL)
    for a, b, c in zip(by_keys, given, uncoded):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # fp16 values change the result: the codec was really used
    assert not all(torch.equal(x, z) for x, z in zip(by_keys[0], uncoded[0]))


@pytest.mark.parametrize("params,codec,error,match", [
    ({**SPARDL, "deepreduce": "index", "index": "delta"}, IdentityCodec(), ValueError,
     "not both"),
    ({"compressor": "topk", "memory": "residual", "communicator": "allgather"}, IdentityCodec(),
     ValueError, "communicator 'allgather' sends none"),
    ({**SPARDL, "communicator": "dense", "compressor": "none"}, IdentityCodec(), ValueError,
     "communicator 'dense' sends none"),
    (SPARDL, "bloom", TypeError, "codec must be a spardl_grace.payload.PayloadCodec, got str"),
])
def test_a_misplaced_codec_is_refused(params, codec, error, match):
    with pytest.raises(error, match=match):
        run_local(1, lambda t: grace_from_params(params, transport=t, codec=codec))


class _Scaled(IdentityCodec):
    name = "scaled"


@pytest.fixture
def other_package():
    yield
    registry._CODEC_KEYS.pop("other_codecs", None)


def test_another_package_registers_its_own_keys(other_package):
    def resolve(p):
        value = p.get("scaled", False)
        if not isinstance(value, bool):
            raise ValueError(f"scaled must be True or False, got {value!r}")
        return {"scaled": value}

    register_codec_keys(CodecKeys("other_codecs", {"scaled": False}, resolve,
                                  lambda p: _Scaled() if p["scaled"] else None))
    assert resolve_params({"scaled": True})["scaled"] is True
    with pytest.raises(ValueError, match="scaled must be True or False"):
        resolve_params({"scaled": 1})
    grc = run_local(1, lambda t: grace_from_params({**SPARDL, "scaled": True}, transport=t))[0]
    assert isinstance(grc.codec, _Scaled)
    with pytest.raises(ValueError, match="other_codecs, deepreduce_compat|deepreduce_compat, other_codecs"):
        resolve_params({**SPARDL, "scaled": True, "deepreduce": "value"})


@pytest.mark.parametrize("defaults,match", [
    ({"index": "delta"}, "registers key 'index', which deepreduce_compat registered"),
    ({"seed": 1}, "key 'seed' the default 1, but it is shared with the core, whose default is 0"),
])
def test_conflicting_keys_are_refused(other_package, defaults, match):
    with pytest.raises(ValueError, match=match):
        register_codec_keys(CodecKeys("other_codecs", defaults, dict, lambda p: None))
    assert "other_codecs" not in registry._CODEC_KEYS


def test_deepreduce_shares_the_cores_settings():
    """'seed' and 'quantum_num' are one setting each: GRACE's qsgd and DeepReduce's qsgd value
    codec read the same value."""
    p = resolve_params({**SPARDL, "deepreduce": "value", "value": "qsgd", "quantum_num": 15,
                        "seed": 4})
    codec = codec_from_params(p)
    assert (codec.value.levels, codec.value.seed) == (15, 4)
