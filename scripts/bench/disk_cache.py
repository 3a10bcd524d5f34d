"""Time to first token for a long prompt cached on disk by a runner that has since exited.

Each repetition takes a 4,000-token prompt that shares no prefix with any other and a fresh
``--cache-dir``: a runner serves it cold (and writes it to disk as it closes the request),
exits; a second runner on the same directory serves it again, restoring the prefix from disk
and computing only the tail (the last prompt token and the first decode step); that runner
then serves it a third time, from memory. Both runners run the default configuration (the
shipped head, speculation on). TTFT is host wall time from writing the request to reading
the first token frame; runner starts are not timed. Repetitions interleave cold and disk,
medians and the median of the per-repetition ratios are reported. Usage:

    python scripts/bench/disk_cache.py [--model GGUF] [--reps 4] [--length 4000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

TARGET = 0.10  # disk-restored TTFT at most this fraction of cold
KINDS = ("cold", "disk", "memory")


def prompts(corpus: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` disjoint corpus windows whose first tokens differ pairwise."""
    out, starts, pos = [], set(), 0
    while len(out) < count:
        window = corpus[pos : pos + length]
        if len(window) < length:
            raise SystemExit(f"corpus too short for {count} prompts of {length} tokens")
        if window[0] in starts:
            pos += 1
            continue
        starts.add(window[0])
        out.append(window)
        pos += length
    return out


def measure(runner: bc.PipeRunner, prompt: list[int], tag: str) -> dict:
    request = {"id": tag, "tokens": prompt, "options": {"temperature": 0, "num_predict": 8}}
    reply = runner.complete(request)
    done = reply["done"]
    return {
        "ttft_s": reply["tokens"][0][0],
        "prompt_tokens": done["prompt_tokens"],
        "prompt_cached_tokens": done["prompt_cached_tokens"],
        "prompt_disk_tokens": done.get("prompt_disk_tokens", 0),
        "tokens": bc.flatten_ids(reply["tokens"]),
        "load": bc.machine_load(),
    }


def one_rep(model_args: list[str], prompt: list[int], tag: str, root: str) -> dict:
    """Cold on a first runner, then disk and memory on a second one, same directory."""
    directory = tempfile.mkdtemp(prefix=f"{tag}-", dir=root)
    args = [*model_args, "--cache-dir", directory]
    first = bc.PipeRunner(args, "disk-cache-cold.log")
    try:
        first.wait_ready()
        cold = measure(first, prompt, f"{tag}-cold")
    finally:
        first.close()  # exits once its writes are on disk
    second = bc.PipeRunner(args, "disk-cache-restart.log")
    try:
        second.wait_ready()
        disk = measure(second, prompt, f"{tag}-disk")
        memory = measure(second, prompt, f"{tag}-memory")
    finally:
        second.close()
    return {"cold": cold, "disk": disk, "memory": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir (default: embedded model)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--length", type=int, default=4000, help="prompt tokens")
    parser.add_argument("--out", default="disk_cache.json", help="file name under bench-results/")
    args = parser.parse_args()
    model = args.model or bc.default_model_path()
    model_args = ["--model", model]

    started = time.perf_counter()
    probe = bc.PipeRunner(model_args, "disk-cache-probe.log")
    try:
        ready = probe.wait_ready()
        corpus = probe.tokenize(bc.corpus_text())
    finally:
        probe.close()
    chosen = prompts(corpus, args.reps + 1, args.length)
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="disk-cache-bench-") as root:
        one_rep(model_args, chosen[-1], "warmup", root)  # untimed: first-call set-up
        for rep, prompt in enumerate(chosen[:-1]):
            result = one_rep(model_args, prompt, f"r{rep}", root)
            for kind in KINDS:
                runs[kind].append(result[kind])
            r = result
            print(
                f"rep {rep}: cold {r['cold']['ttft_s']:.3f} s, disk {r['disk']['ttft_s']:.3f} s "
                f"({r['disk']['prompt_disk_tokens']} from disk), memory "
                f"{r['memory']['ttft_s']:.3f} s, load {r['disk']['load']['loadavg_1m']:.2f}",
                file=sys.stderr,
            )
    report(args, model, ready, runs, time.perf_counter() - started)
    return 0


def report(args, model, ready, runs, elapsed) -> None:
    cold, disk, memory = (runs[k] for k in KINDS)
    medians = {k: bc.median([r["ttft_s"] for r in runs[k]]) for k in KINDS}
    paired = bc.median([d["ttft_s"] / c["ttft_s"] for c, d in zip(cold, disk, strict=True)])
    triples = zip(cold, disk, memory, strict=True)
    same = all(c["tokens"] == d["tokens"] == m["tokens"] for c, d, m in triples)
    ratio = medians["disk"] / medians["cold"]
    verdict = "meets" if ratio <= TARGET else "misses"
    rows = [
        [
            f"{medians['cold']:.3f}",
            f"{medians['disk']:.3f}",
            f"{ratio:.1%} ({verdict} <= {TARGET:.0%})",
            f"{paired:.1%}",
            f"{medians['memory']:.3f}",
            str(sorted({r["prompt_disk_tokens"] for r in disk})),
            "yes" if same else "NO",
        ]
    ]
    headers = [
        f"cold TTFT s (median of {args.reps})",
        "disk TTFT s",
        "disk / cold (medians)",
        "disk / cold (paired)",
        "memory TTFT s",
        "prompt_disk_tokens",
        "same 8 tokens",
    ]
    print()
    print(bc.markdown_table(headers, rows))
    print()
    loads = [r["load"] for kind in runs.values() for r in kind]
    print(f"prompts: {args.length} tokens, each cold once, then restored after a restart")
    print(bc.describe_load(loads))
    print(f"BLAS: {ready.get('blas')}; {ready.get('mtp_detail')}; {elapsed:.0f} s in all")
    summary = {
        "cold_ttft_s": medians["cold"],
        "disk_ttft_s": medians["disk"],
        "memory_ttft_s": medians["memory"],
        "disk_over_cold": ratio,
        "paired_disk_over_cold": paired,
        "same_tokens": same,
    }
    path = bc.write_json(
        args.out,
        {
            "model": model,
            "length": args.length,
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
