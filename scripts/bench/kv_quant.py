"""Quantized KV caches (``--kv-bits``) against float32 KV: memory, quality, speed.

For the default model (and, with ``--hybrid``, the Qwen3.5 hybrid fixture of the tests:
random float32 weights, one attention layer in four, so its row checks the hybrid path,
not a trained model's quality), one engine is loaded and tuned as the runner serves it, and
each configuration (float32 KV, 8 bits, 4 bits; groups of ``--group``) gets its own caches:

- memory: the full-attention caches' bytes per position after a ``--prompt``-token prefill
  (buffers hold whole 256-position steps), scaled to a ``--context``-token context (a
  multiple of the step, so the figure is what a prefill of that length holds);
- quality, teacher-forced: after the prompt (a chat turn: corpus text and a request to
  summarise it), ``--tokens`` greedy steps of float32 KV; each
  quantized configuration is fed the same tokens and its argmax compared at every step
  (agreement), with the mean and max |logit error| over every step and vocabulary entry;
- quality, free-running: its own greedy tokens, the fraction equal to float32 KV's position
  by position and the length of the common prefix;
- speed (default model): prefill of the prompt in 512-token chunks and the plain greedy
  decode steps, configurations interleaved ``--repeats`` times, medians and ratios.

Prints a markdown table, writes JSON under bench-results/. Usage:

    python scripts/bench/kv_quant.py [--hybrid] [--repeats 3] [--group 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

HYBRID = os.path.join(bc.ROOT, "tests", "fixtures", "reference", "hybrid", "qwen3_5_text")
CHUNK = 512


def load(path: str):
    from runner.engine import Engine, EngineOptions

    return Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))


def make_caches(engine, bits: int | None, group: int) -> list:
    from cache.kv_quantized import quantize_caches

    return quantize_caches(engine.model.make_caches(), bits, group)


def prefill(model, caches: list, tokens: list[int]):
    """The prompt in chunks; returns the last row's logits ``[V]``."""
    import mlx.core as mx

    for start in range(0, len(tokens), CHUNK):
        h = model.hidden(mx.array(tokens[start : start + CHUNK])[None], caches)
        mx.eval(h, [c.state for c in caches])
    logits = model.unembed(h[:, -1])[0]
    mx.eval(logits)
    return logits


def step(model, caches: list, token: int):
    import mlx.core as mx

    logits = model.unembed(model.hidden(mx.array([[token]]), caches)[:, -1])[0]
    mx.eval(logits)
    return logits


def kv_bytes_per_position(caches: list) -> float:
    from cache.kv import KVCache

    full = [c for c in caches if isinstance(c, KVCache) and c.keys is not None]
    return sum(c.nbytes for c in full) / full[0].keys.shape[2]


def greedy(model, caches: list, prompt: list[int], count: int, forced: list[int] | None = None):
    """Greedy tokens and the logits before each (fed ``forced`` tokens if given)."""
    import numpy as np

    logits = prefill(model, caches, prompt)
    tokens, rows = [], []
    for i in range(count):
        rows.append(np.asarray(logits))
        tokens.append(int(rows[-1].argmax()))
        logits = step(model, caches, forced[i] if forced else tokens[-1])
    return tokens, np.stack(rows)


def quality(engine, configs: list, prompt: list[int], count: int, group: int) -> dict:
    import numpy as np

    ref_tokens, ref_logits = greedy(engine.model, make_caches(engine, None, group), prompt, count)
    out = {}
    for bits in configs:
        caches = make_caches(engine, bits, group)
        forced, logits = greedy(engine.model, caches, prompt, count, forced=ref_tokens)
        free, _ = greedy(engine.model, make_caches(engine, bits, group), prompt, count)
        err = np.abs(logits - ref_logits)
        prefix = next(
            (i for i, (a, b) in enumerate(zip(free, ref_tokens, strict=True)) if a != b), count
        )
        out[bits] = {
            "bytes_per_position": kv_bytes_per_position(caches),
            "agreement": float(np.mean([a == b for a, b in zip(forced, ref_tokens, strict=True)])),
            "free_agreement": float(
                np.mean([a == b for a, b in zip(free, ref_tokens, strict=True)])
            ),
            "free_prefix": prefix,
            "logit_error_mean": float(err.mean()),
            "logit_error_max": float(err.max()),
        }
    ref = make_caches(engine, None, group)
    prefill(engine.model, ref, prompt)
    out[None] = {"bytes_per_position": kv_bytes_per_position(ref)}
    return out


def speed(engine, configs: list, prompt: list[int], count: int, group: int, repeats: int):
    import statistics

    runs: dict = {bits: {"prefill": [], "decode": []} for bits in configs}
    for _ in range(repeats):
        for bits in configs:
            caches = make_caches(engine, bits, group)
            start = time.perf_counter()
            logits = prefill(engine.model, caches, prompt)
            mid = time.perf_counter()
            token = int(logits.argmax().item())
            for _ in range(count):
                token = int(step(engine.model, caches, token).argmax().item())
            end = time.perf_counter()
            runs[bits]["prefill"].append(len(prompt) / (mid - start))
            runs[bits]["decode"].append(count / (end - mid))
    return {
        bits: {k: statistics.median(v) for k, v in r.items()} | {"runs": r}
        for bits, r in runs.items()
    }


CHAT = "<|im_start|>user\n{}\n\n{}<|im_end|>\n<|im_start|>assistant\n"
ASK = "Summarize the text above in a few sentences."


def prompt_tokens(engine, length: int) -> list[int]:
    """A chat turn of exactly ``length`` tokens: corpus text, then a request to summarise it
    (a prompt whose continuation is an answer, not the middle of a corpus sentence)."""
    text = bc.corpus_text()
    while len(engine.tokenize(text)) < length:
        text += "\n\n" + text
    words = text.split(" ")
    lo, hi = 0, len(words)
    while lo < hi:  # the most words whose chat turn fits
        mid = (lo + hi + 1) // 2
        if len(engine.tokenize(CHAT.format(" ".join(words[:mid]), ASK))) <= length:
            lo = mid
        else:
            hi = mid - 1
    ids = engine.tokenize(CHAT.format(" ".join(words[:lo]), ASK))
    return ids[:1] * (length - len(ids)) + ids  # pad with the first token up to the length


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4000)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hybrid", action="store_true", help="the hybrid fixture too (groups of 32)")
    args = p.parse_args()
    configs = [None, 8, 4]
    engine = load(bc.default_model_path())
    prompt = prompt_tokens(engine, args.prompt)
    results = {"environment": bc.environment(), "args": vars(args)}
    qual = quality(engine, [8, 4], prompt, args.tokens, args.group)
    fast = speed(engine, configs, prompt, args.tokens, args.group, args.repeats)
    rows = []
    base = qual[None]["bytes_per_position"]
    for bits in configs:
        q, s = qual[bits], fast[bits]
        rows.append(
            [
                "float32" if bits is None else f"{bits} bits",
                f"{q['bytes_per_position'] * args.context / 2**20:.0f} MiB",
                f"{q['bytes_per_position'] / base:.3f}",
                "-" if bits is None else f"{q['agreement']:.3f}",
                "-" if bits is None else f"{q['free_agreement']:.3f} ({q['free_prefix']})",
                "-"
                if bits is None
                else f"{q['logit_error_mean']:.4f} / {q['logit_error_max']:.3f}",
                f"{s['prefill']:.0f} ({s['prefill'] / fast[None]['prefill']:.2f}x)",
                f"{s['decode']:.1f} ({s['decode'] / fast[None]['decode']:.2f}x)",
            ]
        )
    headers = [
        "KV",
        f"KV at {args.context}",
        "ratio",
        f"agreement ({args.tokens}, forced)",
        "free-running (prefix)",
        "logit error mean / max",
        "prefill tok/s",
        "decode tok/s",
    ]
    print(f"default model, {args.prompt}-token prompt, groups of {args.group}")
    print(bc.markdown_table(headers, rows))
    results["default"] = {"quality": {str(k): v for k, v in qual.items()}}
    results["default"]["speed"] = {str(k): v for k, v in fast.items()}
    if args.hybrid:
        hybrid = load(HYBRID)
        vocab = hybrid.info.vocab_size
        tokens = [(i * 7919 + 13) % (vocab - 3) + 3 for i in range(args.prompt)]
        hq = quality(hybrid, [8, 4], tokens, args.tokens, 32)
        hrows = [
            [
                f"{bits} bits",
                f"{hq[bits]['bytes_per_position'] / hq[None]['bytes_per_position']:.3f}",
                f"{hq[bits]['agreement']:.3f}",
                f"{hq[bits]['free_agreement']:.3f} ({hq[bits]['free_prefix']})",
                f"{hq[bits]['logit_error_mean']:.4f} / {hq[bits]['logit_error_max']:.3f}",
            ]
            for bits in (8, 4)
        ]
        print("\nhybrid fixture (random weights), groups of 32")
        print(bc.markdown_table(headers[:1] + headers[2:6], hrows))
        results["hybrid"] = {str(k): v for k, v in hq.items()}
    print(bc.describe_load([bc.machine_load()]))
    print(bc.write_json("kv_quant", results))


if __name__ == "__main__":
    main()
