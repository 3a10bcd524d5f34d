"""Load a fast BLAS before MLX: float32 matmuls otherwise use MLX's slow reference BLAS.

MLX's Linux CPU wheel links a slow reference ``libblas``. Loading another BLAS with
RTLD_GLOBAL first makes the dynamic linker resolve MLX's ``cblas_sgemm`` to it. The choice,
``MTP_RUNNER_BLAS`` (default ``auto``):

- ``mkl``: Intel oneMKL from the ``mkl`` wheel in this environment (``bootstrap.sh`` installs
  it on x86-64 Linux). Its one-thread matrix-vector products are fast enough that a decode
  step runs best on one thread, leaving the other core to build the next step's graph; see
  :func:`wide` for prefill. ``auto`` takes it only when GNU OpenMP is there (threaded prefill).
- ``openblas``: the system OpenBLAS (Debian's ``libopenblas0-pthread``), path override
  ``MTP_RUNNER_OPENBLAS``; ``OPENBLAS_CORETYPE`` is named when the user has not.
- ``bundled``: MLX's own (also ``MTP_RUNNER_NO_OPENBLAS=1``).

The BLAS must be loaded before MLX's library is, whatever imports MLX first: importing
``runner`` installs :func:`install_hook`, an import hook that runs :func:`preload` just before
``mlx`` is first imported, and ``bootstrap.sh`` puts the same hook in a ``.pth`` line of the
project's venv (it imports nothing of the runner until mlx is imported), so no script, test or
entry point has to import in a special order. This module must not import mlx.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import sys
from collections.abc import Callable, Iterator

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
# The `mkl` wheel puts its libraries in <prefix>/lib; libmkl_rt finds the rest beside itself.
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
CHOICES = ("auto", "mkl", "openblas", "bundled")

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


def choice() -> str:
    """The requested BLAS (``MTP_RUNNER_BLAS``); unknown values fall back to ``auto``."""
    if os.environ.get("MTP_RUNNER_NO_OPENBLAS") == "1":
        return "bundled"
    wanted = os.environ.get("MTP_RUNNER_BLAS", "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        log.warning("MTP_RUNNER_BLAS=%r is not one of %s; using auto", wanted, CHOICES)
        return "auto"
    return wanted


def find_mkl() -> str | None:
    override = os.environ.get("MTP_RUNNER_MKL")
    if override:
        return override if os.path.exists(override) else None
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for name in _MKL_NAMES:
            path = os.path.join(prefix, "lib", name)
            if os.path.exists(path):
                return path
    return None


def _has_gnu_openmp() -> bool:
    try:
        ctypes.CDLL("libgomp.so.1")
    except OSError:
        return False
    return True


class _Threads:
    """MKL's thread count for the two kinds of work (no-op for the other BLAS choices)."""

    def __init__(self) -> None:
        self.set_max: Callable[[int], object] | None = None
        self.narrow = self.wide = 1

    def apply(self, count: int) -> None:
        if self.set_max is not None:
            self.set_max(count)


_threads = _Threads()


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _decode_threads(cores: int) -> int:
    """``MTP_RUNNER_DECODE_THREADS`` (a positive int), else all cores but one."""
    raw = os.environ.get("MTP_RUNNER_DECODE_THREADS")
    if raw is not None:
        try:
            if int(raw) >= 1:
                return int(raw)
        except ValueError:
            pass
        log.warning("MTP_RUNNER_DECODE_THREADS=%r is not a positive integer; ignored", raw)
    return max(1, cores - 1)


def decode_threads() -> int:
    """Threads for a decode step's products (``MTP_RUNNER_DECODE_THREADS``, else all cores
    but one: the other builds the next step's graph)."""
    return _decode_threads(_usable_cores())


def _load_mkl(path: str, asked: bool) -> str | None:
    """Load oneMKL (``asked``: named by the user, not picked by auto); return its description,
    or None when it cannot be used."""
    gnu = _has_gnu_openmp()
    if not gnu and not asked:
        return None  # sequential MKL prefills slower than threaded OpenBLAS: not the better pick
    os.environ.setdefault("MKL_THREADING_LAYER", "GNU" if gnu else "SEQUENTIAL")
    # libmkl_rt exits the process on its first call if a part it loads lazily is missing
    # (a broken install): check the parts are there instead.
    layer_lib = {"GNU": "gnu_thread", "SEQUENTIAL": "sequential", "INTEL": "intel_thread"}
    parts = ("core", layer_lib.get(os.environ["MKL_THREADING_LAYER"].upper(), "core"))
    folder = os.path.dirname(path)
    missing = [p for p in parts if not glob.glob(os.path.join(folder, f"libmkl_{p}.so*"))]
    if missing:
        log.warning("MKL at %s lacks %s; not using it", folder, ", ".join(missing))
        return None
    try:
        lib = ctypes.CDLL(path, os.RTLD_GLOBAL)
    except OSError as exc:
        log.warning("could not load %s: %s", path, exc)
        return None
    layer = os.environ["MKL_THREADING_LAYER"]
    if "MKL_NUM_THREADS" not in os.environ and layer.upper() != "SEQUENTIAL":
        # One core decodes, the rest build the next step's graph; prefill uses them all.
        cores = _usable_cores()
        _threads.set_max = lib.MKL_Set_Num_Threads
        _threads.set_max.argtypes = [ctypes.c_int]
        _threads.wide = cores
        _threads.narrow = _decode_threads(cores)
        _threads.apply(_threads.narrow)
        if "MKL_DYNAMIC" not in os.environ:
            # MKL would run the small per-head attention products of a prefill chunk on fewer
            # threads; on all of them prefill is faster (scripts/bench/forward.py).
            lib.MKL_Set_Dynamic(0)
    return f"mkl ({path}, {layer.lower()}, threads {_threads.narrow}/{_threads.wide})"


def _load_openblas() -> str | None:
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
        return f"openblas ({path}, core {os.environ.get('OPENBLAS_CORETYPE', 'auto')})"
    return None


def preload() -> str:
    """Load the chosen BLAS once; return a short description of the BLAS in use."""
    if "name" in _state:
        return _state["name"]
    name = "bundled"
    wanted = choice()
    if sys.platform == "darwin":
        name = "accelerate"
    elif sys.platform.startswith("linux") and wanted != "bundled":
        if "mlx.core" in sys.modules:
            log.warning("mlx was imported before the BLAS preload; keeping its bundled BLAS")
        else:
            loaded = None
            mkl = find_mkl() if wanted in ("auto", "mkl") else None
            if mkl:
                loaded = _load_mkl(mkl, asked=wanted == "mkl")
            elif wanted == "mkl":
                log.warning("MTP_RUNNER_BLAS=mkl but no libmkl_rt found; trying OpenBLAS")
            if loaded is None:
                loaded = _load_openblas()
            name = loaded or name
    _state["name"] = name
    return name


class _PreloadBeforeMlx:
    """A ``sys.meta_path`` entry that loads the BLAS when ``mlx`` is about to be imported,
    then steps aside (it finds nothing itself)."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            uninstall_hook()
            preload()
        return None


def install_hook() -> None:
    """Load the BLAS before mlx is imported: now if mlx is already there (too late: it warns),
    else at mlx's first import."""
    if "mlx.core" in sys.modules or "mlx" in sys.modules:
        preload()
    elif not any(isinstance(f, _PreloadBeforeMlx) for f in sys.meta_path):
        sys.meta_path.insert(0, _PreloadBeforeMlx())


def uninstall_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PreloadBeforeMlx)]


def blas_in_use() -> str:
    return _state.get("name", "bundled")


@contextlib.contextmanager
def wide() -> Iterator[None]:
    """Run many-row work (prefill chunks) on every core; decode steps go back to the narrow
    count on exit. Only MKL's count changes (OpenBLAS decodes slower on one thread)."""
    _threads.apply(_threads.wide)
    try:
        yield
    finally:
        _threads.apply(_threads.narrow)


def limit_cores(cores: int) -> None:
    """Use at most ``cores`` cores from now on (a process sharing the machine with others
    working in turn with it: ``--ranks``): MKL's thread counts become those of a machine
    with that many cores. A no-op where the runner does not set MKL's counts."""
    if _threads.set_max is None:
        return
    before = f"threads {_threads.narrow}/{_threads.wide}"
    _threads.wide = max(1, min(cores, _usable_cores()))
    _threads.narrow = min(_decode_threads(_threads.wide), _threads.wide)
    _threads.apply(_threads.narrow)
    if "name" in _state:
        after = f"threads {_threads.narrow}/{_threads.wide}"
        _state["name"] = _state["name"].replace(before, after)


def row_layout_pays() -> bool:
    """Whether verify rows should use the ``[out, in]`` weight layout under this BLAS
    (``runner.models.layers.add_row_layout``): OpenBLAS packs the transposed operand of
    ``x @ Wt`` on every multi-row call and runs ``W @ x.T`` faster, oneMKL the other way round
    (docs/PERFORMANCE.md)."""
    return not blas_in_use().startswith("mkl")


def thread_counts() -> tuple[int, int] | None:
    """(decode, prefill) BLAS threads where the runner sets them (MKL), else None."""
    if _threads.set_max is None:
        return None
    return _threads.narrow, _threads.wide
