"""GGUF files of the Multi-head Latent Attention models (llama.cpp's ``deepseek2``: DeepSeek-V3
and GLM-4.7-Flash alike), as the runner's ``deepseek_v3`` config dict and Hugging Face tensor
names (``runner.gguf`` reads the file and the common keys; ``runner.models.mla`` runs them).

llama.cpp writes DeepSeek-V3 and GLM-4.7-Flash (``glm4_moe_lite``) checkpoints under one
architecture; the two are the same computation once every hyper-parameter is explicit, so a
``deepseek2`` file is configured as ``deepseek_v3`` with nothing left to a family default.

**Attention keys.** The converter writes the model as the multi-query attention it becomes
once the up-projections are absorbed: ``attention.head_count_kv`` 1, ``attention.key_length``
``kv_lora_rank + qk_rope_head_dim`` and ``value_length`` ``kv_lora_rank``, the per-head sizes in
``key_length_mla`` (``qk_nope_head_dim + qk_rope_head_dim``) and ``value_length_mla``
(``v_head_dim``); ``rope.dimension_count`` is ``qk_rope_head_dim``, ``attention.kv_lora_rank``
and (low-rank queries only) ``attention.q_lora_rank`` the ranks. Files from before that split
have no ``*_mla`` keys: their key / value lengths are the per-head ones, with as many KV heads
as heads. The block norms run at the file's epsilon, the two latent norms at transformers'
fixed 1e-6 (``runner.models.mla_config``) where llama.cpp applies the file's to them too: the
same for DeepSeek-V3 (1e-6), a last-bits difference for GLM-4.7-Flash (1e-5).

**Tensors.** ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` (or a full-rank ``attn_q``),
``attn_kv_a_mqa`` / ``attn_kv_a_norm``, ``attn_output``, ``ffn_norm`` (the pre-MLP norm).
``kv_b_proj`` is stored split per head as ``attn_k_b`` ``[H, kv_lora_rank, qk_nope]`` (the
key rows transposed, for llama.cpp's absorbed product) and ``attn_v_b`` ``[H, v_head_dim,
kv_lora_rank]``, or whole as ``attn_kv_b`` in older files; either way it is put back as
``kv_b_proj`` ``[H * (qk_nope + v), kv_lora_rank]`` (per head its key rows, then its value
rows), float32: the model multiplies by per-head views of it and keeps no quantized form.
A quantized ``attn_k_b`` is blocked along ``qk_nope``, so its values are exact only
dequantized. MoE layers: ``ffn_gate_inp`` (the router, float32: sigmoid scores),
``exp_probs_b.bias`` (``e_score_correction_bias``), stacked ``ffn_{gate,up,down}_exps`` or
fused ``ffn_gate_up_exps`` (gate rows first), ``ffn_*_shexp`` (plain shared experts). The
query / key RoPE is llama.cpp's adjacent-pair rotation with no row permutation, which is
``rope_interleave`` true. Biases (none in the released models) are taken when present
(``attention_bias``).

**Routing.** Sigmoid scores only (``expert_gating_func`` 2). Without the key llama.cpp routes
by softmax (DeepSeek-V2's files), except a 47 / 48-block model with GLM-4.7's 154,880-token
vocabulary, whose files were written without it: sigmoid, as llama.cpp decides. Absent
``expert_weights_norm`` is off and ``expert_weights_scale`` 1 (llama.cpp's defaults);
``expert_group_count`` / ``expert_group_used_count`` default to one group.

**RoPE scaling.** YaRN with ``rope.scaling.yarn_log_multiplier`` (the converter's 0.1 x
``mscale_all_dim``): llama.cpp squares ``1 + 0.1 mscale_all_dim ln(factor)`` into the softmax
scale and leaves cos and sin unscaled, which transformers computes for ``mscale`` equal to
``mscale_all_dim`` (as DeepSeek's configs set them); YaRN without it, or any other scaling, is
refused by name.

**MTP.** ``nextn_predict_layers`` blocks are counted in ``block_count`` and stored last
(``blk.{N}.nextn.*`` with a whole decoder block); they are dropped here (logged): the target
loads without its MTP head.

Every ``deepseek2.*`` key is either read or refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from protocol.errors import CorruptModelFile
from runner.gguf_families import COMMON_KEYS as COMMON_FAMILY_KEYS
from runner.gguf_families import dense_stack, hyper_int, refuse_unmapped
from runner.gguf_tensors import GGUFQuantized
from runner.models.config import malformed, refuse
from runner.quantized import affine_dense

log = logging.getLogger("mtp_runner.gguf")

ARCHS = ("deepseek2",)
KEYS = COMMON_FAMILY_KEYS | frozenset(
    {
        "attention.q_lora_rank",
        "attention.kv_lora_rank",
        "attention.key_length_mla",
        "attention.value_length_mla",
        "leading_dense_block_count",
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_count",
        "expert_weights_scale",
        "expert_weights_norm",
        "expert_gating_func",
        "expert_group_count",
        "expert_group_used_count",
        "nextn_predict_layers",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
        "rope.scaling.yarn_log_multiplier",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
    }
)
_SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
# llama.cpp's test for GLM-4.7-Flash files written without a gating function.
_GLM_LITE_BLOCKS, _GLM_LITE_VOCAB = (47, 48), 154880

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Stored as GGUF matrices, used as float32 arrays (never quantized products).
_FLOAT = {"ffn_gate_inp", "attn_kv_b"}
Get = Callable[..., object]


def refuse_unknown_keys(arch: str, meta: dict, path: str) -> None:
    refuse_unmapped(arch, meta, KEYS, path)


def _int(arch: str, key: str, get: Get, path: str, default: int | None = None) -> int:
    return hyper_int(arch, get, key, path, default)


def family_config(arch: str, config: dict, get: Get, path: str, vocab: int) -> dict:
    """``config`` (the common keys, read by ``runner.gguf.gguf_config``) completed with the MLA
    keys, as the runner's ``deepseek_v3`` config (module docstring). ``vocab``: the file's
    vocabulary size (llama.cpp's routing default looks at it)."""
    config["model_type"] = "deepseek_v3"
    blocks = config["num_hidden_layers"]
    mtp = get("nextn_predict_layers") or 0
    if not isinstance(mtp, int) or not 0 <= mtp < blocks:
        raise malformed(f"{arch}.nextn_predict_layers", f"{mtp!r} of {blocks} blocks", path)
    config["num_hidden_layers"] = blocks - mtp
    _attention(arch, config, get, path)
    _routing(arch, config, get, path, blocks, vocab)
    _rope_scaling(arch, config, get, path)
    return config


def _attention(arch: str, config: dict, get: Get, path: str) -> None:
    heads = config["num_attention_heads"]
    rank = _int(arch, "attention.kv_lora_rank", get, path)
    rope = _int(arch, "rope.dimension_count", get, path)
    keys, values = config.pop("head_dim", None), get("attention.value_length")
    if get("attention.key_length_mla") is not None:  # the absorbed layout (module docstring)
        if (keys, values) != (rank + rope, rank):
            why = f"key / value length {keys} / {values}, not {rank + rope} / {rank}"
            raise malformed(f"{arch}.attention.key_length", why, path)
        keys = _int(arch, "attention.key_length_mla", get, path)
        values = _int(arch, "attention.value_length_mla", get, path)
    elif config["num_key_value_heads"] != heads:
        why = f"{config['num_key_value_heads']} KV heads of {heads} without key_length_mla"
        raise malformed(f"{arch}.attention.head_count_kv", why, path)
    if not isinstance(keys, int) or not isinstance(values, int) or keys <= rope or values < 1:
        why = f"per-head key / value length {keys!r} / {values!r}, {rope} rotated"
        raise malformed(f"{arch}.attention.key_length_mla", why, path)
    q_rank = _int(arch, "attention.q_lora_rank", get, path, 0)
    config.update(
        num_key_value_heads=heads,
        q_lora_rank=q_rank or None,  # 0 / absent: one full-rank attn_q
        kv_lora_rank=rank,
        qk_nope_head_dim=keys - rope,
        qk_rope_head_dim=rope,
        v_head_dim=values,
        rope_interleave=True,  # llama.cpp rotates adjacent pairs, rows as the checkpoint has
    )


def _routing(arch: str, config: dict, get: Get, path: str, blocks: int, vocab: int) -> None:
    gating = get("expert_gating_func")
    if gating is None and blocks in _GLM_LITE_BLOCKS and vocab == _GLM_LITE_VOCAB:
        gating = _SIGMOID_GATING  # llama.cpp's rule for GLM-4.7-Flash files (docstring)
    if gating != _SIGMOID_GATING:
        why = "sigmoid routing only (absent: llama.cpp routes these files by softmax)"
        raise refuse(f"{arch}.expert_gating_func", gating, why, path)
    experts = _int(arch, "expert_count", get, path)
    dense = _int(arch, "leading_dense_block_count", get, path, 0)
    config.update(
        n_routed_experts=experts,
        num_experts_per_tok=_int(arch, "expert_used_count", get, path),
        moe_intermediate_size=_int(arch, "expert_feed_forward_length", get, path),
        n_shared_experts=_int(arch, "expert_shared_count", get, path, 0),
        n_group=_int(arch, "expert_group_count", get, path, 1) or 1,
        topk_group=_int(arch, "expert_group_used_count", get, path, 1) or 1,
        first_k_dense_replace=min(dense, config["num_hidden_layers"]),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


def _rope_scaling(arch: str, config: dict, get: Get, path: str) -> None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if kind != "yarn" or not log_mul:
        why = "YaRN with yarn_log_multiplier only (llama.cpp's DeepSeek scaling)"
        raise refuse(f"{arch}.rope.scaling.type", kind, why, path)
    factor = get("rope.scaling.factor")
    original = get("rope.scaling.original_context_length")
    if not isinstance(factor, int | float) or not isinstance(original, int):
        raise CorruptModelFile(
            f"missing or bad hyper-parameter {arch}.rope.scaling.factor / "
            f"original_context_length: {factor!r} / {original!r}",
            path=path,
        )
    mscale = float(log_mul) / 0.1  # the converter stored 0.1 x mscale_all_dim
    config["rope_scaling"] = {
        "type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        # Equal: cos / sin unscaled and the squared factor in the softmax scale, as llama.cpp.
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


# --- tensors


def _dense(w) -> np.ndarray:
    """A matrix (or a list of per-head / per-expert quantized matrices) as float32 numpy."""
    if isinstance(w, list):
        return np.stack([affine_dense(*q.unpack()) for q in w])
    if isinstance(w, GGUFQuantized):
        return affine_dense(*w.unpack())
    return np.array(w.astype(mx.float32))


def kv_b_from_split(k_b, v_b, heads: int) -> mx.array:
    """``kv_b_proj`` ``[H * (nope + v), rank]`` from the converter's ``attn_k_b`` ``[H, rank,
    nope]`` and ``attn_v_b`` ``[H, v, rank]`` (per head: key rows, then value rows)."""
    k, v = _dense(k_b), _dense(v_b)
    if k.ndim != 3 or v.ndim != 3 or k.shape[0] != heads or v.shape[0] != heads:
        raise ValueError(f"attn_k_b {k.shape} / attn_v_b {v.shape} for {heads} heads")
    joined = np.concatenate([k.transpose(0, 2, 1), v], axis=1)
    return mx.array(joined.reshape(-1, joined.shape[-1]))


def map_mla_tensors(arch: str, weights: dict, config: dict) -> dict:
    """Rename a ``deepseek2`` file's tensors to the runner's Hugging Face names and undo the
    converter's split of ``kv_b_proj`` (module docstring); MTP blocks are dropped, unknown
    tensors stay under their GGUF names (surfacing as extras, never silently used)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    out: dict = {}
    split: dict[str, dict[str, object]] = {}
    dropped = []
    for name, w in weights.items():
        stem, _, suffix = name.rpartition(".")
        if not stem.startswith("blk."):
            out[f"{_TOP[stem]}.{suffix}" if stem in _TOP else name] = w
            continue
        _, idx, part = stem.split(".", 2)
        if int(idx) >= layers:
            dropped.append(name)
            continue
        layer = f"model.layers.{idx}"
        if part in ("attn_k_b", "attn_v_b") and suffix == "weight":
            split.setdefault(idx, {})[part] = w
            continue
        if part == "exp_probs_b":  # a bare parameter in the Hugging Face names
            out[f"{layer}.mlp.gate.e_score_correction_bias"] = w
            continue
        if part == "ffn_gate_up_exps":  # fused by the converter: gate rows, then up rows
            stack = dense_stack(w)
            half = stack.shape[1] // 2
            out[f"{layer}.mlp.switch_mlp.gate_proj.weight"] = stack[:, :half]
            out[f"{layer}.mlp.switch_mlp.up_proj.weight"] = stack[:, half:]
            continue
        mapped = _LAYER.get(part)
        if mapped is None:
            out[name] = w
            continue
        if part.endswith("_exps"):
            w = dense_stack(w)
        elif part in _FLOAT and isinstance(w, GGUFQuantized):
            w = mx.array(_dense(w))
        out[f"{layer}.{mapped}.{suffix}"] = w
    for idx, parts in split.items():
        if set(parts) != {"attn_k_b", "attn_v_b"}:
            missing = ({"attn_k_b", "attn_v_b"} - set(parts)).pop()
            raise CorruptModelFile(f"blk.{idx}.{missing}.weight missing beside its pair", path=None)
        out[f"model.layers.{idx}.self_attn.kv_b_proj.weight"] = kv_b_from_split(
            parts["attn_k_b"], parts["attn_v_b"], heads
        )
    # No key for these: the tensors say (the model is built after this mapping).
    config["attention_bias"] = any(k.endswith(".self_attn.o_proj.bias") for k in out)
    if dropped:
        log.info(
            "skipping %d MTP tensors of %s (%s, ...): the GGUF's MTP layers are not loaded",
            len(dropped),
            arch,
            dropped[0],
        )
    return out
