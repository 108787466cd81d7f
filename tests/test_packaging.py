"""Packaging: the wheel built from a clean copy of the checkout installs into a fresh venv and
holds the library (spardl_grace, deepreduce_compat) and nothing else; its metadata agrees with
the set-up's requirement files."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

import spardl_grace

PACKAGES = {"spardl_grace", "deepreduce_compat"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the tracked and untracked-but-not-ignored files only, as a clean
    checkout would have them."""
    tmp = tmp_path_factory.mktemp("packaging")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    source = tmp / "checkout"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True)
    (built,) = (tmp / "dist").glob("*.whl")
    return built


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return z.read(name).decode().splitlines()


def test_the_wheel_holds_the_library_and_not_the_drivers(wheel):
    with zipfile.ZipFile(wheel) as z:
        top = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
        names = set(z.namelist())
    assert top == PACKAGES  # no top-level 'experiments' or 'benchmarks' in users' site-packages
    for package in PACKAGES:  # every module of the checkout is in the wheel
        for module in (ROOT / package).rglob("*.py"):
            assert module.relative_to(ROOT).as_posix() in names


def test_one_version_and_a_torch_range(wheel):
    meta = _metadata(wheel)
    assert f"Version: {spardl_grace.__version__}" in meta
    requires = [ln.split(": ", 1)[1] for ln in meta if ln.startswith("Requires-Dist: ")]
    torch_req = [r for r in requires if re.match(r"torch\b", r)]
    assert torch_req == ["torch>=2.1"], torch_req  # a range users can satisfy; the pin is the set-up's
    extras = {ln.split(": ", 1)[1] for ln in meta if ln.startswith("Provides-Extra: ")}
    assert extras == {"horovod", "mpi", "wandb", "experiments", "docs", "dev", "lightning",
                      "accelerate"}


def test_the_changelog_and_the_docs_name_the_packages_version():
    """The newest release in CHANGELOG.md is __version__ (an 'Unreleased' section may sit
    above it), and the manual's front page says which version it describes."""
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == spardl_grace.__version__
    assert f"spardl-grace {spardl_grace.__version__}" in (ROOT / "docs" / "index.md").read_text()


def test_setup_py_reads_the_same_metadata():
    """setup.py is a shim for tools that still run it; the metadata is pyproject.toml's."""
    out = subprocess.run([sys.executable, "setup.py", "--name", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-2:] == ["spardl-grace", spardl_grace.__version__]


def _name(requirement: str) -> str:
    """The package name of a requirement specifier ('torch>=2.1' -> 'torch')."""
    return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower()


def _requirements(name: str) -> set[str]:
    """Package names of a requirement file, following its -r includes."""
    names: set[str] = set()
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("-r "):
            names |= _requirements(line[3:].strip())
        elif line and not line.startswith("#"):
            names.add(_name(line))
    return names


def test_extras_name_what_the_setup_installs():
    """The set-up installs from requirements/*.txt, pip users get the extras: the same packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    base = _requirements("base.txt")
    assert {_name(r) for r in project["dependencies"]} == base
    assert extras["experiments"] == _requirements("experiments.txt") - base
    assert extras["dev"] == _requirements("dev.txt") - base
    assert extras["docs"] == _requirements("docs.txt")
    assert extras["horovod"] == _requirements("horovod.txt")
    assert extras["lightning"] | extras["accelerate"] == _requirements("trainers.txt")
    assert "mpi4py" in extras["mpi"] and {"wandb", "tensorboard"} <= extras["wandb"]


def test_pip_install_into_a_fresh_venv_then_import_every_module(wheel, tmp_path):
    """The wheel installs with pip into a new venv. Its dependencies come from this test's
    environment (a .pth file), so nothing is downloaded; every module of both packages imports
    from outside the checkout, and the drivers are not importable there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # Without PYTHONPATH: pip would take the checkout on it for an installed copy and skip.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, env=clean)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # After the wheel's own files, so the checkout's editable install cannot shadow them.
    Path(site, "zz_dependencies.pth").write_text(ours + "\n")
    script = (
        "import importlib, importlib.util, pkgutil, spardl_grace, deepreduce_compat\n"
        "assert spardl_grace.__file__.startswith(%r), spardl_grace.__file__\n"
        "for pkg in (spardl_grace, deepreduce_compat):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert importlib.util.find_spec('experiments') is None\n"
        "assert importlib.util.find_spec('benchmarks') is None\n"
        "print(spardl_grace.__version__)\n") % site
    proc = subprocess.run([str(python), "-I", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == spardl_grace.__version__
