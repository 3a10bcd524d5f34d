"""Cold prefill speed at 512-8,000 prompt tokens against mlx-lm, and cancel latency in prefill.

Each side is a process loaded once and driven one command at a time, runs interleaved
(length by length, side by side) after one untimed warm-up per side:

- "runner": this tree's ``runner.prefill.prefill`` on the engine's tuned model (the layout,
  compiled blocks and ``prefill_chunk`` the server uses), fresh caches for every run;
- "baseline" (``--baseline REV``): the same worker on another revision of the runner,
  exported with ``git archive`` under bench-results/ with this tree's native build copied
  in (the report's tuning lines show the layout each side got), for before/after numbers;
- "mlx-lm": ``mlx_lm.stream_generate`` with one output token on a Hugging Face export of the
  same float32 weights (scripts/bench/export_hf.py), in its own venv (.venv-ref, else .venv-bench
  as scripts/bench/decode.py makes it; mlx-lm is never a project dependency), with the same
  BLAS and the runner's prefill thread count. Its rate is the one it reports (prompt_tps).

Prompts are the corpus text's tokens (``common.corpus_text``), a different window per
repetition, so nothing is cached anywhere. Rates are tokens over wall seconds, medians of
``--reps`` runs. A length over the model's context is skipped and said so.

Cancel latency: ``--cancel-trials`` prefills of ``--cancel-tokens`` tokens, each cancelled by
a thread that sets the flag at a random moment (seeded) while it runs; the latency is from
setting the flag to ``prefill`` raising ``Cancelled``, and every trial checks that all caches
rest at one offset on a chunk boundary. Usage:

    python scripts/bench/prefill.py [--model GGUF] [--reps 3] [--lengths 512,1500,4000,8000]
        [--baseline HEAD] [--cancel-trials 12] [--cancel-tokens 8000] [--no-mlx-lm]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

RUNNER, BASELINE, MLX_LM = "runner", "baseline", "mlx-lm"
LENGTHS = (512, 1500, 4000, 8000)
WARMUP_TOKENS = 600
REF_VENV = os.path.join(bc.ROOT, ".venv-ref")


# ----------------------------------------------------------------------------- runner side
def runner_worker(model_path: str, tree: str) -> None:
    """This runner (or the one at ``tree``): prefill and cancel commands on the tuned model."""
    sys.path.insert(0, tree)
    import threading

    import mlx.core as mx

    import runner
    from runner.engine import Engine, EngineOptions
    from runner.prefill import Cancelled, chunk_ends, prefill

    engine = Engine(EngineOptions(model_path=model_path, use_draft=False, prefix_cache=False))
    model, chunk = engine.model, engine.options.prefill_chunk

    def run_prefill(command: dict) -> dict:
        caches = model.make_caches()
        t0 = time.perf_counter()
        prefill(model, caches, command["tokens"], 0, chunk=chunk)
        seconds = time.perf_counter() - t0
        del caches
        mx.clear_cache()  # as the engine does after every request
        return {"seconds": seconds, "tokens": len(command["tokens"])}

    def run_cancel(command: dict) -> dict:
        tokens, delay = command["tokens"], command["delay"]
        caches = model.make_caches()
        flag = threading.Event()
        set_at: list[float] = []

        def cancel_later() -> None:
            time.sleep(delay)
            set_at.append(time.perf_counter())
            flag.set()

        thread = threading.Thread(target=cancel_later, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        try:
            prefill(model, caches, tokens, 0, chunk=chunk, cancelled=flag.is_set)
            raised_at, kept = None, len(tokens)
        except Cancelled as stop:
            raised_at, kept = time.perf_counter(), stop.args[0]
        thread.join()
        offsets = sorted({c.offset for c in caches})
        boundaries = {0, *chunk_ends(0, len(tokens), chunk)}
        result = {
            "delay_s": delay,
            "finished": raised_at is None,
            "kept": kept,
            "consistent": offsets == [kept] and kept in boundaries,
            "elapsed_s": time.perf_counter() - t0,
        }
        if raised_at is not None:
            result["latency_s"] = raised_at - set_at[0]
        del caches
        mx.clear_cache()
        return result

    def handle(command: dict) -> dict:
        if command["op"] == "tokenize":
            return {"tokens": engine.tokenize(command["text"])}
        if command["op"] == "prefill":
            return run_prefill(command)
        return run_cancel(command)

    info = {
        "blas": runner.blas.blas_in_use(),
        "tuning": engine.info.tuning,
        "prefill_chunk": chunk,
        "context_length": engine.info.context_length,
        "mlx": mx.__version__,
    }
    bc.serve_worker(info, handle)


# ----------------------------------------------------------------------------- mlx-lm side
def mlx_lm_worker(hf_dir: str) -> None:
    """Runs inside the mlx-lm venv: mlx-lm's own model code and prompt processing."""
    blas = bc.preload_runner_blas()
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(hf_dir)

    def handle(command: dict) -> dict:
        last = None
        t0 = time.perf_counter()
        with blas.wide():  # the thread count the runner's prefill uses
            for response in stream_generate(
                model, tokenizer, prompt=command["tokens"], max_tokens=1
            ):
                last = response
        seconds = time.perf_counter() - t0
        mx.clear_cache()
        return {"seconds": seconds, "tokens": len(command["tokens"]), "prompt_tps": last.prompt_tps}

    info = {
        "blas": blas.blas_in_use(),
        "mlx": mx.__version__,
        "mlx_lm": importlib.metadata.version("mlx-lm"),
    }
    bc.serve_worker(info, handle)


def mlx_lm_python() -> str:
    """.venv-ref's python when it has mlx-lm, else .venv-bench (made as decode.py does)."""
    python = os.path.join(REF_VENV, "bin", "python")
    probe = [python, "-c", "import mlx_lm, mlx.core"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    import decode

    return decode.ensure_bench_venv()


# ----------------------------------------------------------------------------- set-up
def baseline_tree(rev: str) -> str:
    """``rev`` of this repository exported under bench-results/ (read-only git use)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev],
        cwd=bc.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = os.path.join(bc.RESULTS_DIR, f"baseline-{sha}")
    if not os.path.exists(os.path.join(tree, "runner")):
        os.makedirs(tree, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", sha], cwd=bc.ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    # The native build is not in git: use this tree's (runner.native checks that it fits and
    # falls back to the packed layout otherwise, which the report's tuning line shows).
    native = os.path.join(bc.ROOT, "runner", "native")
    for name in os.listdir(native):
        if name.startswith("_smallrow") and name.endswith(".so"):
            shutil.copy2(os.path.join(native, name), os.path.join(tree, "runner", "native"))
    return tree


def start_sides(args, model: str, hf_dir: str | None, baseline: str | None) -> dict:
    here = os.path.abspath(__file__)
    sides = {
        RUNNER: bc.Worker(
            [sys.executable, here, "--runner-worker", model, bc.ROOT], "prefill-runner.log"
        )
    }
    if baseline is not None:
        sides[BASELINE] = bc.Worker(
            [sys.executable, here, "--runner-worker", model, baseline], "prefill-baseline.log"
        )
    if hf_dir is not None:
        env = dict(os.environ, PYTHONPATH=bc.ROOT)
        sides[MLX_LM] = bc.Worker(
            [mlx_lm_python(), here, "--mlx-lm-worker", hf_dir], "prefill-mlx-lm.log", env=env
        )
    return sides


def prompts(corpus: list[int], length: int, reps: int) -> list[list[int]]:
    """``reps`` prompts of ``length`` tokens from different windows of the corpus."""
    if len(corpus) < length:
        raise SystemExit(f"the corpus gives only {len(corpus)} tokens, fewer than {length}")
    step = max(1, (len(corpus) - length) // max(1, reps))
    return [corpus[(i * step) % (len(corpus) - length + 1) :][:length] for i in range(reps)]


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir (default: embedded model)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per side and length")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths")
    parser.add_argument("--baseline", metavar="REV", help="also time the runner at git REV")
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave mlx-lm out")
    parser.add_argument("--cancel-trials", type=int, default=12, help="0: no cancel latency")
    parser.add_argument("--cancel-tokens", type=int, default=8000, help="prompt of the cancels")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cancel moments")
    parser.add_argument("--out", default="prefill.json", help="file name under bench-results/")
    hidden = argparse.SUPPRESS
    parser.add_argument("--runner-worker", nargs=2, metavar=("MODEL", "TREE"), help=hidden)
    parser.add_argument("--mlx-lm-worker", metavar="HF_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner_worker:
        runner_worker(*args.runner_worker)
        return 0
    if args.mlx_lm_worker:
        mlx_lm_worker(args.mlx_lm_worker)
        return 0

    model = args.model or bc.default_model_path()
    hf_dir = None
    if not args.no_mlx_lm:
        import export_hf

        hf_dir = export_hf.ensure_export_in_child(model)
    baseline = baseline_tree(args.baseline) if args.baseline else None
    lengths = [int(x) for x in args.lengths.split(",") if x]

    started = time.perf_counter()
    sides = start_sides(args, model, hf_dir, baseline)
    try:
        info = {name: side.info for name, side in sides.items()}
        context = info[RUNNER]["context_length"]
        corpus = sides[RUNNER].call({"op": "tokenize", "text": bc.corpus_text()})["tokens"]
        fitting = [n for n in lengths if n <= context]
        skipped = [n for n in lengths if n > context]
        for side in sides.values():  # untimed: JIT kernels, first allocations
            side.call({"op": "prefill", "tokens": corpus[:WARMUP_TOKENS]})
        runs: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in fitting} for s in sides}
        for n in fitting:
            for rep, tokens in enumerate(prompts(corpus, n, args.reps)):
                for name, side in sides.items():
                    reply = side.call({"op": "prefill", "tokens": tokens})
                    reply["rate"] = reply["tokens"] / reply["seconds"]
                    reply["load"] = bc.machine_load()
                    runs[name][n].append(reply)
                    print(
                        f"{n:5d} tokens rep {rep} {name:9s} {reply['rate']:7.1f} tok/s "
                        f"({reply['seconds']:.2f} s), load {reply['load']['loadavg_1m']:.2f}",
                        file=sys.stderr,
                    )
        cancels = []
        cancel_tokens = min(args.cancel_tokens, context)
        if args.cancel_trials > 0:
            tokens = prompts(corpus, cancel_tokens, 1)[0]
            full = bc.median([r["seconds"] for r in runs[RUNNER].get(cancel_tokens, [])])
            if full != full:  # not timed above: time one run for the window of cancel moments
                full = sides[RUNNER].call({"op": "prefill", "tokens": tokens})["seconds"]
            rng = random.Random(args.seed)
            for trial in range(args.cancel_trials):
                delay = rng.uniform(0.02, 0.95) * full
                reply = sides[RUNNER].call({"op": "cancel", "tokens": tokens, "delay": delay})
                cancels.append(reply)
                latency = reply.get("latency_s")
                shown = "finished first" if latency is None else f"{latency * 1e3:6.1f} ms"
                print(
                    f"cancel {trial:2d} at {delay:6.2f} s: {shown}, kept {reply['kept']}, "
                    f"consistent {reply['consistent']}",
                    file=sys.stderr,
                )
    finally:
        for side in sides.values():
            side.close()
    elapsed = time.perf_counter() - started
    report(args, model, hf_dir, info, runs, skipped, context, cancels, cancel_tokens, elapsed)
    return 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def report(args, model, hf_dir, info, runs, skipped, context, cancels, cancel_tokens, elapsed):
    sides = list(runs)
    summary: dict[str, dict] = {}
    headers = ["prompt tokens"] + [f"{s} tok/s" for s in sides]
    if BASELINE in runs:
        headers.append("runner / baseline")
    if MLX_LM in runs:
        headers += ["runner / mlx-lm", "mlx-lm self-reported tok/s"]
    rows = []
    lengths = list(runs[RUNNER])
    for n in lengths:
        med = {s: bc.median([r["rate"] for r in runs[s][n]]) for s in sides}
        row = [n] + [f"{med[s]:.1f}" for s in sides]
        entry = {"median_tps": med}
        for other, label in ((BASELINE, "baseline"), (MLX_LM, "mlx_lm")):
            if other in runs:
                pairs = zip(runs[RUNNER][n], runs[other][n], strict=True)
                paired = [a["rate"] / b["rate"] for a, b in pairs]
                entry[f"ratio_vs_{label}"] = med[RUNNER] / med[other]
                entry[f"paired_ratio_vs_{label}"] = bc.median(paired)
                row.append(f"{med[RUNNER] / med[other]:.2f} (paired {bc.median(paired):.2f})")
        if MLX_LM in runs:
            reported = bc.median([r["prompt_tps"] for r in runs[MLX_LM][n]])
            entry["mlx_lm_reported_tps"] = reported
            row.append(f"{reported:.1f}")
        summary[str(n)] = entry
        rows.append(row)
    print()
    print(f"Cold prefill, medians of {args.reps} (wall clock)")
    print(bc.markdown_table(headers, rows))
    for n in skipped:
        print(f"{n} tokens: skipped, over the model's context length ({context})")
    latency = [c["latency_s"] for c in cancels if "latency_s" in c]
    cancel_summary = {}
    if cancels:
        cancel_summary = {
            "prompt_tokens": cancel_tokens,
            "trials": len(cancels),
            "cancelled": len(latency),
            "all_consistent": all(c["consistent"] for c in cancels),
            **{f"p{q}_ms": percentile(latency, q) * 1e3 for q in (50, 90, 99)},
            "max_ms": max(latency, default=float("nan")) * 1e3,
        }
        print()
        print(
            f"Cancel latency during a {cancel_tokens}-token prefill ({len(latency)} of "
            f"{len(cancels)} trials cancelled before the end): p50 "
            f"{cancel_summary['p50_ms']:.0f} ms, p90 {cancel_summary['p90_ms']:.0f} ms, p99 "
            f"{cancel_summary['p99_ms']:.0f} ms, max {cancel_summary['max_ms']:.0f} ms; caches "
            f"consistent in every trial: {cancel_summary['all_consistent']}"
        )
    loads = [r["load"] for s in sides for n in lengths for r in runs[s][n]]
    print()
    if loads:
        print(bc.describe_load(loads))
    for side in sides:
        details = ", ".join(f"{k} {v}" for k, v in info[side].items() if k != "context_length")
        print(f"{side}: {details}")
    print(f"{elapsed:.0f} s in all")
    path = bc.write_json(
        args.out,
        {
            "model": model,
            "hf_export": hf_dir,
            "baseline": args.baseline,
            "reps": args.reps,
            "context_length": context,
            "skipped_lengths": skipped,
            "environment": bc.environment(),
            "info": info,
            "summary": summary,
            "cancel": cancel_summary,
            "cancel_trials": cancels,
            "runs": runs,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
