"""Plain greedy decode speed: this runner in process, through the pipe, and mlx-lm.

All three decode the same 64-token prompt for 128 tokens, greedily without penalties, on the
same float32 weights and the same BLAS (the system OpenBLAS). Each side is a process loaded
once; runs are interleaved (A B C A B C ...) after one short untimed warm-up run per side.
mlx-lm runs from its own venv (.venv-bench, created on first use; never a project dependency)
on a Hugging Face export of the weights (scripts/bench/export_hf.py). Usage:

    python scripts/bench/decode.py [--model GGUF] [--reps 4] [--decode 128]

The table's decode rate is wall clock: the tokens after the first over the time between the
first and the last token's arrival (in the emit callback, at the host's end of the pipe, or
between mlx-lm's yields). The rate each side reports itself (the done frame's
eval_tokens / eval_ns; mlx-lm's generation_tps) is listed beside it. "First token" is not a
like-for-like prefill number: the runner restores the repeated prompt from its prefix cache,
mlx-lm evaluates it every time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

PROMPT_TOKENS = 64
# Prose the model continues for well over 128 tokens without an end-of-turn token (checked
# on every run: a side that stops early is reported).
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "lantern, a thermos of tea and a notebook in which he recorded the weather, the ships "
    "that passed and the birds that rested on the railing. Over forty years the notebooks "
    "filled three shelves of his small cottage, and when the historians from the university "
    "finally came to read them, they found"
)
SIDES = ("runner in process", "runner through the pipe", "mlx-lm stream_generate")
MLX_LM = SIDES[2]
WARMUP_TOKENS = 16


# ----------------------------------------------------------------------------- mlx-lm side
def ensure_bench_venv() -> str:
    """The python of .venv-bench, with mlx-lm and the project's mlx version installed."""
    python = os.path.join(bc.BENCH_VENV, "bin", "python")
    probe = [python, "-c", "import mlx_lm, mlx.core"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    mlx_version = importlib.metadata.version("mlx")
    print(f"creating {bc.BENCH_VENV} with mlx=={mlx_version} and mlx-lm ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", bc.BENCH_VENV], check=True)
    spec = f"mlx[cpu]=={mlx_version}" if sys.platform.startswith("linux") else f"mlx=={mlx_version}"
    subprocess.run([python, "-m", "pip", "install", "-q", spec, "mlx-lm"], check=True)
    return python


def mlx_lm_worker(hf_dir: str) -> None:
    """Runs inside .venv-bench: mlx-lm's own model code and generate loop."""
    blas = bc.preload_runner_blas()
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(hf_dir)

    def handle(command: dict) -> dict:
        tokens: list[tuple[float, list[int]]] = []
        last = None
        t0 = time.perf_counter()
        for response in stream_generate(
            model, tokenizer, prompt=command["prompt"], max_tokens=command["max_tokens"]
        ):
            tokens.append((time.perf_counter() - t0, [int(response.token)]))
            last = response
        done_at = time.perf_counter() - t0
        if last.finish_reason == "stop":
            tokens.pop()  # the end-of-turn token is not a generated token
        return {
            "tokens": tokens,
            "done_at": done_at,
            "generation_tps": last.generation_tps,
            "prompt_tps": last.prompt_tps,
            "finish_reason": last.finish_reason,
        }

    info = {
        "blas": blas.blas_in_use(),
        "mlx": mx.__version__,
        "mlx_lm": importlib.metadata.version("mlx-lm"),
    }
    bc.serve_worker(info, handle)


# ----------------------------------------------------------------------------- one run
def summarize(side: str, reply: dict) -> dict:
    tokens = reply["tokens"]
    if side == MLX_LM:
        reported = reply["generation_tps"]
    else:
        done = reply["done"]
        reported = done["eval_tokens"] / (done["eval_ns"] / 1e9) if done["eval_ns"] else 0.0
    cached = 0 if side == MLX_LM else reply["done"]["prompt_cached_tokens"]
    return {
        "prompt_cached_tokens": cached,
        "ids": bc.flatten_ids(tokens),
        "first_token_s": tokens[0][0] if tokens else float("nan"),
        "wall_tps": bc.interval_rate(tokens),
        "reported_tps": reported,
        "load": bc.machine_load(),
    }


def run_once(side: str, sides: dict, prompt: list[int], n: int, tag: str) -> dict:
    options = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": n}
    request = {"id": tag, "tokens": prompt, "options": options}
    if side == SIDES[0]:
        reply = sides[side].call({"request": request})
    elif side == SIDES[1]:
        reply = sides[side].complete(request)
    else:
        reply = sides[side].call({"prompt": prompt, "max_tokens": n})
    return summarize(side, reply)


# ----------------------------------------------------------------------------- main
def start_sides(model: str, hf_dir: str, bench_python: str) -> dict:
    env = dict(os.environ, PYTHONPATH=bc.ROOT)
    here = os.path.abspath(__file__)
    engine_opts = {"use_draft": False}
    sides = {
        SIDES[1]: bc.PipeRunner(["--model", model, "--no-draft"], "decode-runner.log"),
        SIDES[0]: bc.Worker(bc.engine_worker_argv(model, engine_opts), "decode-engine.log"),
        SIDES[2]: bc.Worker(
            [bench_python, here, "--mlx-lm-worker", hf_dir], "decode-mlx-lm.log", env=env
        ),
    }
    sides[SIDES[1]].wait_ready()
    return sides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir (default: embedded model)")
    parser.add_argument("--reps", type=int, default=4, help="timed runs per side")
    parser.add_argument("--decode", type=int, default=128, help="tokens to generate")
    parser.add_argument("--out", default="decode.json", help="file name under bench-results/")
    parser.add_argument("--mlx-lm-worker", metavar="HF_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlx_lm_worker:
        mlx_lm_worker(args.mlx_lm_worker)
        return 0

    import export_hf

    model = args.model or bc.default_model_path()
    hf_dir = export_hf.ensure_export_in_child(model)
    bench_python = ensure_bench_venv()

    started = time.perf_counter()
    sides = start_sides(model, hf_dir, bench_python)
    try:
        prompt = sides[SIDES[1]].tokenize(PROMPT_TEXT)[:PROMPT_TOKENS]
        if len(prompt) != PROMPT_TOKENS:
            raise SystemExit(f"the prompt text gives only {len(prompt)} tokens")
        runs: dict[str, list[dict]] = {s: [] for s in SIDES}
        # Untimed and short: first-call allocations and lazy set-up are not decode speed.
        warmup = {s: run_once(s, sides, prompt, WARMUP_TOKENS, "warmup") for s in SIDES}
        for rep in range(args.reps):
            for side in SIDES:
                runs[side].append(run_once(side, sides, prompt, args.decode, f"r{rep}"))
                r = runs[side][-1]
                print(
                    f"rep {rep} {side:26s} {r['wall_tps']:6.2f} tok/s wall, "
                    f"{r['reported_tps']:6.2f} reported, {len(r['ids'])} tokens, "
                    f"load {r['load']['loadavg_1m']:.2f}",
                    file=sys.stderr,
                )
        info = {
            SIDES[0]: sides[SIDES[0]].info,
            SIDES[1]: {k: sides[SIDES[1]].ready.get(k) for k in ("model", "blas")},
            SIDES[2]: sides[SIDES[2]].info,
        }
    finally:
        for side in sides.values():
            side.close()
    report(args, model, hf_dir, prompt, warmup, runs, info, time.perf_counter() - started)
    return 0


def report(args, model, hf_dir, prompt, warmup, runs, info, elapsed) -> None:
    reference = runs[SIDES[0]][0]["ids"]
    agreement = {}
    for side in SIDES:
        all_ids = [r["ids"] for r in runs[side]]
        same_runs = all(ids == all_ids[0] for ids in all_ids)
        same_runs = same_runs and warmup[side]["ids"] == all_ids[0][:WARMUP_TOKENS]
        agreement[side] = {
            "tokens": len(all_ids[0]),
            "stable_across_runs": same_runs,
            "first_difference_vs_runner": bc.first_difference(reference, all_ids[0]),
        }
    base = bc.median([r["wall_tps"] for r in runs[MLX_LM]])
    rows, summary = [], {}
    for side in SIDES:
        wall = bc.median([r["wall_tps"] for r in runs[side]])
        paired = bc.median(
            [a["wall_tps"] / b["wall_tps"] for a, b in zip(runs[side], runs[MLX_LM], strict=True)]
        )
        summary[side] = {
            "wall_tps": wall,
            "reported_tps": bc.median([r["reported_tps"] for r in runs[side]]),
            "first_token_s": bc.median([r["first_token_s"] for r in runs[side]]),
            "ratio_vs_mlx_lm": wall / base,
            "paired_ratio_vs_mlx_lm": paired,
            "blas": info[side].get("blas"),
        }
        s, a = summary[side], agreement[side]
        diff = a["first_difference_vs_runner"]
        same = "identical" if diff is None else f"differ from index {diff}"
        rows.append(
            [
                side,
                f"{s['wall_tps']:.2f}",
                f"{s['reported_tps']:.2f}",
                f"{s['ratio_vs_mlx_lm']:.3f}",
                f"{s['paired_ratio_vs_mlx_lm']:.3f}",
                f"{s['first_token_s']:.3f}",
                f"{a['tokens']} ({same})",
            ]
        )
    loads = [r["load"] for side in SIDES for r in runs[side]]
    headers = [
        "side",
        f"decode tok/s (wall, median of {args.reps})",
        "self-reported tok/s",
        "x mlx-lm (medians)",
        "x mlx-lm (paired)",
        "first token s",
        "tokens generated",
    ]
    print()
    print(bc.markdown_table(headers, rows))
    print()
    print(bc.describe_load(loads))
    print(f"BLAS: runner {summary[SIDES[0]]['blas']}; mlx-lm {summary[MLX_LM]['blas']}")
    print(f"mlx {info[MLX_LM]['mlx']}, mlx-lm {info[MLX_LM]['mlx_lm']}; {elapsed:.0f} s in all")
    for side in SIDES:
        if not agreement[side]["stable_across_runs"]:
            print(f"WARNING: {side} generated different tokens in different runs")
        if agreement[side]["tokens"] != args.decode:
            got = agreement[side]["tokens"]
            print(f"WARNING: {side} generated {got} tokens, not {args.decode}")
    path = bc.write_json(
        args.out,
        {
            "model": model,
            "hf_export": hf_dir,
            "prompt_tokens": prompt,
            "decode_tokens": args.decode,
            "reps": args.reps,
            "environment": bc.environment(),
            "summary": summary,
            "agreement": agreement,
            "info": info,
            "warmup": warmup,
            "runs": runs,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
