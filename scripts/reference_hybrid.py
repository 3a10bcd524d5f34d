"""Reference fixtures for the hybrid families (Qwen3.5, dense Qwen3-Next): tiny random float32
checkpoints and what transformers computes for them, under ``tests/fixtures/reference/hybrid/``.

    .venv-ref/bin/python scripts/make_reference_checkpoints.py --only hybrid   # these only

A module of ``make_reference_checkpoints.py`` (run in ``.venv-ref``, see reference_env.sh),
which calls :func:`make` with itself as ``base`` (the suite's tokenizer, prompt choice,
reference writer) when asked for ``hybrid`` or run without ``--only``; it never imports
``base`` itself. The cases live in their own folder so the other fixtures (24 greedy tokens each)
stay as they are; here every case has 32 greedy tokens, same files otherwise
(``tests/test_hybrid_models.py`` reads them):

- ``qwen3_5_text``: a text-only save (``Qwen3_5ForCausalLM``, ``model.`` names, config
  ``qwen3_5_text`` with ``layer_types`` as transformers writes them), tied head;
- ``qwen3_5_vl``: the same weights in the released multimodal layout
  (``Qwen3_5ForConditionalGeneration``: ``model.language_model.``, a tiny real vision tower
  under ``model.visual.``, nested ``text_config``) plus an inline MTP head (``mtp.*``,
  ``mtp_num_hidden_layers`` 1); its reference is the multimodal class itself on text input;
- ``qwen3_5_mlx``: ``qwen3_5_vl`` converted by ``mlx_lm.convert`` (float32): mlx-lm names,
  conv weights ``[C, K, 1]``, zero-centred norms already shifted, no vision tower or head;
- ``qwen3_next_dense``: dense Qwen3-Next (``num_experts`` 0), the Hub's older layout
  (top-level ``rope_theta`` and ``partial_rotary_factor`` 0.5, ``full_attention_interval`` 3
  instead of ``layer_types``), untied head, ``num_nextn_predict_layers`` 1 with the MTP
  tensors stripped.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

GREEDY = 32
SUBDIR = "hybrid"
# Linear-attention shapes: 2 key heads shared by 4 value heads, Dk != Dv (a transposed state
# or a wrong head grouping cannot pass).
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)
ZERO_CENTRED = (
    "input_layernorm",
    "post_attention_layernorm",
    "q_norm",
    "k_norm",
    "pre_fc_norm_embedding",
    "pre_fc_norm_hidden",
)
EXERCISES = {
    "qwen3_5_text": "qwen3_5_text, text-only save: 4 layers [linear x3, full] from layer_types; "
    "Gated DeltaNet (2 key / 4 value heads, Dk 16, Dv 32, conv 4, float32 state) and gated "
    "full attention (q_proj emits query + gate per head, q/k (1 + w) norms, partial RoPE 0.25 "
    "of head_dim 32, theta 1e6, mrope_section on text), GQA 4/2, (1 + w) layer and final "
    "norms, tied head",
    "qwen3_5_vl": "the qwen3_5_text weights as Qwen3_5ForConditionalGeneration saves them "
    "(model.language_model.*, a tiny vision tower under model.visual.*, nested text_config) "
    "plus inline MTP tensors (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm) and "
    "mtp_num_hidden_layers 1; reference: the multimodal class on text input",
    "qwen3_5_mlx": "qwen3_5_vl converted by mlx_lm.convert (float32): language_model.model.* "
    "names, conv weights [C, K, 1], zero-centred norms stored shifted (1 + w), vision tower "
    "and MTP head dropped",
    "qwen3_next_dense": "qwen3_next, dense MLPs (num_experts 0), old layout: top-level "
    "rope_theta 5e5 and partial_rotary_factor 0.5, full_attention_interval 3 over 6 layers "
    "(no layer_types), fused in_proj_qkvz / in_proj_ba interleaved per key-head group, untied "
    "head, num_nextn_predict_layers 1 but no MTP tensors",
}


def text_config(base) -> dict:
    return dict(
        vocab_size=base.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=base.EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **LINEAR,
    )


def next_config(base) -> dict:
    return dict(
        vocab_size=base.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=base.EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
        num_experts=0,
        full_attention_interval=3,
        rope_theta=5e5,
        partial_rotary_factor=0.5,
        **LINEAR,
    )


VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    out_hidden_size=64,
    num_position_embeddings=16,
    in_channels=3,
)


# --- weights


def randomize(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Seeded weights with signal (as the other fixtures: linear N(0, 1/fan_in), o/down/out
    projections x2, unit-direction embedding rows, lm_head N(0, 0.5^2)); norm gains 1 +
    N(0, 0.2^2), stored as w for the zero-centred ones; decays A in U(0.02, 0.3) so the state
    remembers a few dozen rows; dt_bias N(0, 0.5^2); conv taps N(0, 1/K)."""
    gen = torch.Generator().manual_seed(seed)
    row_norm, final_scale = (2.0, 2.0) if tied else (4.0, 1.0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
            if name.endswith("A_log"):
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                value = torch.log(0.02 + 0.28 * u)
            elif name.endswith("dt_bias"):
                value = 0.5 * noise
            elif "norm" in name and p.ndim == 1 and "visual" not in name:
                final = name.endswith("language_model.norm.weight") or name == "model.norm.weight"
                value = (final_scale if final else 1.0) * (1.0 + 0.2 * noise)
                if leaf in ZERO_CENTRED or final or name.endswith("mtp.norm.weight"):
                    value = value - 1.0
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name:
                value = noise / noise.norm(dim=-1, keepdim=True) * row_norm
            elif "lm_head" in name:
                value = 0.5 * noise
            elif "conv1d" in name:
                value = noise / math.sqrt(p.shape[-1])
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[0]
                value = noise / math.sqrt(fan_in)
                if any(s in name for s in ("o_proj", "down_proj", "out_proj")):
                    value = value * 2.0
            p.copy_(value)


def mtp_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """An inline MTP head's tensors (Qwen3-Next naming), random, shaped for ``cfg``: a fusion
    of [embedding; hidden], its two pre-norms, one gated full-attention block and a norm."""
    gen = torch.Generator().manual_seed(seed)
    h, heads, kv, hd = (
        cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    inter = cfg["intermediate_size"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * heads * hd, h),
        "mtp.layers.0.self_attn.k_proj.weight": (kv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (kv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, heads * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate_proj.weight": (inter, h),
        "mtp.layers.0.mlp.up_proj.weight": (inter, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, inter),
    }
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        out[name] = 0.2 * noise if len(shape) == 1 else noise / math.sqrt(shape[-1])
    return out


# --- cases


def build(kind: str, config: dict, seed: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    if kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**config))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config))
    model.config._attn_implementation = "eager"
    randomize(model, seed, bool(config["tie_word_embeddings"]))
    return model.to(torch.float32).eval()


def save(model, directory: Path, base, *, extra_tensors=None, config_edit=None) -> None:
    from safetensors.torch import load_file, save_file

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
    tensors.update(extra_tensors or {})
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    if config_edit is not None:
        config_edit(config)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    base.write_support_files(directory)


def multimodal(text_model, config: dict):
    """``Qwen3_5ForConditionalGeneration`` with ``text_model``'s weights and a tiny random
    vision tower."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(
        text_config=config, vision_config=VISION, tie_word_embeddings=config["tie_word_embeddings"]
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg)
    state = {}
    for name, value in text_model.state_dict().items():
        state[name.replace("model.", "model.language_model.", 1)] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".visual." in m for m in missing), (missing, unexpected)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.config._attn_implementation = "eager"
    return model.to(torch.float32).eval()


def loader(directory: Path, vl: bool = False):
    def make():
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
        model = auto.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
        return model.eval()

    return make


@contextlib.contextmanager
def greedy_steps(base, steps: int):
    """``base.run_prompt`` decodes ``base.GREEDY`` tokens; these fixtures want ``steps``."""
    old, base.GREEDY = base.GREEDY, steps
    try:
        yield
    finally:
        base.GREEDY = old


def reference(
    base, out: Path, case: str, family: str, make, summary: list, *, prompts=None, extra=None
) -> tuple:
    start = time.perf_counter()
    with greedy_steps(base, GREEDY):
        if prompts is None:
            prompts, results, attempts = base.choose_prompts(make)
        else:
            results, attempts = [base.run_prompt(make, p) for p in prompts], None
    worst = max(r["cache_vs_full"] for r in results)
    assert worst < 1e-4, f"{case}: transformers' cache path differs from a full forward by {worst}"
    meta = base.write_reference(
        out / case,
        case,
        family,
        EXERCISES[case],
        prompts,
        results,
        {
            "config_layout": (extra or {}).pop("layout", "as transformers 5 saves it"),
            "weights_dtype": "float32",
            "prompt_seed_attempts": attempts,
            **(extra or {}),
        },
    )
    summary.append((meta, time.perf_counter() - start))
    return prompts, results


def convert_mlx(source: Path, directory: Path, base) -> None:
    from mlx_lm import convert

    if directory.exists():
        shutil.rmtree(directory)
    convert(str(source), str(directory), dtype="float32")
    base.write_support_files(directory)
    keep = (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    )
    for extra in directory.iterdir():
        if extra.name not in keep:
            extra.unlink()


def mlx_lm_logits(directory: Path, prompt: list[int]) -> np.ndarray:
    """mlx-lm's own last-position logits for ``prompt`` (a second opinion on the files)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(directory)
    return np.array(model(mx.array([prompt]))[0, -1].astype(mx.float32))


def make(base, summary: list) -> None:
    """Write every hybrid case under ``base.OUT / "hybrid"``."""
    out = base.OUT / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    cfg = text_config(base)
    text = build("qwen3_5_text", cfg, zlib.crc32(b"qwen3_5_text"))
    save(text, out / "qwen3_5_text", base)
    prompts, results = reference(
        base, out, "qwen3_5_text", "qwen3_5_text", loader(out / "qwen3_5_text"), summary
    )

    def nest(config: dict) -> None:
        config["text_config"]["mtp_num_hidden_layers"] = 1

    vl = multimodal(text, copy.deepcopy(cfg))
    save(vl, out / "qwen3_5_vl", base, extra_tensors=mtp_tensors(cfg, 11), config_edit=nest)
    _, vl_results = reference(
        base,
        out,
        "qwen3_5_vl",
        "qwen3_5",
        loader(out / "qwen3_5_vl", True),
        summary,
        prompts=prompts,
        extra={"layout": "nested text_config (Qwen3_5Config)"},
    )
    gap = max(
        float(np.abs(a["prompt_logits"] - b["prompt_logits"]).max())
        for a, b in zip(results, vl_results, strict=True)
    )
    assert gap < 1e-5 and all(
        a["greedy"] == b["greedy"] for a, b in zip(results, vl_results, strict=True)
    ), gap

    convert_mlx(out / "qwen3_5_vl", out / "qwen3_5_mlx", base)
    theirs = mlx_lm_logits(out / "qwen3_5_mlx", prompts[0])
    mlx_gap = float(np.abs(theirs - results[0]["prompt_logits"]).max())
    assert mlx_gap < 1e-3, f"mlx-lm reads its own conversion differently: {mlx_gap}"
    reference(
        base,
        out,
        "qwen3_5_mlx",
        "qwen3_5",
        loader(out / "qwen3_5_vl", True),
        summary,
        prompts=prompts,
        extra={
            "layout": "mlx_lm.convert of qwen3_5_vl",
            "converted_from": "qwen3_5_vl",
            "mlx_lm_prompt0_logits_vs_reference": mlx_gap,
        },
    )

    ncfg = next_config(base)
    nxt = build("qwen3_next", ncfg, zlib.crc32(b"qwen3_next_dense"))

    def old_layout(config: dict) -> None:
        config.pop("rope_parameters", None)
        config.pop("layer_types", None)
        config.update(
            rope_theta=5e5,
            partial_rotary_factor=0.5,
            full_attention_interval=3,
            rope_scaling=None,
            num_nextn_predict_layers=1,
        )

    save(nxt, out / "qwen3_next_dense", base, config_edit=old_layout)
    reference(
        base,
        out,
        "qwen3_next_dense",
        "qwen3_next",
        loader(out / "qwen3_next_dense"),
        summary,
        extra={
            "layout": "old (top-level rope_theta / partial_rotary_factor, full_attention_interval)"
        },
    )
    rows = [f"| `{c}` | {EXERCISES[c]} |" for c in EXERCISES]
    (out / "README.md").write_text(
        "# Hybrid reference checkpoints\n\nWritten by `scripts/reference_hybrid.py` (see its "
        "docstring); 32 greedy tokens per prompt, otherwise the files of `../README.md`.\n\n"
        "| case | exercises |\n|---|---|\n" + "\n".join(rows) + "\n"
    )
