#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (never run in CI): bootstrap with MLX's CUDA
# build, show MLX's default device, run the model tests, then short decode and speculation
# benchmarks. Every step runs even when an earlier one fails (bootstrap aside); outputs go to
# bench-results/gpu-check/ and a summary is printed at the end. Exits 1 if any step failed.
# About 3-8 minutes on a fast GPU box, plus the first bootstrap's downloads (~2 GB of CUDA
# libraries) and mlx-lm's bench venv (.venv-bench).
#
#   ./scripts/gpu_check.sh
#
# MTP_RUNNER_MLX=cuda12|cuda13 picks MLX's CUDA build (scripts/bootstrap.sh); GPU_CHECK_CPU=1
# runs the same steps without a GPU (to check this script itself).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT="$(pwd)"
OUT="$ROOT/bench-results/gpu-check"
mkdir -p "$OUT"
export MTP_RUNNER_REQUIRE_DEFAULT=1 PYTHONUNBUFFERED=1

if nvidia-smi -L >"$OUT/nvidia-smi.txt" 2>&1; then
  gpu="$(head -n 1 "$OUT/nvidia-smi.txt")"
elif [ "${GPU_CHECK_CPU:-0}" = "1" ]; then
  gpu="no GPU (GPU_CHECK_CPU=1)"
else
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed); GPU_CHECK_CPU=1 runs it anyway" >&2
  exit 2
fi

summary=()
failed=0
step() {  # name, timeout in seconds, command...: run it, log it, record its status and time
  local name="$1" limit="$2" start rc
  shift 2
  echo "=== $name" >&2
  start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if [ "$rc" = 0 ]; then
    summary+=("$(printf '%-10s ok      %4ss' "$name" "$took")")
  else
    [ "$rc" = 124 ] && rc="$rc (timed out after ${limit}s)"
    summary+=("$(printf '%-10s FAILED  %4ss  exit %s, see %s' "$name" "$took" "$rc" \
      "${OUT#"$ROOT"/}/$name.log")")
    failed=1
  fi
  return 0
}

step bootstrap 1200 ./scripts/bootstrap.sh
if [ ! -x .venv/bin/python ]; then
  printf '%s\n' "${summary[@]}" >&2
  exit 1
fi
PY="$ROOT/.venv/bin/python"
step device 60 "$PY" -c 'import mlx.core as mx; print(mx.default_device())'
device="$(tail -n 1 "$OUT/device.log")"
if [ "${GPU_CHECK_CPU:-0}" != "1" ] && [[ "${summary[-1]}" != *FAILED* ]] \
   && [[ "$device" != *gpu* ]]; then
  summary+=("device     FAILED        MLX's default device is not the GPU: $device")
  failed=1
fi

step tests 600 "$PY" -m pytest -q -p no:cacheprovider -rfE --junitxml="$OUT/tests.xml" \
  tests/test_models.py tests/test_smollm2_reference.py tests/test_engine.py \
  tests/test_speculative.py tests/conformance/test_default_speculation.py

# bench/decode.py makes .venv-bench with mlx[cpu] on Linux when it has none: make it first
# with the MLX build .venv has (the CUDA one here), so that mlx-lm runs on the same device.
mlx_requirement() {  # python: the mlx[build]==version it has, or nothing
  "$1" -c 'import importlib.metadata as md
for extra in ("cuda13", "cuda12", "cpu"):
    try:
        md.version("mlx-" + extra.replace("cuda", "cuda-"))
    except md.PackageNotFoundError:
        continue
    print("mlx[" + extra + "]==" + md.version("mlx"))
    break' 2>/dev/null
}
mlx_req="$(mlx_requirement "$PY")"
if [ -n "$mlx_req" ] && [ "$(mlx_requirement .venv-bench/bin/python)" != "$mlx_req" ]; then
  # shellcheck disable=SC2016  # $0 and $1 are bash -c's arguments
  step bench-venv 600 bash -c 'rm -rf .venv-bench && "$0" -m venv .venv-bench \
    && .venv-bench/bin/python -m pip install -q "$1" mlx-lm' "$PY" "$mlx_req"
fi
step decode 600 "$PY" scripts/bench/decode.py --reps 2 --decode 64 --out "$OUT/decode.json"
step spec 600 "$PY" scripts/bench/spec.py --prompts 3 --tokens 64 --modes greedy,T=0.7 \
  --out "$OUT/spec.json"

{
  echo
  echo "=== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ); $gpu)"
  echo "MLX default device: $device"
  printf '%s\n' "${summary[@]}"
  echo "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1)"
  echo "decode (bench/decode.py --reps 2 --decode 64):"
  grep '^|' "$OUT/decode.log"
  echo "speculation (bench/spec.py --prompts 3 --tokens 64):"
  grep '^|' "$OUT/spec.log"
  echo "outputs: ${OUT#"$ROOT"/}/ (the benchmarks' child logs: bench-results/logs/)"
} 2>/dev/null | tee "$OUT/summary.txt"
exit "$failed"
