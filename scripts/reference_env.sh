#!/usr/bin/env bash
# The reference environment for tests/fixtures/reference/: a separate venv, .venv-ref/, with
# torch (CPU), Hugging Face transformers and mlx-lm, pinned. It only *writes* the fixtures
# (scripts/fixtures/); the runner and its tests never import any of it.
#
#   ./scripts/reference_env.sh && .venv-ref/bin/python scripts/fixtures/checkpoints.py
#
# Idempotent: an existing .venv-ref/ that already has the pinned versions is left alone.
# MTP_REF_PYTHON chooses the interpreter (default python3, 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=2.13.0          # a CPU build; an unpinned torch pulls a multi-GB CUDA build on Linux
TRANSFORMERS=5.24.0
MLX_LM=0.32.2
MLX=0.32.4            # the project's own mlx, so the quantized fixtures pack as the runner reads
SAFETENSORS=0.8.0
NUMPY=2.4.6
TOKENIZERS=0.23.3     # trains the suite's tokenizer (tests/checkpoints.py) that the fixtures ship
PILLOW=13.0.0         # the image processor's resampler: pixels must match the runner's exactly

VENV=.venv-ref
PY="${MTP_REF_PYTHON:-python3}"

want="torch==$TORCH transformers==$TRANSFORMERS mlx-lm==$MLX_LM mlx==$MLX safetensors==$SAFETENSORS numpy==$NUMPY tokenizers==$TOKENIZERS pillow==$PILLOW"
stamp="$VENV/.reference-pins"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "reference_env: $VENV is up to date ($want)" >&2
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "reference_env: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip >/dev/null
# torch first, on its own, pinned: the resolver must never pick a CUDA build for a dependency.
pip install "torch==$TORCH"
case "$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" in
  *+cpu* | "$TORCH") ;;
  *) echo "reference_env: warning: torch is not the CPU build" >&2 ;;
esac
mlx_spec="mlx==$MLX"
if [ "$(uname -s)" = "Linux" ]; then mlx_spec="mlx[cpu]==$MLX"; fi
pip install "torch==$TORCH" "transformers==$TRANSFORMERS" "mlx-lm==$MLX_LM" "$mlx_spec" \
  "safetensors==$SAFETENSORS" "numpy==$NUMPY" "tokenizers==$TOKENIZERS" "pillow==$PILLOW"
"$VENV/bin/python" - <<'EOF'
import mlx.core, mlx_lm, numpy, safetensors, torch, transformers
print("reference_env: torch", torch.__version__, "transformers", transformers.__version__,
      "mlx-lm", mlx_lm.__version__, "mlx", mlx.core.__version__)
EOF
echo "$want" >"$stamp"
