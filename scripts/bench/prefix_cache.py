"""Time to first token with the prefix cache: a cold 1,500-token prompt, then a warm one.

Each repetition sends a 1,500-token prompt that shares no prefix with anything sent before
(cold), then a prompt made of its first 1,400 tokens and a different 100-token tail (warm),
through the pipe (host wall time from writing the request to reading the first token frame)
and in process (from calling ``Engine.run`` to the first token frame). One runner process and
one in-process engine serve every repetition, interleaved: pipe cold, in-process cold, pipe
warm, in-process warm. Usage:

    python scripts/bench/prefix_cache.py [--model GGUF] [--reps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

PIPE, ENGINE = "through the pipe", "in process"
SIDES = (PIPE, ENGINE)
TARGET = 0.10  # warm time to first token at most this fraction of cold


def prompt_pairs(corpus: list[int], count: int, length: int, shared: int) -> list[tuple]:
    """``count`` (cold, warm) prompt pairs from disjoint corpus windows.

    Cold prompts start with pairwise different tokens, so none shares even one token of
    prefix with another; each warm prompt keeps ``shared`` tokens of its cold prompt and
    continues with the corpus text after it, which differs at position ``shared``.
    """
    tail = length - shared
    pairs, starts, pos = [], set(), 0
    while len(pairs) < count:
        window = corpus[pos : pos + length + tail]
        if len(window) < length + tail:
            raise SystemExit(f"corpus too short for {count} prompt pairs of {length} tokens")
        cold, after = window[:length], window[length:]
        if cold[0] in starts or after[0] == cold[shared]:
            pos += 1
            continue
        starts.add(cold[0])
        pairs.append((cold, cold[:shared] + after))
        pos += length + tail
    return pairs


def measure(side: str, sides: dict, prompt: list[int], tag: str) -> dict:
    request = {"id": tag, "tokens": prompt, "options": {"temperature": 0, "num_predict": 1}}
    if side == PIPE:
        reply = sides[side].complete(request)
    else:
        reply = sides[side].call({"request": request})
    done = reply["done"]
    return {
        "ttft_s": reply["tokens"][0][0],
        "engine_prompt_eval_s": done["prompt_eval_ns"] / 1e9,
        "prompt_tokens": done["prompt_tokens"],
        "prompt_cached_tokens": done["prompt_cached_tokens"],
        "first_token": reply["tokens"][0][1],
        "load": bc.machine_load(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir (default: embedded model)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--length", type=int, default=1500, help="prompt tokens")
    parser.add_argument("--shared", type=int, default=1400, help="tokens the warm prompt shares")
    parser.add_argument("--out", default="cache.json", help="file name under bench-results/")
    args = parser.parse_args()
    model = args.model or bc.default_model_path()

    started = time.perf_counter()
    sides = {
        PIPE: bc.PipeRunner(["--model", model, "--no-draft"], "cache-runner.log"),
        ENGINE: bc.Worker(bc.engine_worker_argv(model, {"use_draft": False}), "cache-engine.log"),
    }
    runs: dict[str, dict[str, list[dict]]] = {s: {"cold": [], "warm": []} for s in SIDES}
    try:
        ready = sides[PIPE].wait_ready()
        corpus = sides[PIPE].tokenize(bc.corpus_text())
        pairs = prompt_pairs(corpus, args.reps + 1, args.length, args.shared)
        # Untimed: one cold+warm pair per side for first-call set-up and allocations.
        for side in SIDES:
            for kind, prompt in zip(("cold", "warm"), pairs[-1], strict=True):
                measure(side, sides, prompt, f"warmup-{kind}")
        for rep, pair in enumerate(pairs[:-1]):
            for kind, prompt in zip(("cold", "warm"), pair, strict=True):
                for side in SIDES:
                    r = measure(side, sides, prompt, f"r{rep}-{kind}")
                    runs[side][kind].append(r)
                    print(
                        f"rep {rep} {kind} {side:17s} first token {r['ttft_s']:7.3f} s, "
                        f"{r['prompt_cached_tokens']}/{r['prompt_tokens']} cached, "
                        f"load {r['load']['loadavg_1m']:.2f}",
                        file=sys.stderr,
                    )
    finally:
        for side in sides.values():
            side.close()
    report(args, model, ready, runs, time.perf_counter() - started)
    return 0


def report(args, model, ready, runs, elapsed) -> None:
    rows, summary = [], {}
    for side in SIDES:
        cold, warm = runs[side]["cold"], runs[side]["warm"]
        cold_s = bc.median([r["ttft_s"] for r in cold])
        warm_s = bc.median([r["ttft_s"] for r in warm])
        paired = bc.median([w["ttft_s"] / c["ttft_s"] for c, w in zip(cold, warm, strict=True)])
        summary[side] = {
            "cold_ttft_s": cold_s,
            "warm_ttft_s": warm_s,
            "warm_over_cold": warm_s / cold_s,
            "paired_warm_over_cold": paired,
            "cold_engine_prompt_eval_s": bc.median([r["engine_prompt_eval_s"] for r in cold]),
            "warm_engine_prompt_eval_s": bc.median([r["engine_prompt_eval_s"] for r in warm]),
            "cold_cached_tokens": sorted({r["prompt_cached_tokens"] for r in cold}),
            "warm_cached_tokens": sorted({r["prompt_cached_tokens"] for r in warm}),
        }
        s = summary[side]
        verdict = "meets" if s["warm_over_cold"] <= TARGET else "misses"
        rows.append(
            [
                side,
                f"{s['cold_ttft_s']:.3f}",
                f"{s['warm_ttft_s']:.3f}",
                f"{s['warm_over_cold']:.1%} ({verdict} <= {TARGET:.0%})",
                f"{s['paired_warm_over_cold']:.1%}",
                f"{s['cold_engine_prompt_eval_s']:.3f} / {s['warm_engine_prompt_eval_s']:.3f}",
                f"{s['cold_cached_tokens']} / {s['warm_cached_tokens']}",
            ]
        )
    headers = [
        "side",
        f"cold TTFT s (median of {args.reps})",
        "warm TTFT s",
        "warm / cold (medians)",
        "warm / cold (paired)",
        "done prompt_eval s cold / warm",
        "prompt_cached_tokens cold / warm",
    ]
    loads = [r["load"] for side in SIDES for kind in runs[side].values() for r in kind]
    print()
    print(bc.markdown_table(headers, rows))
    print()
    print(
        f"prompts: {args.length} tokens cold; warm shares the first {args.shared} and has a "
        f"different {args.length - args.shared}-token tail"
    )
    print(bc.describe_load(loads))
    print(f"BLAS: {ready.get('blas')}; {elapsed:.0f} s in all")
    path = bc.write_json(
        args.out,
        {
            "model": model,
            "length": args.length,
            "shared": args.shared,
            "reps": args.reps,
            "environment": bc.environment(),
            "summary": summary,
            "runs": runs,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
