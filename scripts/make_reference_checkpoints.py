"""Write tiny random reference checkpoints and Hugging Face's outputs for them (test fixtures).

    ./scripts/reference_env.sh && .venv-ref/bin/python scripts/make_reference_checkpoints.py

Run it with ``.venv-ref/bin/python`` (torch, transformers, mlx-lm: see reference_env.sh);
never with the project's venv, and nothing of the runner is imported here. Every case is a
Hugging Face directory under ``tests/fixtures/reference/<case>/`` (config.json as transformers
saves it, or rewritten into the pre-5 layout Hub checkpoints have, model.safetensors, the test
suite's tokenizer, generation_config.json) plus what transformers computes for it, in float32
with eager attention:

- ``reference.npz``: ``prompt_logits[p]`` the logits of the last prompt position (one forward
  of the prompt, no cache), ``greedy[p]`` 24 greedy tokens decoded one at a time through
  transformers' own cache after that prefill (never stopping at EOS), ``step_logit[p, i]`` the
  logit of ``greedy[p, i]`` when it was chosen, ``margin[p, i]`` its lead over the runner-up,
  and ``final_logits[p]`` the logits after the 24th token was fed too (the deepest position);
- ``reference.json``: what the case exercises, the versions, the prompts and greedy tokens,
  max |logit| and the smallest greedy margin (so a tolerance means something).

Prompts (token ids, lengths 12, 35 and 60) are drawn from a fixed seed; a prompt whose greedy
tokens contain EOS or a near tie (margin < 1e-3) is redrawn with the next seed, so every case's
24 greedy tokens are EOS-free and the runner's pipe (which stops at EOS) streams all of them.

Quantized cases are the llama_default_old model converted by ``mlx_lm.convert`` (the files and
the ``quantization`` config exactly as mlx-lm writes them); their reference is transformers run
on the exact float32 dequantization (scales and biases cast to float32 first) of those files.
Deterministic: the same versions write the same files.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "reference"
PROMPT_LENGTHS = (12, 35, 60)
GREEDY = 24
PROMPT_SEED = 1234
MIN_MARGIN = 1e-3
# First ids of the tokenizer are its special tokens (tests/checkpoints.py SPECIAL_TOKENS).
FIRST_PLAIN_ID = 5

torch.set_num_threads(2)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a network
torch.use_deterministic_algorithms(True)


# --- the test suite's tokenizer, without importing tests/checkpoints.py (it imports mlx/runner)


def _checkpoints_namespace() -> dict:
    """``tokenizer_json`` and its constants, read out of tests/checkpoints.py with ``ast``."""
    source = (ROOT / "tests" / "checkpoints.py").read_text(encoding="utf-8")
    wanted = {"SPECIAL_TOKENS", "EOS_TOKEN", "_CORPUS", "tokenizer_json"}
    body = []
    for node in ast.parse(source).body:
        names = set()
        if isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef):
            names = {node.name}
            node.decorator_list = []  # functools.lru_cache: not needed for one call
        if names & wanted:
            body.append(node)
    namespace: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "tests/checkpoints.py", "exec"), namespace)
    return namespace


_CK = _checkpoints_namespace()
TOKENIZER_JSON: str = _CK["tokenizer_json"]()
EOS_TOKEN: str = _CK["EOS_TOKEN"]


def _tokenizer_facts() -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(TOKENIZER_JSON)
    return tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(EOS_TOKEN)


VOCAB, EOS_ID = _tokenizer_facts()


# --- cases


@dataclass
class Spec:
    """One random model; ``layouts`` says which config layouts get a case directory.

    ``config`` is in transformers-5 terms (``rope_parameters``); ``old`` holds the pre-5 keys
    (``rope_theta``, ``rope_scaling``, ...) that replace ``old_drop`` in the old layout.
    """

    name: str
    family: str  # model_type
    exercises: str
    config: dict
    layouts: tuple[str, ...] = ("old",)
    old: dict = field(default_factory=dict)
    old_drop: tuple[str, ...] = ("rope_parameters",)
    weights_dtype: str = "bfloat16"  # how model.safetensors stores the floats
    # Greedy decode through the cache equals a full uncached forward (False: dynamic/longrope
    # RoPE, where transformers rotates each new token with the frequencies of that moment).
    cache_equals_full: bool = True
    seed: int = 0  # added to the name's CRC: another draw of the same architecture

    def case(self, layout: str) -> str:
        return f"{self.name}_{layout}" if len(self.layouts) > 1 or layout == "new" else self.name


BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=EOS_ID,
    pad_token_id=None,
)


def cfg(**kw) -> dict:
    out = dict(BASE)
    out.update(kw)
    return out


def rope(kind: str = "default", theta: float = 10000.0, **kw) -> dict:
    return {"rope_type": kind, "rope_theta": theta, **kw}


PHI3_SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7]
PHI3_LONG = [1.0, 1.3, 1.9, 2.8, 4.0, 5.5, 7.0, 8.0]

# fmt: off
SPECS = [
    Spec("llama_default", "llama",
         "llama, default RoPE with theta 5e5, untied lm_head, float32 weights; the old layout "
         "(top-level rope_theta, rope_scaling null) and the same model as transformers 5 saves it "
         "(rope_parameters); also the base of the quantized cases",
         cfg(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters=rope(theta=500000.0)),
         layouts=("old", "new"), old={"rope_theta": 500000.0, "rope_scaling": None},
         weights_dtype="float32"),
    Spec("llama_tied", "llama", "llama with a tied output head (no lm_head tensor), theta 1e4",
         cfg(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_parameters=rope()),
         old={"rope_theta": 10000.0}),
    Spec("llama_bias", "llama",
         "llama with attention_bias (q, k, v and o_proj biases) and mlp_bias (gate, up, down)",
         cfg(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False,
             attention_bias=True, mlp_bias=True, rope_parameters=rope()),
         old={"rope_theta": 10000.0}, seed=1),
    Spec("llama_rope_linear", "llama", "llama, linear RoPE scaling (factor 2)",
         cfg(model_type="llama", tie_word_embeddings=True,
             rope_parameters=rope("linear", factor=2.0)),
         layouts=("old", "new"),
         old={"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    Spec("llama_rope_dynamic", "llama",
         "llama, dynamic NTK RoPE (factor 2) with max_position_embeddings 48: the 12-token prompt "
         "stays below 48, the 35-token one crosses 48 while decoding, the 60-token one starts "
         "past it; transformers recomputes the base for the current length at every forward "
         "and leaves cached keys as they were rotated",
         cfg(model_type="llama", tie_word_embeddings=True, max_position_embeddings=48,
             rope_parameters=rope("dynamic", factor=2.0)),
         layouts=("old", "new"),
         old={"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         cache_equals_full=False),
    Spec("llama_rope_llama3", "llama",
         "llama, Llama 3.1 RoPE (factor 8, low 1, high 4, original max 64, theta 5e5): the 8 "
         "frequencies fall in all three bands (kept, smoothed, divided)",
         cfg(model_type="llama", tie_word_embeddings=True,
             rope_parameters=rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=64)),
         layouts=("old", "new"),
         old={"rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    Spec("llama_rope_yarn", "llama",
         "llama, YaRN RoPE (factor 4, original max 64, beta 32/1, attention factor "
         "0.1 ln 4 + 1 = 1.1386 on cos and sin)",
         cfg(model_type="llama", tie_word_embeddings=True,
             rope_parameters=rope("yarn", factor=4.0, original_max_position_embeddings=64)),
         layouts=("old", "new"),
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64}}),
    Spec("mistral_sliding", "mistral",
         "mistral with sliding_window 16 (< every prompt + generation: keys older than 16 "
         "positions are masked), theta 1e6, untied",
         cfg(model_type="mistral", rms_norm_eps=1e-5, tie_word_embeddings=False,
             sliding_window=16, rope_parameters=rope(theta=1000000.0)),
         old={"rope_theta": 1000000.0}),
    Spec("qwen2_sliding", "qwen2",
         "qwen2 with use_sliding_window, sliding_window 16, max_window_layers 1 over 3 layers: "
         "layer 0 full attention, layers 1-2 sliding (transformers: layer i slides when "
         "i >= max_window_layers); q/k/v biases; old layout without layer_types, new with them",
         cfg(model_type="qwen2", num_hidden_layers=3, rms_norm_eps=1e-6, tie_word_embeddings=False,
             use_sliding_window=True, sliding_window=16, max_window_layers=1,
             rope_parameters=rope(theta=1000000.0)),
         layouts=("old", "new"), old={"rope_theta": 1000000.0},
         old_drop=("rope_parameters", "layer_types")),
    Spec("qwen2_bias", "qwen2",
         "qwen2 without a window: q/k/v biases (none on o_proj), tied head; the config says "
         "sliding_window 16 but use_sliding_window false, so no layer slides",
         cfg(model_type="qwen2", rms_norm_eps=1e-6, tie_word_embeddings=True,
             use_sliding_window=False, sliding_window=None, max_window_layers=28,
             rope_parameters=rope(theta=1000000.0)),
         old={"rope_theta": 1000000.0, "sliding_window": 16},
         old_drop=("rope_parameters", "layer_types"), seed=2),
    Spec("qwen3", "qwen3",
         "qwen3: RMS q_norm/k_norm per head before RoPE, explicit head_dim, theta 1e6 (non-"
         "default), tied head; old and new config layouts",
         cfg(model_type="qwen3", rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters=rope(theta=1000000.0)),
         layouts=("old", "new"), old={"rope_theta": 1000000.0},
         old_drop=("rope_parameters", "layer_types")),
    Spec("phi3_longrope", "phi3",
         "phi3: fused qkv_proj and gate_up_proj, LongRoPE with short/long factors, original max "
         "32 and max 256 (attention factor sqrt(1 + ln 8 / ln 32)): transformers uses the long "
         "factors for a forward whose last position is >= 32, the short ones before (the "
         "12-token prompt switches mid-decode and its cached keys keep the short rotation)",
         cfg(model_type="phi3", head_dim=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
             original_max_position_embeddings=32,
             rope_parameters=rope("longrope", short_factor=PHI3_SHORT, long_factor=PHI3_LONG,
                                  original_max_position_embeddings=32)),
         layouts=("old", "new"),
         old={"rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope", "short_factor": PHI3_SHORT,
                               "long_factor": PHI3_LONG}},
         cache_equals_full=False),
    Spec("gemma2", "gemma2",
         "gemma2: (1 + w) RMS norms, pre/post feedforward norms and post-attention norm, "
         "embeddings scaled by sqrt(hidden), GELU-tanh, query_pre_attn_scalar 24 (!= head_dim), "
         "attention soft-cap 1.5 and final logit soft-cap 15, alternating sliding (window 16) / "
         "global layers over 3 layers, tied head",
         cfg(model_type="gemma2", num_hidden_layers=3, rms_norm_eps=1e-6,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=16,
             attn_logit_softcapping=1.5, final_logit_softcapping=15.0, tie_word_embeddings=True,
             rope_parameters=rope()),
         layouts=("old", "new"), old={"rope_theta": 10000.0},
         old_drop=("rope_parameters", "layer_types"), seed=2),
    Spec("gemma3_text", "gemma3_text",
         "gemma3_text: gemma norms plus (1 + w) q/k norms, local RoPE base 1e4 on sliding layers "
         "and global base 1e6 with linear scaling 2 on full layers, layers [sliding, sliding, "
         "full] with window 16, query_pre_attn_scalar 24, scaled embeddings, GELU-tanh, no soft "
         "caps; old layout: rope_theta / rope_local_base_freq / rope_scaling / "
         "sliding_window_pattern 3",
         cfg(model_type="gemma3_text", num_hidden_layers=3, rms_norm_eps=1e-6,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=16,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             tie_word_embeddings=True,
             rope_parameters={"sliding_attention": rope(theta=10000.0),
                              "full_attention": rope("linear", 1000000.0, factor=2.0)}),
         layouts=("old", "new"),
         old={"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0},
              "sliding_window_pattern": 3},
         old_drop=("rope_parameters", "layer_types")),
]

# mlx-lm conversions of llama_default_old: (case, dtype of scales/biases and unquantized
# tensors, bits, group size, predicate, what it exercises)
QUANTIZED = [
    ("llama_q4_f16", "float16", 4, 64, None,
     "mlx-lm affine 4-bit, group 64, float16 scales/biases (and float16 norms)"),
    ("llama_q4_bf16", "bfloat16", 4, 64, None,
     "mlx-lm affine 4-bit, group 64, bfloat16 scales/biases (and bfloat16 norms)"),
    ("llama_q8", "float16", 8, 64, None, "mlx-lm affine 8-bit, group 64, float16 scales"),
    ("llama_q8_bf16", "bfloat16", 8, 64, None, "mlx-lm affine 8-bit, group 64, bfloat16 scales"),
    ("llama_q_mixed_8_4", "float16", 4, 64, "down8",
     "mlx-lm per-layer mixed quantization: down_proj 8-bit (per-layer entries in the config's "
     "quantization dict), everything else 4-bit (the top-level bits)"),
    ("llama_q_mixed_4_6", "float16", 4, 64, "mixed_4_6",
     "mlx-lm's built-in mixed_4_6 recipe: 6-bit v_proj/down_proj in layer 1 and a 6-bit "
     "lm_head (6 bits straddle the uint32 words), 4-bit elsewhere; every layer has an entry"),
]
# fmt: on


# --- weights


def randomize(model: torch.nn.Module, spec: Spec, seed: int) -> None:
    """Seeded weights with signal, so that every part of the model moves the logits and greedy
    decoding does not just repeat one token: linear N(0, 1/fan_in) (o_proj and down_proj x2,
    so the blocks, not the token's own embedding, dominate the residual stream), embedding rows
    of one norm in random directions, lm_head N(0, 0.5^2), norm scales 1 + N(0, 0.2^2) (gemma
    stores them as w of (1 + w)), biases N(0, 0.2^2)."""
    gen = torch.Generator().manual_seed(seed)
    gemma = spec.family.startswith("gemma")
    tied = bool(model.config.tie_word_embeddings)
    # A tied head reads the embedding: short rows (less of the token itself in the residual,
    # which makes greedy decoding repeat it) and a final norm scale that brings the logits back.
    row_norm = 2.0 if tied else 4.0
    final_scale = 2.0 if tied else 1.0
    if gemma:  # embeddings are multiplied by sqrt(hidden) = 8 on the way in
        row_norm, final_scale = row_norm / 8, final_scale * 8
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                value = final_scale if name == "model.norm.weight" else 1.0
                value = value * (1.0 + 0.2 * noise)
                if gemma:  # stored as w in (1 + w)
                    value = value - 1.0
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name:
                value = noise / noise.norm(dim=-1, keepdim=True) * row_norm
            elif "lm_head" in name:
                value = 0.5 * noise
            else:
                value = noise / math.sqrt(p.shape[-1])
                if "o_proj" in name or "down_proj" in name:
                    value = value * 2.0
            if spec.weights_dtype != "float32":
                value = value.to(getattr(torch, spec.weights_dtype)).to(torch.float32)
            p.copy_(value)


def build(spec: Spec):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    kwargs = copy.deepcopy(spec.config)
    model_type = kwargs.pop("model_type")
    kwargs = {
        k: v
        for k, v in kwargs.items()
        if v is not None or k in ("bos_token_id", "pad_token_id", "sliding_window")
    }
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    randomize(model, spec, zlib.crc32(spec.name.encode()) + spec.seed)
    model.eval()
    return model


def write_support_files(directory: Path) -> None:
    (directory / "tokenizer.json").write_text(TOKENIZER_JSON, encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": [EOS_ID], "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def save_case(model, spec: Spec, layout: str, directory: Path) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    with tempfile.TemporaryDirectory() as tmp:
        saved = model.to(getattr(torch, spec.weights_dtype))
        saved.save_pretrained(tmp, safe_serialization=True)
        model.to(torch.float32)
        directory.mkdir(parents=True)
        shutil.copyfile(Path(tmp) / "model.safetensors", directory / "model.safetensors")
        config = json.loads((Path(tmp) / "config.json").read_text())
    if layout == "old":
        for key in spec.old_drop:
            config.pop(key, None)
        config.update(copy.deepcopy(spec.old))
        if "dtype" in config:  # transformers 4 called it torch_dtype
            config["torch_dtype"] = config.pop("dtype")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_support_files(directory)


def load_reference(directory: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


# --- reference outputs


@torch.no_grad()
def run_prompt(make_model, prompt: list[int]) -> dict:
    """Transformers' outputs for one prompt, on a fresh model (dynamic and longrope RoPE keep
    state between forwards)."""
    model = make_model()
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    cache = out.cache
    logits = out.logits[0, -1].float()
    prompt_logits = logits.clone()
    greedy, chosen, margins = [], [], []
    for _ in range(GREEDY):
        top = torch.topk(logits, 2)
        token = int(top.indices[0])
        greedy.append(token)
        chosen.append(float(top.values[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].float()
    final_logits = logits.clone()
    # Self-check: the same positions in one uncached forward of a fresh model.
    full = make_model()(input_ids=torch.tensor([prompt + greedy])).logits[0].float()
    rows = full[len(prompt) - 1 :]
    gathered = rows[torch.arange(GREEDY), torch.tensor(greedy)]
    cache_vs_full = max(
        float((rows[0] - prompt_logits).abs().max()),
        float((gathered - torch.tensor(chosen)).abs().max()),
        float((rows[-1] - final_logits).abs().max()),
    )
    return dict(
        prompt_logits=prompt_logits.numpy(),
        greedy=greedy,
        step_logit=np.array(chosen, np.float32),
        margin=np.array(margins, np.float32),
        final_logits=final_logits.numpy(),
        cache_vs_full=cache_vs_full,
    )


def draw_prompt(index: int, attempt: int) -> list[int]:
    rng = np.random.default_rng(PROMPT_SEED + 1000 * index + attempt)
    return [int(t) for t in rng.integers(FIRST_PLAIN_ID, VOCAB, size=PROMPT_LENGTHS[index])]


def choose_prompts(make_model) -> tuple[list[list[int]], list[dict], list[int]]:
    """Per prompt length the first seed whose greedy run has no EOS and no near tie."""
    prompts, results, attempts = [], [], []
    for index in range(len(PROMPT_LENGTHS)):
        for attempt in range(50):
            prompt = draw_prompt(index, attempt)
            result = run_prompt(make_model, prompt)
            if EOS_ID not in result["greedy"] and result["margin"].min() >= MIN_MARGIN:
                break
        else:
            raise RuntimeError("no prompt without EOS / near ties in 50 draws")
        prompts.append(prompt)
        results.append(result)
        attempts.append(attempt)
    return prompts, results, attempts


def versions() -> dict:
    import mlx.core as mx
    import mlx_lm
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx": mx.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


def write_reference(
    directory: Path, case: str, family: str, exercises: str, prompts, results, extra: dict
) -> dict:
    arrays = {
        "prompt_logits": np.stack([r["prompt_logits"] for r in results]).astype(np.float32),
        "final_logits": np.stack([r["final_logits"] for r in results]).astype(np.float32),
        "greedy": np.array([r["greedy"] for r in results], np.int32),
        "step_logit": np.stack([r["step_logit"] for r in results]),
        "margin": np.stack([r["margin"] for r in results]),
    }
    for i, p in enumerate(prompts):
        arrays[f"prompt_{i}"] = np.array(p, np.int32)
    np.savez_compressed(directory / "reference.npz", **arrays)
    all_logits = np.concatenate([arrays["prompt_logits"], arrays["final_logits"]])
    meta = {
        "case": case,
        "family": family,
        "exercises": exercises,
        "versions": versions(),
        "eos_token_id": EOS_ID,
        "vocab_size": VOCAB,
        "prompts": prompts,
        "greedy": arrays["greedy"].tolist(),
        "greedy_contains_eos": False,
        "max_abs_logit": float(np.abs(all_logits).max()),
        "max_abs_step_logit": float(np.abs(arrays["step_logit"]).max()),
        "min_greedy_margin": float(arrays["margin"].min()),
        "cache_vs_full_forward_max_diff": max(r["cache_vs_full"] for r in results),
        "reference": "transformers AutoModelForCausalLM, float32, attn_implementation=eager, "
        "CPU; greedy = prefill then one token at a time through its cache",
        **extra,
    }
    (directory / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def rope_view(model) -> dict:
    """What transformers made of a config's RoPE and window keys (an old ``type`` key, kept
    beside the ``rope_type`` it was copied to, aside)."""

    def clean(params):
        if isinstance(params, dict):
            return {
                k: clean(v)
                for k, v in params.items()
                if not (k == "type" and params.get("rope_type") == v)
            }
        return params

    c = model.config
    return {
        "rope_parameters": clean(c.rope_parameters),
        "layer_types": getattr(c, "layer_types", None),
        "sliding_window": getattr(c, "sliding_window", None),
    }


def make_spec(spec: Spec, summary: list) -> None:
    model = build(spec)
    dirs = {layout: OUT / spec.case(layout) for layout in spec.layouts}
    for layout, directory in dirs.items():
        save_case(model, spec, layout, directory)
    first, *others = spec.layouts
    view = rope_view(load_reference(dirs[first]))
    for layout in others:  # transformers reads both layouts as the same model
        other = rope_view(load_reference(dirs[layout]))
        if json.dumps(other, sort_keys=True) != json.dumps(view, sort_keys=True):
            raise RuntimeError(f"{spec.name}: layouts differ for transformers: {view} / {other}")
    prompts, results, attempts = None, None, None
    for layout, directory in dirs.items():
        start = time.perf_counter()
        make = lambda d=directory: load_reference(d)  # noqa: E731
        if prompts is None:
            prompts, results, attempts = choose_prompts(make)
        else:
            again = [run_prompt(make, p) for p in prompts]
            for a, b in zip(results, again, strict=True):
                assert a["greedy"] == b["greedy"]
                assert np.array_equal(a["prompt_logits"], b["prompt_logits"]), spec.name
        if spec.cache_equals_full:
            worst = max(r["cache_vs_full"] for r in results)
            assert worst < 1e-4, f"{spec.name}: transformers' cache path differs by {worst}"
        meta = write_reference(
            directory,
            spec.case(layout),
            spec.family,
            spec.exercises,
            prompts,
            results,
            {
                "config_layout": "old (pre-transformers-5: top-level rope keys)"
                if layout == "old"
                else "new (as transformers 5 saves it: rope_parameters)",
                "weights_dtype": spec.weights_dtype,
                "prompt_seed_attempts": attempts,
                "transformers_config": view,
            },
        )
        summary.append((meta, time.perf_counter() - start))


# --- quantized


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: values LSB-first in a little-endian uint32 bit stream."""
    rows = packed.shape[0]
    stream = np.unpackbits(
        packed.astype("<u4").view(np.uint8).reshape(rows, -1), axis=1, bitorder="little"
    )
    stream = stream.reshape(rows, -1, bits).astype(np.uint32)
    return (stream << np.arange(bits, dtype=np.uint32)).sum(axis=2).astype(np.uint32)


def dequantize_f32(packed, scales, biases, group_size: int) -> np.ndarray:
    """Exact float32 dequantization: q * s + b with s and b cast to float32 first."""
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * group_size)
    q = unpack(packed, bits).astype(np.float32)
    rows, groups = scales.shape
    q = q.reshape(rows, groups, group_size)
    w = q * scales[:, :, None] + biases[:, :, None]  # float32 products are exact here
    return w.reshape(rows, groups * group_size).astype(np.float32)


def make_quantized(base: Path, summary: list) -> None:
    import mlx.core as mx
    from mlx_lm.convert import convert
    from transformers import AutoConfig, AutoModelForCausalLM

    for case, dtype, bits, group, predicate, exercises in QUANTIZED:
        start = time.perf_counter()
        directory = OUT / case
        if directory.exists():
            shutil.rmtree(directory)
        if predicate == "down8":

            def predicate_fn(path, module, _g=group):
                if "down_proj" in path:
                    return {"group_size": _g, "bits": 8, "mode": "affine"}
                return True
        else:
            predicate_fn = predicate
        convert(
            str(base),
            str(directory),
            quantize=True,
            q_group_size=group,
            q_bits=bits,
            dtype=dtype,
            quant_predicate=predicate_fn,
        )
        write_support_files(directory)  # the suite's tokenizer files, as every other case
        for extra in directory.iterdir():
            if extra.name not in (
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
            ):
                extra.unlink()
        config = json.loads((directory / "config.json").read_text())
        raw = mx.load(str(directory / "model.safetensors"))
        dense, checks = {}, {}
        for name, value in raw.items():
            if name.endswith((".scales", ".biases")):
                continue
            stem = name[: -len(".weight")]
            if f"{stem}.scales" in raw:
                layer = config["quantization"].get(stem, config["quantization"])
                scales = np.array(raw[f"{stem}.scales"].astype(mx.float32))
                biases = np.array(raw[f"{stem}.biases"].astype(mx.float32))
                w = dequantize_f32(np.array(raw[name]), scales, biases, layer["group_size"])
                # Our unpacking agrees with MLX's own kernel (float32 scales).
                theirs = mx.dequantize(
                    raw[name],
                    raw[f"{stem}.scales"].astype(mx.float32),
                    raw[f"{stem}.biases"].astype(mx.float32),
                    group_size=layer["group_size"],
                    bits=packed_bits(raw, stem, layer),
                )
                checks[stem] = float(np.abs(np.array(theirs) - w).max())
                dense[name] = torch.from_numpy(w)
            else:
                dense[name] = torch.from_numpy(np.array(value.astype(mx.float32)))
        assert max(checks.values()) <= 1e-6, checks
        ref_config = AutoConfig.from_pretrained(base)

        def make(_cfg=ref_config, _dense=dense):
            model = AutoModelForCausalLM.from_config(
                _cfg, dtype=torch.float32, attn_implementation="eager"
            )
            missing, unexpected = model.load_state_dict(_dense, strict=False)
            assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
            return model.eval()

        prompts, results, attempts = choose_prompts(make)
        for r in results:
            assert r["cache_vs_full"] < 1e-4, case
        bits_used = sorted(
            {
                packed_bits(
                    raw,
                    n[: -len(".scales")],
                    config["quantization"].get(n[: -len(".scales")], config["quantization"]),
                )
                for n in raw
                if n.endswith(".scales")
            }
        )
        meta = write_reference(
            directory,
            case,
            "llama",
            exercises,
            prompts,
            results,
            {
                "config_layout": "old (llama_default_old's config.json plus mlx-lm's quantization)",
                "quantized_from": base.name,
                "scales_dtype": dtype,
                "bits_present": bits_used,
                "quantization": config["quantization"],
                "reference_weights": "float32 dequantization of the quantized tensors "
                "(q * float32(scale) + float32(bias)); unquantized tensors "
                f"are the {dtype} values mlx-lm stored, upcast",
                "prompt_seed_attempts": attempts,
            },
        )
        summary.append((meta, time.perf_counter() - start))


def packed_bits(raw, stem: str, layer: dict) -> int:
    packed, scales = raw[f"{stem}.weight"], raw[f"{stem}.scales"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * int(layer["group_size"]))


# --- main


README = """# Reference checkpoints

Tiny random Hugging Face checkpoints and what Hugging Face `transformers` computes for them:
the judge of the runner's model code (`tests/test_reference_models.py`, which needs neither
torch nor transformers). Each `<case>/` is a model directory the runner loads as it is
(`config.json`, `model.safetensors`, the test suite's tokenizer, `generation_config.json`)
plus `reference.npz` (float32 last-prompt-position logits, 24 greedy tokens, each chosen
token's logit and margin, the logits after the 24th token) and `reference.json` (what the
case exercises, versions, prompts, greedy tokens, max |logit|). Quantized cases are
`llama_default_old` converted by `mlx_lm.convert`; their reference is transformers on the
float32 dequantization of those exact files.

Regenerate (deterministic; needs PyPI for the first step only):

    ./scripts/reference_env.sh && .venv-ref/bin/python scripts/make_reference_checkpoints.py

`--only CASE...` rewrites some cases (quantized ones need `llama_default_old`).

`rope_tables.json` holds transformers' own RoPE inverse frequencies and attention factors
(`ROPE_INIT_FUNCTIONS`) for every variant and the sequence lengths a forward may end at, from
configs in both layouts (`tests/test_rope_tables.py`); regenerate it with
`.venv-ref/bin/python scripts/make_rope_tables.py`.

| case | exercises |
|---|---|
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="*",
        help="spec or case names, or hybrid (scripts/reference_hybrid.py's "
        "cases under hybrid/), moe (reference_moe.py's, under moe/) or hybrid_moe (the "
        "MoE hybrids among them); default: all",
    )
    args = parser.parse_args(argv)
    wanted = set(args.only or [])
    OUT.mkdir(parents=True, exist_ok=True)
    summary: list = []
    started = time.perf_counter()
    for spec in SPECS:
        cases = {spec.name, *(spec.case(layout) for layout in spec.layouts)}
        if not wanted or wanted & cases:
            print(f"{spec.name} ...", file=sys.stderr, flush=True)
            make_spec(spec, summary)
    if not wanted or wanted & {q[0] for q in QUANTIZED} or "quantized" in wanted:
        print("quantized ...", file=sys.stderr, flush=True)
        make_quantized(OUT / "llama_default_old", summary)
    if not wanted or "hybrid" in wanted:  # scripts/reference_hybrid.py: OUT / "hybrid"
        import reference_hybrid

        print("hybrid ...", file=sys.stderr, flush=True)
        reference_hybrid.make(sys.modules[__name__], summary)
    if not wanted or "moe" in wanted:  # scripts/reference_moe.py: OUT / "moe"
        import reference_moe

        print("moe ...", file=sys.stderr, flush=True)
        reference_moe.make(sys.modules[__name__], summary)
    elif "hybrid_moe" in wanted:  # the MoE hybrids alone (reference_hybrid_moe.py), OUT / "moe"
        import reference_hybrid_moe
        import reference_moe

        print("hybrid_moe ...", file=sys.stderr, flush=True)
        reference_hybrid_moe.make(
            sys.modules[__name__], OUT / reference_moe.SUBDIR, summary, reference_moe.reference
        )
        reference_moe.write_readme(OUT / reference_moe.SUBDIR)
    rows = []
    for directory in sorted(p for p in OUT.iterdir() if (p / "reference.json").exists()):
        meta = json.loads((directory / "reference.json").read_text())
        rows.append(f"| `{meta['case']}` | {meta['exercises']} |")
    (OUT / "README.md").write_text(README + "\n".join(rows) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    for meta, seconds in summary:
        print(
            f"{meta['case']:28s} {seconds:6.1f}s  max|logit| {meta['max_abs_logit']:7.3f}  "
            f"min margin {meta['min_greedy_margin']:.4f}  cache/full "
            f"{meta['cache_vs_full_forward_max_diff']:.2e}",
            file=sys.stderr,
        )
    print(
        f"{len(rows)} cases, {total / 1e6:.2f} MB, {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
