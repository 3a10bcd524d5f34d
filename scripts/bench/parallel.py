"""Concurrent greedy streams: the runner's continuous batching against mlx-lm's batch_generate.

For 1, 2, 4 and 8 streams, that many completions of ``--decode`` tokens are sent at once
through the pipe to one runner (``--parallel 8``, so all of them decode together), each on a
prompt of its own (a unique first line: no prefix-cache hits between them). Reported:

- aggregate tokens/s: every stream's tokens over the wall time from the sends to the last
  done frame (prefill included, as a host sees it);
- per-stream tokens/s: the median of the streams' own decode rates (tokens after the first
  over the time between their first and last arrival);
- newcomer TTFT: with N - 1 streams decoding, one more request is sent; its time to first
  token over the same request's time to first token on an idle runner (median of the runs).

Three runner sides take turns: the default (a lone stream speculates with the shipped head
and the suffix drafter; shared forwards carry suffix drafts where they pay), parked
(``--shared-draft-rows 0``: shared forwards feed one row a stream) and ``--no-draft`` (plain
decoding throughout). mlx-lm's ``batch_generate`` runs the same prompts on the same float32
weights from its own venv (.venv-bench, as scripts/bench/decode.py makes it).

``--mix prose`` gives every stream a story to continue; ``--mix quoting`` gives every other
stream a listing to copy (its answer quotes its prompt), the rest stories. Usage:

    python scripts/bench/parallel.py [--reps 3] [--decode 128] [--streams 1,2,4,8] [--mix M]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

# Prose the model continues at length (scripts/bench/decode.py), behind a unique first line.
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "lantern, a thermos of tea and a notebook in which he recorded the weather, the ships "
    "that passed and the birds that rested on the railing. Over forty years the notebooks "
    "filled three shelves of his small cottage, and when the historians from the university "
    "finally came to read them, they found"
)
TOPICS = [
    "harbour",
    "orchard",
    "glacier",
    "market",
    "library",
    "desert",
    "river",
    "forest",
    "valley",
    "island",
]
RUNNER_SIDES = {
    "runner (default)": [],
    "runner (parked)": ["--shared-draft-rows", "0"],
    "runner (no head)": ["--no-draft"],
}
PLAIN = "runner (no head)"
MLX_LM = "mlx-lm batch_generate"
MIX = {"quoting": False}  # set by --mix
# Functions whose source a quoting stream copies (the standard library's, so every machine
# has the same text).
LISTINGS = ("textwrap.indent", "shlex.quote", "string.capwords", "textwrap.shorten")


def prompt_text(tag: str, i: int) -> str:
    if MIX["quoting"] and i % 2 == 0:
        module, _, name = LISTINGS[i // 2 % len(LISTINGS)].rpartition(".")
        source = inspect.getsource(getattr(__import__(module), name))
        return f"Listing {tag}-{i}.\n```python\n{source}```\nThe listing again, unchanged:\n"
    return f"Story {tag}-{i} about the {TOPICS[i % len(TOPICS)]}.\n{TEXT}"


# ----------------------------------------------------------------------------- runner side
class Streams(bc.PipeRunner):
    """Several completions in flight on one runner; frames timestamped when read."""

    def send(self, rid: str, tokens: list[int], n: int) -> float:
        options = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": n}
        line = {"type": "completion", "id": rid, "tokens": tokens, "options": options}
        self.proc.stdin.write(json.dumps(line).encode() + b"\n")
        self.proc.stdin.flush()
        return time.perf_counter()

    def collect(self, ids: set[str], until=None) -> dict[str, dict]:
        """Read frames until every id in ``ids`` is done (or ``until(streams)`` says stop)."""
        out = {rid: {"tokens": [], "done": None} for rid in ids}
        while any(v["done"] is None for v in out.values()):
            raw = self.proc.stdout.readline()
            if not raw:
                raise RuntimeError("runner exited mid-run")
            now = time.perf_counter()
            frame = json.loads(raw)
            entry = out.get(frame.get("id"))
            if entry is None:
                continue
            if frame["type"] == "token":
                entry["tokens"].append((now, frame["tokens"]))
            elif frame["type"] == "done":
                entry["done"] = (now, frame)
            elif frame["type"] == "error":
                raise RuntimeError(f"runner refused or failed a request: {frame}")
            if until is not None and until(out):
                return out
        return out


def runner_round(side: Streams, n: int, decode: int, tag: str) -> dict:
    prompts = {f"{tag}-{i}": side.tokenize(prompt_text(tag, i)) for i in range(n)}
    start = time.perf_counter()
    sent = {rid: side.send(rid, p, decode) for rid, p in prompts.items()}
    out = side.collect(set(prompts))
    end = max(v["done"][0] for v in out.values())
    total = sum(len(ids) for v in out.values() for _, ids in v["tokens"])
    rates = [
        bc.interval_rate([(t - sent[r], ids) for t, ids in v["tokens"]]) for r, v in out.items()
    ]
    return {
        "aggregate": total / (end - start),
        "per_stream": bc.median(rates),
        "tokens": total,
        "ids": {r: bc.flatten_ids(v["tokens"]) for r, v in out.items()},
    }


def newcomer_ttft(side: Streams, n: int, decode: int, tag: str) -> dict:
    """TTFT of one request sent while ``n - 1`` others decode, and alone."""
    newcomer = side.tokenize(prompt_text(f"{tag}-new", 0))
    solo_prompt = side.tokenize(prompt_text(f"{tag}-solo", 0))
    t0 = side.send(f"{tag}-solo", solo_prompt, 4)
    solo = side.collect({f"{tag}-solo"})[f"{tag}-solo"]
    solo_ttft = solo["tokens"][0][0] - t0
    others = {f"{tag}-o{i}": side.tokenize(prompt_text(tag, i)) for i in range(n - 1)}
    for rid, p in others.items():
        side.send(rid, p, decode)
    ids = set(others) | {f"{tag}-new"}
    if others:  # wait until every other stream decodes
        side.collect(ids, until=lambda out: all(len(out[r]["tokens"]) >= 8 for r in others))
    t1 = side.send(f"{tag}-new", newcomer, 4)
    out = side.collect(ids)
    ttft = out[f"{tag}-new"]["tokens"][0][0] - t1
    return {"ttft": ttft, "solo_ttft": solo_ttft, "ratio": ttft / solo_ttft}


def rate_while_prefilling(side: Streams, n: int, decode: int, tag: str, long: list[int]) -> dict:
    """The decode rate of ``n - 1`` streams while a long prompt is admitted (from its send to
    its first token), against their rate just before it was sent (once all of them decode)."""
    others = {f"{tag}-p{i}": side.tokenize(prompt_text(f"{tag}-p", i)) for i in range(n - 1)}
    for rid, p in others.items():
        side.send(rid, p, decode)
    ids = set(others) | {f"{tag}-long"}
    out = side.collect(ids, until=lambda o: all(len(o[r]["tokens"]) >= 24 for r in others))
    sent = side.send(f"{tag}-long", long, 2)
    rest = side.collect(ids)
    first = rest[f"{tag}-long"]["tokens"][0][0]
    span = first - sent
    arrivals = [t for r in others for t, _ in out[r]["tokens"] + rest[r]["tokens"]]
    settled = max(out[r]["tokens"][7][0] for r in others)  # every stream decoding by then
    during = sum(sent <= t < first for t in arrivals) / span
    before = sum(settled <= t < sent for t in arrivals) / (sent - settled)
    return {"during": during, "before": before, "share": during / before, "ttft_s": span}


# ----------------------------------------------------------------------------- mlx-lm side
def mlx_lm_worker(hf_dir: str) -> None:
    """Runs inside .venv-bench: mlx-lm's batch_generate on its own model code."""
    blas = bc.preload_runner_blas()
    import importlib.metadata

    import mlx.core as mx
    from mlx_lm import batch_generate, load

    model, tokenizer = load(hf_dir)

    def handle(command: dict) -> dict:
        t0 = time.perf_counter()
        response = batch_generate(
            model,
            tokenizer,
            command["prompts"],
            max_tokens=command["max_tokens"],
            return_token_ids=True,
        )
        wall = time.perf_counter() - t0
        ids = [list(map(int, t)) for t in getattr(response, "token_ids", None) or []]
        total = sum(len(t) for t in ids) if ids else None
        return {
            "wall": wall,
            "ids": ids,
            "total": total,
            "generation_tps": getattr(response.stats, "generation_tps", None),
        }

    info = {
        "blas": blas.blas_in_use(),
        "mlx": mx.__version__,
        "mlx_lm": importlib.metadata.version("mlx-lm"),
    }
    bc.serve_worker(info, handle)


def mlx_lm_round(worker: bc.Worker, tokenize, n: int, decode: int, tag: str) -> dict:
    prompts = [tokenize(prompt_text(tag, i)) for i in range(n)]
    reply = worker.call({"prompts": prompts, "max_tokens": decode})
    total = reply["total"] if reply["total"] is not None else n * decode
    return {
        "aggregate": total / reply["wall"],
        "per_stream": total / n / reply["wall"],
        "tokens": total,
        "ids": reply["ids"],
    }


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--decode", type=int, default=128, help="tokens per stream")
    parser.add_argument("--streams", default="1,2,4,8", help="stream counts")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm side")
    parser.add_argument(
        "--mix", choices=("prose", "quoting"), default="prose", help="the streams' prompts"
    )
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=1500,
        help="tokens of the prompt admitted while 3 streams decode",
    )
    parser.add_argument("--out", default="parallel.json", help="file name under bench-results/")
    parser.add_argument("--mlx-lm-worker", metavar="HF_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlx_lm_worker:
        mlx_lm_worker(args.mlx_lm_worker)
        return 0
    counts = [int(c) for c in args.streams.split(",")]
    MIX["quoting"] = args.mix == "quoting"
    model = bc.default_model_path()
    most = max(counts)
    sides: dict = {}
    for name, flags in RUNNER_SIDES.items():
        sides[name] = Streams(
            ["--model", model, "--parallel", str(most), *flags], f"parallel-{len(sides)}.log"
        )
        sides[name].wait_ready()
    tokenize = sides[PLAIN].tokenize
    if not args.no_mlx_lm:
        import decode
        import export_hf

        hf_dir = export_hf.ensure_export_in_child(model)
        python = decode.ensure_bench_venv()
        env = dict(os.environ, PYTHONPATH=bc.ROOT)
        here = os.path.abspath(__file__)
        sides[MLX_LM] = bc.Worker(
            [python, here, "--mlx-lm-worker", hf_dir], "parallel-mlx-lm.log", env=env
        )
    runs: dict = {name: {n: [] for n in counts} for name in sides}
    ttft: dict = {name: {n: [] for n in counts} for name in RUNNER_SIDES}
    shares: dict = {name: [] for name in RUNNER_SIDES}
    corpus = bc.corpus_text()[: 12 * args.long_prompt]
    started = time.perf_counter()
    try:
        for name in RUNNER_SIDES:  # untimed: compiled shapes, first-call allocations
            runner_round(sides[name], most, 8, "warm")
        if MLX_LM in sides:
            mlx_lm_round(sides[MLX_LM], tokenize, most, 8, "warm")
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for n in counts:
                for name in order:
                    tag = f"r{rep}n{n}"
                    if name == MLX_LM:
                        r = mlx_lm_round(sides[name], tokenize, n, args.decode, tag)
                    else:
                        r = runner_round(sides[name], n, args.decode, tag)
                        ttft[name][n].append(newcomer_ttft(sides[name], n, args.decode, tag))
                    runs[name][n].append(r)
                    if name != MLX_LM and n == 4:
                        long = tokenize(f"Run {tag}.\n{corpus}")[: args.long_prompt]
                        shares[name].append(rate_while_prefilling(sides[name], 4, 512, tag, long))
                    line = f"rep {rep} {name:22s} {n} streams: {r['aggregate']:6.1f} tok/s"
                    print(f"{line} aggregate, {r['per_stream']:5.1f} per stream", file=sys.stderr)
    finally:
        for side in sides.values():
            side.close()
    report(args, counts, runs, ttft, shares, time.perf_counter() - started)
    return 0


def report(args, counts, runs, ttft, shares, elapsed) -> None:
    rows, summary = [], {}
    plain = bc.median([r["aggregate"] for r in runs[PLAIN][counts[0]]])
    for name, by_n in runs.items():
        one = bc.median([r["aggregate"] for r in by_n[counts[0]]])
        for n in counts:
            agg = bc.median([r["aggregate"] for r in by_n[n]])
            per = bc.median([r["per_stream"] for r in by_n[n]])
            t = ttft.get(name, {}).get(n, [])
            ratio = bc.median([x["ratio"] for x in t]) if t else float("nan")
            rows.append(
                [
                    name,
                    n,
                    f"{agg:.1f}",
                    f"{per:.1f}",
                    f"{agg / one:.2f}x",
                    "-" if name == MLX_LM else f"{agg / plain:.2f}x",
                    "-" if not t else f"{ratio:.2f}x",
                ]
            )
            summary[f"{name} / {n}"] = {
                "aggregate": agg,
                "per_stream": per,
                "vs_one": agg / one,
                "vs_plain_one": agg / plain,
                "ttft_ratio": ratio,
            }
    print(
        bc.markdown_table(
            [
                "side",
                "streams",
                "aggregate tok/s",
                "per-stream tok/s",
                "aggregate / 1 stream",
                f"aggregate / 1 stream of {PLAIN}",
                "newcomer TTFT / solo",
            ],
            rows,
        )
    )
    for name, got in shares.items():
        if got:
            share = bc.median([g["share"] for g in got])
            ttft_s = bc.median([g["ttft_s"] for g in got])
            long = f"a {args.long_prompt}-token prompt"
            print(
                f"{name}: 3 streams keep {share:.2f}x their rate while {long} prefills "
                f"(its TTFT {ttft_s:.2f} s)"
            )
    path = bc.write_json(
        args.out,
        {
            "streams": counts,
            "decode": args.decode,
            "mix": args.mix,
            "reps": args.reps,
            "summary": summary,
            "runs": {k: {str(n): v for n, v in by.items()} for k, by in runs.items()},
            "ttft": {k: {str(n): v for n, v in by.items()} for k, by in ttft.items()},
            "prefill_share": shares,
            "elapsed_s": elapsed,
            "environment": bc.environment(),
        },
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
