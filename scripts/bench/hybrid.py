"""Qwen3.5 hybrid speed: this runner against mlx-lm's ``qwen3_5`` on the same random weights,
and what speculation costs on a hybrid (verify feeds, the rollback of a rejection).

The checkpoint is made on the fly: a random Qwen3.5 with the 0.8B shape (hidden 1024, 24
layers of which every 4th is gated full attention, 8 query / 2 KV heads of 256, FFN 3584,
Gated DeltaNet with 16 key / 16 value heads of 128 and a conv of 4), the vocabulary cut to 32k,
float32, tied head, saved in the released multimodal layout (``model.language_model.*``,
nested ``text_config``), which both loaders read. Each side is a process loaded once (mlx-lm
in the separate reference venv ``.venv-ref``, never a project dependency, as
scripts/bench/decode.py runs it); runs are interleaved (A B A B ...) after one untimed
warm-up run per side, and every figure is a median. Usage:

    python scripts/bench/hybrid.py [--reps 5] [--prompt 512] [--decode 48] [--dir DIR]

- prefill tok/s: prompt tokens over the time to the first generated token (prefix cache off);
- decode tok/s: tokens after the first over the time between the first and the last one;
- verify k rows: one fused forward over ``[x, d1..dk-1]`` through the round driver's MLX seam
  (``drafting.mlx_ops``: the recurrent layers keep the state after every prefix, one host
  sync), relative to a one-row step through the same seam;
- restore: rolling the caches back after a rejected verify (``MlxRoundOps.rewind`` to
  ``entry + 1``: attention offsets move, recurrent layers take a kept state), relative to
  that step; "keep" is what keeping the prefix states adds to a verify feed.
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

REF_VENV = os.path.join(bc.ROOT, ".venv-ref")
DEFAULT_DIR = os.path.join(bc.RESULTS_DIR, "hybrid-0.8b-random")
SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 3584,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 32000,
}
SIDES = ("runner", "mlx-lm")
VERIFY_ROWS = (2, 3, 5)


# ----------------------------------------------------------------------------- checkpoint
def checkpoint_config() -> dict:
    layers = SHAPE["num_hidden_layers"]
    text = {
        "model_type": "qwen3_5_text",
        **SHAPE,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "dtype": "float32",
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "bench_hybrid": 1,  # the generator's version: a changed generator makes a new one
    }


def make_checkpoint(directory: str) -> str:
    """Write the random checkpoint (Hugging Face layout: conv ``[C, 1, K]``, zero-centred
    gains stored as ``w``) unless ``directory`` already holds this one."""
    config = checkpoint_config()
    path = os.path.join(directory, "config.json")
    if os.path.exists(path) and os.path.exists(os.path.join(directory, "model.safetensors")):
        with open(path, encoding="utf-8") as f:
            if json.load(f) == config:
                return directory
    import mlx.core as mx

    print(f"writing a random 0.8B-shaped Qwen3.5 to {directory} ...", file=sys.stderr)
    os.makedirs(directory, exist_ok=True)
    mx.random.seed(0)
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    heads, kv, hd = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    keys = SHAPE["linear_num_key_heads"] * SHAPE["linear_key_head_dim"]
    values = SHAPE["linear_num_value_heads"] * SHAPE["linear_value_head_dim"]
    vh, conv = SHAPE["linear_num_value_heads"], SHAPE["linear_conv_kernel_dim"]

    def normal(*shape: int, std: float = 0.02):
        return (std * mx.random.normal(shape)).astype(mx.float32)

    weights = {
        "model.language_model.embed_tokens.weight": normal(SHAPE["vocab_size"], h),
        "model.language_model.norm.weight": normal(h, std=0.1),
    }
    for i, kind in enumerate(config["text_config"]["layer_types"]):
        p = f"model.language_model.layers.{i}."
        layer = {
            "input_layernorm.weight": normal(h, std=0.1),
            "post_attention_layernorm.weight": normal(h, std=0.1),
            "mlp.gate_proj.weight": normal(inter, h),
            "mlp.up_proj.weight": normal(inter, h),
            "mlp.down_proj.weight": normal(h, inter),
        }
        if kind == "full_attention":
            layer.update(
                {
                    "self_attn.q_proj.weight": normal(2 * heads * hd, h),
                    "self_attn.k_proj.weight": normal(kv * hd, h),
                    "self_attn.v_proj.weight": normal(kv * hd, h),
                    "self_attn.o_proj.weight": normal(h, heads * hd),
                    "self_attn.q_norm.weight": normal(hd, std=0.1),
                    "self_attn.k_norm.weight": normal(hd, std=0.1),
                }
            )
        else:
            layer.update(
                {
                    "linear_attn.in_proj_qkv.weight": normal(2 * keys + values, h),
                    "linear_attn.in_proj_z.weight": normal(values, h),
                    "linear_attn.in_proj_b.weight": normal(vh, h),
                    "linear_attn.in_proj_a.weight": normal(vh, h),
                    "linear_attn.conv1d.weight": normal(2 * keys + values, 1, conv, std=0.3),
                    "linear_attn.dt_bias": mx.ones((vh,)),
                    "linear_attn.A_log": mx.log(mx.random.uniform(1.0, 16.0, (vh,))),
                    "linear_attn.norm.weight": mx.ones((SHAPE["linear_value_head_dim"],)),
                    "linear_attn.out_proj.weight": normal(h, values),
                }
            )
        weights.update({p + k: v for k, v in layer.items()})
    mx.eval(weights)
    mx.save_safetensors(os.path.join(directory, "model.safetensors"), weights)
    del weights
    bc.write_word_tokenizer(directory, SHAPE["vocab_size"], "<|im_end|>")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory


# ----------------------------------------------------------------------------- runner side
def runner_worker(directory: str) -> None:
    """This runner's Engine in process (prefix cache off, no head): generate and the seam's
    verify / restore micro-benchmark."""
    sys.path.insert(0, bc.ROOT)
    import mlx.core as mx

    import runner
    from cache.recurrent import RecurrentCache
    from drafting.mlx_ops import MlxRoundOps
    from drafting.session import Proposal
    from runner.engine import Engine, EngineOptions
    from runner.prefill import prefill
    from runner.sampler import Sampler, SamplingParams

    engine = Engine(EngineOptions(model_path=directory, use_draft=False, prefix_cache=False))
    model = engine.model

    def generate(command: dict) -> dict:
        return bc.engine_generate(engine, command["prompt"], command["n"])

    def seam(command: dict) -> dict:
        """Median seconds of a one-row step, each verify size, the rollback of a rejection
        and the same verify feeds without keeping prefix states, all through one seam."""
        prompt, reps = command["prompt"], command["reps"]
        caches = model.make_caches()
        prefill(model, caches, prompt[:-1], 0, chunk=512)
        params = SamplingParams(temperature=0.0, repeat_penalty=1.0)
        sampler = Sampler(params, prompt, engine.info.vocab_size, engine.info.context_length)
        ops = MlxRoundOps(model, caches, None, sampler)
        recurrent = [c for c in caches if isinstance(c, RecurrentCache)]
        times: dict[str, list[float]] = {}
        x = prompt[-1]

        def timed(name: str, fn) -> None:
            t0 = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t0)

        def plain_feed(rows: int) -> None:  # the same forward and sync, no prefix states kept
            entry = ops.position
            hidden = model.hidden(mx.array([[x] * rows]), caches)
            logits = model.unembed(hidden[0])
            mx.eval(mx.argmax(logits, axis=-1), [c.state for c in caches])
            for c in caches:
                c.rewind(entry)

        entry = ops.position  # every feed starts here (a state each feed keeps)
        for _ in range(reps + 1):  # the first pass warms every shape up, untimed
            timed("step", lambda: ops.verify_feed(x, None))
            ops.rewind(entry)
            for rows in VERIFY_ROWS:
                drafts = Proposal(mx.array([x] * (rows - 1), dtype=mx.int32), entry + 1)
                timed(f"verify{rows}", lambda d=drafts: ops.verify_feed(x, d))
                timed(f"restore{rows}", lambda: ops.rewind(entry + 1))  # d1 rejected
                ops.rewind(entry)
                timed(f"nokeep{rows}", lambda r=rows: plain_feed(r))
        assert all(not c._wanted for c in recurrent)
        return {k: statistics.median(v[1:]) for k, v in times.items()}

    info = {"blas": runner.blas.blas_in_use(), "tuning": engine.tuning.describe()}
    bc.serve_worker(info, lambda c: generate(c) if c["op"] == "generate" else seam(c))


# ----------------------------------------------------------------------------- mlx-lm side
def mlx_lm_worker(directory: str) -> None:
    """Runs inside .venv-ref: mlx-lm's own qwen3_5 model and generate loop, greedy."""
    _, generate, info = bc.mlx_lm_side(directory)
    bc.serve_worker(info, generate)


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed runs per side")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=48, help="tokens to generate")
    parser.add_argument("--seam-reps", type=int, default=12, help="verify/restore samples")
    parser.add_argument("--dir", default=DEFAULT_DIR, help="where the checkpoint is kept")
    parser.add_argument("--out", default="hybrid.json", help="file name under bench-results/")
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
    directory = make_checkpoint(os.path.abspath(args.dir))
    prompt = bc.random_prompt(args.prompt, SHAPE["vocab_size"])
    sides = bc.runner_and_mlx_lm(
        __file__, directory, "hybrid", os.path.join(REF_VENV, "bin", "python")
    )
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    seams: list[dict] = []
    try:
        for side in SIDES:  # untimed: first-call allocations, compiled kernels
            sides[side].call({"op": "generate", "prompt": prompt[:64], "n": 8})
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
            seams.append(
                sides["runner"].call({"op": "seam", "prompt": prompt[:128], "reps": args.seam_reps})
            )
        info = {side: sides[side].info for side in SIDES}
    finally:
        for worker in sides.values():
            worker.close()
    report(args, directory, prompt, runs, seams, info, time.perf_counter() - started)
    return 0


def report(args, directory, prompt, runs, seams, info, elapsed) -> None:
    summary = bc.versus_summary(runs, ("prefill_tps", "decode_tps"))
    seam = {k: bc.median([s[k] for s in seams]) for k in seams[0]}
    step = seam["step"]
    rows = [
        [
            "prefill tok/s",
            f"{summary['runner']['prefill_tps']:.1f}",
            f"{summary['mlx-lm']['prefill_tps']:.1f}",
            f"{summary['runner']['prefill_tps_ratio']:.2f}x "
            f"(paired {summary['runner']['prefill_tps_paired_ratio']:.2f}x)",
            ">= 2x",
        ],
        [
            "decode tok/s",
            f"{summary['runner']['decode_tps']:.2f}",
            f"{summary['mlx-lm']['decode_tps']:.2f}",
            f"{summary['runner']['decode_tps_ratio']:.2f}x "
            f"(paired {summary['runner']['decode_tps_paired_ratio']:.2f}x)",
            ">= 1.0x",
        ],
        ["one-row step (seam)", f"{step * 1e3:.1f} ms", "", "1.00", ""],
    ]
    for n in VERIFY_ROWS:
        keep = seam[f"verify{n}"] / seam[f"nokeep{n}"] - 1
        rows.append(
            [
                f"verify {n} rows",
                f"{seam[f'verify{n}'] * 1e3:.1f} ms",
                "",
                f"{seam[f'verify{n}'] / step:.2f} x step (keep +{keep:.0%})",
                "",
            ]
        )
    restore = bc.median([seam[f"restore{n}"] for n in VERIFY_ROWS])
    rows.append(
        [
            "restore after a rejection",
            f"{restore * 1e6:.0f} us",
            "",
            f"{restore / step:.2%} of a step",
            "< 5%",
        ]
    )
    ids = {side: runs[side][0]["ids"] for side in SIDES}
    print()
    print(bc.markdown_table(["", "runner", "mlx-lm", "ratio", "target"], rows))
    print()
    print(bc.describe_load([r["load"] for side in SIDES for r in runs[side]]))
    same = bc.print_versus_footer(info, ids, len(prompt), args.decode, args.reps, elapsed)
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
            "seam_s": seam,
            "seam_runs": seams,
            "info": info,
            "runs": runs,
            "first_difference": same,
            "elapsed_s": elapsed,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
