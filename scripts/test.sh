#!/usr/bin/env bash
# The test suite, as CI runs it: sets up .venv if needed, then pytest (GPU tests deselected) on two
# workers, each test file on one worker (module fixtures are shared by the tests of a file), the longest files first
# (tests/conftest.py LONGEST_FIRST).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder tests "$@"
