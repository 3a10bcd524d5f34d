#!/usr/bin/env python
"""Constrained decoding (``format``) against unconstrained decoding on the same prompts.

For each of the ``tests/test_format.py`` schemas, one greedy completion of the default model
(the schema in the prompt, ``--tokens`` at most) constrained, then unconstrained for as many
tokens, plain and with speculation (the default head: drafts through the matcher's masks, the
verify rows masked), and speculation again with grammar-forced tokens drafted from the head
like any other instead of as they are, in turn per rep, so a drift of this shared machine's
speed hits all alike. Reported: decode tokens/s
(the done frame's ``eval_tokens / eval_ns``, medians over prompts and reps), the constrained /
free ratio per mode, and the matcher's CPU time per token (mask + consume: it overlaps the
forward, so it costs only what exceeds the forward's time), and under speculation the drafts'
acceptance (accepted / drafted) on the constrained runs. Prints a table, writes JSON under
bench-results/.

    .venv/bin/python scripts/bench/format.py [--reps 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common as bc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF or HF dir (default: embedded model)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out", default="format.json")
    args = p.parse_args(argv)

    from protocol.requests import Completion, Options
    from runner import constraint
    from runner.engine import Engine, EngineOptions
    from tests.test_format import SCHEMAS

    model = args.model or bc.default_model_path()
    speculative = Engine(EngineOptions(model_path=model))
    engines = {
        "plain": Engine(EngineOptions(model_path=model, use_draft=False)),
        "speculative": speculative,
        "speculative, forced tokens drafted by the head": speculative,
    }
    drafted: dict[str, list[int]] = {mode: [0, 0] for mode in engines}
    spent = {"mask": 0.0, "consume": 0.0, "tokens": 0}
    mask, consume = constraint.Constraint.mask, constraint.Constraint.consume

    def timed_mask(self):
        t0 = time.perf_counter()
        try:
            return mask(self)
        finally:
            spent["mask"] += time.perf_counter() - t0

    def timed_consume(self, token):
        t0 = time.perf_counter()
        try:
            return consume(self, token)
        finally:
            spent["consume"] += time.perf_counter() - t0
            spent["tokens"] += 1

    constraint.Constraint.mask, constraint.Constraint.consume = timed_mask, timed_consume

    def rate(engine, topic: str, schema, constrained: bool, tokens: int, mode: str = ""):
        ask = f"Reply with JSON only matching this JSON Schema: {json.dumps(schema)}."
        text = f"{ask} Give {topic}."
        request = Completion(
            id="b",
            messages=[{"role": "user", "content": text}],
            format=schema if constrained else None,
            options=Options(num_predict=tokens, temperature=0, repeat_penalty=1.0),
        )
        frames: list = []
        engine.speculation.forced_drafts = "by the head" not in mode
        engine.run(engine.prepare(request), frames.append, lambda: False)
        engine.speculation.forced_drafts = True
        done = frames[-1]
        if constrained and mode:
            drafted[mode][0] += done.speculation.accepted
            drafted[mode][1] += done.speculation.drafted
        return done.eval_tokens / max(done.eval_ns, 1) * 1e9, done.eval_tokens

    samples: dict[tuple[str, bool], list[float]] = {}
    ratios: dict[str, list[float]] = {mode: [] for mode in engines}
    loads = []
    for rep in range(args.reps):
        for topic, schema in SCHEMAS:
            loads.append(bc.machine_load())
            for mode, engine in engines.items():
                # The free run decodes as many tokens as the constrained one did (a JSON answer
                # ends early; per-request costs weigh more on a short run).
                bound, n = rate(engine, topic, schema, True, args.tokens, mode)
                free, _ = rate(engine, topic, schema, False, n, mode)
                samples.setdefault((mode, False), []).append(free)
                samples.setdefault((mode, True), []).append(bound)
                ratios[mode].append(bound / free)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    rows = []
    for mode in engines:
        free = statistics.median(samples[(mode, False)])
        bound = statistics.median(samples[(mode, True)])
        accepted, total = drafted[mode]
        acceptance = f"{accepted / total:.2f} ({accepted}/{total})" if total else "-"
        rows.append(
            [
                mode,
                f"{free:.1f}",
                f"{bound:.1f}",
                f"{statistics.median(ratios[mode]):.2f}",
                acceptance,
            ]
        )
    per_token_us = 1e6 * (spent["mask"] + spent["consume"]) / max(spent["tokens"], 1)
    print("\nGreedy decode tokens/s, medians over prompts and reps")
    headers = ["mode", "unconstrained", "constrained", "constrained / free", "acceptance"]
    print(bc.markdown_table(headers, rows))
    print(f"\nmatcher per token: {per_token_us:.0f} us (mask and consume, overlapping the forward)")
    print(f"load: {bc.describe_load(loads)}")
    out = bc.write_json(
        args.out,
        {
            "model": model,
            "reps": args.reps,
            "tokens": args.tokens,
            "rates": {f"{m}/{'constrained' if c else 'free'}": v for (m, c), v in samples.items()},
            "ratios": ratios,
            "matcher_us_per_token": per_token_us,
            "load": loads,
            "drafted": drafted,
            "environment": bc.environment(),
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
