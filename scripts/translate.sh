#!/usr/bin/env bash
# The quickstart: English->French on the King James / Louis Segond Bible, MoE vs dense, BLEU + chrF.
# Options go to examples/translation/run.py (see --help there). With --multilingual first: English into French,
# Spanish and Italian, one multilingual model each, and pruning (examples/translation/multilingual.py).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
if [ "${1:-}" = "--multilingual" ]; then
    shift
    exec "$PY" examples/translation/multilingual.py "$@"
fi
exec "$PY" examples/translation/run.py "$@"
