"""Write tests/fixtures/reference/rope_tables.json: RoPE inverse frequencies and attention
factors as Hugging Face transformers computes them (its ``ROPE_INIT_FUNCTIONS``).

    ./scripts/reference_env.sh && .venv-ref/bin/python scripts/make_rope_tables.py

Run it with ``.venv-ref/bin/python`` (torch, transformers: see reference_env.sh); nothing of
the runner is imported here. Each case is a config.json-like dict (the transformers 5 layout,
``rope_parameters``, and for most cases the pre-5 layout too: top-level ``rope_theta`` plus
``rope_scaling``); transformers reads it with ``AutoConfig.for_model`` and the case records,
for each sequence length a forward may end at, the ``inv_freq`` and ``attention_factor`` that
the rotary embedding uses for that forward: ``seq_len`` null is the value at initialisation
(what every forward of a static variant uses), otherwise ``seq_len`` is ``max(position_ids)
+ 1`` as ``dynamic_rope_update`` passes it (a tensor, so transformers' dynamic NTK base is
computed in float32, as at run time). ``tests/test_rope_tables.py`` compares the runner's
``runner.models.rope.RoPE`` with these numbers. Deterministic.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "reference" / "rope_tables.json"

BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
PHI3_SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7]
PHI3_LONG = [1.0, 1.3, 1.9, 2.8, 4.0, 5.5, 7.0, 8.0]
# A 48-pair LongRoPE table shaped like Phi-3.5's (head_dim 96).
LONG_48 = [round(1.0 + 0.05 * i + 0.002 * i * i, 4) for i in range(48)]
SHORT_48 = [round(1.0 + 0.002 * i, 4) for i in range(48)]


def case(name, rope, *, old=None, seq_lens=(None,), **top):
    """``rope``: the rope_parameters dict (transformers 5); ``old``: the pre-5 top-level keys
    (rope_theta, rope_scaling) that replace it in the old layout, or None for no old layout."""
    config = {**BASE, **top, "rope_parameters": rope}
    layouts = {"new": config}
    if old is not None:
        old_config = {k: v for k, v in config.items() if k != "rope_parameters"}
        old_config.update(old)
        layouts["old"] = old_config
    return {"name": name, "layouts": layouts, "seq_lens": list(seq_lens)}


def default(theta=10000.0, **kw):
    return {"rope_type": "default", "rope_theta": theta, **kw}


# fmt: off
CASES = [
    case("default_1e4", default(), old={"rope_theta": 10000.0},
         max_position_embeddings=256),
    case("default_5e5_dim64", default(500000.0), old={"rope_theta": 500000.0},
         hidden_size=256, head_dim=64, max_position_embeddings=256),
    case("linear_2", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
         old={"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
         max_position_embeddings=256),
    case("linear_4_theta_1e6", {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
         old={"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
         max_position_embeddings=256),
    case("dynamic_2_max48", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
         old={"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         seq_lens=(None, 12, 47, 48, 49, 50, 60, 84, 200), max_position_embeddings=48),
    case("dynamic_4_dim64", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500000.0},
         old={"rope_theta": 500000.0, "rope_scaling": {"type": "dynamic", "factor": 4.0}},
         seq_lens=(None, 2048, 2049, 4096, 8191), hidden_size=256, head_dim=64,
         max_position_embeddings=2048),
    case("llama3_fixture",
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0},
         old={"rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
         max_position_embeddings=256),
    case("llama3_1_dim128",
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
         old={"rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
         hidden_size=512, head_dim=128, max_position_embeddings=131072),
    case("yarn_fixture",
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
          "rope_theta": 10000.0},
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64}},
         max_position_embeddings=256),
    case("yarn_qwen_dim128",
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
          "rope_theta": 1000000.0},
         old={"rope_theta": 1000000.0,
              "rope_scaling": {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768}},
         hidden_size=512, head_dim=128, max_position_embeddings=131072),
    case("yarn_betas_untruncated",
         {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
          "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "rope_theta": 10000.0},
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 8.0,
                               "original_max_position_embeddings": 128, "beta_fast": 16.0,
                               "beta_slow": 2.0, "truncate": False}},
         hidden_size=128, head_dim=32, max_position_embeddings=1024),
    case("yarn_mscale",
         {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
          "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
         max_position_embeddings=2560),
    case("yarn_attention_factor",
         {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
          "attention_factor": 1.25, "rope_theta": 10000.0},
         max_position_embeddings=256),
    case("yarn_factor_from_lengths",
         {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64,
          "rope_theta": 10000.0},
         max_position_embeddings=512),
    case("longrope_phi3_fixture",
         {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0},
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope", "short_factor": PHI3_SHORT,
                               "long_factor": PHI3_LONG}},
         seq_lens=(None, 12, 32, 33, 60, 256), max_position_embeddings=256,
         original_max_position_embeddings=32),
    case("longrope_dim96_factor_given",
         {"rope_type": "longrope", "short_factor": SHORT_48, "long_factor": LONG_48,
          "original_max_position_embeddings": 4096, "factor": 32.0, "attention_factor": 1.19,
          "rope_theta": 10000.0},
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope", "short_factor": SHORT_48,
                               "long_factor": LONG_48, "original_max_position_embeddings": 4096,
                               "factor": 32.0, "attention_factor": 1.19}},
         seq_lens=(None, 4096, 4097, 131072), hidden_size=384, head_dim=96,
         max_position_embeddings=131072),
    case("longrope_no_extension",
         {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
          "original_max_position_embeddings": 256, "rope_theta": 10000.0},
         seq_lens=(None, 256, 257), max_position_embeddings=256),
]
# fmt: on


def transformers_config(config: dict):
    from transformers import AutoConfig

    kwargs = copy.deepcopy(config)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def tables(config: dict, seq_lens) -> list[dict]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = transformers_config(config)
    rope_type = hf.rope_parameters["rope_type"]
    out = []
    for seq_len in seq_lens:
        if rope_type == "default":
            inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        else:
            arg = None if seq_len is None else torch.tensor(seq_len)
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len=arg)
        out.append(
            {
                "seq_len": seq_len,
                "inv_freq": [float(v) for v in inv_freq.to(torch.float32).tolist()],
                "attention_factor": float(factor),
            }
        )
    return out, rope_type, json.loads(json.dumps(hf.rope_parameters))


def main() -> int:
    import transformers

    cases = []
    for spec in CASES:
        results = {}
        for layout, config in spec["layouts"].items():
            results[layout] = tables(config, spec["seq_lens"])
        first = next(iter(results.values()))
        for layout, other in results.items():  # transformers reads both layouts alike
            if other[0] != first[0]:
                raise RuntimeError(f"{spec['name']}: layout {layout} differs for transformers")
        cases.append(
            {
                "name": spec["name"],
                "rope_type": first[1],
                "configs": spec["layouts"],
                "transformers_rope_parameters": first[2],
                "tables": first[0],
            }
        )
    data = {
        "about": "RoPE inv_freq / attention_factor from transformers' ROPE_INIT_FUNCTIONS "
        "(scripts/make_rope_tables.py); seq_len null = at initialisation, else the "
        "max(position_ids) + 1 of a forward",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "cases": cases,
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{OUT}: {len(cases)} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
