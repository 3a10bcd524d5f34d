"""Prefill and decode speed of the bare model on the default model, per BLAS/dtype setting.

Each configuration runs in its own process (the BLAS choice is fixed at import), several
times, the configurations taking turns; the table shows medians. Usage:

    python scripts/bench_forward.py [--model PATH] [--reps 3] [--prefill 512] [--decode 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "float32 + MKL (packed, compiled; default)": {
        "env": {"MTP_RUNNER_BLAS": "mkl"},
        "args": ["--compile"],
    },
    "float32 + MKL, threads left to MKL": {
        "env": {"MTP_RUNNER_BLAS": "mkl", "MKL_NUM_THREADS": str(os.cpu_count() or 1)},
        "args": ["--compile"],
    },
    "float32 + OpenBLAS (packed, compiled)": {
        "env": {"MTP_RUNNER_BLAS": "openblas"},
        "args": ["--compile"],
    },
    "float32 + OpenBLAS (packed, eager)": {"env": {"MTP_RUNNER_BLAS": "openblas"}, "args": []},
    "float32 + OpenBLAS (HF layout)": {
        "env": {"MTP_RUNNER_BLAS": "openblas"},
        "args": ["--no-pack"],
    },
    "float32, bundled BLAS": {"env": {"MTP_RUNNER_BLAS": "bundled"}, "args": []},
    "quantized Q4_1/Q8_0 (kept)": {"env": {}, "args": ["--keep-quantized"]},
}


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx

    import runner
    import runner.device
    from runner.loader import load_model

    loaded = load_model(args.model, keep_quantized=args.keep_quantized)
    model = loaded.model
    runner.device.tune(model, layout="hf" if args.no_pack else "packed", compile=args.compile)
    prompt = mx.array([[(i * 7919) % 40000 + 100 for i in range(args.prefill)]], dtype=mx.int32)

    warm = model.make_caches()  # first-use costs (allocations, BLAS threads) are not timed
    with runner.blas.wide():
        mx.eval(model.hidden(prompt[:, :16], warm), [c.state for c in warm])
    caches = model.make_caches()
    with runner.blas.wide():  # as runner.decoder.prefill does
        t = time.perf_counter()
        h = model.hidden(prompt, caches)
        mx.eval(h, [c.state for c in caches])
        prefill_s = time.perf_counter() - t

    # Pipelined greedy decode: the next forward is dispatched before the token is read.
    def step(tok):
        hid = model.hidden(tok.reshape(1, 1), caches)
        nxt = mx.argmax(model.unembed(hid[:, -1]), axis=-1).astype(mx.int32)
        mx.async_eval(nxt)
        return nxt

    y = step(mx.array([42], dtype=mx.int32))
    y.item()
    t = time.perf_counter()
    for _ in range(args.decode):
        nxt = step(y)
        y.item()
        y = nxt
    decode_s = time.perf_counter() - t
    print(
        json.dumps(
            {
                "prefill_tps": args.prefill / prefill_s,
                "decode_tps": args.decode / decode_s,
                "blas": runner.blas.blas_in_use(),
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument(
        "--only",
        action="append",
        help="run configurations whose name contains this (repeatable)",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-results", "forward.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-pack", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep-quantized", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
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
            cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode), *cfg["args"]]
            env = dict(os.environ, **cfg["env"])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            all_runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {}
    for name, runs in all_runs.items():
        results[name] = {
            "prefill_tps": statistics.median(r["prefill_tps"] for r in runs),
            "decode_tps": statistics.median(r["decode_tps"] for r in runs),
            "blas": runs[0]["blas"],
            "runs": runs,
        }
        r = results[name]
        print(
            f"{name:40s} prefill {r['prefill_tps']:8.1f} tok/s  decode {r['decode_tps']:6.2f} tok/s"
        )

    print()
    print(f"| configuration | prefill {args.prefill} tok/s | decode {args.decode} tok/s |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "reps": args.reps, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
