"""How the benchmarks and the tests start real ranks: the environment every launcher needs
here, and the launcher command for each backend."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def launch_env() -> dict[str, str]:
    """This environment plus the checkout on PYTHONPATH, one OpenMP thread per rank, this
    interpreter's bin first on PATH (horovodrun, torchrun), and what Open MPI needs here: run
    as root, more ranks than cores, and no cross-memory attach (containers often forbid it)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def launcher_command(backend: str, nprocs: int, args: list[str]) -> list[str]:
    """`python ARGS` on nprocs local ranks: torchrun for 'gloo', mpirun for 'mpi', horovodrun
    for 'horovod'/'horovod-gloo' (gloo) and 'horovod-mpi'."""
    if backend == "gloo":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nprocs}", *args]
    if backend == "mpi":
        return ["mpirun", "-np", str(nprocs), sys.executable, *args]
    if backend in ("horovod", "horovod-gloo", "horovod-mpi"):
        mode = "--mpi" if backend == "horovod-mpi" else "--gloo"
        return [str(BIN / "horovodrun"), "-np", str(nprocs), "-H", f"localhost:{nprocs}", mode,
                sys.executable, *args]
    raise ValueError(f"unknown backend {backend!r}; valid: gloo, mpi, horovod, horovod-gloo, "
                     "horovod-mpi")
