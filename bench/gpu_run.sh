#!/usr/bin/env bash
# The H200 checks, one command each (the machine has torch, triton, transformers and pytest but no pydantic or
# megatron-core, and no registry): unpack the cp312 wheels that `make gpu-wheels` put in .gpu-wheels/, then run
# bench/gpu.py (≤ 8 min), with `megatron` first bench/megatron_gpu.py (≤ 6 min), with `checks` first
# bench/gpu_checks.py (≤ 1 min: the kernels past 2^31 elements against their twins, the FP8 indexer's agreement),
# or with `tests` first the suite's CUDA tests (the ones a CPU machine skips), writing under $OUT.
#   bash bench/gpu_run.sh [--sections kernels model decode parity] [--model-sizes 524M 2B]
#   bash bench/gpu_run.sh megatron [--sections parity sao tp2 speed]
#   bash bench/gpu_run.sh checks [--sections offsets fp8]
#   bash bench/gpu_run.sh tests [pytest arguments]
#   bash bench/gpu_run.sh all      # tests, checks, megatron, gpu, each under its own time cap: ≤ 9.1 min (one call)
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
if [ "${1:-}" = all ]; then
  # caps from the H200 runs of 2026-12-04 (tests 26 s for 4 of today's 8 tests; megatron parity+sao+speed 107 s before
  # a third speed model and a bf16 SAO step; gpu 157 s before the tile sweeps, the fp32 decode check and the
  # checkpointing row): 75 + 60 + 170 + 240 s, within one 590 s device call (the checks' 60 s came out of the gpu
  # part's 300: its kernel sweeps run last, so a cut there loses sweep rows). A part past its cap is cut and keeps
  # what it wrote. The tp2 check (gloo ranks on the host CPU, what the CPU suite runs too) is not in `all`: it ran
  # out of its time there once; `bash bench/gpu_run.sh megatron --sections tp2`.
  # at most 8 files come back from a device call, and `all` writes 8: nvidia-smi.csv (once, here), gpu_tests.log,
  # checks.json + gpu_checks.log, megatron.json + megatron_gpu.log, gpu.json + gpu.log
  export PYTHONUNBUFFERED=1 SKIP_SMI=1
  mkdir -p "${OUT:-runs/gpu}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "${OUT:-runs/gpu}/nvidia-smi.csv" 2>&1 || true
  timeout 75 bash "$SELF" tests || echo "tests: exit $?"
  timeout 60 bash "$SELF" checks || echo "checks: exit $?"
  timeout 170 bash "$SELF" megatron --sections parity sao speed || echo "megatron: exit $?"
  timeout 240 bash "$SELF" --sections model decode profile parity kernels --model-sizes 524M || echo "gpu: exit $?"
  exit 0
fi
MODE=gpu
case "${1:-}" in megatron|tests|checks) MODE=$1; shift ;; esac
W=/tmp/temper-wheels
mkdir -p "$W"
if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  # .gpu-wheels/ is git-ignored: a device call brings it only when asked (the run tool's carry: [".gpu-wheels"])
  echo "no wheels in .gpu-wheels/: run \`make gpu-wheels\` on a machine with a registry and carry .gpu-wheels along" >&2
  exit 2
fi
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
[ "$MODE" = checks ] && SCRIPT=bench/gpu_checks.py
python "$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$OUT/$(basename "$SCRIPT" .py).log"
