#!/usr/bin/env bash
# Set up everything on a fresh machine, idempotently: system OpenBLAS (Debian/Ubuntu), a venv
# in .venv with the package and its test extras, oneMKL on x86-64 Linux (runner.blas), and the
# embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_install() {  # package, what is lost without it
  sudo=""
  if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
  echo "bootstrap: installing $1" >&2
  $sudo apt-get install -y -qq "$1" >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq "$1" >/dev/null 2>&1; } \
    || echo "bootstrap: warning: could not install $1; $2" >&2
}
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    apt_install libopenblas0-pthread "float32 matmuls will be slow"
  fi
  # MLX JIT-compiles the fused CPU kernels of compiled blocks with g++ (runner.models.llama).
  if ! command -v g++ >/dev/null 2>&1; then
    apt_install g++ "compiled blocks will run unfused (slower decoding)"
  fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import runner, mlx, msgspec, tokenizers, pytest" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "bootstrap: installing the package with test extras" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.installed
fi
# oneMKL's one-thread matrix-vector products make decode steps ~1.3x faster than OpenBLAS
# here (runner.blas; README, Design). Its wheel is ~220 MB (MTP_RUNNER_SKIP_MKL=1 skips it);
# without it the runner uses OpenBLAS.
if [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ] \
   && [ "${MTP_RUNNER_SKIP_MKL:-0}" != "1" ] && ! ls .venv/lib/libmkl_rt.so.* >/dev/null 2>&1; then
  echo "bootstrap: installing oneMKL (mkl wheel, ~220 MB)" >&2
  .venv/bin/python -m pip install -q --no-deps "mkl==2026.2.0" \
    || echo "bootstrap: warning: could not install mkl; the runner will use OpenBLAS" >&2
fi
.venv/bin/python scripts/setup_default_model.py >/dev/null
