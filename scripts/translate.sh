#!/usr/bin/env bash
# The quickstart: English->French on the King James / Louis Segond Bible, MoE vs dense, BLEU + chrF.
# Options go to examples/translation/run.py (see --help there).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" examples/translation/run.py "$@"
