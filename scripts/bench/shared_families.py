"""Shared forwards for the families with per-sequence state beyond a plain cache: a
sliding-window model and the Qwen3.5 hybrid, several requests at once against the same
requests served one at a time (what ``--parallel`` gave these families before they took
shared forwards).

Two random checkpoints, each quantized to 4 bits at load (``--quantize q4``, the CPU's
quantized panels):

- sliding: a Qwen2 of SmolLM2-135M's shape (576 wide, 30 layers, 9 / 3 heads, FFN 1536; the
  test tokenizer's 320 tokens) whose layers slide over a 128-token window except every
  fourth (Gemma 3's and Qwen2's interleaving);
- hybrid: ``scripts/bench/hybrid.py``'s Qwen3.5 of the 0.8B shape (24 layers, every 4th gated
  full attention, Gated DeltaNet on the others).

For each model, one process and one engine (``--parallel N``); N greedy requests of
``--decode`` tokens, each on a prompt of its own, are served in turn by the two sides,
alternating, after an untimed warm-up of each: **shared**, all admitted at once to the
scheduler (shared forwards), and **one at a time**, each run to its end before the next.
Both give the same tokens (the tests pin it); reported: aggregate tokens/s (every token over
the wall time, prefill included) and the ratio, medians over ``--reps``. Usage:

    python scripts/bench/shared_families.py [--reps 3] [--decode 64] [--streams 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import common as bc  # noqa: E402
import hybrid  # noqa: E402

SLIDING_DIR = os.path.join(bc.RESULTS_DIR, "sliding-135m-random")
WINDOW = 128


def sliding_checkpoint(directory: str) -> str:
    """The random sliding-window checkpoint (written once)."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    from tests.checkpoints import write_checkpoint

    print(f"writing a random sliding-window model to {directory} ...", file=sys.stderr)
    layers = 30
    return write_checkpoint(
        directory,
        "qwen2",
        tokenizer_vocab=320,
        hidden_size=576,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        sliding_window=WINDOW,
        use_sliding_window=True,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)
        ],
    )


def requests(streams: int, decode: int, vocab: int, speculative: bool) -> list:
    from protocol.requests import Completion, Options

    return [
        Completion(
            id=f"r{i}",
            tokens=[(37 * i + 11 * j) % (vocab - 10) + 5 for j in range(48 + 8 * i)],
            options=Options(temperature=0.0, num_predict=decode, repeat_penalty=1.0),
            speculative=speculative,
        )
        for i in range(streams)
    ]


def serve(engine, reqs, shared: bool) -> tuple[int, float]:
    """Tokens generated and wall seconds for ``reqs``, all at once or one after another."""
    from runner.batch import Scheduler

    counts = {r.id: 0 for r in reqs}

    def collector(rid: str):
        def emit(frame) -> None:
            counts[rid] += len(getattr(frame, "tokens", ()) or ())

        return emit

    start = time.perf_counter()
    if shared:
        scheduler = Scheduler(engine)
        for r in reqs:
            scheduler.admit(engine.prepare(r), collector(r.id), lambda: False)
        while scheduler.active:
            scheduler.step()
    else:
        for r in reqs:
            engine.run(engine.prepare(r), collector(r.id), lambda: False)
    return sum(counts.values()), time.perf_counter() - start


def measure(name: str, path: str, args) -> dict:
    """Each side's median aggregate rate, plain (``speculative: false``) and speculating
    (random weights repeat themselves, so the suffix drafter finds long drafts)."""
    from runner.engine import Engine, EngineOptions

    engine = Engine(EngineOptions(model_path=path, parallel=args.streams, quantize=4))
    if engine.parallel != args.streams:
        raise SystemExit(f"{name}: {engine.parallel_detail}")
    result = {}
    for speculative in (False, True):
        reqs = requests(args.streams, args.decode, engine.info.vocab_size, speculative)
        rates: dict[str, list[float]] = {"shared": [], "one at a time": []}
        for rep in range(args.reps + 1):
            for shared in [True, False] if rep % 2 else [False, True]:
                n, seconds = serve(engine, reqs, shared)
                if rep:  # the first round warms both sides up
                    rates["shared" if shared else "one at a time"].append(n / seconds)
        medians = {side: statistics.median(values) for side, values in rates.items()}
        medians["ratio"] = medians["shared"] / medians["one at a time"]
        result["speculating" if speculative else "plain"] = medians
        print(f"{name} speculative={speculative}: {medians}", file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="timed runs per side")
    parser.add_argument("--decode", type=int, default=64, help="tokens per request")
    parser.add_argument("--streams", type=int, default=4, help="requests at once")
    parser.add_argument("--only", choices=("sliding", "hybrid"), help="one model only")
    parser.add_argument("--out", default="shared_families.json", help="file under bench-results/")
    args = parser.parse_args()
    models = {
        "sliding": lambda: sliding_checkpoint(SLIDING_DIR),
        "hybrid": lambda: hybrid.make_checkpoint(hybrid.DEFAULT_DIR),
    }
    results = {}
    for name, make in models.items():
        if args.only in (None, name):
            results[name] = measure(name, make(), args)
    rows = [
        [name, mode, f"{r['shared']:.1f}", f"{r['one at a time']:.1f}", f"{r['ratio']:.2f}x"]
        for name, modes in results.items()
        for mode, r in modes.items()
    ]
    headers = ["model", "decoding", "shared tok/s", "one at a time tok/s", "ratio"]
    print(bc.markdown_table(headers, rows))
    bc.write_json(args.out, {"streams": args.streams, "decode": args.decode, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
