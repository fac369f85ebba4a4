# Source me: makes .venv at the repository root (once) with fairseq-moe and its dependencies.
# torch is pinned to 2.13.0 here because a bare "torch" requirement would pull a multi-GB CUDA
# build on a CPU machine; set FAIRSEQ_MOE_TORCH to pick another (e.g. "torch==2.13.0" from a CUDA index).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV"
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[env] installing ${FAIRSEQ_MOE_TORCH:-torch==2.13.0}"
    "$PY" -m pip install -q "${FAIRSEQ_MOE_TORCH:-torch==2.13.0}"
fi
# A regular (non-editable) install: `--user-dir fairseq_moe` then also resolves outside the checkout.
echo "[env] installing fairseq-moe and its dependencies (first time: a few minutes)"
"$PY" -m pip install -q --disable-pip-version-check "$ROOT[test]"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$ROOT"
export PATH="$VENV/bin:$PATH"
