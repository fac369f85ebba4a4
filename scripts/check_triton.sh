#!/usr/bin/env bash
# The kernels' CPU tests under another Triton release, e.g. the one a GPU machine has:
#     bash scripts/check_triton.sh 3.6.0
# In a throw-away venv (.venv-triton-VERSION, git-ignored) with that triton beside torch 2.13 (CPU):
# the interpreter tests, and the slow test that compiles every kernel and autotune config for sm_90
# with that release's own compiler (layout passes differ between releases: 3.6 failed on a kernel
# that 3.9 compiled). Triton <= 3.6's interpreter cannot take NumPy >= 2.3, so NumPy is held below it.
set -euo pipefail
VERSION="${1:?usage: bash scripts/check_triton.sh TRITON_VERSION}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-triton-$VERSION"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 "triton==$VERSION" "numpy<2.3" pytest
cd "$ROOT"
PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu" tests/fairseq_moe_kernels tests/fairseq_moe_layer/test_layer_backends.py
