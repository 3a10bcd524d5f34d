"""Reference fixtures for the MoE families (qwen3_moe, glm4_moe with its MTP layer): tiny random
float32 checkpoints in three expert layouts and what transformers computes for them, under
``tests/fixtures/reference/moe/``; the MoE hybrids' cases (qwen3_5_moe, qwen3_next with MoE
layers) are ``reference_hybrid_moe``'s, written beside them.

    .venv-ref/bin/python scripts/make_reference_checkpoints.py --only moe   # these cases only

Run with ``.venv-ref/bin/python`` (see reference_env.sh); ``make_reference_checkpoints.py``
calls :func:`make` with itself as ``base`` (the suite's tokenizer, prompt choice, reference
writer) and generates these cases only when asked for ``moe`` or when run without ``--only``.
Files per case as in ``../README.md`` (24 greedy tokens); ``tests/test_moe_models.py`` reads
them. Layouts, one model each family:

- ``<family>``: what ``save_pretrained`` of transformers 5.24 writes: one tensor per expert
  (``mlp.experts.{i}.{gate,up,down}_proj.weight``; it undoes its in-memory fusion on save);
- ``<family>_fused``: the same weights as transformers 5 holds them (``mlp.experts.
  gate_up_proj`` ``[E, 2I, D]``, ``mlp.experts.down_proj`` ``[E, D, I]``), the layout Qwen3.6
  checkpoints ship; transformers itself loads it, and its outputs are checked identical;
- ``<family>_mlx``: ``mlx_lm.convert`` (float32) of the first: ``mlp.switch_mlp.*`` (mlx-lm
  drops GLM's MTP layer); mlx-lm's own logits are recorded as a second opinion.

GLM's MTP layer (``model.layers.{N}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
and a MoE decoder layer; transformers builds none) is made here with random weights, in the
file's expert layout; the per-expert case also carries DeepSeek's copies of the embedding and
output head (``embed_tokens``, ``shared_head.head``). ``mtp_logits_{p}`` in reference.npz are
that layer's logits over prompt p (p = 0, 1) computed in torch with transformers' own
``Glm4MoeDecoderLayer``: row S from ``eh_proj(concat(enorm(embed(t[S+1])), hnorm(h[S])))``
at position S, ``h`` the target's post-final-norm hidden (the runner's head convention).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import reference_hybrid_moe
import torch

SUBDIR = "moe"
MTP_PROMPTS = (0, 1)
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    bos_token_id=None,
    pad_token_id=None,
)
EXERCISES = {
    "qwen3_moe": "qwen3_moe, 3 layers [MoE, dense (mlp_only_layers [1]), MoE], 8 experts / 2 "
    "active, softmax routing with norm_topk_prob, q/k norms, theta 1e6; per-expert tensors as "
    "transformers 5.24 saves them, Hub config layout (num_experts, top-level rope_theta)",
    "qwen3_moe_fused": "the qwen3_moe weights in transformers 5's fused layout (experts."
    "gate_up_proj [E, 2I, D], experts.down_proj [E, D, I], as Qwen3.6 ships them); config as "
    "transformers 5 writes it (num_local_experts, rope_parameters)",
    "qwen3_moe_mlx": "qwen3_moe converted by mlx_lm.convert (float32): switch_mlp stacked experts",
    "glm4_moe": "glm4_moe, 2 layers [dense (first_k_dense_replace 1), MoE] plus its MTP layer "
    "model.layers.2 (enorm, hnorm, eh_proj, shared_head.norm/head, embed_tokens, a MoE block); "
    "8 experts / 2 active, sigmoid routing with e_score_correction_bias for the choice, n_group "
    "4 / topk_group 2, norm_topk_prob, routed_scaling_factor 2.5, one shared expert; attention "
    "bias on q/k/v, q/k norms, partial RoPE 0.5; per-expert tensors, Hub config layout (top-"
    "level rope_theta and partial_rotary_factor, num_nextn_predict_layers 1)",
    "glm4_moe_fused": "the glm4_moe weights (MTP layer included, without the embedding/head "
    "copies) in transformers 5's fused expert layout; config as transformers 5 writes it",
    "glm4_moe_mlx": "glm4_moe converted by mlx_lm.convert (float32): switch_mlp experts, the MTP "
    "layer dropped",
    **reference_hybrid_moe.EXERCISES,
}


def qwen_config(base) -> dict:
    return dict(
        COMMON,
        vocab_size=base.VOCAB,
        eos_token_id=base.EOS_ID,
        num_hidden_layers=3,
        num_experts=8,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def glm_config(base) -> dict:
    return dict(
        COMMON,
        vocab_size=base.VOCAB,
        eos_token_id=base.EOS_ID,
        num_hidden_layers=2,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
    )


# --- weights


def randomize(module: torch.nn.Module, seed: int) -> None:
    """The other fixtures' recipe (linear N(0, 1/fan_in), o/down x2, unit-direction embedding
    rows of norm 4, lm_head N(0, 0.5^2), norm gains 1 + N(0, 0.2^2), biases N(0, 0.2^2)); the
    router x2 (decisive routing: no near ties between implementations) and the correction
    bias N(0, 0.2^2), the spread of the sigmoid scores, so it changes the choice."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n.endswith("correction_bias"))
    with torch.no_grad():
        for name, p in sorted(tensors.items()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("correction_bias") or name.endswith(".bias"):
                value = 0.2 * noise
            elif "norm" in name:
                value = 1.0 + 0.2 * noise
            elif "embed_tokens" in name:
                value = noise / noise.norm(dim=-1, keepdim=True) * 4.0
            elif "lm_head" in name:
                value = 0.5 * noise
            else:
                value = noise / math.sqrt(p.shape[-1])
                if "o_proj" in name or "down_proj" in name or name.endswith("mlp.gate.weight"):
                    value = value * 2.0
            p.copy_(value)


def build(family: str, config: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    kind = cfg.pop("model_type", family)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(kind, **cfg), dtype=torch.float32, attn_implementation="eager"
    )
    randomize(model, seed)
    return model.eval()


def mtp_layer(model, seed: int) -> dict[str, torch.Tensor]:
    """GLM's MTP module ``model.layers.{N}`` (fused experts, as the torch module holds them)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    n, d = model.config.num_hidden_layers, model.config.hidden_size
    module = torch.nn.Module()
    module.block = Glm4MoeDecoderLayer(model.config, layer_idx=n)
    module.enorm, module.hnorm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
    module.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
    module.shared_head = torch.nn.Module()
    module.shared_head.norm = torch.nn.RMSNorm(d)
    randomize(module, seed)
    out = {}
    for name, value in module.state_dict().items():
        name = name[len("block.") :] if name.startswith("block.") else name
        out[f"model.layers.{n}.{name}"] = value.detach().clone()
    return out


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused ``experts.gate_up_proj`` / ``experts.down_proj`` as one tensor per expert."""
    out = {}
    for name, value in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            stem, half = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = value[e, :half].clone()
                out[f"{stem}{e}.up_proj.weight"] = value[e, half:].clone()
        elif name.endswith(".experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[name] = value
    return out


def write(directory: Path, base, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    base.write_support_files(directory)


def saved(model) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``save_pretrained`` writes: (tensors, config)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return load_file(str(Path(tmp) / "model.safetensors")), json.loads(
            (Path(tmp) / "config.json").read_text()
        )


def old_layout(config: dict, family: str) -> dict:
    """The Hub's pre-transformers-5 config keys for the same model."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None)
    if family == "glm4_moe":
        config["partial_rotary_factor"] = rope["partial_rotary_factor"]
    else:
        config["num_experts"] = config.pop("num_local_experts")
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    return config


def loader(directory: Path):
    def make():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()

    return make


# --- the MTP layer's reference


@torch.no_grad()
def mtp_logits(model, mtp: dict[str, torch.Tensor], prompt: list[int]) -> np.ndarray:
    """The MTP layer over ``prompt`` (module docstring), with transformers' decoder layer."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    cfg, n = model.config, model.config.num_hidden_layers
    prefix = f"model.layers.{n}."
    local = {k[len(prefix) :]: v for k, v in mtp.items() if k.startswith(prefix)}
    block = Glm4MoeDecoderLayer(cfg, layer_idx=n).eval()
    block.load_state_dict(
        {
            k: v
            for k, v in local.items()
            if k.split(".")[0]
            in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        }
    )

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    ids = torch.tensor([prompt])
    hidden = model.model(input_ids=ids).last_hidden_state[0]  # post-final-norm
    e = rms(model.model.embed_tokens(ids[0, 1:]), local["enorm.weight"])
    h = rms(hidden[:-1], local["hnorm.weight"])
    x = torch.nn.functional.linear(torch.cat([e, h], dim=-1), local["eh_proj.weight"])[None]
    length = x.shape[1]
    positions = torch.arange(length)[None]
    cos_sin = model.model.rotary_emb(x, positions)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    y = block(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    y = rms(y[0], local["shared_head.norm.weight"])
    return model.lm_head(y).float().numpy()


# --- cases


def reference(
    base, out: Path, case: str, family: str, make, summary: list, *, prompts=None, extra=None
) -> tuple:
    start = time.perf_counter()
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
        {"weights_dtype": "float32", "prompt_seed_attempts": attempts, **(extra or {})},
    )
    summary.append((meta, time.perf_counter() - start))
    return prompts, results


def add_arrays(directory: Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` beside the standard ones in ``directory/reference.npz``."""
    path = directory / "reference.npz"
    with np.load(path) as npz:
        merged = {k: npz[k] for k in npz.files}
    np.savez_compressed(path, **merged, **{k: v.astype(np.float32) for k, v in arrays.items()})


def same(a: list, b: list, what: str) -> None:
    gap = max(
        float(np.abs(x["prompt_logits"] - y["prompt_logits"]).max())
        for x, y in zip(a, b, strict=True)
    )
    assert gap < 1e-5 and all(x["greedy"] == y["greedy"] for x, y in zip(a, b, strict=True)), (
        what,
        gap,
    )


def convert_mlx(source: Path, directory: Path, base) -> float:
    """mlx-lm's conversion of ``source``; returns its prompt-0 logits (a second opinion)."""
    import mlx.core as mx
    from mlx_lm import convert
    from mlx_lm.utils import load_model

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
    model, _ = load_model(directory)
    prompt = json.loads((source / "reference.json").read_text())["prompts"][0]
    return np.array(model(mx.array([prompt]))[0, -1].astype(mx.float32))


def make_family(base, out: Path, family: str, config: dict, summary: list) -> None:
    model = build(family, config, zlib.crc32(family.encode()))
    tensors, saved_config = saved(model)
    fused = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(".experts.0." in k for k in tensors) and any(
        k.endswith("gate_up_proj") for k in fused
    )
    mtp = extra_mtp = {}
    if family == "glm4_moe":
        mtp = mtp_layer(model, zlib.crc32(b"glm4_moe_mtp"))
        n = model.config.num_hidden_layers
        extra_mtp = {
            f"model.layers.{n}.embed_tokens.weight": model.model.embed_tokens.weight.detach(),
            f"model.layers.{n}.shared_head.head.weight": model.lm_head.weight.detach(),
        }
    first = out / family
    write(
        first, base, {**tensors, **per_expert(mtp), **extra_mtp}, old_layout(saved_config, family)
    )
    prompts, results = reference(
        base,
        out,
        family,
        family,
        loader(first),
        summary,
        extra={"config_layout": "old (Hub: top-level rope keys)"},
    )
    arrays = {}
    if mtp:
        ref = loader(first)()
        arrays = {f"mtp_logits_{p}": mtp_logits(ref, mtp, prompts[p]) for p in MTP_PROMPTS}
        add_arrays(out / family, arrays)

    name = f"{family}_fused"
    write(out / name, base, {**fused, **mtp}, saved_config)
    _, fused_results = reference(
        base,
        out,
        name,
        family,
        loader(out / name),
        summary,
        prompts=prompts,
        extra={"config_layout": "new (as transformers 5 writes it)"},
    )
    same(results, fused_results, name)
    if arrays:
        add_arrays(out / name, arrays)

    name = f"{family}_mlx"
    theirs = convert_mlx(first, out / name, base)
    gap = float(np.abs(theirs - results[0]["prompt_logits"]).max())
    assert gap < 1e-3, f"mlx-lm reads its own conversion differently: {gap}"
    reference(
        base,
        out,
        name,
        family,
        loader(first),
        summary,
        prompts=prompts,
        extra={
            "config_layout": f"mlx_lm.convert of {family}",
            "converted_from": family,
            "mlx_lm_prompt0_logits_vs_reference": gap,
        },
    )


def make(base, summary: list) -> None:
    """Write every MoE case under ``base.OUT / "moe"``."""
    out = base.OUT / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    make_family(base, out, "qwen3_moe", qwen_config(base), summary)
    make_family(base, out, "glm4_moe", glm_config(base), summary)
    reference_hybrid_moe.make(base, out, summary, reference)
    write_readme(out)


def write_readme(out: Path) -> None:
    rows = [f"| `{c}` | {EXERCISES[c]} |" for c in EXERCISES]
    (out / "README.md").write_text(
        "# MoE reference checkpoints\n\nWritten by `scripts/reference_moe.py` (see its "
        "docstring); the files of `../README.md`, plus `mtp_logits_{p}` for the GLM cases.\n\n"
        "| case | exercises |\n|---|---|\n" + "\n".join(rows) + "\n"
    )
