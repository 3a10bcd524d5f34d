#!/usr/bin/env bash
# Set up everything on a fresh machine, idempotently: system OpenBLAS (Debian/Ubuntu), a venv
# in .venv with the package and its test extras, oneMKL on x86-64 Linux (runner.blas), and the
# embedded default model.
#
# With an NVIDIA GPU (Linux x86-64/aarch64 where `nvidia-smi -L` lists one), MLX's CUDA build
# replaces the CPU one and the OpenBLAS and oneMKL steps are skipped: mlx[cuda13] with a
# driver >= 580, else mlx[cuda12]. MTP_RUNNER_MLX=cpu|cuda12|cuda13 chooses instead of
# detecting. From a CUDA .venv back to the CPU build: delete .venv and rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

mlx_cuda=""  # the extra of MLX's CUDA build to install (cuda12, cuda13); empty: the CPU build
case "${MTP_RUNNER_MLX:-auto}" in
  cpu) ;;
  cuda12 | cuda13) mlx_cuda="$MTP_RUNNER_MLX" ;;
  auto)
    if [ "$(uname -s)" = "Linux" ] \
       && case "$(uname -m)" in x86_64 | aarch64) true ;; *) false ;; esac \
       && nvidia-smi -L >/dev/null 2>&1; then
      driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)" || true
      driver="${driver%%$'\n'*}"  # the first GPU's
      if [ "${driver%%.*}" -ge 580 ] 2>/dev/null; then mlx_cuda=cuda13; else mlx_cuda=cuda12; fi
      echo "bootstrap: NVIDIA GPU (driver ${driver:-?}): using MLX's CUDA build, mlx[$mlx_cuda]" >&2
    fi
    ;;
  *) echo "bootstrap: MTP_RUNNER_MLX must be auto, cpu, cuda12 or cuda13" >&2; exit 2 ;;
esac

apt_install() {  # package, what is lost without it
  sudo=""
  if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
  echo "bootstrap: installing $1" >&2
  $sudo apt-get install -y -qq "$1" >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq "$1" >/dev/null 2>&1; } \
    || echo "bootstrap: warning: could not install $1; $2" >&2
}
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if [ -z "$mlx_cuda" ] \
     && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    apt_install libopenblas0-pthread "float32 matmuls will be slow"
  fi
  # MLX JIT-compiles the fused CPU kernels of compiled blocks with g++ (runner.models.llama);
  # g++ and cmake build the native few-row product (runner.native).
  if ! command -v g++ >/dev/null 2>&1; then
    apt_install g++ "compiled blocks will run unfused and runner.native cannot be built"
  fi
  if [ -z "$mlx_cuda" ] && ! command -v cmake >/dev/null 2>&1; then
    apt_install cmake "runner.native cannot be built (verify rows cost more)"
  fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
if [ -n "$mlx_cuda" ]; then
  # pyproject.toml asks for mlx[cpu] on Linux, and MLX's builds (mlx-cpu, mlx-cuda-12, ...)
  # all ship mlx/lib/libmlx.so: install the package's dependencies with mlx[cpu] swapped for
  # mlx[$mlx_cuda], then the package without dependencies. (A later plain `pip install -e .`
  # would bring mlx-cpu back over the CUDA library; rerunning this script undoes that.)
  cuda_dist="mlx-${mlx_cuda/cuda/cuda-}"  # mlx[cuda12] -> mlx-cuda-12
  other_builds=()
  for dist in mlx-cpu mlx-cuda mlx-cuda-12 mlx-cuda-13; do
    [ "$dist" = "$cuda_dist" ] || other_builds+=("$dist")
  done
  cuda_venv_ok() {  # the package and its test extras, and this CUDA build of MLX alone
    .venv/bin/python - "$cuda_dist" "${other_builds[@]}" >/dev/null 2>&1 <<'EOF'
import importlib.metadata as md, sys
import runner, mlx.core, msgspec, tokenizers, pytest
md.version(sys.argv[1])
for other in sys.argv[2:]:
    try:
        md.version(other)
    except md.PackageNotFoundError:
        continue
    sys.exit(1)
EOF
  }
  if ! cuda_venv_ok || [ pyproject.toml -nt ".venv/.installed-$mlx_cuda" ]; then
    echo "bootstrap: installing the package with test extras and mlx[$mlx_cuda]" >&2
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    requirements="$(mktemp)"
    .venv/bin/python - "$mlx_cuda" >"$requirements" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["test"]
if not any(d.startswith("mlx[cpu]") for d in deps):
    sys.exit("bootstrap: pyproject.toml no longer depends on mlx[cpu]: update bootstrap.sh")
print("\n".join(d.replace("mlx[cpu]", f"mlx[{sys.argv[1]}]", 1) for d in deps))
EOF
    .venv/bin/python -m pip uninstall -q -y "${other_builds[@]}" >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -r "$requirements"
    rm -f "$requirements"
    # Uninstalling another build deletes the libmlx.so they share: put the CUDA one back.
    mlx_version="$(.venv/bin/python -c 'import importlib.metadata as md; print(md.version("mlx"))')"
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$cuda_dist==$mlx_version"
    .venv/bin/python -m pip install -q --no-deps -e .
    touch ".venv/.installed-$mlx_cuda"
  fi
  .venv/bin/python -c 'import mlx.core as m; print("bootstrap: MLX device:", m.default_device())' \
    >&2 || echo "bootstrap: warning: mlx.core does not import" >&2
elif ! .venv/bin/python -c "import runner, mlx, msgspec, tokenizers, pytest" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "bootstrap: installing the package with test extras" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.installed
fi
# Every interpreter of this venv loads the runner's BLAS just before MLX is first imported,
# whatever a script or test imports first: a .pth line installs an import hook that runs
# runner.blas.preload() then (and imports nothing of the runner until then).
.venv/bin/python - <<'EOF'
import pathlib, sysconfig
hook = """class MtpRunnerBlas:
    @staticmethod
    def find_spec(name, path=None, target=None):
        import sys
        if name.partition(".")[0] == "mlx":
            sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "MtpRunnerBlas"]
            try:
                import runner.blas
                runner.blas.preload()
            except ImportError:
                pass
        return None
sys.meta_path.insert(0, MtpRunnerBlas)"""
line = f"import sys; exec({hook!r})\n"
path = pathlib.Path(sysconfig.get_paths()["purelib"], "mtp_runner_blas.pth")
if not path.exists() or path.read_text() != line:
    path.write_text(line)
EOF
# oneMKL's one-thread matrix-vector products make decode steps faster than OpenBLAS's
# (runner.blas; docs/DESIGN.md). Its wheel is ~220 MB (MTP_RUNNER_SKIP_MKL=1 skips it);
# without it the runner uses OpenBLAS. Not with MLX's CUDA build.
if [ -z "$mlx_cuda" ] && [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ] \
   && [ "${MTP_RUNNER_SKIP_MKL:-0}" != "1" ] && ! ls .venv/lib/libmkl_rt.so.* >/dev/null 2>&1; then
  echo "bootstrap: installing oneMKL (mkl wheel, ~220 MB)" >&2
  .venv/bin/python -m pip install -q --no-deps "mkl==2026.2.0" \
    || echo "bootstrap: warning: could not install mkl; the runner will use OpenBLAS" >&2
fi
# The native few-row product (runner.native, the panel weight layout): built for this machine's
# CPU and this MLX; rebuilt when it does not load or a source is newer. Without it the runner
# keeps the packed layout.
if [ -z "$mlx_cuda" ]; then
  so="$(ls runner/native/_smallrow*.so 2>/dev/null | head -n 1 || true)"
  if [ -z "$so" ] || [ -n "$(find runner/native -maxdepth 1 -newer "$so" \( -name '*.cpp' -o -name '*.h' -o -name CMakeLists.txt \))" ] \
     || ! .venv/bin/python -c "import sys, runner.native as n; sys.exit(not n.available())" 2>/dev/null; then
    echo "bootstrap: building runner.native" >&2
    .venv/bin/python -m runner.native.build >&2 \
      || echo "bootstrap: warning: runner.native did not build; the runner uses the packed layout" >&2
  fi
fi
.venv/bin/python scripts/setup_default_model.py >/dev/null
