"""The runner.native panel primitive against MLX's ``x @ w_t`` under the runner's BLAS.

For the default model's five weight shapes and M = 1, 2, 3, 4, 5, 8, 16 rows: median
microseconds of ``native.panel_matmul(x, panels, n)`` and of ``x @ w_t`` (w_t [K, N]
contiguous), the two timed alternately in one process (each call built and evaluated, as the
runner does). ``hot`` repeats one weight (a per-layer weight then sits in the 32 MB L3);
``streamed`` cycles through one weight per layer (30 copies), as a decode step reads them,
from DRAM (the vocabulary projection, 113 MB, streams from DRAM either way; it is also timed
with the primitive on two threads). The M = 1 rate of the primitive is set against this
machine's one-thread streaming bandwidth (numpy sum over a 512 MB float32 array), measured in
the same run. Then M = 512 (a prefill chunk), all alternating: ``x @ w_t``, the MLX-ops paths
over the panel layout (``native.mlx_panel_matmul``: rebuild [K, N], or one GEMM per panel) and
the primitive (``native.panel_matmul``'s default for M > 16), with the BLAS and the primitive
on every core (``runner.blas.wide``), and both on one thread.

    python scripts/bench/native.py [--reps-scale 1.0] [--layers 30] [--no-large]

Writes bench-results/native.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from common import machine_load, markdown_table, write_json  # noqa: E402

from runner import blas, native  # noqa: E402

SHAPES = {
    "qkv 576x960": (576, 960),
    "o 576x576": (576, 576),
    "gate/up 576x3072": (576, 3072),
    "down 1536x576": (1536, 576),
    "vocab 576x49152": (576, 49152),
}
ROWS = (1, 2, 3, 4, 5, 8, 16)
LARGE_M = 512


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def stream_bandwidth(reps: int = 7) -> dict:
    """One-thread read bandwidth over a 512 MB float32 array (GB/s, medians): numpy's sum and
    numpy's max, alternating. The sum is pairwise (it does more than read); the faster of the
    two is the reference."""
    a = np.ones(128 << 20, dtype=np.float32)
    rates: dict[str, list[float]] = {"sum": [], "max": []}
    for _ in range(reps):
        for name, fn in (("sum", a.sum), ("max", a.max)):
            t0 = time.perf_counter()
            fn()
            rates[name].append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    med = {f"numpy_{name}_gbs": statistics.median(v) for name, v in rates.items()}
    return {**med, "reference_gbs": max(med.values()), "reps": reps}


def _timed(fn, *args) -> float:
    t0 = time.perf_counter_ns()
    mx.eval(fn(*args))
    return (time.perf_counter_ns() - t0) / 1e3


def bench_small(
    k: int, n: int, copies: int, reps: int, two_threads: bool = False
) -> dict[int, dict]:
    """Median us per M for the primitive (and on two threads) and x @ w_t, alternating (order
    reversed every other rep), cycling through `copies` weight copies."""
    rng = np.random.default_rng(k * n)
    w_ts, panels = [], []
    for _ in range(copies):
        w = mx.array(rng.standard_normal((k, n), dtype=np.float32))
        p = native.to_panels(w)
        mx.eval(w, p)
        w_ts.append(w)
        panels.append(p)
    xs = {m: mx.array(rng.standard_normal((m, k), dtype=np.float32)) for m in ROWS}
    mx.eval(list(xs.values()))
    cands = {
        "native_us": (lambda x, slot: native.panel_matmul(x, panels[slot], n, threads=1)),
        "mkl_us": (lambda x, slot: x @ w_ts[slot]),
    }
    if two_threads:
        cands["native_2t_us"] = lambda x, slot: native.panel_matmul(x, panels[slot], n, threads=2)
    times = {m: {name: [] for name in cands} for m in ROWS}
    for _ in range(2):  # warm-up (first-use allocations, BLAS set-up)
        for m in ROWS:
            mx.eval([f(xs[m], 0) for f in cands.values()])
    i = 0
    for r in range(reps):
        for m in ROWS:
            slot = i % copies
            i += 1
            names = list(cands) if r % 2 == 0 else list(reversed(cands))
            for name in names:
                times[m][name].append(_timed(cands[name], xs[m], slot))
    return {m: {name: statistics.median(v) for name, v in t.items()} for m, t in times.items()}


def bench_large(k: int, n: int, reps: int) -> dict:
    """M = LARGE_M, all candidates alternating: x @ w_t, the MLX-ops paths over the panels and
    the primitive; with the BLAS on every core (``wide``: how the runner prefills) and on one
    thread (``narrow``, against the primitive on one thread)."""
    rng = np.random.default_rng(k + n)
    w = mx.array(rng.standard_normal((k, n), dtype=np.float32))
    p = native.to_panels(w)
    x = mx.array(rng.standard_normal((LARGE_M, k), dtype=np.float32))
    mx.eval(w, p, x)
    wide = {
        "w_t": lambda: x @ w,
        "mlx_rebuild": lambda: native.mlx_panel_matmul(x, p, n, method="rebuild"),
        "primitive": lambda: native.panel_matmul(x, p, n, threads=native.LARGE_M_THREADS),
    }
    if n * k < 10_000_000:  # thousands of narrow GEMMs for the vocabulary: too slow to time
        wide["mlx_batched"] = lambda: native.mlx_panel_matmul(x, p, n, method="batched")
    narrow = {"w_t": lambda: x @ w, "primitive": lambda: native.panel_matmul(x, p, n, threads=1)}
    out: dict = {"M": LARGE_M, "blas_threads": blas.thread_counts()}
    for mode, cands in (("wide", wide), ("narrow", narrow)):
        times: dict[str, list[float]] = {name: [] for name in cands}
        with blas.wide() if mode == "wide" else contextlib.nullcontext():
            mx.eval([f() for f in cands.values()])
            for r in range(reps):
                names = list(cands) if r % 2 == 0 else list(reversed(cands))
                for name in names:
                    times[name].append(_timed(cands[name]))
        med = {name: statistics.median(v) for name, v in times.items()}
        out[mode] = {
            **{f"{name}_us": t for name, t in med.items()},
            **{f"{name}_ratio": t / med["w_t"] for name, t in med.items() if name != "w_t"},
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps-scale", type=float, default=1.0, help="scale every rep count")
    parser.add_argument("--layers", type=int, default=30, help="weight copies when streamed")
    parser.add_argument("--no-large", action="store_true", help="skip the M = 512 comparison")
    args = parser.parse_args()
    if not native.available():
        print(f"runner.native is not available: {native.reason()}", file=sys.stderr)
        return 1

    scale = args.reps_scale
    load_before = machine_load()
    bandwidth = stream_bandwidth()
    print(
        f"cpu: {_cpu_model()}, kernel {native.isa()}, blas {blas.blas_in_use()}; one-thread "
        f"read bandwidth {bandwidth['reference_gbs']:.1f} GB/s (numpy sum "
        f"{bandwidth['numpy_sum_gbs']:.1f}, max {bandwidth['numpy_max_gbs']:.1f})"
    )
    results: list[dict] = []
    for name, (k, n) in SHAPES.items():
        big = k * n * 4 > 32 << 20
        modes = {"hot": 1} if big else {"hot": 1, "streamed": args.layers}
        for mode, copies in modes.items():
            reps = max(5, int((15 if big else 150 if mode == "hot" else 60) * scale))
            per_m = bench_small(k, n, copies, reps, two_threads=big)
            panel_bytes = -(-n // native.PANEL) * native.PANEL * k * 4
            for m, t in per_m.items():
                row = {"shape": name, "K": k, "N": n, "mode": mode, "M": m, "reps": reps, **t}
                row["speedup"] = t["mkl_us"] / t["native_us"]
                if m == 1:
                    row["native_gbs"] = panel_bytes / t["native_us"] / 1e3
                    row["of_stream_bandwidth"] = row["native_gbs"] / bandwidth["reference_gbs"]
                results.append(row)
            print(f"  {name} ({mode}) done", flush=True)

    headers = ["shape", "weights", "M", "native us", "MKL x @ w_t us", "MKL / native"]
    headers.append("GB/s (of bandwidth)")
    headers.append("native 2 threads us")
    table = [
        [
            r["shape"],
            r["mode"],
            r["M"],
            f"{r['native_us']:.0f}",
            f"{r['mkl_us']:.0f}",
            f"{r['speedup']:.2f}",
            f"{r['native_gbs']:.1f} ({r['of_stream_bandwidth']:.0%})" if "native_gbs" in r else "",
            f"{r['native_2t_us']:.0f}" if "native_2t_us" in r else "",
        ]
        for r in results
    ]
    print(markdown_table(headers, table))

    large: list[dict] = []
    if not args.no_large:
        for name, (k, n) in SHAPES.items():
            reps = max(3, int((5 if k * n > 10_000_000 else 15) * scale))
            large.append({"shape": name, "K": k, "N": n, "reps": reps, **bench_large(k, n, reps)})
        print()
        rows = []
        for r in large:
            wide, narrow = r["wide"], r["narrow"]
            batched = wide.get("mlx_batched_us")
            rows.append(
                [
                    r["shape"],
                    f"{wide['w_t_us'] / 1e3:.1f}",
                    f"{wide['mlx_rebuild_us'] / 1e3:.1f} ({wide['mlx_rebuild_ratio']:.2f})",
                    f"{batched / 1e3:.1f} ({wide['mlx_batched_ratio']:.2f})" if batched else "-",
                    f"{wide['primitive_us'] / 1e3:.1f} ({wide['primitive_ratio']:.2f})",
                    f"{narrow['w_t_us'] / 1e3:.1f}",
                    f"{narrow['primitive_us'] / 1e3:.1f} ({narrow['primitive_ratio']:.2f})",
                ]
            )
        print(f"M = {LARGE_M}, ms (ratio to x @ w_t); wide: BLAS threads {blas.thread_counts()}")
        print(
            markdown_table(
                [
                    "shape",
                    "x @ w_t (wide)",
                    "MLX rebuild w_t",
                    "MLX batched",
                    f"primitive {native.LARGE_M_THREADS} threads",
                    "x @ w_t (1 thread)",
                    "primitive 1 thread",
                ],
                rows,
            )
        )

    path = write_json(
        "native.json",
        {
            "machine": {
                "cpu": _cpu_model(),
                "cpus": os.cpu_count(),
                "kernel_isa": native.isa(),
                "blas": blas.blas_in_use(),
                "mlx": mx.__version__,
                "load_before": load_before,
                "load_after": machine_load(),
            },
            "stream_bandwidth": bandwidth,
            "small_rows": results,
            "large_m": large,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
