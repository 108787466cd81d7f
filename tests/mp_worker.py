"""A rank of a real multi-process run, started by the tests under a real launcher:

    torchrun --standalone --nproc-per-node P tests/mp_worker.py gloo SCENARIO OUTDIR
    mpirun -np P python tests/mp_worker.py mpi SCENARIO OUTDIR
    horovodrun -np P -H localhost:P --gloo python tests/mp_worker.py horovod SCENARIO OUTDIR

SCENARIO is a function of tests/scenarios.py, or MODULE.FUNCTION of another module in tests/.
Each rank runs SCENARIO against the transport that spardl_grace detects for the launcher
(default_transport), and saves what it computed to OUTDIR/rank{r}.pt for the test to compare.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios  # noqa: E402

from spardl_grace.launch import join  # noqa: E402

TIMEOUT_S = float(os.environ.get("SPARDL_TEST_TIMEOUT", "60"))  # tests of stalls shorten it


LAUNCHERS = {"gloo": "torchrun", "mpi": "mpirun", "horovod": "horovod"}


def main() -> None:
    backend, scenario, outdir = sys.argv[1:4]
    if backend not in LAUNCHERS:
        raise SystemExit(f"unknown backend {backend!r}; valid: {', '.join(LAUNCHERS)}")
    torch.set_num_threads(1)
    # horovodrun --mpi sets only MPI's variables: the test says which launcher it used.
    transport = join(TIMEOUT_S, launcher=LAUNCHERS[backend])
    module, _, function = scenario.rpartition(".")
    result = getattr(importlib.import_module(module) if module else scenarios, function)(transport)
    torch.save(result, Path(outdir) / f"rank{transport.rank}.pt")
    transport.barrier("done")
    if backend == "gloo":
        from spardl_grace.transport.torch_dist import destroy_and_exit
        destroy_and_exit()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
