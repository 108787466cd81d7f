#!/usr/bin/env bash
# The README's main job: sets up everything on a fresh machine (scripts/setup_env.sh), then 4
# workers train a CNN on Fashion-MNIST on an emulated 100 Mbit network (network namespaces; as
# root, else loopback and it says why) with PyTorch's DDP (fp32 and its fp16 hook), PyTorch's
# PowerSGD hook, SparDL and 'communicator': 'auto' (the library's own choice), and it prints
# time to accuracy (mean and range over 3 runs each), bytes, what auto chose, and a verdict that
# names a winner only when the 95% Welch interval of the difference of means excludes zero.
# About 18 to 23 minutes on 2 cores after the set-up.
# Extra arguments go to experiments.compare (e.g. --quick, --algorithms ddp,spardl,powersgd1).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
cd "$ROOT"
OMP_NUM_THREADS=1 exec "$VENV/bin/python" -m experiments.compare "$@"
