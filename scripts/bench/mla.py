"""Multi-head latent attention decode speed: this runner against mlx-lm's ``glm4_moe_lite`` on
the same random weights, and what the latent cache holds per token.

The checkpoint is made on the fly: a random GLM-4.7-Flash (``glm4_moe_lite``) with its
attention exactly (hidden 2048, 20 heads, ``q_lora_rank`` 768, ``kv_lora_rank`` 512, heads of
``qk_nope`` 192 + ``qk_rope`` 64 for keys and 256 for values, interleaved RoPE base 1e6), its
dense first layer (FFN 10240) and its MoE block (experts of width 1536, 4 routed per token,
one shared expert, sigmoid routing with a correction bias, scaling 1.8), cut down to fit two
float32 copies in memory beside other work: 5 layers instead of 47 (1 dense, 4 MoE), 16
experts instead of 64, a 32k vocabulary instead of 154,880, no MTP layer; 0.94B parameters
(3.5 GiB), 0.43B of them read per token. ``rms_norm_eps`` is 1e-6, the latent norms' fixed epsilon
in transformers (which the runner follows) where mlx-lm applies the config's to them, so
that difference does not reach the greedy tokens. Float32, per-expert tensors and an unsplit
``kv_b_proj`` (the Hugging Face layout, which both loaders read). Each side is a process
loaded once (mlx-lm in ``.venv-bench``, never a project dependency, under the runner's BLAS);
runs are interleaved (A B A B ...) after one untimed warm-up run per side, and every figure
is a median. Usage:

    python scripts/bench/mla.py [--reps 5] [--prompt 128] [--decode 48] [--dir DIR]
                                [--profile] [--llama-cpp]

- prefill tok/s: prompt tokens over the time to the first generated token (prefix cache off);
- decode tok/s: tokens after the first over the time between the first and the last one;
- cache bytes per token: what each side's layer caches hold per cached token, read off the
  arrays after a prefill (their last dimensions and dtype), against the per-head keys and
  values an expanded cache would hold (``runner.models.mla.cache_bytes_per_token``);
- ``--llama-cpp``: the tests' ``deepseek2`` GGUF files (``tests/test_gguf_mla.py``) written
  in F32, the runner against llama.cpp on them (``.venv-llamacpp``, an F32 cache): the GGUF
  mapping's conventions checked to rounding, with no int8 activations in the way;
- ``--profile``: the runner's decode step split into its parts (attention with its
  projections, the MoE and dense MLPs, the output head), each part built for every layer
  and evaluated alone, to say where a slower step goes.

Writes bench-results/mla.json.
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

DEFAULT_DIR = os.path.join(bc.RESULTS_DIR, "mla-glm47-flash-random")
SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 5,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "vocab_size": 32000,
}
# GLM-4.7-Flash's own layer count, for the cache figures of the released model.
RELEASED_LAYERS = 47
SIDES = ("runner", "mlx-lm")
PROFILE_REPS = 7


# ----------------------------------------------------------------------------- checkpoint
def checkpoint_config() -> dict:
    layers = SHAPE["num_hidden_layers"]
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        **SHAPE,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "rope_theta": 1e6,
        "rope_interleave": True,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "dtype": "float32",
        "bench_mla": 1,  # the generator's version: a changed generator makes a new one
    }


def make_checkpoint(directory: str) -> str:
    """Write the random checkpoint unless ``directory`` already holds this one."""
    config = checkpoint_config()
    path = os.path.join(directory, "config.json")
    if os.path.exists(path) and os.path.exists(os.path.join(directory, "model.safetensors")):
        with open(path, encoding="utf-8") as f:
            if json.load(f) == config:
                return directory
    import mlx.core as mx

    print(f"writing a random GLM-4.7-Flash-shaped model to {directory} ...", file=sys.stderr)
    os.makedirs(directory, exist_ok=True)
    mx.random.seed(0)
    s = SHAPE
    h, heads = s["hidden_size"], s["num_attention_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]

    def normal(*shape: int, std: float = 0.02):
        return (std * mx.random.normal(shape)).astype(mx.float32)

    def gain(n: int):
        return 1.0 + normal(n, std=0.1)

    def mlp(prefix: str, width: int) -> dict:
        return {
            f"{prefix}.gate_proj.weight": normal(width, h),
            f"{prefix}.up_proj.weight": normal(width, h),
            f"{prefix}.down_proj.weight": normal(h, width),
        }

    weights = {
        "model.embed_tokens.weight": normal(s["vocab_size"], h),
        "model.norm.weight": gain(h),
        "lm_head.weight": normal(s["vocab_size"], h),
    }
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": gain(h),
            "post_attention_layernorm.weight": gain(h),
            "self_attn.q_a_proj.weight": normal(s["q_lora_rank"], h),
            "self_attn.q_a_layernorm.weight": gain(s["q_lora_rank"]),
            "self_attn.q_b_proj.weight": normal(heads * qk, s["q_lora_rank"]),
            "self_attn.kv_a_proj_with_mqa.weight": normal(
                s["kv_lora_rank"] + s["qk_rope_head_dim"], h
            ),
            "self_attn.kv_a_layernorm.weight": gain(s["kv_lora_rank"]),
            "self_attn.kv_b_proj.weight": normal(
                heads * (s["qk_nope_head_dim"] + s["v_head_dim"]), s["kv_lora_rank"]
            ),
            "self_attn.o_proj.weight": normal(h, heads * s["v_head_dim"]),
        }
        if i == 0:
            layer |= mlp("mlp", s["intermediate_size"])
        else:
            width, experts = s["moe_intermediate_size"], s["n_routed_experts"]
            layer["mlp.gate.weight"] = normal(experts, h)
            layer["mlp.gate.e_score_correction_bias"] = normal(experts, std=0.01)
            layer |= mlp("mlp.shared_experts", width)
            for e in range(experts):
                layer |= mlp(f"mlp.experts.{e}", width)
        weights.update({p + k: v for k, v in layer.items()})
        mx.eval(weights)
    mx.save_safetensors(os.path.join(directory, "model.safetensors"), weights)
    del weights
    bc.write_word_tokenizer(directory, SHAPE["vocab_size"], "<|endoftext|>")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory


def cache_row_bytes(pairs) -> int:
    """Bytes per cached token of layer caches given as (keys, values) arrays ``[..., T, d]``."""
    return sum(k.shape[-1] * k.itemsize + v.shape[-1] * v.itemsize for k, v in pairs)


# ----------------------------------------------------------------------------- runner side
def runner_worker(directory: str) -> None:
    """This runner's Engine in process (prefix cache off, no drafting)."""
    sys.path.insert(0, bc.ROOT)
    import runner
    from runner.engine import Engine, EngineOptions
    from runner.models.mla import cache_bytes_per_token
    from runner.prefill import prefill

    engine = Engine(EngineOptions(model_path=directory, use_draft=False, prefix_cache=False))
    model = engine.model

    def generate(command: dict) -> dict:
        return bc.engine_generate(engine, command["prompt"], command["n"])

    def cache(command: dict) -> dict:
        caches = model.make_caches()
        prefill(model, caches, command["prompt"], 0, chunk=512)
        pairs = [(c.keys, c.values) for c in caches]
        itemsize = pairs[0][0].itemsize
        _, expanded = cache_bytes_per_token(model.args, itemsize)
        return {"bytes_per_token": cache_row_bytes(pairs), "expanded": expanded}

    def profile(command: dict) -> dict:
        return profile_step(model, command["prompt"], command["reps"])

    ops = {"generate": generate, "cache": cache, "profile": profile}
    info = {"blas": runner.blas.blas_in_use(), "tuning": engine.tuning.describe()}
    bc.serve_worker(info, lambda c: ops[c["op"]](c))


def profile_step(model, prompt: list[int], reps: int) -> dict:
    """Median seconds of a one-token decode step at the prompt's offset, whole and by part:
    every layer's attention (its norm and projections, the latent cache's attention and
    ``o_proj``), the dense and the MoE MLPs (norm included), and the final norm with the
    output head; each part built for all its layers from fixed inputs and evaluated alone
    (the whole step through the model's compiled blocks, the parts through the same layer
    code, uncompiled)."""
    import mlx.core as mx

    from runner.prefill import prefill

    caches = model.make_caches()
    prefill(model, caches, prompt[:-1], 0, chunk=512)
    entry = caches[0].offset
    token = mx.array([[prompt[-1]]])
    layers = model.layers
    x0 = model.embed(token)
    xs = [(0.5 * mx.random.normal(x0.shape)).astype(x0.dtype) for _ in layers]
    mx.eval(xs)
    sparse = [i for i, layer in enumerate(layers) if type(layer.mlp).__name__ == "SparseMoE"]
    dense = [i for i in range(len(layers)) if i not in sparse]

    def attention(i: int) -> mx.array:
        layer, cache = layers[i], caches[i]
        attn = layer.self_attn
        q, latent, k_rot = layer.before_cache(xs[i], *attn.rope.tables(entry, 1, xs[i].dtype))
        return attn.output(attn.attend_cached(q, latent, k_rot, None, cache))

    def mlp(i: int) -> mx.array:
        return layers[i].mlp(layers[i].post_attention_layernorm(xs[i]))

    parts = {
        "step": lambda: model(token, caches),
        "attention": lambda: [attention(i) for i in range(len(layers))],
        "moe mlp": lambda: [mlp(i) for i in sparse],
        "dense mlp": lambda: [mlp(i) for i in dense],
        "head": lambda: model.unembed(model.model.norm(xs[-1])),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(reps + 1):  # the first pass warms every shape up, untimed
        for name, fn in parts.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - t0)
            for c in caches:
                c.rewind(entry)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


# ----------------------------------------------------------------------------- mlx-lm side
def mlx_lm_worker(directory: str) -> None:
    """Runs inside .venv-bench: mlx-lm's own glm4_moe_lite model and generate loop, greedy."""
    model, generate, info = bc.mlx_lm_side(directory)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def cache(command: dict) -> dict:
        caches = make_prompt_cache(model)
        model(mx.array([command["prompt"]]), cache=caches)
        mx.eval([c.state for c in caches])
        return {"bytes_per_token": cache_row_bytes([(c.keys, c.values) for c in caches])}

    ops = {"generate": generate, "cache": cache}
    bc.serve_worker(info, lambda c: ops[c["op"]](c))


# ----------------------------------------------------------------------------- llama.cpp
# Runs in llama.cpp's environment (``.venv-llamacpp``): argv[1] is {"path", "prompt",
# "tokens"}; prints the greedy ids and every prompt position's logits. The cache holds F32
# keys and values (GGML type 0): llama.cpp's default F16 cache would round the latents.
LLAMA_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
m = Llama(model_path=job["path"], n_ctx=128, n_threads=1, verbose=False, logits_all=True,
          type_k=0, type_v=0)
m.eval(job["prompt"])
rows = [np.array(m.scores[i]).tolist() for i in range(m.n_tokens)]
ids = []
for _ in range(job["tokens"]):
    ids.append(int(np.argmax(m.scores[m.n_tokens - 1])))
    m.eval([ids[-1]])
print(json.dumps({"ids": ids, "logits": rows}))
"""
# The tests' cases llama.cpp loads (it reads a full-rank query only at DeepSeek-V2-Lite's
# layer counts, and no attention biases).
LLAMA_CASES = ("deepseek_v3", "glm4_moe_lite")


def llama_cpp_check(tokens: int) -> list[dict]:
    """``tests/test_gguf_mla.py``'s ``deepseek2`` files written with F32 tensors only (so
    llama.cpp quantizes no activation), run by llama.cpp and by the runner from the same file:
    greedy tokens agreeing before the first difference, and the largest logit difference over
    every prompt position against the logits' span."""
    sys.path.insert(0, bc.ROOT)
    import subprocess
    import tempfile
    from pathlib import Path

    import numpy as np

    from scripts.bench.gguf_agreement import agreed
    from scripts.bench.llamacpp import ensure_llama_venv
    from tests import test_gguf_mla as cases
    from tests.test_gguf_families import PROMPT
    from tests.test_gguf_models import greedy, logits, tuned

    python = ensure_llama_venv(skip_build=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in LLAMA_CASES:
            _, path = cases.write_pair(Path(folder), case, floats=True)
            loaded = tuned(path)
            prompt = loaded.tokenizer.encode(PROMPT)
            ours, ref = greedy(loaded.model, prompt, tokens), logits(loaded.model, prompt)
            job = json.dumps({"path": path, "prompt": prompt, "tokens": tokens})
            done = subprocess.run([python, "-c", LLAMA_CHILD, job], capture_output=True, text=True)
            if done.returncode:
                rows.append({"case": case, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            theirs = json.loads(done.stdout.strip().splitlines()[-1])
            diff = float(np.abs(np.array(theirs["logits"]) - ref).max())
            rows.append(
                {
                    "case": case,
                    "greedy_agreed": agreed(theirs["ids"], ours),
                    "tokens": tokens,
                    "max_logit_diff": diff,
                    "span": float(ref.max() - ref.min()),
                }
            )
    return rows


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed runs per side")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=48, help="tokens to generate")
    parser.add_argument("--profile", action="store_true", help="split the runner's step")
    parser.add_argument(
        "--llama-cpp", action="store_true", help="float deepseek2 files against llama.cpp"
    )
    parser.add_argument("--dir", default=DEFAULT_DIR, help="where the checkpoint is kept")
    parser.add_argument("--out", default="mla.json", help="file name under bench-results/")
    parser.add_argument("--runner-worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--mlx-lm-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner_worker:
        runner_worker(args.runner_worker)
        return 0
    if args.mlx_lm_worker:
        mlx_lm_worker(args.mlx_lm_worker)
        return 0

    started = time.perf_counter()
    llama = llama_cpp_check(16) if args.llama_cpp else []
    directory = make_checkpoint(os.path.abspath(args.dir))
    prompt = bc.random_prompt(args.prompt, SHAPE["vocab_size"])
    sides = bc.runner_and_mlx_lm(
        __file__, directory, "mla", os.path.join(bc.BENCH_VENV, "bin", "python")
    )
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    profiles: list[dict] = []
    try:
        caches = {side: sides[side].call({"op": "cache", "prompt": prompt}) for side in SIDES}
        for side in SIDES:  # untimed: first-call allocations, compiled kernels
            sides[side].call({"op": "generate", "prompt": prompt[:32], "n": 8})
        for rep in range(args.reps):
            for side in SIDES:
                reply = sides[side].call({"op": "generate", "prompt": prompt, "n": args.decode})
                runs[side].append(bc.generation_summary(reply, len(prompt)))
                r = runs[side][-1]
                print(
                    f"rep {rep} {side:7s} prefill {r['prefill_tps']:7.1f} tok/s, decode "
                    f"{r['decode_tps']:6.2f} tok/s, load {r['load']['loadavg_1m']:.2f}",
                    file=sys.stderr,
                )
            if args.profile:
                command = {"op": "profile", "prompt": prompt, "reps": PROFILE_REPS}
                profiles.append(sides["runner"].call(command))
        info = {side: sides[side].info for side in SIDES}
    finally:
        for worker in sides.values():
            worker.close()
    elapsed = time.perf_counter() - started
    report(args, directory, prompt, runs, caches, profiles, llama, info, elapsed)
    return 0


def report(args, directory, prompt, runs, caches, profiles, llama, info, elapsed) -> None:
    summary = bc.versus_summary(runs, ("prefill_tps", "decode_tps"))
    latent, expanded = caches["runner"]["bytes_per_token"], caches["runner"]["expanded"]
    scale = RELEASED_LAYERS / SHAPE["num_hidden_layers"] / 2  # 47 layers, bfloat16
    released = (int(latent * scale), int(expanded * scale))
    ours, theirs = summary["runner"], summary["mlx-lm"]
    rows = [
        [
            name,
            f"{ours[key]:.2f}",
            f"{theirs[key]:.2f}",
            f"{ours[key + '_ratio']:.2f}x (paired {ours[key + '_paired_ratio']:.2f}x)",
            target,
        ]
        for key, name, target in (
            ("prefill_tps", "prefill tok/s", ""),
            ("decode_tps", "decode tok/s", ">= 1.0x"),
        )
    ]
    rows.append(
        [
            "cache bytes / token (float32)",
            f"{latent:,}",
            f"{caches['mlx-lm']['bytes_per_token']:,}",
            f"expanded heads: {expanded:,} ({expanded / latent:.1f}x the latent)",
            "",
        ]
    )
    ids = {side: runs[side][0]["ids"] for side in SIDES}
    print()
    print(bc.markdown_table(["", "runner", "mlx-lm", "ratio", "target"], rows))
    profile = {}
    if profiles:
        profile = {k: bc.median([p[k] for p in profiles]) for k in profiles[0]}
        print()
        print(
            bc.markdown_table(
                ["runner decode step part", "ms", "of the step"],
                [[k, f"{v * 1e3:.2f}", f"{v / profile['step']:.0%}"] for k, v in profile.items()],
            )
        )
    if llama:
        print()
        print(
            bc.markdown_table(
                ["deepseek2 file, F32", "greedy", "logits, max diff"],
                [
                    [r["case"], "failed", r["error"]]
                    if "error" in r
                    else [
                        r["case"],
                        f"{r['greedy_agreed']}/{r['tokens']}",
                        f"{r['max_logit_diff']:.1e} (span {r['span']:.2f})",
                    ]
                    for r in llama
                ],
            )
        )
    print()
    print(bc.describe_load([r["load"] for side in SIDES for r in runs[side]]))
    same = bc.print_versus_footer(info, ids, len(prompt), args.decode, args.reps, elapsed)
    print(
        f"released model ({RELEASED_LAYERS} layers, bfloat16): latent "
        f"{released[0]:,} bytes / token against {released[1]:,} expanded"
    )
    path = bc.write_json(
        args.out,
        {
            "checkpoint": directory,
            "shape": SHAPE,
            "prompt_tokens": len(prompt),
            "decode_tokens": args.decode,
            "reps": args.reps,
            "environment": bc.environment(),
            "summary": summary,
            "cache_bytes_per_token": {
                "runner": latent,
                "mlx-lm": caches["mlx-lm"]["bytes_per_token"],
                "expanded": expanded,
                "released_bf16": {"latent": released[0], "expanded": released[1]},
            },
            "profile_s": profile,
            "llama_cpp_float": llama,
            "profile_runs": profiles,
            "info": info,
            "runs": runs,
            "first_difference": same,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
