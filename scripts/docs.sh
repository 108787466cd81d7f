#!/usr/bin/env bash
# Builds the docs site into site/ with --strict (what CI checks), or serves it:
#   bash scripts/docs.sh          # build
#   bash scripts/docs.sh serve    # http://127.0.0.1:8000, rebuilt on every change
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(SPARDL_SKIP_HOROVOD=${SPARDL_SKIP_HOROVOD:-1} bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
cd "$ROOT"
case "${1:-build}" in
    build) exec "$VENV/bin/python" -m mkdocs build --strict ;;
    serve) exec "$VENV/bin/python" -m mkdocs serve --strict ;;
    *) echo "usage: bash scripts/docs.sh [build|serve]" >&2; exit 2 ;;
esac
