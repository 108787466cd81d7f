"""Installs spardl_grace (the library), deepreduce_compat (payload codecs) and the
experiments/benchmarks drivers. Run-time requirements are read from requirements/base.txt so
the pin on the CPU torch wheel lives in one place."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# The one version string lives in the package; read, not imported (torch may not be installed yet).
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "spardl_grace" / "version.py").read_text())[1]


def read_requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-r"))]


setup(
    name="spardl-grace",
    version=VERSION,
    description="Sparse, compressed gradient synchronisation (SparDL and peers) behind the GRACE API",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["spardl_grace*", "deepreduce_compat*", "experiments*", "benchmarks*"]),
    install_requires=read_requirements("base.txt"),
    entry_points={"console_scripts": ["spardl-train=experiments.main_trainer:main"]},
    extras_require={
        "dev": read_requirements("dev.txt"),
        "mpi": ["mpi4py>=4.0"],
        "horovod": read_requirements("horovod.txt"),
        "wandb": ["wandb>=0.18"],
    },
)
