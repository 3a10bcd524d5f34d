"""Load the system OpenBLAS before MLX so float32 matmuls stop using the reference BLAS.

MLX's Linux CPU wheel links a slow reference ``libblas``. Loading OpenBLAS with RTLD_GLOBAL
first makes the dynamic linker resolve MLX's ``cblas_sgemm`` to it. This module must not
import mlx; ``runner/__init__.py`` calls :func:`preload` before anything else does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("mtp_runner.blas")

# Debian's libopenblas0-pthread, then other common layouts.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_state: dict[str, str] = {}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_coretype(flags: set[str]) -> str | None:
    """OpenBLAS 0.3.21 misdetects newer CPUs and falls back to a generic kernel; name one."""
    if "avx512f" in flags:
        return "SkylakeX"
    if "avx2" in flags:
        return "Haswell"
    return None


def preload() -> str:
    """Load OpenBLAS once if present; return a short description of the BLAS in use."""
    if "name" in _state:
        return _state["name"]
    name = "bundled"
    if sys.platform == "darwin":
        name = "accelerate"
    elif sys.platform.startswith("linux") and os.environ.get("MTP_RUNNER_NO_OPENBLAS") != "1":
        if "mlx.core" in sys.modules:
            log.warning("mlx was imported before the BLAS preload; keeping its bundled BLAS")
        else:
            override = os.environ.get("MTP_RUNNER_OPENBLAS")
            for path in (override,) if override else _CANDIDATES:
                if not path or not os.path.exists(path):
                    continue
                if "OPENBLAS_CORETYPE" not in os.environ:
                    core = pick_coretype(_cpu_flags())
                    if core:
                        os.environ["OPENBLAS_CORETYPE"] = core
                try:
                    ctypes.CDLL(path, os.RTLD_GLOBAL)
                except OSError as exc:
                    log.warning("could not load %s: %s", path, exc)
                    continue
                core = os.environ.get("OPENBLAS_CORETYPE", "auto")
                name = f"openblas ({path}, core {core})"
                break
    _state["name"] = name
    return name


def blas_in_use() -> str:
    return _state.get("name", "bundled")
