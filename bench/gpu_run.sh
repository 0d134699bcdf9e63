#!/usr/bin/env bash
# The H200 checks, one command each (the machine has torch, triton and transformers but no pydantic or
# megatron-core, and no registry): unpack the cp312 wheels that `make gpu-wheels` put in .gpu-wheels/, then run
# bench/gpu.py (≤ 8 min) or, with `megatron` first, bench/megatron_gpu.py (≤ 6 min), writing under $OUT.
#   bash bench/gpu_run.sh [--sections kernels model decode parity]
#   bash bench/gpu_run.sh megatron [--sections parity sao tp2 speed]
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=bench/gpu.py
if [ "${1:-}" = megatron ]; then SCRIPT=bench/megatron_gpu.py; shift; fi
W=/tmp/temper-wheels
mkdir -p "$W"
for f in .gpu-wheels/*.whl; do python -m zipfile -e "$f" "$W"; done
export PYTHONPATH="$W:$PWD"
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
python "$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$OUT/$(basename "$SCRIPT" .py).log"
