"""Build the native extension (PanelMatmul, GatherPanelMatmul, FlashAttention) in place: ``python -m
runner.native.build``.

CMake + nanobind, against the mlx installed in this Python; the module lands next to this file
(``runner/native/_smallrow*.so``), the build tree in ``runner/native/build/``. Compiled with
``-march=native``: build it on the machine that runs it. nanobind is pip-installed into this
Python when missing or when its ABI differs from the one mlx.core was built with (the two must
share nanobind's type registry for mx.array to pass through). Exits non-zero with a one-line
message when a tool is missing or the build fails.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
# Per cmake step: a bound on a hung compiler, not an estimate. The one translation unit of
# kernel instances compiles for a minute or two on a quiet 2-core machine and several times
# that on a loaded one, where a tighter bound left CI without the native product.
STEP_TIMEOUT_S = 900

# nanobind's per-backend registry key (NB_INTERNALS_KEY) -> a pip requirement that produces it.
# mlx.core embeds its key; an extension must use the same one.
_KEY_TO_REQUIREMENT = {
    "_a1_v22": "nanobind>=3.0,<4",
    "v21_": "nanobind==2.15.0",
}


class BuildError(Exception):
    pass


def _mlx_nanobind_key() -> str | None:
    """The nanobind registry key compiled into mlx.core (read from the binary, not imported)."""
    spec = importlib.util.find_spec("mlx.core")
    if spec is None or not spec.origin:
        raise BuildError("mlx is not installed in this Python")
    data = Path(spec.origin).read_bytes()
    found = re.search(rb"(?:nanobind|v\d+)_system_\w+", data)
    return found.group(0).decode() if found else None


def _nanobind_key() -> str | None:
    """The key the installed nanobind would compile in, from its headers; None if missing."""
    try:
        import nanobind  # noqa: F401
    except ImportError:
        return None
    root = Path(importlib.import_module("nanobind").__file__).parent
    internals = root / "src" / "nb_internals.h"
    backend = root / "include" / "nanobind" / "nb_backend.h"
    text = internals.read_text() if internals.exists() else ""
    version = re.search(r"define NB_INTERNALS_VERSION (\d+)", text)
    if backend.exists():
        major = re.search(r"define NB_BACKEND_ABI_MAJOR (\d+)", backend.read_text())
        if version and major:
            return f"_a{major.group(1)}_v{version.group(1)}"
    abi = root / "src" / "nb_abi.h"
    text = abi.read_text() if abi.exists() else text
    version = re.search(r"define NB_INTERNALS_VERSION (\d+)", text)
    return f"v{version.group(1)}_" if version else "unknown"


def _matches(mlx_key: str | None, nb_key: str | None) -> bool:
    if nb_key is None:
        return False
    if mlx_key is None:
        return True  # cannot tell: take what is installed, the import check below decides
    return nb_key in mlx_key


def ensure_nanobind() -> None:
    mlx_key = _mlx_nanobind_key()
    if _matches(mlx_key, _nanobind_key()):
        return
    want = next(
        (req for tag, req in _KEY_TO_REQUIREMENT.items() if mlx_key and tag in mlx_key), None
    )
    if want is None:
        want = "nanobind"
    print(f"installing {want} (mlx.core's nanobind ABI: {mlx_key})", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", want], capture_output=True, text=True
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise BuildError(f"pip install {want} failed: {tail[0]}")
    importlib.invalidate_caches()
    sys.modules.pop("nanobind", None)
    if not _matches(mlx_key, _nanobind_key()):
        raise BuildError(f"installed {want} but its ABI still differs from mlx.core's ({mlx_key})")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{what} took over {STEP_TIMEOUT_S} s; stopped") from exc
    if done.returncode != 0:
        log = BUILD_DIR / f"{what}.log"
        log.write_text(done.stdout + done.stderr)
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line]
        first = errors[0].strip() if errors else f"exit status {done.returncode}"
        raise BuildError(f"{what} failed: {first} (full log: {log})")


def _check() -> str:
    """Import the fresh module in a new process and run one small product against numpy."""
    code = (
        "import runner, numpy as np, mlx.core as mx\n"
        "from runner import native\n"
        "assert native.available(), native.reason()\n"
        "w = mx.random.normal((33, 70)); x = mx.random.normal((3, 33))\n"
        "y = native.panel_matmul(x, native.to_panels(w), 70)\n"
        "ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)\n"
        "assert np.abs(np.asarray(y) - ref).max() < 1e-3\n"
        "assert native.gathered_available()\n"
        "e = mx.random.normal((4, 70, 33)); i = mx.array([[3, 1], [0, 3]])\n"
        "g = native.gather_panel_matmul(x[:2, None], native.expert_panels(e), i, 70)\n"
        "w = np.asarray(e, np.float64)[np.asarray(i)]\n"
        "ref = np.einsum('tk,tjnk->tjn', np.asarray(x[:2], np.float64), w)\n"
        "assert np.abs(np.asarray(g) - ref).max() < 1e-3\n"
        "assert native.attention_available()\n"
        "q = mx.random.normal((1, 2, 3, 8)); kv = mx.random.normal((1, 1, 5, 8))\n"
        "a = native.flash_attention(q, kv, kv, scale=1.0, causal=False)\n"
        "s = np.asarray(q, np.float64) @ np.asarray(kv, np.float64)[0, 0].T\n"
        "w = np.exp(s - s.max(-1, keepdims=True)); w /= w.sum(-1, keepdims=True)\n"
        "assert np.abs(np.asarray(a) - w @ np.asarray(kv, np.float64)[0, 0]).max() < 1e-4\n"
        "print(native.isa())\n"
    )
    env = dict(os.environ)
    root = str(HERE.parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env
    )
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise BuildError(f"the built module failed its check: {last[0]}")
    return done.stdout.strip()


def build(portable: bool = False, clean: bool = False) -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake not found on PATH (apt-get install cmake, or pip install cmake)")
    cxx = _compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or apt-get install g++)")
    ensure_nanobind()
    if clean and BUILD_DIR.exists():
        shutil.rmtree(BUILD_DIR)
    BUILD_DIR.mkdir(exist_ok=True)
    for old in HERE.glob("_smallrow*.so"):
        old.unlink()
    configure = [
        cmake,
        "-S",
        str(HERE),
        "-B",
        str(BUILD_DIR),
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_CXX_COMPILER={cxx}",
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={HERE}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DSMALLROW_PORTABLE={'ON' if portable else 'OFF'}",
    ]
    if shutil.which("ninja") and not (BUILD_DIR / "Makefile").exists():
        configure += ["-G", "Ninja"]
    _run(configure, "configure")
    _run([cmake, "--build", str(BUILD_DIR), "--parallel", str(os.cpu_count() or 2)], "build")
    if not list(HERE.glob("_smallrow*.so")):
        raise BuildError(f"the build finished but left no _smallrow*.so in {HERE}")
    return _check()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.native.build", description=__doc__)
    parser.add_argument("--portable", action="store_true", help="plain C++ kernel (no AVX)")
    parser.add_argument("--clean", action="store_true", help="remove the build tree first")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        isa = build(portable=args.portable, clean=args.clean)
    except BuildError as exc:
        print(f"runner.native.build: {exc}", file=sys.stderr)
        return 1
    print(f"built runner/native/_smallrow ({isa}) in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
