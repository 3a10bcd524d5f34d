"""Quality of the fast quantized product against the exact one, as llama.cpp's
``perplexity --kl-divergence`` measures a quantization: same model, same weights, two paths.

A quantized checkpoint kept quantized on the CPU multiplies its quantized panels one of two
ways (``runner.native.quantized``): exact (bit-for-bit the float32 product of the dequantized
weight) or fast (each activation row quantized to int8 per block of 32 inputs, integer dot
products; the default). Each of 20 built-in prompts is fed teacher-forced, 16 positions a
forward (decode-sized products; AVX2 builds compute 32 rows or more exactly), once per path;
every position of every prompt is compared:

- top-1 agreement: the fraction of positions where the fast logits' argmax is the exact one;
- KL(P_exact || P_fast) of the two softmax distributions, in float64: mean, 99th percentile
  and maximum over the positions;
- mean |logit error|: over every position and vocabulary entry.

Models: the default model (a Q4_1/Q8_0 GGUF), each ``--model PATH`` (any checkpoint the
loader keeps quantized), and with ``--hybrid`` the Qwen3.5 hybrid fixture of the tests
(tests/fixtures/reference/hybrid/qwen3_5_text, random float32 weights) quantized here with
``mx.quantize`` (4 bits, groups of 64) into an MLX-affine checkpoint in a temporary folder;
its weights are random, so its row checks the recurrent layers' path, not a trained model's
quality. Prints a markdown table, writes JSON under bench-results/. Usage:

    python scripts/bench/quant_quality.py [--hybrid] [--model PATH ...] [--no-default]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

TARGET_TOP1 = 0.99
TARGET_KL = 0.002
HYBRID_SOURCE = os.path.join(bc.ROOT, "tests", "fixtures", "reference", "hybrid", "qwen3_5_text")
HYBRID_GROUP, HYBRID_BITS = 64, 4
CHUNK = 16  # positions per forward: a verify feed's rows, below the exact product's 32

PROMPTS = [
    "The committee met on Tuesday to discuss next year's budget. After a long debate, the "
    "members agreed to cut travel spending by a fifth and to hire two more engineers.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis turns light into chemical energy. In the chloroplasts water is split, "
    "oxygen is released, and carbon dioxide is fixed into sugars by the Calvin cycle.",
    "User: Can you recommend a good book about the history of mathematics?\nAssistant: "
    "Certainly! A classic choice is a broad survey that starts with Babylonian tablets.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic, and cook "
    "until fragrant. Add crushed tomatoes, a pinch of salt, and simmer for twenty minutes.",
    '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], '
    '"notes": "Wrote what is often called the first computer program."}',
    "Solve for x: 3x + 7 = 22. Subtract 7 from both sides to get 3x = 15, then divide by 3, "
    "so x = 5. Check: 3 * 5 + 7 = 22, which is correct.",
    "Le soleil se couchait lentement derrière les collines. Les enfants rentraient de "
    "l'école en riant, et l'odeur du pain frais flottait dans les rues du village.",
    "Der Zug nach Berlin hatte zwanzig Minuten Verspätung. Die Reisenden warteten geduldig "
    "auf dem Bahnsteig und tranken Kaffee aus Pappbechern.",
    "SELECT customer_id, SUM(amount) AS total\nFROM orders\nWHERE created_at >= '2024-01-01'"
    "\nGROUP BY customer_id\nORDER BY total DESC\nLIMIT 10;",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
    "rough winds do shake the darling buds of May, and summer's lease hath all too short a "
    "date.",
    "The mitochondrion is the powerhouse of the cell. It produces ATP through oxidative "
    "phosphorylation, a process that depends on a gradient of protons across its inner "
    "membrane.",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin spent about two "
    "and a half hours outside the lunar module, while Michael Collins orbited above.",
    "Step 1: Unplug the router. Step 2: Wait thirty seconds. Step 3: Plug it back in and "
    "wait for the lights to turn green. Step 4: If the problem persists, call support.",
    "The tenant shall pay the rent on the first day of each month. Late payments incur a "
    "fee of five percent. Either party may end this agreement with sixty days' notice.",
    "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 5; i++) {\n"
    '        printf("%d squared is %d\\n", i, i * i);\n    }\n    return 0;\n}\n',
    "Why is the sky blue? Sunlight is scattered by the molecules of the air, and shorter "
    "wavelengths scatter much more strongly than longer ones, so blue light reaches us from "
    "every direction.",
    "Once upon a time, a little robot wanted to learn how to paint the sky. Every evening "
    "it rolled up the hill with a brush and tried to catch the colours of the sunset.",
    "Quarterly revenue rose 12% to $4.3 billion, driven by cloud services. Operating margin "
    "narrowed slightly because of higher data-center costs, the company said on Thursday.",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: What is the largest ocean?\n"
    "A: The Pacific Ocean.\nQ: How many legs does a spider have?\nA: Eight.",
]


def build_hybrid(directory: str) -> str:
    """An MLX-affine 4-bit copy of the hybrid test fixture in ``directory``: every Linear and
    embedding weight whose input width is whole groups quantized as mlx-lm stores it
    (weight, scales, biases), everything else (norms, conv, gates) kept float32."""
    import mlx.core as mx
    import mlx.nn as nn

    from runner.models import build_model

    with open(os.path.join(HYBRID_SOURCE, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    modules = {
        name
        for name, m in build_model(config).named_modules()
        if isinstance(m, nn.Linear | nn.Embedding)
    }
    tensors = {}
    for name, value in mx.load(os.path.join(HYBRID_SOURCE, "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if base != name and base in modules and value.shape[-1] % HYBRID_GROUP == 0:
            packed, scales, biases = mx.quantize(value, group_size=HYBRID_GROUP, bits=HYBRID_BITS)
            tensors.update({name: packed, f"{base}.scales": scales, f"{base}.biases": biases})
        else:
            tensors[name] = value
    os.makedirs(directory, exist_ok=True)
    mx.save_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    config["quantization"] = {"group_size": HYBRID_GROUP, "bits": HYBRID_BITS}
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(HYBRID_SOURCE, name), directory)
    return directory


def compare(exact: np.ndarray, fast: np.ndarray) -> dict[str, np.ndarray]:
    """Per-position agreement, KL(P_exact || P_fast) and mean |logit error| of two
    ``[positions, vocab]`` logit arrays, in float64."""
    exact, fast = exact.astype(np.float64), fast.astype(np.float64)

    def log_softmax(x: np.ndarray) -> np.ndarray:
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(exact), log_softmax(fast)
    return {
        "agree": exact.argmax(axis=-1) == fast.argmax(axis=-1),
        "kl": (np.exp(lp) * (lp - lq)).sum(axis=-1),
        "abs_err": np.abs(exact - fast).mean(axis=-1),
    }


def chunked_logits(model, ids: list[int], chunk: int) -> np.ndarray:
    """Teacher-forced logits ``[len(ids), vocab]``, fed ``chunk`` positions a forward over one
    set of caches: the row counts of decode steps and verify feeds, whose products are the
    fast ones (AVX2 builds compute products of 32 rows or more, prefill chunks, as the exact
    product: a whole prompt in one forward would compare the exact path with itself)."""
    import mlx.core as mx

    caches = model.make_caches()
    parts = []
    for start in range(0, len(ids), chunk):
        out, _ = model.forward(mx.array([ids[start : start + chunk]], dtype=mx.int32), caches)
        parts.append(np.array(out[0].astype(mx.float32)))
    return np.concatenate(parts)


def measure(path: str, label: str | None, max_tokens: int | None) -> dict:
    """Load ``path`` kept quantized, feed every prompt through both product paths, and
    return the statistics over all positions (and per prompt); ``label`` None: the model's
    name."""

    from runner import device, native
    from runner.loader import load_model
    from runner.models.layers import set_exact_products

    loaded = load_model(path, keep_quantized=True)
    if not loaded.quantized:
        raise SystemExit(f"{path}: no weight stays quantized on this device; nothing to compare")
    model = loaded.model
    # One model, both paths: ``set_exact_products`` is read when a product is added to the
    # graph, so with compiled blocks off (compile=False) every forward builds its graph anew
    # and follows the switch as set just before it. The two paths then share every weight
    # array, layout and kernel except the quantized product itself; compiled blocks (the
    # serving default) would keep whichever path they traced first.
    tuning = device.tune(model, compile=False)
    limit = min(max_tokens or loaded.context_length, loaded.context_length)
    per_prompt, stats = [], []
    for text in PROMPTS:
        ids = loaded.tokenizer.encode(text)[:limit]
        logits = {}
        for exact in (True, False):
            set_exact_products(exact)
            logits[exact] = chunked_logits(model, ids, CHUNK)
        s = compare(logits[True], logits[False])
        stats.append(s)
        per_prompt.append(
            {
                "positions": len(ids),
                "top1": float(s["agree"].mean()),
                "mean_kl": float(s["kl"].mean()),
            }
        )
    set_exact_products(False)
    agree = np.concatenate([s["agree"] for s in stats])
    kl = np.concatenate([s["kl"] for s in stats])
    abs_err = np.concatenate([s["abs_err"] for s in stats])
    return {
        "model": label or f"{loaded.name} (default model)",
        "path": path,
        "name": loaded.name,
        "tuning": tuning.describe(),
        "qpanel_isa": native.qpanel_isa(),
        "positions": int(agree.size),
        "top1": float(agree.mean()),
        "mean_kl": float(kl.mean()),
        "p99_kl": float(np.percentile(kl, 99)),
        "max_kl": float(kl.max()),
        "mean_abs_logit_err": float(abs_err.mean()),  # every position weighs the same
        "paths_differ": bool(abs_err.max() > 0),
        "per_prompt": per_prompt,
    }


def table(results: list[dict]) -> str:
    headers = ["model", "positions", "top-1 agreement", "mean KL", "p99 KL", "max KL"]
    headers.append("mean abs logit error")
    rows = [
        [
            r["model"],
            r["positions"],
            f"{100 * r['top1']:.2f}%",
            f"{r['mean_kl']:.5f}",
            f"{r['p99_kl']:.5f}",
            f"{r['max_kl']:.5f}",
            f"{r['mean_abs_logit_err']:.4f}",
        ]
        for r in results
    ]
    return bc.markdown_table(headers, rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH",
        help="also measure this quantized checkpoint (repeatable)",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help=f"also measure the Qwen3.5 hybrid test fixture quantized to {HYBRID_BITS} bits, "
        f"groups of {HYBRID_GROUP} (built in a temporary folder)",
    )
    parser.add_argument("--no-default", action="store_true", help="skip the default model")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cut each tokenized prompt to this many tokens (default: whole, up to the "
        "model's context length)",
    )
    parser.add_argument(
        "--out",
        default="quant_quality.json",
        help="JSON file (relative: under bench-results/)",
    )
    args = parser.parse_args()
    sys.path.insert(0, bc.ROOT)
    import runner  # noqa: F401  (the BLAS loads before MLX)

    models = [] if args.no_default else [(bc.default_model_path(), None)]
    models += [(path, os.path.basename(os.path.normpath(path))) for path in args.model]
    if not models and not args.hybrid:
        parser.error("nothing to measure: drop --no-default or give --model / --hybrid")
    results = [measure(path, label, args.max_tokens) for path, label in models]
    if args.hybrid:
        with tempfile.TemporaryDirectory(prefix="quant-quality-") as tmp:
            path = build_hybrid(os.path.join(tmp, "hybrid"))
            label = f"qwen3_5_text fixture, MLX affine {HYBRID_BITS}-bit g{HYBRID_GROUP}"
            results.append(measure(path, label, args.max_tokens))
    for r in results:
        r["meets_targets"] = r["top1"] >= TARGET_TOP1 and r["mean_kl"] <= TARGET_KL
        if not r["paths_differ"]:
            print(f"warning: {r['model']}: the two paths gave identical logits", file=sys.stderr)
    print(table(results))
    print(
        f"\ntargets: top-1 >= {100 * TARGET_TOP1:.0f}%, mean KL <= {TARGET_KL}; "
        + ", ".join(f"{r['model']}: {'met' if r['meets_targets'] else 'missed'}" for r in results)
    )
    data = {
        "prompts": len(PROMPTS),
        "targets": {"top1": TARGET_TOP1, "mean_kl": TARGET_KL},
        "environment": bc.environment(),
        "results": results,
    }
    print(f"wrote {bc.write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
