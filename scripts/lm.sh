#!/usr/bin/env bash
# Language modelling on the King James Bible (public domain): an MoE LM, a Mixtral-style one and a dense one, test perplexity.
# Options go to examples/language_model/run.py (see --help there).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" examples/language_model/run.py "$@"
