#!/usr/bin/env bash
# The device run of the GPU side of the kernels, in one call (from the repository root, on a CUDA
# machine that has torch and triton; fairseq is not needed):
#     bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the gpu-marked tests: bf16/fp16 kernels (Triton, and the expert MLP on torch's grouped_mm that
#    --moe-kernel-backend auto takes on CUDA) against fp32 references, offsets past 2^31, determinism;
# 2. benchmarks/bench_kernels.py: correctness on the device of every backend (triton, grouped_mm, torch),
#    then timings against the device's dense bf16 matmul rate and copy bandwidth, with PASS/FAIL per
#    target (JSON + log in OUT_DIR);
# 3. benchmarks/bench_train.py: training tokens/s of a quickstart-size MoE LM over its dense equivalent (same
#    active FLOPs), bf16 autocast, plain PyTorch (no fairseq: the device's Python has no fairseq wheel).
# The steps have time limits that together stay under 10 minutes. Record the figures in
# benchmarks/kernel_notes.md (device, date, command), which benchmarks/README.md links.
set -uo pipefail
OUT="${1:-${OUT:-gpu_out}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$OUT/env.txt"
timeout 220 "$PY" -m pytest -q -m gpu tests/fairseq_moe_kernels -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
timeout 280 "$PY" benchmarks/bench_kernels.py --budget-s 200 --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
timeout 90 "$PY" benchmarks/bench_train.py --out "$OUT/train.json" 2>&1 | tee "$OUT/train.log"
