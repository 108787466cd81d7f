"""The top level holds what a user calls; the names it held before 0.3 still resolve, with a
DeprecationWarning naming their new place, and nothing in the checkout uses them any more."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import spardl_grace

ROOT = Path(__file__).resolve().parent.parent


def test_the_top_level_is_what_a_user_calls():
    assert sorted(spardl_grace.__all__) == sorted([
        "grace_from_params", "DistributedOptimizer", "CommHookState", "comm_hook",
        "broadcast_parameters", "broadcast_optimizer_state", "Compressor", "Memory",
        "Communicator", "fsdp", "join_uneven_inputs", "__version__"])
    for name in spardl_grace.__all__:
        assert hasattr(spardl_grace, name)


@pytest.mark.parametrize("name", sorted(spardl_grace.MOVED))
def test_an_old_name_warns_and_is_the_submodules(name):
    module = importlib.import_module(f"spardl_grace.{spardl_grace.MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=f"spardl_grace.{name} moved to "
                                                f"spardl_grace.{spardl_grace.MOVED[name]}.{name}"):
        old = getattr(spardl_grace, name)
    assert old is getattr(module, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        spardl_grace.nothing_here  # noqa: B018


def test_the_lightning_callback_has_a_name_of_its_own():
    lightning = pytest.importorskip("spardl_grace.lightning")
    with pytest.warns(DeprecationWarning, match="now spardl_grace.lightning.GradientCompression"):
        assert lightning.SparseAllreduce is lightning.GradientCompression


def test_nothing_in_the_checkout_uses_the_old_names():
    old = "|".join(spardl_grace.MOVED)
    uses = re.compile(rf"spardl_grace\.({old})\b|from spardl_grace import [^\n]*\b({old})\b"
                      rf"|lightning\.SparseAllreduce\b")
    found = []
    for folder in ("spardl_grace", "deepreduce_compat", "experiments", "benchmarks", "tests",
                   "examples", "docs", "testbed"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and "results" not in path.parts \
                    and path.name not in ("test_surface.py", "__init__.py", "lightning.py"):
                for number, line in enumerate(path.read_text().splitlines(), 1):
                    if uses.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    for path in (ROOT / "README.md",):
        found += [f"README.md: {line}" for line in path.read_text().splitlines() if uses.search(line)]
    assert not found, "\n".join(found)


def test_one_warmup_vocabulary_the_old_key_warns_and_means_the_new_one():
    """Every warm-up is NAME_warmup_steps: Ok-Topk's old 'oktopk_warmup' still works for one
    release, with a DeprecationWarning, and means 'oktopk_warmup_steps'; both at once raise."""
    from spardl_grace.registry import resolve_params
    with pytest.warns(DeprecationWarning, match="'oktopk_warmup' is now 'oktopk_warmup_steps'"):
        old = resolve_params({"communicator": "oktopk", "compressor": "topk", "oktopk_warmup": 3})
    assert old["oktopk_warmup_steps"] == 3 and "oktopk_warmup" not in old
    with pytest.raises(ValueError, match="give 'oktopk_warmup_steps' alone"):
        resolve_params({"communicator": "oktopk", "compressor": "topk", "oktopk_warmup": 3,
                        "oktopk_warmup_steps": 3})
    warmups = [k for k in resolve_params({}) if "warmup" in k and k != "density_warmup_start"]
    assert all(k.endswith("_warmup_steps") for k in warmups), warmups
