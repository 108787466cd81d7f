#!/usr/bin/env bash
# The README's main job: sets up everything on a fresh machine (scripts/setup_env.sh), then trains
# a small CNN on Fashion-MNIST with 4 worker processes, dense vs SparDL, and prints the comparison.
# Extra arguments go to experiments.compare (e.g. --quick, --density 0.05, --epochs 3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
cd "$ROOT"
OMP_NUM_THREADS=1 exec "$VENV/bin/python" -m experiments.compare "$@"
