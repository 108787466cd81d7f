#!/usr/bin/env bash
# The README's test command: sets up everything on a fresh machine (scripts/setup_env.sh) and
# runs the whole test suite. Extra arguments go to pytest (e.g. -k spardl).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
if [ "${SPARDL_SKIP_HOROVOD:-0}" != 1 ]; then
    export SPARDL_REQUIRE_HOROVOD=1
fi
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
