#!/usr/bin/env bash
# The H200 checks, one command each (the machine has torch, triton, transformers and pytest but no pydantic or
# megatron-core, and no registry): unpack the cp312 wheels that `make gpu-wheels` put in .gpu-wheels/, then run
# bench/gpu.py (≤ 8 min), with `megatron` first bench/megatron_gpu.py (≤ 6 min), or with `tests` first the suite's
# CUDA tests (the ones a CPU machine skips), writing under $OUT.
#   bash bench/gpu_run.sh [--sections kernels model decode parity] [--model-sizes 524M 2B]
#   bash bench/gpu_run.sh megatron [--sections parity sao tp2 speed]
#   bash bench/gpu_run.sh tests [pytest arguments]
#   bash bench/gpu_run.sh all      # everything, each part under its own time cap: ≤ 9.5 min (one device call)
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
if [ "${1:-}" = all ]; then
  # caps from the H200 runs of 2026-12-04 (tests 26 s; megatron parity+sao+speed 107 s, tp2 unknown; gpu kernels 34 s,
  # model 32 s at 524M, decode 75 s, parity 16 s): a part past its cap is cut and keeps what it wrote
  export PYTHONUNBUFFERED=1 SKIP_SMI=1  # 8 files come back from a device call: nvidia-smi's once, here
  mkdir -p "${OUT:-runs/gpu}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "${OUT:-runs/gpu}/nvidia-smi.csv" 2>&1 || true
  # megatron: +25 s for the speed section's third model (SequentialMLP experts beside the grouped ones)
  timeout 45 bash "$SELF" tests || echo "tests: exit $?"
  timeout 155 bash "$SELF" megatron --sections parity sao speed || echo "megatron: exit $?"
  timeout 280 bash "$SELF" --sections model decode kernels profile parity --model-sizes 524M || echo "gpu: exit $?"
  # gloo ranks on the host CPU (37 s on 2 CPU cores here); its progress lines say where a cut run stood
  OUT="${OUT:-runs/gpu}/more" timeout 80 bash "$SELF" megatron --sections tp2 || echo "megatron tp2: exit $?"
  exit 0
fi
MODE=gpu
case "${1:-}" in megatron|tests) MODE=$1; shift ;; esac
W=/tmp/temper-wheels
mkdir -p "$W"
for f in .gpu-wheels/*.whl; do python -m zipfile -e "$f" "$W"; done
export PYTHONPATH="$W:$PWD"
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
[ -n "${SKIP_SMI:-}" ] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
if [ "$MODE" = tests ]; then
  # the CUDA tests: the trainers on the device, the engine's CUDA graphs (bench/gpu.py checks the kernels there)
  [ $# -gt 0 ] || set -- tests/trainers/test_device.py \
    tests/rollout/test_engine_device.py::test_cuda_engine_with_graphs_equals_eager \
    "tests/trainers/test_sharded_adamw.py::test_bf16_weights_are_adamw_on_fp32_main_weights[cuda]" \
    "tests/trainers/test_sharded_adamw.py::test_bf16_gradients_of_micro_batches_sum_in_fp32[cuda]"
  python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log"
  exit
fi
SCRIPT=bench/gpu.py
[ "$MODE" = megatron ] && SCRIPT=bench/megatron_gpu.py
python "$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$OUT/$(basename "$SCRIPT" .py).log"
