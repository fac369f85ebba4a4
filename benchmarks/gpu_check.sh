#!/usr/bin/env bash
# The device check, in one call from the repository root (benchmarks/device_check.py says what each step does):
#     bash benchmarks/gpu_check.sh [OUT_DIR]                  # on a CUDA machine: within 570 s by its budget
#     bash benchmarks/gpu_check.sh --device cpu OUT_DIR       # its rehearsal on a CPU, tiny sizes (a test runs it)
# Flags after OUT_DIR go to benchmarks/device_check.py (--skip STEP..., --selftest-only FEATURE..., --budget-s S).
# Where the device's Python has no fairseq (the lent GPU machines' image: Python 3.12, torch, triton, no fairseq),
# it is installed first from the wheels in .whl/ at the repository root, which `bash benchmarks/device_wheels.sh`
# downloads beforehand on a machine with the package registry (carried along with the repository), into a
# temporary folder put on PYTHONPATH; nothing is installed into the device's own Python. $PYTHON picks the Python.
# Results: OUT_DIR (default gpu_out) holds at most 8 files, summary.txt with a line per step. Record the figures in
# benchmarks/kernel_notes.md (device, date, command), which benchmarks/README.md links.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE="${2:?--device takes cuda or cpu}"; shift 2; fi
OUT="${1:-${OUT:-gpu_out}}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import fairseq" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: this Python ($PY) has no fairseq and .whl/ holds no wheels: run 'bash benchmarks/device_wheels.sh' where pip reaches the package registry, and carry .whl/ here" >&2
        exit 2
    fi
    SITE="$(mktemp -d)/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || {
        echo "gpu_check: installing the wheels of .whl/ failed (above)" >&2; exit 2; }
    export PYTHONPATH="$PYTHONPATH:$SITE"  # (after the repository: the plugin is the checkout's)
    export PATH="$SITE/bin:$PATH"  # (fairseq's console scripts: the self-test's torchrun runs fairseq-train)
fi
# The device's command may run 600 s in all: the steps get what is left of 570 after the install (a later
# --budget-s among the flags wins).
exec "$PY" benchmarks/device_check.py --device "$DEVICE" --out "$OUT" --budget-s "$((570 - SECONDS))" "$@"
