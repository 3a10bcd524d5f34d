"""Plain versus speculative decoding on the default model, in one run.

For each sampling mode (greedy, temperature 0.7) and each of 10 prompts, the same engine serves
the prompt once with `speculative: false` and once with speculation (adaptive depth unless
--depth is given), interleaved, the arm that goes first alternating from prompt to prompt.
Decode speed is eval_tokens / eval_ns from the done frames. Prints tokens/s, the ratio,
acceptance per draft position (position 1 counted, deeper ones the controller's running
estimate) and the depths the controller chose, and writes JSON under bench-results/.

    python scripts/bench/spec.py                 # the shipped head (or --draft DIR)
    python scripts/bench/spec.py --random-head   # a useless head: the controller must park
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "What are the main causes of climate change?",
    "Describe your ideal weekend in detail.",
    "Give me a recipe for pancakes.",
    "Write a letter to a friend about a recent trip to the mountains.",
    "Explain the difference between a list and a tuple in Python.",
    "What should I consider when buying a laptop?",
    "Write a poem about the city at night.",
]
# The head is trained on the target's unpenalised distribution, so the two main modes turn
# the repeat penalty off; "greedy+rp" keeps Ollama's default repeat_penalty 1.1, which moves
# the target's argmax away from what the head learned (the draft is penalised the same way);
# "defaults" is a request that sets no sampling option but the seed (temperature 0.8, top-k
# 40, top-p 0.9, repeat penalty 1.1 over 64 tokens).
MODES = {
    "greedy": {"temperature": 0.0, "repeat_penalty": 1.0},
    "T=0.7": {"temperature": 0.7, "seed": 1, "repeat_penalty": 1.0},
    "T=1.0": {"temperature": 1.0, "seed": 1, "repeat_penalty": 1.0},
    "greedy+rp": {"temperature": 0.0},
    "defaults": {"seed": 1},
}


def random_head_dir(loaded) -> str:
    """A head with random weights (drafts are almost never accepted)."""
    from tests.heads import write_head

    return write_head(tempfile.mkdtemp(prefix="random-head-"), loaded)


def run_one(engine, prompt: str, speculative: bool, tokens: int, sampling: dict):
    from protocol.requests import Completion, Options

    frames: list = []
    request = Completion(
        id="b",
        prompt=CHAT.format(prompt),
        speculative=speculative,
        options=Options(num_predict=tokens, **sampling),
    )
    engine.run(engine.prepare(request), frames.append, lambda: False)
    done = frames[-1]
    ids = [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]
    return done, ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None, help="head sidecar (default: the shipped one)")
    parser.add_argument("--random-head", action="store_true")
    parser.add_argument("--depth", type=int, default=None, help="fixed depth (default adaptive)")
    parser.add_argument("--weight-layout", default="auto", help="as the runner's option")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--modes", default="greedy,T=0.7", help=f"comma list of {list(MODES)}")
    parser.add_argument("--out", default=None, help="where to write the JSON report")
    args = parser.parse_args()

    from runner.default_model import ensure_default_model
    from runner.engine import Engine, EngineOptions

    model = args.model or ensure_default_model()
    draft = args.draft
    if args.random_head:
        from runner.loader import load_model

        draft = random_head_dir(load_model(model))
    engine = Engine(
        EngineOptions(
            model_path=model,
            draft_path=draft,
            draft_depth=args.depth,
            weight_layout=args.weight_layout,
        )
    )
    if engine.head is None:
        print(f"no draft head: {engine.info.mtp_detail}", file=sys.stderr)
        return 1
    print(f"head: {engine.info.mtp_detail}")
    print(f"machine load: {os.getloadavg()}")
    # Warm up both paths once (kernels, allocator) before measuring.
    run_one(engine, "Hello!", False, 8, {"temperature": 0.0})
    run_one(engine, "Hello!", True, 8, {"temperature": 0.0})

    print(f"tuning: {engine.info.tuning}")
    report: dict = {
        "head": engine.info.mtp_detail,
        "tuning": engine.info.tuning,
        "tokens": args.tokens,
        "modes": {},
    }
    rows = []
    for mode in args.modes.split(","):
        sampling = MODES[mode]
        plain_t = plain_n = spec_t = spec_n = 0
        ratios, same, per_prompt = [], 0, []
        rounds = drafted = accepted = 0
        histogram: list[int] = []
        depths = []
        t0 = time.time()
        for i, prompt in enumerate(PROMPTS[: args.prompts]):
            # Alternate which arm goes first, so a slow drift of this shared machine's speed
            # falls on both arms alike.
            if i % 2 == 0:
                done_p, ids_p = run_one(engine, prompt, False, args.tokens, sampling)
                done_s, ids_s = run_one(engine, prompt, True, args.tokens, sampling)
            else:
                done_s, ids_s = run_one(engine, prompt, True, args.tokens, sampling)
                done_p, ids_p = run_one(engine, prompt, False, args.tokens, sampling)
            same += ids_p == ids_s
            plain_t += done_p.eval_ns
            plain_n += done_p.eval_tokens
            spec_t += done_s.eval_ns
            spec_n += done_s.eval_tokens
            tps_p = done_p.eval_tokens / done_p.eval_ns * 1e9
            tps_s = done_s.eval_tokens / done_s.eval_ns * 1e9
            ratios.append(tps_s / tps_p)
            sp = done_s.speculation
            rounds += sp.rounds
            drafted += sp.drafted
            accepted += sp.accepted
            for a, n in enumerate(sp.accepted_per_depth):
                histogram.extend([0] * (a + 1 - len(histogram)))
                histogram[a] += n
            depths.append(sp.final_depth)
            per_prompt.append({"plain_tps": tps_p, "spec_tps": tps_s, "depth": sp.final_depth})
            print(
                f"  {mode:7s} plain {tps_p:6.2f} tok/s  spec {tps_s:6.2f} tok/s  "
                f"x{tps_s / tps_p:.2f}  depth {sp.final_depth}  {prompt[:40]}"
            )
        plain_tps = plain_n / plain_t * 1e9
        spec_tps = spec_n / spec_t * 1e9
        # Position 1 is exact from the round histogram (every round drafts it). Deeper positions
        # come from the controller, which knows each round's depth (the histogram does not:
        # a depth-1 round that accepted its draft never tried a second one).
        first = 1.0 - histogram[0] / rounds if rounds else None
        position = [first, *engine.speculation.depth.state()["acceptance"][1:]]
        while position and position[-1] is None:
            position.pop()
        result = {
            "plain_tps": plain_tps,
            "spec_tps": spec_tps,
            "ratio": spec_tps / plain_tps,
            "median_prompt_ratio": statistics.median(ratios),
            "identical_outputs": same,
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "accepted_per_round_histogram": histogram,
            "acceptance_by_position": position,
            "final_depths": depths,
            "controller": engine.speculation.depth.state(),
            "seconds": time.time() - t0,
            "prompts": per_prompt,
        }
        report["modes"][mode] = result
        rows.append((mode, result))

    print()
    print(
        "| mode | plain tok/s | speculative tok/s | ratio | median prompt ratio "
        "| acceptance by position | depths |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        print(
            f"| {mode} | {r['plain_tps']:.2f} | {r['spec_tps']:.2f} | {r['ratio']:.2f}x | "
            f"{r['median_prompt_ratio']:.2f}x | "
            f"{acc} | {sorted(set(r['final_depths']))} |"
        )
    out = args.out or os.path.join(
        ROOT, "bench-results", "spec-random.json" if args.random_head else "spec.json"
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
