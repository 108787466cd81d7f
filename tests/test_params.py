"""The declaration of grace_from_params' keys (spardl_grace.registry.PARAMS) is what the
registry validates from: every default is valid, every key refuses a bad value by name."""
from __future__ import annotations

import re

import pytest

from spardl_grace import registry
from spardl_grace.registry import resolve_params
from spardl_grace.params import Param, int_at_least

SPARSE = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl"}


def test_defaults_come_from_the_declaration_and_are_valid():
    assert registry.DEFAULTS == {p.key: p.default for p in registry.PARAMS}
    assert len({p.key for p in registry.PARAMS}) == len(registry.PARAMS)
    resolved = resolve_params({})
    for param in registry.PARAMS:
        param.validate(resolved[param.key])


@pytest.mark.parametrize("param", registry.PARAMS, ids=lambda p: p.key)
def test_every_key_refuses_a_bad_value_by_name(param):
    base = SPARSE if param.key.startswith("oktopk_") else {}
    with pytest.raises(ValueError) as caught:
        resolve_params({**base, param.key: "nonsense"})
    message = str(caught.value)
    if param.choices is not None:
        assert f"unknown {param.kind} 'nonsense'; valid choices: " in message
        assert all(str(choice) in message for choice in param.choices)
    else:
        assert message == f"{param.key} must be {param.rule}, got 'nonsense'"


@pytest.mark.parametrize("key,value", [("teams", True), ("seed", 1.5), ("world_size", 0),
                                       ("oktopk_warmup_steps", -1), ("powersgd_rank", False)])
def test_bools_floats_and_out_of_range_values_are_refused(key, value):
    with pytest.raises(ValueError, match=f"^{key} must be"):
        resolve_params({**SPARSE, key: value})


def test_the_communicators_are_the_declared_algorithms():
    assert registry.COMMUNICATORS == sorted(registry.ALGORITHMS)
    families = {a.family for a in registry.ALGORITHMS.values()}
    assert families == {"grace", "sparse", "dense", "auto"}
    assert set(registry.SPARSE_ALLREDUCES) == {"spardl", "topka", "gaussiank", "topkdsa",
                                               "gtopk", "oktopk"}


def test_a_param_validates_as_declared():
    check, rule = int_at_least(2)
    param = Param("x", 2, "doc", check=check, rule=rule)
    param.validate(3)
    with pytest.raises(ValueError, match=r"^x must be an int >= 2, got 1$"):
        param.validate(1)
    choice = Param("y", "a", "doc", choices=("a", "b"), kind="thing")
    with pytest.raises(ValueError, match=r"^unknown thing 'c'; valid choices: a, b$"):
        choice.validate("c")


def test_graces_own_key_names_are_accepted():
    """compress_rank is GRACE's name for the PowerSGD rank; with both names given they must
    agree."""
    from spardl_grace.registry import resolve_params
    powersgd = {"compressor": "powersgd", "memory": "powersgd"}
    assert resolve_params({**powersgd, "compress_rank": 4})["powersgd_rank"] == 4
    assert "compress_rank" not in resolve_params({**powersgd, "compress_rank": 4})
    with pytest.raises(ValueError, match="'compress_rank' is an alias of 'powersgd_rank'"):
        resolve_params({**powersgd, "compress_rank": 4, "powersgd_rank": 2})


@pytest.mark.parametrize("params", [None, "{'compressor': 'topk'}", [("compressor", "topk")]])
def test_parameters_that_are_not_a_dict_are_refused_showing_the_form(params):
    """A JSON string, None or pairs gave AttributeError or 'not iterable' from deep inside."""
    from spardl_grace import grace_from_params
    for build in (resolve_params, lambda p: grace_from_params(p, transport=None)):
        with pytest.raises(TypeError, match="a dict of keys to values, e.g. {'compressor'"):
            build(params)


@pytest.mark.parametrize("given,says", [
    ({"communicator": "topka", "teams": 2}, "teams configures communicator 'spardl'; "
                                            "communicator 'topka' has none"),
    ({"oktopk_region_interval": 8}, "oktopk_region_interval configures communicator 'oktopk'; "
                                    "communicator 'spardl' has none"),
    ({"communicator": "topka", "gtopk_residual": "paper"},
     "gtopk_residual configures communicator 'gtopk'"),
    ({"compress_rank": 2}, "powersgd_rank (GRACE's compress_rank) configures compressor "
                           "'powersgd'; compressor 'topk' has none"),
])
def test_a_key_of_one_communicator_is_refused_with_another(given, says):
    """It was accepted and ignored: SparDL's teams with TopkA sent what teams 1 sends."""
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        resolve_params({**SPARSE, **given})
    owner = {"teams": "spardl", "oktopk_region_interval": "oktopk", "gtopk_residual": "gtopk"}
    for key, comm in owner.items():
        if key in given:
            resolve_params({**SPARSE, **given, "communicator": comm})
