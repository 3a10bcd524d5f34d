"""The bare model's speed per configuration (BLAS, weight layout, native, compiled or eager
blocks, decode threads).

For each configuration, in its own process (the BLAS is fixed at import): a prefill of
``--prefill`` tokens, ``--decode`` pipelined greedy decode steps, and the synchronous cost of a
forward over k = 1..``--rows`` rows at the prefill's offset (a speculative verify of k - 1
drafts costs about this), as medians of alternating repeats; and the memory bandwidth of one
thread on this machine (a numpy read of 512 MiB), measured in the same process, against
the weight bytes a decode step streams. The configurations take turns, ``--reps`` times;
the table shows medians. Usage:

    python scripts/bench/forward.py [--model PATH] [--reps 3] [--only NAME ...] [--rows 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CONFIGS = {
    # A quantized checkpoint (the embedded model is one) as the runner serves it by default,
    # then with --exact-products, then dequantized to float32 (--dequantize) in each layout.
    "quantized panels (default)": {
        "env": {"MTP_RUNNER_BLAS": "mkl"},
        "args": ["--layout", "panels", "--keep-quantized"],
    },
    "quantized panels, MLX blocks (no native blocks)": {
        "env": {"MTP_RUNNER_BLAS": "mkl"},
        "args": ["--layout", "panels", "--keep-quantized", "--no-native-blocks"],
    },
    "quantized panels, exact products": {
        "env": {"MTP_RUNNER_BLAS": "mkl"},
        "args": ["--layout", "panels", "--keep-quantized", "--exact"],
    },
    "quantized panels, exact products, 1 decode thread": {
        "env": {"MTP_RUNNER_BLAS": "mkl", "MTP_RUNNER_DECODE_THREADS": "1"},
        "args": ["--layout", "panels", "--keep-quantized", "--exact"],
    },
    "quantized panels, 1 decode thread": {
        "env": {"MTP_RUNNER_BLAS": "mkl", "MTP_RUNNER_DECODE_THREADS": "1"},
        "args": ["--layout", "panels", "--keep-quantized"],
    },
    "MKL, packed": {"env": {"MTP_RUNNER_BLAS": "mkl"}, "args": ["--layout", "packed"]},
    "MKL, panels": {"env": {"MTP_RUNNER_BLAS": "mkl"}, "args": ["--layout", "panels"]},
    "MKL, packed, threads left to MKL": {
        "env": {"MTP_RUNNER_BLAS": "mkl", "MKL_NUM_THREADS": str(os.cpu_count() or 1)},
        "args": ["--layout", "packed"],
    },
    "OpenBLAS, packed": {"env": {"MTP_RUNNER_BLAS": "openblas"}, "args": ["--layout", "packed"]},
    "OpenBLAS, panels": {"env": {"MTP_RUNNER_BLAS": "openblas"}, "args": ["--layout", "panels"]},
    "MKL, packed, eager blocks": {
        "env": {"MTP_RUNNER_BLAS": "mkl"},
        "args": ["--layout", "packed", "--eager"],
    },
    "MKL, Hugging Face layout": {"env": {"MTP_RUNNER_BLAS": "mkl"}, "args": ["--layout", "hf"]},
    "bundled BLAS, packed": {"env": {"MTP_RUNNER_BLAS": "bundled"}, "args": ["--layout", "packed"]},
}
STEP_REPS = 9  # timings per row count in one worker (medians)


def bandwidth_gbs() -> float:
    """One thread's read rate over 512 MiB of float32 (numpy's max reads each byte once)."""
    import numpy as np

    a = np.ones(128 << 20, dtype=np.float32)
    a.max()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        a.max()
        times.append(time.perf_counter() - t)
    return a.nbytes / min(times) / 1e9


def weight_bytes(model) -> int:
    """Bytes of the dense float32 weights one decode step reads: every projection and the
    output projection (the embedding lookup reads one row)."""
    from runner.models.layers import Linear, dense_weight

    total = sum(dense_weight(m).size for _, m in model.named_modules() if isinstance(m, Linear))
    if model.args.tie_word_embeddings:
        total += model.output_weight().size
    return 4 * total


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from runner import blas, device
    from runner.loader import load_model

    loaded = load_model(args.model, keep_quantized=args.keep_quantized)
    model = loaded.model
    nbytes = 0 if loaded.quantized else weight_bytes(model)
    tuning = device.tune(
        model,
        layout=args.layout,
        compile=not args.eager,
        native_blocks=not args.no_native_blocks,
        exact_products=args.exact,
    )
    if loaded.quantized:  # the bytes a step reads: the quantized weights as held
        nbytes = device.weight_bytes(model)
    prompt = mx.array([[(i * 7919) % 40000 + 100 for i in range(args.prefill)]], dtype=mx.int32)

    warm = model.make_caches()  # first-use costs (allocations, BLAS threads) are not timed
    with blas.wide():
        mx.eval(model.hidden(prompt[:, :16], warm), [c.state for c in warm])
    caches = model.make_caches()
    with blas.wide():  # as runner.decoder.prefill does
        t = time.perf_counter()
        h = model.hidden(prompt, caches)
        mx.eval(h, [c.state for c in caches])
        prefill_s = time.perf_counter() - t

    # Pipelined greedy decode: the next forward is dispatched before the token is read.
    def step(tok):
        hid = model.hidden(tok.reshape(1, 1), caches)
        nxt = mx.argmax(model.unembed(hid[:, -1]), axis=-1).astype(mx.int32)
        mx.async_eval(nxt, [c.state for c in caches])
        return nxt

    y = step(mx.array([42], dtype=mx.int32))
    y.item()
    t = time.perf_counter()
    for _ in range(args.decode):
        nxt = step(y)
        y.item()
        y = nxt
    decode_s = time.perf_counter() - t

    # Synchronous k-row forwards at the prefill's offset, row counts alternating.
    base = caches[0].offset
    ids = mx.array([[(i * 31) % 40000 + 7 for i in range(args.rows)]], dtype=mx.int32)
    timings: dict[int, list[float]] = {k: [] for k in range(1, args.rows + 1)}
    for rep in range(STEP_REPS + 1):
        for k in timings:
            for c in caches:
                c.rewind(base)
            t = time.perf_counter()
            mx.eval(model.unembed(model.hidden(ids[:, :k], caches)), [c.state for c in caches])
            if rep:  # the first pass traces every row count
                timings[k].append(time.perf_counter() - t)
    forward_ms = {k: 1000 * statistics.median(v) for k, v in timings.items()}
    step_s = decode_s / args.decode
    print(
        json.dumps(
            {
                "prefill_tps": args.prefill / prefill_s,
                "decode_tps": 1 / step_s,
                "forward_ms": forward_ms,
                "weight_gb": nbytes / 1e9,
                "step_gbs": nbytes / step_s / 1e9,
                "bandwidth_gbs": bandwidth_gbs(),
                "blas": blas.blas_in_use(),
                "tuning": tuning.describe(),
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8, help="forward cost for 1..ROWS rows")
    parser.add_argument(
        "--only", action="append", help="run configurations whose name contains this (repeatable)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-results", "forward.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="packed", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep-quantized", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-native-blocks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from runner.default_model import ensure_default_model

        args.model = ensure_default_model()
    if args.worker:
        worker(args)
        return 0

    wanted = args.only or []
    chosen = {n: c for n, c in CONFIGS.items() if not wanted or any(w in n for w in wanted)}
    all_runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for _ in range(args.reps):  # configurations take turns, so a drift hits them alike
        for name, cfg in chosen.items():
            cmd = [sys.executable, __file__, "--worker", "--model", args.model]
            cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
            cmd += ["--rows", str(args.rows), *cfg["args"]]
            env = dict(os.environ, **cfg["env"])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            all_runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {name: summarise(runs) for name, runs in all_runs.items()}
    print_tables(results, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "reps": args.reps, "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


def summarise(runs: list[dict]) -> dict:
    med = statistics.median
    rows = sorted(int(k) for k in runs[0]["forward_ms"])
    forward = {k: med(r["forward_ms"][str(k)] for r in runs) for k in rows}
    # Each run's k-row / 1-row ratio, then the median over runs (a drift hits both alike).
    ratios = {k: med(r["forward_ms"][str(k)] / r["forward_ms"]["1"] for r in runs) for k in rows}
    return {
        "prefill_tps": med(r["prefill_tps"] for r in runs),
        "decode_tps": med(r["decode_tps"] for r in runs),
        "step_gbs": med(r["step_gbs"] for r in runs),
        "bandwidth_gbs": med(r["bandwidth_gbs"] for r in runs),
        "forward_ms": forward,
        "forward_ratio": ratios,
        "blas": runs[0]["blas"],
        "tuning": runs[0]["tuning"],
        "runs": runs,
    }


def print_tables(results: dict, args: argparse.Namespace) -> None:
    print(
        f"| configuration | prefill {args.prefill} tok/s | decode tok/s | step GB/s "
        "| one thread GB/s |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
            f"{r['step_gbs']:.1f} | {r['bandwidth_gbs']:.1f} |"
        )
    rows = list(next(iter(results.values()))["forward_ratio"])
    print(f"\nk-row synchronous forward at offset {args.prefill}: ms for 1 row, then x 1 row")
    print("| configuration | 1 row ms | " + " | ".join(f"k={k}" for k in rows[1:]) + " |")
    print("|---|---|" + "---|" * (len(rows) - 1))
    for name, r in results.items():
        ratios = " | ".join(f"{r['forward_ratio'][k]:.2f}" for k in rows[1:])
        print(f"| {name} | {r['forward_ms'][rows[0]]:.1f} | {ratios} |")


if __name__ == "__main__":
    raise SystemExit(main())
