"""Quantizing a float checkpoint at load: decode speed and weight memory of float32 against
``--quantize q4`` and ``q8`` (``EngineOptions.quantize``: affine, groups of 64, into
runner.native's quantized panels), on two random checkpoints:

- ``hybrid``: a Qwen3.5 of the 0.8B shape, made by scripts/bench/hybrid.py's generator; with
  ``--shape 0.8b`` (the default) at the family's full 248,320-token vocabulary (the tied
  embedding is then a third of the weights), with ``--shape bench`` at hybrid.py's 32k;
- ``moe``: scripts/bench/moe.py's qwen3_moe (64 experts of width 272, 8 routed); its routed
  experts (SwitchLinear stacks) are not quantized, so they stay float32.

Each configuration is an Engine in a child process of its own (the engine is process-wide),
loaded once (prefix cache and draft head off), warmed up by one short untimed run; then
``--rounds`` rounds run every configuration of a model in turn, the order reversed every other
round so a drift of the machine's speed falls on all alike. A run is a greedy plain decode of
``--tokens`` tokens after a 16-token prompt; its speed is the done frame's eval_tokens over
eval_ns. Tables show medians; the speed ratio is the median of per-round ratios. Memory is
``engine.info.weights_bytes`` beside the weights held counted here with views once (see
``weight_kinds``), split into quantized panels and what stayed float; a tied float embedding
is held twice, as the lookup table and the output product's ``[D, V]`` copy, a quantized one
once, its panels serving both. Cross-checks: MLX's active memory after load, and the child's
peak resident size (loading reads the float weights first).
Usage:

    python scripts/bench/quantize.py [--rounds 3] [--tokens 64] [--models hybrid,moe]
                                     [--configs float32,q4,q8] [--shape 0.8b|bench] [--dir DIR]

Writes bench-results/quantize.json (``--out``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402
import hybrid  # noqa: E402
import moe  # noqa: E402

QWEN3_5_VOCAB = 248320  # the Qwen3.5 family's vocabulary (hybrid.py cuts it to 32k)
SHAPES = {"0.8b": QWEN3_5_VOCAB, "bench": hybrid.SHAPE["vocab_size"]}
CONFIGS = {"float32": None, "q4": 4, "q8": 8}
MODELS = ("hybrid", "moe")
PROMPT = [(i * 7919) % 30000 + 100 for i in range(16)]  # ids every vocabulary here has
GIB, MIB = 1 << 30, 1 << 20


# ----------------------------------------------------------------------------- checkpoints
def checkpoint(model: str, shape: str, directory: str | None) -> str:
    if model == "moe":
        return moe.ensure_checkpoint("qwen3_moe")  # cached under bench-results/moe-bench/
    # hybrid.py's generator reads its module-level SHAPE when called (config, weights and
    # tokenizer), and remakes a directory whose config.json differs from the one it would write.
    hybrid.SHAPE = {**hybrid.SHAPE, "vocab_size": SHAPES[shape]}
    default = hybrid.DEFAULT_DIR if shape == "bench" else f"{hybrid.DEFAULT_DIR}-full-vocab"
    return hybrid.make_checkpoint(os.path.abspath(directory or default))


# ----------------------------------------------------------------------------- worker
def weight_kinds(*modules) -> dict[str, int]:
    """Bytes of the weights held, by kind: quantized panels (integer arrays), and float
    arrays as routed experts (``switch_mlp``), products (matrices of the other linears and
    embeddings) or the rest (vectors, norms, convolutions, RoPE tables). Arrays are counted
    once and views not at all: fused projections' parts (as runner.device.weight_bytes skips
    them) and the experts' gate and up panels, slices of their owner's ``_gate_up_p``
    (runner.models.moe), which weight_bytes counts again."""
    import mlx.core as mx

    seen: set[int] = set()
    kinds: dict[str, int] = {}
    for module in modules:
        named = dict(module.named_modules())
        for name, child in named.items():
            parent, _, leaf = name.rpartition(".")
            view = leaf in ("gate_proj", "up_proj") and "_gate_up_p" in named.get(parent, {})
            for key, value in child.items():
                if not isinstance(value, mx.array) or id(value) in seen:
                    continue
                if key.startswith("_") and getattr(child, "fused", False):
                    continue
                if key == "_panels" and view:
                    continue
                seen.add(id(value))
                path = f"{name}.{key}"
                if not mx.issubdtype(value.dtype, mx.floating):
                    kind = "quantized"
                elif "switch_mlp" in path:
                    kind = "float experts"
                elif value.ndim == 1 or any(w in path for w in ("norm", "conv", "rope")):
                    kind = "float rest"
                else:
                    kind = "float products"
                kinds[kind] = kinds.get(kind, 0) + value.nbytes
    return kinds


def worker(path: str, config: str) -> None:
    """One configuration's Engine: ``{"tokens": n}`` -> a greedy plain decode's speed."""
    sys.path.insert(0, bc.ROOT)
    import mlx.core as mx

    from protocol import frames as pf
    from protocol.requests import Completion, Options
    from runner import native
    from runner.engine import Engine, EngineOptions

    t0 = time.perf_counter()
    options = EngineOptions(
        model_path=path, use_draft=False, prefix_cache=False, quantize=CONFIGS[config]
    )
    engine = Engine(options)
    load_s = time.perf_counter() - t0

    def handle(command: dict) -> dict:
        request = Completion(
            id="q",
            tokens=PROMPT,
            speculative=False,
            options=Options(temperature=0.0, repeat_penalty=1.0, num_predict=command["tokens"]),
        )
        frames: list = []
        engine.run(engine.prepare(request), frames.append, lambda: False)
        errors = [f for f in frames if isinstance(f, pf.Error)]
        if errors:
            raise RuntimeError(f"engine error: {errors[0].code}: {errors[0].message}")
        done = frames[-1]
        return {
            "tps": done.eval_tokens / done.eval_ns * 1e9,
            "eval_tokens": done.eval_tokens,
            "load": bc.machine_load(),
        }

    info = {
        "weights_bytes": engine.info.weights_bytes,
        "kinds": weight_kinds(engine.model),
        "active_bytes": mx.get_active_memory(),  # MLX's allocator after load: weights and all
        "tuning": engine.info.tuning,
        "blas": engine.info.blas,
        "qpanel_isa": native.qpanel_isa(),  # the quantized product's integer path
        "load_s": load_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }
    bc.serve_worker(info, handle)


# ----------------------------------------------------------------------------- main
def measure(model: str, path: str, configs: list[str], args) -> dict:
    """Start the model's configurations one after another (loads never overlap), then run
    them in interleaved rounds."""
    here = os.path.abspath(__file__)
    workers: dict[str, bc.Worker] = {}
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        for c in configs:
            print(f"loading {model} {c} ...", file=sys.stderr)
            argv = [sys.executable, here, "--worker", path, c]
            workers[c] = bc.Worker(argv, f"quantize-{model}-{c}.log")
        for c in configs:  # untimed: compiled blocks, first-call allocations
            workers[c].call({"tokens": 8})
        for r in range(args.rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                run = workers[c].call({"tokens": args.tokens})
                runs[c].append(run)
                print(
                    f"round {r} {model:6s} {c:7s} {run['tps']:6.2f} tok/s "
                    f"({run['eval_tokens']} tokens), load {run['load']['loadavg_1m']:.2f}",
                    file=sys.stderr,
                )
        info = {c: w.info for c, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    return {"checkpoint": path, "runs": runs, "info": info}


def summarise(data: dict, base: str) -> dict:
    runs, info = data["runs"], data["info"]
    out = {}
    for c, rs in runs.items():
        ratios = [a["tps"] / b["tps"] for a, b in zip(rs, runs[base], strict=True)]
        out[c] = {
            "decode_tps": bc.median([r["tps"] for r in rs]),
            "decode_ratio": bc.median(ratios),
            "weights_bytes": info[c]["weights_bytes"],
            "held_bytes": sum(info[c]["kinds"].values()),
            "held_ratio": sum(info[c]["kinds"].values()) / sum(info[base]["kinds"].values()),
            "kinds": info[c]["kinds"],
            "active_bytes": info[c]["active_bytes"],
            "load_s": info[c]["load_s"],
            "peak_rss_bytes": info[c]["peak_rss_bytes"],
        }
    return out


def float_left(kinds: dict[str, int]) -> str:
    float_kinds = sorted((k, v) for k, v in kinds.items() if k.startswith("float"))
    return ", ".join(f"{k[6:]} {v / MIB:,.1f}" for k, v in float_kinds) or "-"


def report(summaries: dict, args, base: str) -> None:
    headers = [
        "model",
        "weights",
        f"decode tok/s (median of {args.rounds})",
        f"x {base}",
        "weights_bytes GiB",
        "held GiB (views once)",
        f"x {base}",
        "of which float, MiB",
        "MLX active GiB",
        "load s",
        "peak RSS GiB",
    ]
    rows = []
    for model, summary in summaries.items():
        for c, s in summary.items():
            rows.append(
                [
                    model,
                    c,
                    f"{s['decode_tps']:.2f}",
                    f"{s['decode_ratio']:.2f}",
                    f"{s['weights_bytes'] / GIB:.2f}",
                    f"{s['held_bytes'] / GIB:.2f}",
                    f"{s['held_ratio']:.2f}",
                    float_left(s["kinds"]),
                    f"{s['active_bytes'] / GIB:.2f}",
                    f"{s['load_s']:.0f}",
                    f"{s['peak_rss_bytes'] / GIB:.2f}",
                ]
            )
    print()
    print(bc.markdown_table(headers, rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per decode run")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of " + str(MODELS))
    parser.add_argument("--configs", default="float32,q4,q8", help="comma list of " + str(CONFIGS))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.8b", help="hybrid's vocab")
    parser.add_argument("--dir", default=None, help="where the hybrid checkpoint is kept")
    parser.add_argument("--out", default="quantize.json", help="file name under bench-results/")
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    if set(models) - set(MODELS) or set(configs) - set(CONFIGS) or not configs:
        raise SystemExit(f"models from {MODELS}, configs from {tuple(CONFIGS)}")
    base = configs[0]  # ratios are against the first configuration (float32 by default)

    started = time.perf_counter()
    results, summaries = {}, {}
    for model in models:
        path = checkpoint(model, args.shape, args.dir)
        results[model] = measure(model, path, configs, args)
        summaries[model] = summarise(results[model], base)
    elapsed = time.perf_counter() - started
    report(summaries, args, base)
    print()
    loads = [r["load"] for res in results.values() for rs in res["runs"].values() for r in rs]
    print(bc.describe_load(loads))
    first = results[models[0]]["info"][base]
    print(
        f"{len(PROMPT)}-token prompt, {args.tokens} tokens greedy, plain decode; hybrid vocab "
        f"{SHAPES[args.shape]}; tuning ({base}): {first['tuning']}; BLAS {first['blas']}; "
        f"quantized product {first['qpanel_isa']}"
    )
    path = bc.write_json(
        args.out,
        {
            "shape": {**hybrid.SHAPE, "vocab_size": SHAPES[args.shape]},
            "moe_config": moe.CONFIGS["qwen3_moe"],
            "prompt": PROMPT,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "environment": bc.environment(),
            "summary": summaries,
            "results": results,
            "elapsed_s": elapsed,
        },
    )
    print(f"{elapsed:.0f} s in all; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
