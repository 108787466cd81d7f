"""Launch helpers for real multi-process runs (torchrun, mpirun, horovodrun)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.launch import launch_env, launcher_command  # noqa: F401 (tests import both from here)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "mp_worker.py"


_env = launch_env


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


def require_netns() -> None:
    """Skip where network namespaces cannot be made (not root, no iproute2)."""
    from testbed import netem
    why = netem.available()
    if why:
        pytest.skip(f"network namespaces are not available: {why}")


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
