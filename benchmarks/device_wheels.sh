#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that the lent GPU machines' Python lacks for the device check
# (benchmarks/gpu_check.sh installs them there), at the versions the tests run with here: fairseq (ve-fairseq 0.12.3,
# a cp312 build) and what it needs that their image does not have (hydra-core, omegaconf, antlr4's runtime, bitarray). Run it from the repository root on a
# machine whose pip reaches the package registry; DEVICE_PYTHON_VERSION (default 3.12) is the device's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${DEVICE_PYTHON_VERSION:-3.12}"
PY="${PYTHON:-python3}"
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${platforms[@]}" -d .whl ve-fairseq==0.12.3 hydra-core==1.3.8 omegaconf==2.3.1 bitarray==3.12.3
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is published as a source archive only: a pure-Python wheel of it.
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
