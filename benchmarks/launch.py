"""How the benchmarks and the tests start real ranks from this checkout: the launcher
commands and Open MPI's container settings come from spardl_grace.launch; this adds what a
checkout needs (itself on PYTHONPATH, this interpreter's launchers first on PATH)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from spardl_grace.launch import local_command as launcher_command  # noqa: F401 (re-exported)
from spardl_grace.launch import open_mpi_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def launch_env() -> dict[str, str]:
    """This environment plus the checkout on PYTHONPATH, one OpenMP thread per rank, this
    interpreter's bin first on PATH (horovodrun, torchrun), and Open MPI's container settings
    where they are not set (spardl_grace.launch.open_mpi_env)."""
    env = open_mpi_env(os.environ)
    env.update({
        "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    return env
