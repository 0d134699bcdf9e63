#!/usr/bin/env bash
# The H200 check in one command (the machine has torch, triton and transformers but no pydantic, and no registry):
# unpack the cp312 wheels that `make gpu-wheels` put in .gpu-wheels/, then run bench/gpu.py, writing under $OUT.
#   bash bench/gpu_run.sh [--sections kernels model decode parity]
set -euo pipefail
cd "$(dirname "$0")/.."
W=/tmp/temper-wheels
mkdir -p "$W"
for f in .gpu-wheels/*.whl; do python -m zipfile -e "$f" "$W"; done
export PYTHONPATH="$W:$PWD"
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
python bench/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu.log"
