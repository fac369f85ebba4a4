#!/usr/bin/env bash
# The test suite, as CI runs it: sets up .venv if needed, then pytest (GPU tests deselected).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest -m "not gpu" tests "$@"
