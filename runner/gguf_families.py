"""GGUF files of the Gemma 2, Gemma 3, Phi-3, Qwen3-MoE and GLM-4.5 families, as the runner's
Hugging Face config dicts and tensor names (``runner.gguf`` reads the file and the common keys).

Per family, what llama.cpp's converter changed and what is undone here:

- ``gemma2`` / ``gemma3``: every RMSNorm gain is stored as ``w + 1`` (the converter folds
  Gemma's ``1 + w``); ``runner.models.gemma`` applies ``1 + w`` itself, so 1 is subtracted
  (float32). The four block norms are ``attn_norm`` (input), ``post_attention_norm``,
  ``ffn_norm`` (pre-feedforward) and ``post_ffw_norm``. The query scale is not in the file:
  llama.cpp takes ``hidden / heads`` for the 27B models (46 / 62 blocks) and the head width
  otherwise, and so do we (``query_pre_attn_scalar``). Gemma 3 slides ``pattern - 1`` of every
  ``pattern`` layers (default 6) with their own RoPE base (``rope.freq_base_swa``, default
  10000) only when the file has a window; Gemma 2 alternates, soft-capping attention scores
  and logits with the file's caps (llama.cpp's defaults, 50 and 30, when absent).
- ``phi3``: q/k/v stay fused (``attn_qkv`` = ``qkv_proj``) and ``ffn_up`` holds gate then up,
  ``gate_up_proj``'s order, so nothing moves. LongRoPE's tables are tensors
  (``rope_factors_short`` / ``rope_factors_long``) and become the config's ``rope_scaling``;
  ``rope.dimension_count`` below the head width is Phi-4-mini's partial rotary.
- ``qwen3moe``: experts are stacked ``[E, out, in]`` tensors (``ffn_{gate,up,down}_exps``),
  handed over as ``switch_mlp`` stacks (float32: the loader has no quantized product for
  stacked experts on the CPU, and dequantizes them there anyway); the router is
  ``ffn_gate_inp``. llama.cpp always renormalises the top-k weights of this architecture
  (``norm_topk_prob``) unless ``expert_weights_norm`` says otherwise.
- ``glm4moe``: nothing transformed (its RoPE rotates halves already, so Q/K are not
  permuted). The first ``leading_dense_block_count`` layers are dense; the others route by
  sigmoid with the ``exp_probs_b`` correction bias, ``expert_group_count`` /
  ``expert_group_used_count`` groups, ``expert_weights_norm`` (llama.cpp's default when
  absent: off) and ``expert_weights_scale``, plus ``expert_shared_count`` plain shared
  experts (``ffn_*_shexp``). Q/K/V biases and q/k norms are decided by the tensors present
  (the file has no key for them). The MTP layer (``nextn_predict_layers``, counted in
  ``block_count`` and stored as the last block with ``nextn.*`` tensors) is dropped: the
  target loads without its MTP head.

Every ``{arch}.*`` metadata key of these families is either read (``runner.gguf``'s common
keys or :data:`_KEYS`) or refused by name: a key we do not know may change the math.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from protocol.errors import CorruptModelFile
from runner.gguf_tensors import GGUFQuantized
from runner.models.config import malformed, refuse
from runner.quantized import affine_dense

log = logging.getLogger("mtp_runner.gguf")

ARCHS = ("gemma2", "gemma3", "phi3", "qwen3moe", "glm4moe")
MODEL_TYPES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "qwen3moe": "qwen3_moe"}
MODEL_TYPES["glm4moe"] = "glm4_moe"
# The common keys runner.gguf.gguf_config reads for every architecture.
COMMON_KEYS = frozenset(
    {
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
        "attention.key_length",
        "attention.value_length",
        "rope.freq_base",
        "rope.dimension_count",
        "vocab_size",
    }
)
_KEYS = {
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"},
    "gemma3": {
        "final_logit_softcapping",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        "rope.scaling.type",
        "rope.scaling.factor",
    },
    "phi3": {
        "attention.sliding_window",
        "rope.scaling.original_context_length",
        "rope.scaling.attn_factor",
    },
    "qwen3moe": {
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_weights_norm",
        "expert_gating_func",
        "expert_shared_count",
        "rope.scaling.type",
        "rope.scaling.factor",
    },
    "glm4moe": {
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_count",
        "expert_weights_norm",
        "expert_weights_scale",
        "expert_gating_func",
        "expert_group_count",
        "expert_group_used_count",
        "leading_dense_block_count",
        "nextn_predict_layers",
    },
}
# Block counts of the 27B models, whose query scale llama.cpp takes as hidden / heads.
_LARGE_BLOCKS = {"gemma2": 46, "gemma3": 62}
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2  # llama.cpp's expert_gating_func values

# The attention block's tensors, named alike in every family that has separate q, k and v.
ATTENTION_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
}
_GEMMA_LAYER = ATTENTION_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3MOE_LAYER = ATTENTION_NAMES | {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GLM4MOE_LAYER = {
    **{k: v for k, v in _QWEN3MOE_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # stored as exp_probs_b.bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
    "phi3": _PHI3_LAYER,
    "qwen3moe": _QWEN3MOE_LAYER,
    "glm4moe": _GLM4MOE_LAYER,
}
Get = Callable[..., object]


def refuse_unmapped(arch: str, meta: dict, known: frozenset[str] | set[str], path: str) -> None:
    """Refuse, by name, any ``{arch}.*`` key of ``meta`` outside ``known`` (what a mapping
    reads): a key it would ignore may change what the model computes."""
    for key, value in meta.items():
        if key.startswith(arch + ".") and key[len(arch) + 1 :] not in known:
            raise refuse(key, value, f"not mapped from GGUF for {arch}", path)


def whole_number(arch: str, key: str, value: object, path: str, minimum: int = 0) -> int:
    """``value`` of ``{arch}.{key}`` as an int: missing, not a whole number or below
    ``minimum`` is a corrupt file, named."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or int(value) < minimum:
        raise CorruptModelFile(f"missing or bad hyper-parameter {arch}.{key}: {value!r}", path=path)
    return int(value)


def hyper_int(
    arch: str, get: Get, key: str, path: str, default: int | None = None, minimum: int = 0
) -> int:
    """The hyper-parameter ``{arch}.{key}`` (``default`` when the file has none) as an int
    (:func:`whole_number`)."""
    return whole_number(arch, key, get(key, default), path, minimum)


def refuse_unknown_keys(arch: str, meta: dict, path: str) -> None:
    refuse_unmapped(arch, meta, COMMON_KEYS | _KEYS[arch], path)


def family_config(arch: str, config: dict, get: Get, path: str) -> dict:
    """``config`` (the common keys, read by ``runner.gguf.gguf_config``) completed with the
    family's own keys, as the runner's Hugging Face config of that family."""
    config["model_type"] = MODEL_TYPES[arch]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotated = get("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim and arch not in ("phi3", "glm4moe"):
        why = f"partial rotary (head {head_dim})"
        raise refuse(f"{arch}.rope.dimension_count", rotated, why, path)
    values = get("attention.value_length")
    if values is not None and int(values) != head_dim:
        why = f"values as wide as keys ({head_dim})"
        raise refuse(f"{arch}.attention.value_length", values, why, path)
    if arch in ("gemma2", "gemma3"):
        _gemma(arch, config, get, head_dim, path)
    elif arch == "phi3":
        _phi3(config, get, head_dim, rotated, path)
    elif arch == "glm4moe":
        _glm4moe(config, get, head_dim, rotated, path)
    else:
        _qwen3moe(config, get, path)
    return config


def _rope_scaling(arch: str, config: dict, get: Get, path: str) -> None:
    kind = get("rope.scaling.type")
    if kind == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(get("rope.scaling.factor")),
        }
    elif kind not in (None, "none"):
        raise refuse(f"{arch}.rope.scaling.type", kind, "GGUF RoPE scaling: linear only", path)


def _gemma(arch: str, config: dict, get: Get, head_dim: int, path: str) -> None:
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    large = layers == _LARGE_BLOCKS[arch]
    config["query_pre_attn_scalar"] = hidden // config["num_attention_heads"] if large else head_dim
    config["head_dim"] = head_dim
    window = get("attention.sliding_window")
    final_cap = get("final_logit_softcapping")
    if arch == "gemma2":
        # Absent keys keep Gemma 2's defaults (window 4096, caps 50 and 30), llama.cpp's too.
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                config[key] = float(get(key))
        if window is not None:
            config["sliding_window"] = int(window)
        return
    config["final_logit_softcapping"] = None if final_cap is None else float(final_cap)
    config["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    _rope_scaling(arch, config, get, path)
    if not window:  # no window in the file: llama.cpp runs every layer as full attention
        config["layer_types"] = ["full_attention"] * layers
        return
    config["sliding_window"] = int(window)
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: true where the layer slides
        if len(pattern) != layers:
            why = f"one entry per layer ({layers})"
            raise refuse(f"{arch}.attention.sliding_window_pattern", pattern, why, path)
        config["layer_types"] = [
            "sliding_attention" if slides else "full_attention" for slides in pattern
        ]
    else:
        config["sliding_window_pattern"] = int(pattern)


def _phi3(config: dict, get: Get, head_dim: int, rotated, path: str) -> None:
    if rotated is not None and int(rotated) != head_dim:
        config["partial_rotary_factor"] = int(rotated) / head_dim
    window = get("attention.sliding_window")
    # The converter writes 0 for "no window" (Phi-4-mini).
    config["sliding_window"] = int(window) if window else None
    original = get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    attn_factor = get("rope.scaling.attn_factor")
    if attn_factor is not None:  # LongRoPE: the tables arrive as tensors (map_family_tensors)
        config["rope_scaling"] = {"rope_type": "longrope", "attention_factor": float(attn_factor)}


def _qwen3moe(config: dict, get: Get, path: str) -> None:
    experts = hyper_int("qwen3moe", get, "expert_count", path)
    used = hyper_int("qwen3moe", get, "expert_used_count", path)
    width = hyper_int("qwen3moe", get, "expert_feed_forward_length", path)
    shared = get("expert_shared_count")
    if shared:
        raise refuse("qwen3moe.expert_shared_count", shared, "qwen3_moe has no shared expert", path)
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise refuse("qwen3moe.expert_gating_func", gating, "qwen3_moe routes by softmax", path)
    config["num_experts"] = experts
    config["num_experts_per_tok"] = used
    config["moe_intermediate_size"] = width
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []
    _rope_scaling("qwen3moe", config, get, path)


def _glm4moe(config: dict, get: Get, head_dim: int, rotated, path: str) -> None:
    arch = "glm4moe"
    blocks = config["num_hidden_layers"]
    mtp = get("nextn_predict_layers") or 0
    if not isinstance(mtp, int) or not 0 <= mtp < blocks:
        raise malformed(f"{arch}.nextn_predict_layers", f"{mtp!r} of {blocks} blocks", path)
    config["num_hidden_layers"] = blocks - mtp  # the MTP layer is counted in block_count
    config["n_routed_experts"] = hyper_int(arch, get, "expert_count", path)
    config["num_experts_per_tok"] = hyper_int(arch, get, "expert_used_count", path)
    config["moe_intermediate_size"] = hyper_int(arch, get, "expert_feed_forward_length", path)
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _SIGMOID_GATING:
        raise refuse(f"{arch}.expert_gating_func", gating, "glm4_moe routes by sigmoid", path)
    config["head_dim"] = head_dim
    config["partial_rotary_factor"] = (int(rotated) if rotated else head_dim) / head_dim
    config["first_k_dense_replace"] = int(get("leading_dense_block_count", 0))
    config["n_shared_experts"] = int(get("expert_shared_count", 0))
    config["n_group"] = int(get("expert_group_count", 1))
    config["topk_group"] = int(get("expert_group_used_count", 1))
    config["norm_topk_prob"] = bool(get("expert_weights_norm", False))
    config["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0))


def dense_stack(w) -> mx.array:
    """A stacked ``[E, out, in]`` tensor (experts, or per-head matrices) as float32: dense as
    stored, or each quantized matrix (a ``GGUFQuantized`` each, see ``runner.gguf.read_gguf``)
    dequantized: the loader's fallback for experts its gathered product does not take
    (``runner.loader.keep_expert_list``), and the other stacks' form."""
    if isinstance(w, list):
        return mx.array(np.stack([affine_dense(*q.unpack()) for q in w]))
    return w.astype(mx.float32) if w.dtype != mx.float32 else w


def map_family_tensors(arch: str, weights: dict, config: dict) -> dict:
    """Rename a family's GGUF tensors to the runner's Hugging Face names and undo the
    converter's transforms (module docstring); unknown tensors stay under their GGUF names
    (surfacing as extras, never silently used)."""
    names = LAYER_NAMES[arch]
    gemma = arch in ("gemma2", "gemma3")
    out: dict = {}
    tables: dict[str, list[float]] = {}
    dropped = []
    for name, w in weights.items():
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("blk."):
            _, idx, part = stem.split(".", 2)
            if arch == "glm4moe" and int(idx) >= config["num_hidden_layers"]:
                dropped.append(name)  # the MTP layer (module docstring)
                continue
            if arch == "glm4moe" and part == "ffn_gate_inp" and isinstance(w, GGUFQuantized):
                w = mx.array(affine_dense(*w.unpack()))  # a sigmoid router stays float32
            mapped = names.get(part)
            key = f"model.layers.{idx}.{mapped}.{suffix}" if mapped else name
            if part == "exp_probs_b":  # a bare parameter in the Hugging Face names
                key = f"model.layers.{idx}.{mapped}"
        else:
            mapped = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
            mapped["output"] = "lm_head"
            if stem in ("rope_factors_short", "rope_factors_long") and arch == "phi3":
                tables[stem] = np.array(w.astype(mx.float32)).tolist()
                continue
            key = f"{mapped[stem]}.{suffix}" if stem in mapped else name
            part = stem
        if gemma and part.endswith("norm") and isinstance(w, mx.array):
            w = w.astype(mx.float32) - 1.0  # the file holds 1 + w (module docstring)
        elif part.endswith("_exps") and not isinstance(w, list):
            w = dense_stack(w)  # a quantized stack stays one matrix per expert (the loader's)
        out[key] = w
    if arch == "glm4moe":
        # No keys for these: the tensors say (the model is built after this mapping).
        config["attention_bias"] = any(k.endswith(".self_attn.q_proj.bias") for k in out)
        config["use_qk_norm"] = any(k.endswith(".self_attn.q_norm.weight") for k in out)
    if dropped:
        log.info(
            "skipping %d MTP tensors (%s, ...): not loaded from GGUF", len(dropped), dropped[0]
        )
    if tables:
        scaling = config.setdefault("rope_scaling", {"rope_type": "longrope"})
        scaling["short_factor"] = tables.get("rope_factors_short")
        scaling["long_factor"] = tables.get("rope_factors_long")
    return out
