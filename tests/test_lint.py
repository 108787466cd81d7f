"""The library passes ruff's lint and format checks and mypy, as configured in pyproject.toml.
CI runs these through the test command, so a change that breaks them does not land."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ["spardl_grace", "deepreduce_compat"]
DRIVERS = ["experiments", "benchmarks", "testbed", "tests", "examples", "docs"]
BIN = Path(sys.executable).parent


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("check", [["check"], ["format", "--check", "--diff"]],
                         ids=["lint", "format"])
def test_ruff(check):
    out = _run(str(BIN / "ruff"), *check, *LIBRARY)
    assert out.returncode == 0, out.stdout + out.stderr


def test_drivers_have_no_undefined_names_or_unused_imports():
    """Pyflakes' checks (ruff's F rules) on the repository's drivers, tests and examples."""
    out = _run(str(BIN / "ruff"), "check", "--select", "F", *DRIVERS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy():
    out = _run(sys.executable, "-m", "mypy")  # files and settings: [tool.mypy] in pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout


def test_the_checks_catch_a_defect(tmp_path):
    """The same configuration rejects an unused import, a badly formatted line and a type
    error, so a passing run means something."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x: int) -> str:\n    return x+1\n")
    config = str(ROOT / "pyproject.toml")
    lint = _run(str(BIN / "ruff"), "check", "--config", config, str(bad))
    assert lint.returncode != 0 and "F401" in lint.stdout
    fmt = _run(str(BIN / "ruff"), "format", "--check", "--config", config, str(bad))
    assert fmt.returncode != 0
    types = _run(sys.executable, "-m", "mypy", "--config-file", config, str(bad))
    assert types.returncode != 0 and "Incompatible return value type" in types.stdout
