"""Launch helpers for real multi-process runs (torchrun, mpirun, horovodrun)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "mp_worker.py"
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # Containers often forbid the cross-memory-attach syscalls Open MPI's shared memory uses.
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def launcher_command(backend: str, nprocs: int, args: list[str]) -> list[str]:
    if backend == "gloo":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nprocs}", *args]
    if backend == "mpi":
        return ["mpirun", "-np", str(nprocs), sys.executable, *args]
    if backend in ("horovod", "horovod-gloo", "horovod-mpi"):
        mode = "--mpi" if backend == "horovod-mpi" else "--gloo"
        return [str(BIN / "horovodrun"), "-np", str(nprocs), "-H", f"localhost:{nprocs}", mode,
                sys.executable, *args]
    raise ValueError(f"unknown backend {backend!r}")


def require(backend: str) -> None:
    """Skip (or fail, where the run promises the tool) when a launcher is unavailable."""
    if backend.startswith("horovod"):
        try:
            import horovod.torch  # noqa: F401
        except ImportError as exc:
            if os.environ.get("SPARDL_REQUIRE_HOROVOD") == "1":
                pytest.fail(f"Horovod is required here but does not import: {exc}")
            pytest.skip("Horovod is not installed (scripts/setup_env.sh builds it)")
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.fail("mpirun is missing: scripts/setup_env.sh installs Open MPI")


def worker_command(backend: str, nprocs: int, scenario: str, outdir: Path) -> list[str]:
    """The launcher command that runs tests/mp_worker.py's SCENARIO on nprocs ranks (skipping
    or failing, as `require` does, where the launcher is unavailable)."""
    require(backend)
    worker_backend = "horovod" if backend.startswith("horovod") else backend
    return launcher_command(backend, nprocs, [str(WORKER), worker_backend, scenario, str(outdir)])


def run_ranks(backend: str, nprocs: int, scenario: str, tmp_path: Path, timeout: float = 240) -> list:
    """Run tests/scenarios.SCENARIO on nprocs real processes; return each rank's result."""
    cmd = worker_command(backend, nprocs, scenario, tmp_path)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nprocs)]


@pytest.fixture
def launch(tmp_path):
    def _launch(backend: str, nprocs: int, scenario: str, timeout: float = 240):
        return run_ranks(backend, nprocs, scenario, tmp_path, timeout)
    return _launch
