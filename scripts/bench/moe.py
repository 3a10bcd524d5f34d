"""MoE decode cost against the active parameters: a random qwen3_moe against a dense qwen3 of its
active size, against mlx-lm on the same weights, and verify rows against one row.

The checkpoints are made here with the runner's own model code (seeded random weights, saved
as safetensors under ``bench-results/moe-bench/``, remade when their description changes):

- ``qwen3_moe``: 16 layers of width 1024 (16 heads of 64, 4 KV heads), 64 experts of width
  272 per layer, 8 routed per token, a 49,152-token vocabulary, untied; about 1.0B parameters,
  0.25B active (everything but the 56 unselected experts of each layer);
- ``qwen3_dense``: the same model with one dense MLP of width 8 x 272 per layer instead, so
  its parameter count is the MoE's active count.

Each side is a process loaded once (common.Worker); a rep runs every side in turn (A B C
A B C ...), so a drift of this shared machine's speed hits all alike; tables show medians of
per-rep values, and ratios are taken per rep before their median. Per side and rep:

- decode: greedy, pipelined (the next forward dispatched before the token is read), ``--decode``
  tokens after a 64-token prompt, tokens/s between the first and last token;
- rows: the synchronous cost of a forward over 1, 2, 3 and 5 rows at the prompt's offset (a
  verify of 1, 2 and 4 drafts), row counts alternating, medians; each MoE row routes to its
  own experts, so a k-row verify reads more expert weights than one row.

The runner sides are the bare model after ``runner.device.tune`` (as the engine tunes it); the
mlx-lm sides (``.venv-ref``, never imported here) run ``mlx_lm.generate.generate_step`` and
``model(ids, cache)`` on the same files, under the same BLAS (the runner's preload). Phases keep
at most three 4 GB models in memory at once:

- ``main``: the runner's MoE (default tuning) against the dense model and mlx-lm;
- ``change``: the MoE with its experts as loaded (one ``gather_mm`` per projection, a BLAS
  product per (row, expert) pair) against the default (runner.native's gathered panel product);
- ``packed``: the layout without runner.native, experts as loaded against packed (the down
  projection stored [in, out]).

Then the depth controller (``drafting.depth.DepthController``, its own cost model) is given
each model's row costs as round costs (depth d: the (d+1)-row forward; the head's draft steps
are left out, the same absolute cost for both models) and a fixed acceptance curve, and says
which depth it would pick. ``--profile`` also splits a forward over 1 and 5 rows into its parts
(router, each expert product, combine, the sort the few-row path skips; the dense model's MLP
blocks beside them), each part built for all 16 layers and evaluated as one graph, eagerly,
the runner sides taking turns for ``--profile-rounds`` rounds. Usage:

    python scripts/bench/moe.py [--reps 5] [--decode 64] [--phases main,change,packed]
                                [--profile]

Writes bench-results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

CHECKPOINTS = os.path.join(bc.RESULTS_DIR, "moe-bench")
REF_PYTHON = os.path.join(bc.ROOT, ".venv-ref", "bin", "python")
SEED = 1
COMMON = {
    "vocab_size": 49152,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": None,
}
EXPERTS, TOP_K, EXPERT_WIDTH = 64, 8, 272
CONFIGS = {
    "qwen3_moe": {
        **COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": EXPERT_WIDTH,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "intermediate_size": TOP_K * EXPERT_WIDTH,
    },
    "qwen3_dense": {
        **COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "intermediate_size": TOP_K * EXPERT_WIDTH,
    },
}
PROMPT_TOKENS = 64
ROWS = (1, 2, 3, 5)
ROW_REPS = 5  # timings per row count in one measurement (medians)
PROFILE_REPS = 3  # timings per part in one profile round (medians; then over the rounds)
# Conditional acceptance per draft position handed to the depth controller.
ACCEPTANCE = (0.6, 0.45, 0.35)
ACCEPT_ROUNDS = 400
MAX_DEPTH = 8

MOE_PANELS = "runner MoE (experts in panels)"
MOE_LOADED = "runner MoE (experts as loaded)"
MOE_PACKED_LOADED = "runner MoE, packed layout (experts as loaded)"
MOE_PACKED = "runner MoE, packed layout (experts packed)"
DENSE = "runner dense, active size"
DENSE_PACKED = "runner dense, active size, packed layout"
MLX_MOE = "mlx-lm MoE"
MLX_DENSE = "mlx-lm dense, active size"
SIDES = {  # name -> (worker, checkpoint, runner.device.tune options)
    MOE_PANELS: ("runner", "qwen3_moe", {}),
    MOE_LOADED: ("runner", "qwen3_moe", {"expert_layout": "hf"}),
    MOE_PACKED_LOADED: ("runner", "qwen3_moe", {"layout": "packed", "expert_layout": "hf"}),
    MOE_PACKED: ("runner", "qwen3_moe", {"layout": "packed"}),
    DENSE: ("runner", "qwen3_dense", {}),
    DENSE_PACKED: ("runner", "qwen3_dense", {"layout": "packed"}),
    MLX_MOE: ("mlx-lm", "qwen3_moe", {}),
    MLX_DENSE: ("mlx-lm", "qwen3_dense", {}),
}
PHASES = {
    "main": (MOE_PANELS, DENSE, MLX_MOE, MLX_DENSE),
    "change": (MOE_LOADED, MOE_PANELS, DENSE),
    "packed": (MOE_PACKED_LOADED, MOE_PACKED, DENSE_PACKED),
}
# What each phase compares: (side, baseline) pairs reported as ratios.
COMPARISONS = {
    "main": ((MOE_PANELS, DENSE), (MOE_PANELS, MLX_MOE), (MLX_MOE, MLX_DENSE), (DENSE, MLX_DENSE)),
    "change": ((MOE_PANELS, MOE_LOADED), (MOE_LOADED, DENSE), (MOE_PANELS, DENSE)),
    "packed": ((MOE_PACKED, MOE_PACKED_LOADED), (MOE_PACKED, DENSE_PACKED)),
}


def prompt_ids() -> list[int]:
    return [(i * 7919) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def row_ids() -> list[int]:
    return [(i * 31) % 40000 + 7 for i in range(max(ROWS))]


# ----------------------------------------------------------------------------- checkpoints
def parameter_counts(config: dict) -> dict:
    d, layers, v = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = d * heads * hd * 2 + 2 * d * kv * hd + 2 * hd + 2 * d  # q, o, k, v, q/k norms
    shared = 2 * v * d + d + layers * attention  # embedding, head, final norm
    if config["model_type"] == "qwen3_moe":
        expert = 3 * d * config["moe_intermediate_size"]
        per_layer = config["num_experts"] * d  # router
        total = shared + layers * (per_layer + config["num_experts"] * expert)
        active = shared + layers * (per_layer + config["num_experts_per_tok"] * expert)
    else:
        total = active = shared + layers * 3 * d * config["intermediate_size"]
    return {"total": total, "active": active}


def ensure_checkpoint(name: str) -> str:
    """The random checkpoint ``name`` under bench-results/moe-bench/, made when missing or
    made from another description; one safetensors shard per layer keeps memory low."""
    path = os.path.join(CHECKPOINTS, name)
    stamp = {"config": CONFIGS[name], "seed": SEED, "version": 1}
    stamp_path = os.path.join(path, "bench-moe.json")
    if os.path.exists(stamp_path):
        with open(stamp_path, encoding="utf-8") as f:
            if json.load(f) == stamp:
                return path
    print(f"making {path} ...", file=sys.stderr)
    sys.path.insert(0, bc.ROOT)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runner.models import build_model
    from tests.checkpoints import EOS_TOKEN, tokenizer_json

    os.makedirs(path, exist_ok=True)
    config = CONFIGS[name]
    shapes = {n: v.shape for n, v in tree_flatten(build_model(config).parameters())}
    shards: dict[str, list[str]] = {}
    for n in shapes:
        parts = n.split(".")
        shards.setdefault(f"layer{int(parts[2]):02d}" if parts[1] == "layers" else "other", [])
        shards[f"layer{int(parts[2]):02d}" if parts[1] == "layers" else "other"].append(n)
    index = {}
    names = sorted(shapes)
    for shard, members in sorted(shards.items()):
        tensors = {}
        for n in members:
            key = mx.random.key(SEED * 100003 + names.index(n))
            shape = shapes[n]
            if "norm" in n:
                w = 1.0 + 0.1 * mx.random.normal(shape, key=key)
            elif "embed_tokens" in n:
                w = mx.random.normal(shape, key=key)
            else:  # unit-variance outputs for unit-variance inputs
                w = mx.random.normal(shape, key=key) * shape[-1] ** -0.5
            if n == "lm_head.weight":
                w[:8] = 0.0  # the special tokens (EOS among them) are never the argmax
            tensors[n] = w
        mx.eval(tensors)
        fname = f"model-{shard}.safetensors"
        mx.save_safetensors(os.path.join(path, fname), tensors)
        index.update(dict.fromkeys(tensors, fname))
    files = {
        "model.safetensors.index.json": {"metadata": {}, "weight_map": index},
        "config.json": config,
        "tokenizer_config.json": {
            "eos_token": EOS_TOKEN,
            "bos_token": None,
            "add_bos_token": False,
        },
    }
    for fname, data in files.items():
        with open(os.path.join(path, fname), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json(320))
    with open(stamp_path, "w", encoding="utf-8") as f:
        json.dump(stamp, f)
    return path


# ----------------------------------------------------------------------------- workers
def timed_rows(forward, rewind, reps: int) -> dict[str, float]:
    """Median ms of a synchronous forward over k rows for k in ROWS, row counts alternating;
    ``forward(k)`` evaluates k rows, ``rewind()`` puts the caches back at the prompt."""
    times: dict[int, list[float]] = {k: [] for k in ROWS}
    for rep in range(reps + 1):
        for k in ROWS:
            rewind()
            t0 = time.perf_counter()
            forward(k)
            if rep:  # the first pass traces every row count
                times[k].append(1000 * (time.perf_counter() - t0))
    rewind()
    return {str(k): statistics.median(v) for k, v in times.items()}


def runner_worker(path: str, options: dict) -> None:
    """This runner's model after device tuning: decode, rows and profile commands."""
    sys.path.insert(0, bc.ROOT)
    import mlx.core as mx

    from runner import blas, device
    from runner.loader import load_model

    loaded = load_model(path, dtype="float32")
    model = loaded.model
    tuning = device.tune(model, **options)
    prompt = mx.array([prompt_ids()], dtype=mx.int32)
    ids = mx.array([row_ids()], dtype=mx.int32)

    def prefilled() -> list:
        caches = model.make_caches()
        with blas.wide():  # as runner.decoder.prefill does
            mx.eval(model.hidden(prompt, caches), [c.state for c in caches])
        return caches

    def decode(n: int) -> dict:
        caches = prefilled()

        def step(tok: mx.array) -> mx.array:
            h = model.hidden(tok.reshape(1, 1), caches)
            nxt = mx.argmax(model.unembed(h[:, -1]), axis=-1).astype(mx.int32)
            mx.async_eval(nxt, [c.state for c in caches])
            return nxt

        y = step(mx.array([prompt_ids()[-1]], dtype=mx.int32))
        mx.eval(y)
        out = []
        t0 = time.perf_counter()
        for _ in range(n):  # n steps: each dispatched before the previous token is read
            nxt = step(y)
            out.append(y.item())
            y = nxt
        y.item()
        return {"tps": n / (time.perf_counter() - t0), "ids": out}

    def rows(reps: int) -> dict:
        caches = prefilled()
        base = caches[0].offset

        def forward(k: int) -> None:
            mx.eval(model.unembed(model.hidden(ids[:, :k], caches)), [c.state for c in caches])

        def rewind() -> None:
            for c in caches:
                c.rewind(base)

        return {"ms": timed_rows(forward, rewind, reps)}

    def handle(command: dict) -> dict:
        if command["cmd"] == "decode":
            return decode(command["tokens"])
        if command["cmd"] == "rows":
            return rows(command["reps"])
        if command["cmd"] == "profile":
            return {"parts": profile(model, command["rows"], command["reps"])}
        raise ValueError(f"unknown command {command['cmd']!r}")

    info = {"blas": blas.blas_in_use(), "tuning": tuning.describe(), "layout": expert_layout(model)}
    bc.serve_worker(info, handle)


def expert_layout(model) -> str:
    from runner.models import moe

    for _, m in model.named_modules():
        if isinstance(m, moe.SwitchGLU):
            if "_panels" in m.down_proj:
                return "panels (runner.native gathered product)"
            if "_wt" in m.down_proj:
                return "packed (down [in, out]; gather_mm)"
            return "as loaded (gather_mm per projection)"
    return "no experts"


def profile(model, row_counts: list[int], reps: int) -> dict:
    """Where a MoE forward over r rows goes, per part, summed over the layers (ms): each part
    built for every layer and evaluated as one graph (MLX's per-eval cost shared), eagerly."""
    return {str(r): profile_rows(model, r, reps) for r in row_counts}


def profile_rows(model, r: int, reps: int) -> dict[str, float]:
    import mlx.core as mx
    import mlx.nn as nn

    from runner import native
    from runner.models import moe

    dims = model.args.hidden_size

    def normal(shape, seed):
        return mx.random.normal(shape, key=mx.random.key(1000 * r + seed))

    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, moe.SparseMoE)]
    hidden = normal((1, r, dims), 999)

    def head(i: int):
        return model.unembed(hidden) if i == 0 else []

    if not blocks:  # the dense model: its MLP blocks, for the MoE blocks to be set against
        mlps = [layer.mlp for layer in model.layers]
        ins = [normal((1, r, dims), i) for i in range(len(mlps))]
        mx.eval(ins)
        parts = {
            "whole MLP block (dense, active width)": lambda i: mlps[i](ins[i]),
            "output projection (vocabulary, once)": head,
        }
        return timed_parts(parts, len(mlps), reps)
    s = blocks[0].settings
    width, k = s.intermediate_size, s.top_k

    xs = [normal((r, dims), i) for i in range(len(blocks))]
    routes = [moe.route(b.gate, x, s) for b, x in zip(blocks, xs, strict=True)]
    hs = [normal((r, k, width), 100 + i) for i in range(len(blocks))]
    ys = [normal((r, k, dims), 200 + i) for i in range(len(blocks))]
    mx.eval(xs, routes, hs, ys)
    sw = [b.switch_mlp for b in blocks]
    x4 = [x[:, None, None, :] for x in xs]
    h4 = [h[:, :, None, :] for h in hs]

    def sort_unsort(i: int):
        flat = routes[i][0].flatten()
        order = mx.argsort(flat)
        return xs[i][order // k], flat[order], mx.argsort(order)

    parts = {
        "router (product, softmax, top-k, weights)": lambda i: moe.route(blocks[i].gate, xs[i], s)
    }
    if "_panels" in sw[0].down_proj:
        parts["gate+up: one gathered panel product"] = lambda i: native.gather_panel_matmul(
            xs[i][:, None], sw[i]._gate_up_p, routes[i][0], 2 * width
        )
        parts["down: gathered panel product"] = lambda i: sw[i].down_proj.panel_product(
            hs[i], routes[i][0]
        )
    else:
        parts["gate: gather_mm"] = lambda i: sw[i].gate_proj(x4[i], routes[i][0], False)
        parts["up: gather_mm"] = lambda i: sw[i].up_proj(x4[i], routes[i][0], False)
        down = "down [in, out]" if "_wt" in sw[0].down_proj else "down"
        parts[f"{down}: gather_mm"] = lambda i: sw[i].down_proj(h4[i], routes[i][0], False)
    parts["silu(gate) * up"] = lambda i: nn.silu(hs[i]) * hs[i]
    parts["weighted sum over the k experts"] = lambda i: (ys[i] * routes[i][1][..., None]).sum(1)
    parts["sort + unsort (what-if: skipped under 64 pairs)"] = sort_unsort
    parts["whole MoE block"] = lambda i: blocks[i](xs[i][None])
    parts["output projection (vocabulary, once)"] = head
    return timed_parts(parts, len(blocks), reps)


def timed_parts(parts: dict, layers: int, reps: int) -> dict[str, float]:
    """Median ms of each part built for every layer and evaluated as one graph; parts take
    turns, the first pass untimed."""
    import mlx.core as mx

    times: dict[str, list[float]] = {name: [] for name in parts}
    for rep in range(reps + 1):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            mx.eval([fn(i) for i in range(layers)])
            if rep:
                times[name].append(1000 * (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in times.items()}


def mlx_lm_worker(path: str) -> None:
    """Runs inside .venv-ref: mlx-lm's own model code and decode loop."""
    import importlib.metadata
    from pathlib import Path

    blas = bc.preload_runner_blas()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    mx.eval(model.parameters())
    prompt = mx.array(prompt_ids(), dtype=mx.int32)
    ids = mx.array([row_ids()], dtype=mx.int32)

    def decode(n: int) -> dict:
        out, stamps = [], []
        for token, _ in generate_step(prompt, model, max_tokens=n):
            out.append(int(token))
            stamps.append(time.perf_counter())
        return {"tps": (len(out) - 1) / (stamps[-1] - stamps[0]), "ids": out}

    def rows(reps: int) -> dict:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[None], cache=cache), [c.state for c in cache])
        fed = [0]

        def forward(k: int) -> None:
            mx.eval(model(ids[:, :k], cache=cache), [c.state for c in cache])
            fed[0] = k

        def rewind() -> None:
            for c in cache:
                c.trim(fed[0])
            fed[0] = 0

        return {"ms": timed_rows(forward, rewind, reps)}

    def handle(command: dict) -> dict:
        if command["cmd"] == "decode":
            return decode(command["tokens"])
        if command["cmd"] == "rows":
            return rows(command["reps"])
        raise ValueError(f"mlx-lm worker: no {command['cmd']!r}")

    info = {
        "blas": blas.blas_in_use(),
        "mlx": mx.__version__,
        "mlx_lm": importlib.metadata.version("mlx-lm"),
    }
    bc.serve_worker(info, handle)


def start(side: str) -> bc.Worker:
    kind, checkpoint, options = SIDES[side]
    path = os.path.join(CHECKPOINTS, checkpoint)
    here = os.path.abspath(__file__)
    log = "moe-" + side.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
    if kind == "runner":
        argv = [sys.executable, here, "--worker", "runner", path, json.dumps(options)]
        return bc.Worker(argv, log + ".log")
    if not os.path.exists(REF_PYTHON):
        raise SystemExit(f"{REF_PYTHON} not found: the mlx-lm sides need .venv-ref")
    env = dict(os.environ, PYTHONPATH=bc.ROOT)
    return bc.Worker([REF_PYTHON, here, "--worker", "mlx-lm", path], log + ".log", env=env)


# ----------------------------------------------------------------------------- the controller
def depth_pick(row_ms: dict[int, float]) -> dict:
    """What ``DepthController`` picks with ``row_ms`` as round costs (depth d: the (d+1)-row
    forward) and ACCEPTANCE as the per-position acceptance, fed through its own interface."""
    sys.path.insert(0, bc.ROOT)
    from drafting.depth import COST_SEED_SAMPLES, DepthController

    controller = DepthController(max_depth=MAX_DEPTH)
    costs = {rows - 1: ms / 1000 for rows, ms in sorted(row_ms.items())}
    for depth, seconds in costs.items():  # depth 0 first: its samples set the speed
        for _ in range(COST_SEED_SAMPLES):
            controller.record_cost(depth, seconds)
    # Rounds whose outcomes at each position follow ACCEPTANCE as evenly as possible (a
    # Sturmian sequence per position), so the EWMA sits at the curve.
    credit = [0.0] * len(ACCEPTANCE)
    for _ in range(ACCEPT_ROUNDS):
        accepted = 0
        for i, rate in enumerate(ACCEPTANCE):
            credit[i] += rate
            if credit[i] < 1.0:
                break
            credit[i] -= 1.0
            accepted += 1
        controller.observe(len(ACCEPTANCE), accepted)
    limit = controller.limit()
    rates = {d: controller.rate(d) for d in range(limit + 1)}
    return {
        "selected": controller.selected(),
        "best_rate_depth": max(rates, key=lambda d: (rates[d], -d)),
        "limit": limit,
        "acceptance": [controller.acceptance(i) for i in range(1, limit + 1)],
        "relative_cost": {d: controller.cost(d) / controller.cost(0) for d in range(limit + 1)},
        "speedup_vs_plain": {d: rates[d] / rates[0] for d in rates},
    }


# ----------------------------------------------------------------------------- main
def run_phase(phase: str, args: argparse.Namespace) -> dict:
    sides = {}
    try:
        for side in PHASES[phase]:
            print(f"[{phase}] loading {side} ...", file=sys.stderr)
            sides[side] = start(side)
        warm = {s: w.call({"cmd": "decode", "tokens": 8}) for s, w in sides.items()}
        for w in sides.values():
            w.call({"cmd": "rows", "reps": 1})
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for rep in range(args.reps):
            for side, w in sides.items():
                dec = w.call({"cmd": "decode", "tokens": args.decode})
                rows = w.call({"cmd": "rows", "reps": ROW_REPS})["ms"]
                runs[side].append(
                    {
                        "tps": dec["tps"],
                        "ids": dec["ids"],
                        "rows_ms": rows,
                        "load": bc.machine_load(),
                    }
                )
                print(
                    f"[{phase}] rep {rep} {side:46s} {dec['tps']:6.2f} tok/s, rows "
                    + " ".join(f"{k}:{v:.1f}" for k, v in rows.items())
                    + f" ms, load {runs[side][-1]['load']['loadavg_1m']:.2f}",
                    file=sys.stderr,
                )
        parts = {}
        if args.profile:  # the runner sides take turns, round after round, as the reps did
            profiled = [s for s in sides if SIDES[s][0] == "runner"]
            rounds: dict[str, list[dict]] = {s: [] for s in profiled}
            for _ in range(args.profile_rounds):
                for side in profiled:
                    command = {"cmd": "profile", "rows": [1, 5], "reps": PROFILE_REPS}
                    rounds[side].append(sides[side].call(command)["parts"])
            for side, got in rounds.items():
                parts[side] = {
                    r: {name: statistics.median(g[r][name] for g in got) for name in got[0][r]}
                    for r in got[0]
                }
        info = {s: w.info for s, w in sides.items()}
    finally:
        for w in sides.values():
            w.close()
    return {
        "runs": runs,
        "info": info,
        "profile": parts,
        "warmup_ids": {s: r["ids"] for s, r in warm.items()},
    }


def summarise(phase: str, data: dict) -> dict:
    med = statistics.median
    runs = data["runs"]
    out: dict = {"sides": {}, "ratios": {}}
    for side, rs in runs.items():
        ratio = {k: med(r["rows_ms"][str(k)] / r["rows_ms"]["1"] for r in rs) for k in ROWS}
        out["sides"][side] = {
            "decode_tps": med(r["tps"] for r in rs),
            "rows_ms": {k: med(r["rows_ms"][str(k)] for r in rs) for k in ROWS},
            "row_cost_ratio": ratio,
            "depth": depth_pick({k: med(r["rows_ms"][str(k)] for r in rs) for k in ROWS}),
            "info": data["info"][side],
        }
    for side, base in COMPARISONS[phase]:
        if side in runs and base in runs:
            pairs = zip(runs[side], runs[base], strict=True)
            out["ratios"][f"{side} / {base}"] = med(a["tps"] / b["tps"] for a, b in pairs)
    return out


def print_phase(phase: str, summary: dict, data: dict, reps: int) -> None:
    sides = summary["sides"]
    headers = [
        "side",
        f"decode tok/s (median of {reps})",
        "1-row ms",
        "2 rows x",
        "3 rows x",
        "5 rows x",
        "controller's depth",
        "its speed-up at that depth",
    ]
    rows = []
    for side, s in sides.items():
        d = s["depth"]
        rows.append(
            [
                side,
                f"{s['decode_tps']:.2f}",
                f"{s['rows_ms'][1]:.1f}",
                *(f"{s['row_cost_ratio'][k]:.2f}" for k in ROWS[1:]),
                f"{d['selected']} (best rate: {d['best_rate_depth']})",
                f"{d['speedup_vs_plain'][d['selected']]:.2f}x",
            ]
        )
    print(f"\n### phase {phase}\n")
    print(bc.markdown_table(headers, rows))
    print()
    for name, value in summary["ratios"].items():
        print(f"- decode tok/s {name}: {value:.3f}x (median of per-rep ratios)")
    for side, s in sides.items():
        print(
            f"- {side}: {s['info'].get('tuning', s['info'].get('mlx_lm', ''))}; "
            f"experts {s['info'].get('layout', 'mlx-lm SwitchGLU')}"
        )
    ids = {s: data["runs"][s][0]["ids"] for s in sides}
    moe_sides = [s for s in sides if SIDES[s][1] == "qwen3_moe"]
    for s in moe_sides[1:]:
        diff = bc.first_difference(ids[moe_sides[0]], ids[s])
        same = "identical" if diff is None else f"differ from index {diff}"
        print(f"- greedy tokens, {s} vs {moe_sides[0]}: {same}")
    profile = data["profile"]
    if profile:
        sides_ = list(profile)
        for r in next(iter(profile.values())):
            names: list[str] = []
            for side in sides_:
                names += [n for n in profile[side][r] if n not in names]
            table = [
                [n, *(f"{profile[s][r][n]:.2f}" if n in profile[s][r] else "-" for s in sides_)]
                for n in names
            ]
            print(
                f"\nprofile over {r} row(s): ms per forward, summed over the 16 layers, eager "
                f"(median of {PROFILE_REPS} x the rounds)\n"
            )
            print(bc.markdown_table(["part", *sides_], table))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed reps per side")
    parser.add_argument("--decode", type=int, default=64, help="tokens per decode run")
    parser.add_argument("--phases", default="main,change", help="comma list of " + ",".join(PHASES))
    parser.add_argument("--profile", action="store_true", help="split the MoE step into parts")
    parser.add_argument("--profile-rounds", type=int, default=5, help="turns per runner side")
    parser.add_argument("--out", default="moe.json", help="file name under bench-results/")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, path, *rest = args.worker
        if kind == "runner":
            runner_worker(path, json.loads(rest[0]) if rest else {})
        else:
            mlx_lm_worker(path)
        return 0
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"unknown phase(s) {unknown}; choose from {sorted(PHASES)}")
    counts = {}
    for name in CONFIGS:
        ensure_checkpoint(name)
        counts[name] = parameter_counts(CONFIGS[name])
    started = time.perf_counter()
    results, summaries = {}, {}
    for phase in phases:
        results[phase] = run_phase(phase, args)
        summaries[phase] = summarise(phase, results[phase])
    moe, dense = counts["qwen3_moe"], counts["qwen3_dense"]
    print(
        f"\nqwen3_moe: {moe['total'] / 1e9:.3f}B parameters, {moe['active'] / 1e9:.3f}B active; "
        f"qwen3 dense: {dense['total'] / 1e9:.3f}B; float32; {args.decode} tokens per decode "
        f"after {PROMPT_TOKENS}; acceptance per position {ACCEPTANCE}"
    )
    for phase in phases:
        print_phase(phase, summaries[phase], results[phase], args.reps)
    loads = [r["load"] for p in results.values() for rs in p["runs"].values() for r in rs]
    print()
    print(bc.describe_load(loads))
    elapsed = time.perf_counter() - started
    path = bc.write_json(
        args.out,
        {
            "parameters": counts,
            "configs": CONFIGS,
            "decode_tokens": args.decode,
            "prompt_tokens": PROMPT_TOKENS,
            "rows": ROWS,
            "acceptance": ACCEPTANCE,
            "reps": args.reps,
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
