#!/usr/bin/env bash
# The device checks (the machine has torch, triton, transformers and pytest but no pydantic or megatron-core, and no
# registry): unpack the cp312 wheels that `make gpu-wheels` put in .gpu-wheels/, then run what a mode names, writing
# under $OUT.
#
# A lent GPU has 15 minutes in all, start-up included, so its work is two calls on one warm machine, each a list of
# parts in the order of the aims. Every part runs under its own cap and under the call's deadline (whichever comes
# first), keeps what it measured when cut, and the next part still runs:
#   bash bench/gpu_run.sh a    # ≤ 290 s: kernels (sparse MLA + tile sweep with BK 64, indexer + top-k at 8K and 32K,
#                              # the rest), checks (FP8 agreement, then the kernels past 2³¹ elements), decode at
#                              # batch 1/16/64, eager and with CUDA graphs, against transformers `generate`
#   bash bench/gpu_run.sh b    # ≤ 230 s: the model's forward and forward+backward against transformers (524M, the pair
#                              # built once), the profile, the 2B config, Megatron's speed rows, the CUDA tests, parity
# Issue them back to back (run's timeout_s 300 and 240): (a) + (b) + a start ≈ 10 minutes, leaving a rerun of one.
# `--smoke` rehearses a call on the CPU at toy shapes with the same parts and caps (no wheels needed):
#   bash bench/gpu_run.sh a --smoke ; bash bench/gpu_run.sh b --smoke
# What comes back (at most 8 files): nvidia-smi.csv, gpu.json, checks.json (a), megatron.json (b), logs.tgz (every
# part's log) and parts.txt (each part's seconds and exit).
# The single scripts, as before:
#   bash bench/gpu_run.sh [--sections kernels model decode parity profile] [--model-sizes 524M 2B]
#   bash bench/gpu_run.sh megatron [--sections parity sao tp2 speed]
#   bash bench/gpu_run.sh checks [--sections fp8 offsets]
#   bash bench/gpu_run.sh tests [pytest arguments]
set -euo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1

wheels() {
  [ -n "${TEMPER_REHEARSAL:-}" ] && return 0  # the rehearsal (--smoke) runs in this machine's environment
  local w=/tmp/temper-wheels
  if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    # .gpu-wheels/ is git-ignored: a device call brings it only when asked (the run tool's carry: [".gpu-wheels"])
    echo "no wheels in .gpu-wheels/: run \`make gpu-wheels\` on a machine with a registry and carry .gpu-wheels along" >&2
    exit 2
  fi
  mkdir -p "$w"
  [ -f "$w/.done" ] || { for f in .gpu-wheels/*.whl; do python -m zipfile -e "$f" "$w"; done; touch "$w/.done"; }
  export PYTHONPATH="$w:$PWD"
}

smi() { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true; }

# part NAME CAP CMD...: run CMD under min(CAP, what is left of the call's DEADLINE), its output to the log and stdout;
# a part past its cap is cut (it keeps what it wrote) and the next part runs. The logs are tarred after each part.
LOGS=/tmp/temper-gpu-logs
part() {
  local name=$1 cap=$2; shift 2
  local left=$(( DEADLINE - SECONDS ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 5 ]; then echo "$name: skipped, the call's deadline is reached" | tee -a "$OUT/parts.txt"; return; fi
  local t0=$SECONDS rc=0
  echo "== $name (cap ${cap} s) =="
  timeout --kill-after=5 "$cap" "$@" > >(tee "$LOGS/$name.log") 2>&1 || rc=$?
  echo "$name: ${cap} s cap, $(( SECONDS - t0 )) s, exit $rc$([ $rc = 124 ] && echo ' (cut at its cap)')" | tee -a "$OUT/parts.txt"
  tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null || true
}

call_a() {
  DEADLINE=${DEADLINE:-290}
  part kernels 150 python bench/gpu.py --sections kernels --out "$OUT" $SMOKE
  part checks 50 python bench/gpu_checks.py --out "$OUT" $SMOKE
  part decode 85 python bench/gpu.py --sections decode --out "$OUT" $SMOKE
}

call_b() {
  DEADLINE=${DEADLINE:-230}
  part model 95 python bench/gpu.py --sections model profile --model-sizes 524M --out "$OUT" $SMOKE
  part model2B 40 python bench/gpu.py --sections model --model-sizes 2B --out "$OUT" $SMOKE
  part megatron 40 python bench/megatron_gpu.py --sections speed --out "$OUT" $SMOKE
  part tests 45 bash "$SELF" tests
  part parity 20 python bench/gpu.py --sections parity --out "$OUT" $SMOKE
}

# sourced with GPU_RUN_LIB=1 (tests/kernels/test_gpu_bench.py): the functions only
if [ -n "${GPU_RUN_LIB:-}" ]; then rm -rf "$LOGS" && mkdir -p "$LOGS"; return 0; fi
MODE=gpu
case "${1:-}" in a|b|megatron|tests|checks) MODE=$1; shift ;; esac
SMOKE=""
if [ "${1:-}" = --smoke ]; then SMOKE=--smoke; export TEMPER_REHEARSAL=1; shift; fi
wheels
if [ "$MODE" = a ] || [ "$MODE" = b ]; then
  rm -rf "$LOGS" && mkdir -p "$LOGS"
  : > "$OUT/parts.txt"
  [ -n "$SMOKE" ] || smi
  export SKIP_SMI=1  # once a call, here
  SECONDS=0
  "call_$MODE"
  echo "call ($MODE): ${SECONDS} s"
  exit 0
fi
[ -n "${SKIP_SMI:-}${TEMPER_REHEARSAL:-}" ] || smi
if [ "$MODE" = tests ]; then
  # the CUDA tests: the trainers on the device, the engine's CUDA graphs (bench/gpu.py checks the kernels there)
  [ $# -gt 0 ] || set -- tests/trainers/test_device.py \
    tests/rollout/test_engine_device.py::test_cuda_engine_with_graphs_equals_eager \
    "tests/trainers/test_sharded_adamw.py::test_bf16_weights_are_adamw_on_fp32_main_weights[cuda]" \
    "tests/trainers/test_sharded_adamw.py::test_bf16_gradients_of_micro_batches_sum_in_fp32[cuda]"
  exec python -m pytest -q -p no:cacheprovider "$@"
fi
SCRIPT=bench/gpu.py
[ "$MODE" = megatron ] && SCRIPT=bench/megatron_gpu.py
[ "$MODE" = checks ] && SCRIPT=bench/gpu_checks.py
python "$SCRIPT" --out "$OUT" $SMOKE "$@" 2>&1 | tee "$OUT/$(basename "$SCRIPT" .py).log"
