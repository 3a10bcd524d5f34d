"""GGUF files of llama.cpp's ``gemma4`` architecture (the Gemma 4 text models) as the runner's
``gemma4_text`` config and Hugging Face tensor names (``runner.models.gemma4``), and the file's
``gemma4`` vocabulary as a ``tokenizers.Tokenizer``. ``runner.gguf`` hands ``gemma4`` files here
whole: their per-layer arrays (``head_count_kv``, ``feed_forward_length``) do not fit its common
keys.

What llama.cpp's converter writes, and how it is read back:

- the head shapes: ``attention.key_length`` / ``value_length`` are the full layers' head width,
  ``*_swa`` the sliding layers'; ``attention.head_count_kv`` is one count or one per layer;
  ``attention.sliding_window_pattern`` is one bool per layer (true: sliding; required, as
  llama.cpp requires it). They become
  ``per_layer_config`` entries for the full layers, as transformers saves them;
- RoPE: ``rope.freq_base`` (full layers), ``rope.freq_base_swa`` (sliding; llama.cpp's default
  is the full base). The full layers' proportional RoPE is the ``rope_freqs`` tensor: a factor
  per pair, 1 for the pairs that rotate and 1e30 (no rotation) for the rest, so the leading
  run of finite factors gives ``partial_rotary_factor`` (a common factor other than 1 is
  ``factor``). Without the tensor every pair rotates (``default``). ``rope.dimension_count`` /
  ``_swa`` must be the whole head: partial rotary in llama.cpp's sense is no Gemma 4 RoPE;
- ``attention.shared_kv_layers`` (``num_kv_shared_layers``); ``feed_forward_length`` per layer
  is ``use_double_wide_mlp`` when exactly the shared layers are twice as wide;
- ``embedding_length_per_layer_input`` (``hidden_size_per_layer_input``; 0: none), the per-layer
  vocabulary from ``per_layer_token_embd``'s rows;
- the expert block: ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``
  (``enable_moe_block``), the router ``ffn_gate_inp`` with its ``.scale`` (the router's
  ``scale``), each expert's weight ``ffn_down_exps.scale`` (``per_expert_scale``), the experts
  fused (``ffn_gate_up_exps``, gate rows first, as transformers' ``gate_up_proj``) or apart,
  dequantized to float32 stacks as ``runner.gguf_families`` does for stacked experts;
- keys-as-values: a full layer computing keys without ``attn_v`` (``attention_k_eq_v``);
- ``layer_output_scale`` is ``layer_scalar``; norms are stored as they are (no ``1 + w``:
  Gemma 4's RMSNorm gains are plain ``w``), Q/K unpermuted (rotate-half RoPE).

Every ``gemma4.*`` key is read or refused by name, and so is a file whose shapes no Gemma 4
config can say (the rules of ``runner.models.config``): among them tensors whose key is absent
(per-layer inputs without ``embedding_length_per_layer_input``, expert tensors without
``expert_count``) and attention biases.

The ``gemma4`` vocabulary is a BPE over characters (no byte-level alphabet) with its merges in
the file: spaces become ``▁`` with no prefix, runs of newlines are split from the rest
(llama.cpp's ``[^\\n]+|[\\n]+``), characters the vocabulary lacks fall back to ``<0xNN>``
tokens, and llama.cpp always adds BOS for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from protocol.errors import CorruptModelFile, UnsupportedTokenizer
from runner.gguf_families import COMMON_KEYS, dense_stack, refuse_unmapped, whole_number
from runner.gguf_tensors import GGUFQuantized
from runner.models.config import malformed, refuse
from runner.quantized import affine_dense

ARCHS = ("gemma4",)
SLIDING, FULL = "sliding_attention", "full_attention"
_KEYS = COMMON_KEYS | {
    "attention.key_length_swa",
    "attention.value_length_swa",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.shared_kv_layers",
    "rope.freq_base_swa",
    "rope.dimension_count_swa",
    "embedding_length_per_layer_input",
    "final_logit_softcapping",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_gating_func",
}
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func value
# Tensors that only a key makes part of the model (GGUF stem or block part -> the key), so a
# file holding them without it is refused rather than loaded as a model without them.
_ENABLED_BY = {
    "embedding_length_per_layer_input": (
        "per_layer_token_embd",
        "per_layer_model_proj",
        "per_layer_proj_norm",
        "inp_gate",
        "proj",
        "post_norm",
    ),
    "expert_count": (
        "ffn_gate_inp",
        "ffn_gate_up_exps",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
        "pre_ffw_norm_2",
        "post_ffw_norm_1",
        "post_ffw_norm_2",
    ),
}
# A rope_freqs factor this large stops its pair (the converter writes 1e30).
_NO_ROTATION = 1e20
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# (block tensor, suffix) -> name under model.layers.{i}.
_LAYER = {
    ("attn_norm", "weight"): "input_layernorm.weight",
    ("attn_q", "weight"): "self_attn.q_proj.weight",
    ("attn_k", "weight"): "self_attn.k_proj.weight",
    ("attn_v", "weight"): "self_attn.v_proj.weight",
    ("attn_output", "weight"): "self_attn.o_proj.weight",
    ("attn_q_norm", "weight"): "self_attn.q_norm.weight",
    ("attn_k_norm", "weight"): "self_attn.k_norm.weight",
    ("post_attention_norm", "weight"): "post_attention_layernorm.weight",
    ("ffn_norm", "weight"): "pre_feedforward_layernorm.weight",
    ("post_ffw_norm", "weight"): "post_feedforward_layernorm.weight",
    ("ffn_gate", "weight"): "mlp.gate_proj.weight",
    ("ffn_up", "weight"): "mlp.up_proj.weight",
    ("ffn_down", "weight"): "mlp.down_proj.weight",
    ("layer_output_scale", "weight"): "layer_scalar",
    ("inp_gate", "weight"): "per_layer_input_gate.weight",
    ("proj", "weight"): "per_layer_projection.weight",
    ("post_norm", "weight"): "post_per_layer_input_norm.weight",
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("pre_ffw_norm_2", "weight"): "pre_feedforward_layernorm_2.weight",
    ("post_ffw_norm_1", "weight"): "post_feedforward_layernorm_1.weight",
    ("post_ffw_norm_2", "weight"): "post_feedforward_layernorm_2.weight",
    ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",  # split by map_tensors
    ("ffn_gate_exps", "weight"): "experts.gate_proj.weight",
    ("ffn_up_exps", "weight"): "experts.up_proj.weight",
    ("ffn_down_exps", "weight"): "experts.down_proj.weight",
}
Get = Callable[..., object]


def refuse_unknown_keys(meta: dict, path: str) -> None:
    refuse_unmapped("gemma4", meta, _KEYS, path)


def _whole(value: object, key: str, path: str) -> int:
    return whole_number("gemma4", key, value, path)


def _int(get: Get, key: str, path: str, default: object = None) -> int:
    return _whole(get(key, default), key, path)


def _per_layer(get: Get, key: str, layers: int, path: str, default: object = None) -> list[int]:
    """A key llama.cpp reads as one value or one per layer, as one value per layer."""
    value = get(key, default)
    if isinstance(value, list):
        if len(value) != layers:
            raise malformed(f"gemma4.{key}", f"{len(value)} values for {layers} layers", path)
        return [_whole(v, key, path) for v in value]
    return [_int(get, key, path, default)] * layers


def gguf_config(meta: dict, path: str) -> dict:
    """The ``gemma4_text`` config of a ``gemma4`` file's metadata (module docstring); what
    only the tensors say is filled in by :func:`map_tensors`."""
    refuse_unknown_keys(meta, path)

    def get(key: str, default: object = None) -> object:
        return meta.get(f"gemma4.{key}", default)

    layers = _int(get, "block_count", path)
    heads = set(_per_layer(get, "attention.head_count", layers, path))
    if len(heads) != 1:
        raise refuse("gemma4.attention.head_count", sorted(heads), "one head count", path)
    # llama.cpp requires the pattern (it reads it with get_key_or_arr, required): a file
    # without one is not all full attention but incomplete.
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        why = f"one bool per layer (required, as llama.cpp requires it), found {pattern!r}"
        raise malformed("gemma4.attention.sliding_window_pattern", why, path)
    types = [SLIDING if slides else FULL for slides in pattern]
    if types[-1] != FULL:  # transformers forces the last layer to full attention
        why = "the last layer attends fully in Gemma 4"
        raise refuse("gemma4.attention.sliding_window_pattern", pattern, why, path)
    dims = {FULL: _int(get, "attention.key_length", path)}
    dims[SLIDING] = _int(get, "attention.key_length_swa", path, dims[FULL])
    for t, suffix in ((FULL, ""), (SLIDING, "_swa")):
        values = _int(get, f"attention.value_length{suffix}", path, dims[t])
        rotated = _int(get, f"rope.dimension_count{suffix}", path, dims[t])
        if values != dims[t]:
            raise refuse(f"gemma4.attention.value_length{suffix}", values, "values as keys", path)
        if rotated != dims[t]:
            why = f"partial rotary outside rope_freqs (head {dims[t]})"
            raise refuse(f"gemma4.rope.dimension_count{suffix}", rotated, why, path)
    kv = _per_layer(get, "attention.head_count_kv", layers, path, next(iter(heads)))
    for t in set(types):  # a Gemma 4 config has one key-head count per layer type
        if len({kv[i] for i in range(layers) if types[i] == t}) != 1:
            raise refuse("gemma4.attention.head_count_kv", kv, "one count per layer type", path)
    swa_kv = {kv[i] for i in range(layers) if types[i] == SLIDING} or {kv[0]}
    shared = _int(get, "attention.shared_kv_layers", path, 0)
    widths = _per_layer(get, "feed_forward_length", layers, path)
    first_shared = layers - shared
    narrow = widths[0]
    wide = widths != [narrow] * layers
    if wide and widths != [narrow] * first_shared + [2 * narrow] * shared:
        why = "one width, or twice it on exactly the shared-KV layers (use_double_wide_mlp)"
        raise refuse("gemma4.feed_forward_length", widths, why, path)
    config: dict = {
        "model_type": "gemma4_text",
        "hidden_size": _int(get, "embedding_length", path),
        "num_hidden_layers": layers,
        "intermediate_size": narrow,
        "num_attention_heads": next(iter(heads)),
        "num_key_value_heads": next(iter(swa_kv)),
        "head_dim": dims[SLIDING],
        "per_layer_config": {
            str(i): {"head_dim": dims[FULL], "num_key_value_heads": kv[i]}
            for i, t in enumerate(types)
            if t == FULL
        },
        "layer_types": types,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": _int(get, "context_length", path, 131072),
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": wide,
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's GELU is the tanh form
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_size_per_layer_input": _int(get, "embedding_length_per_layer_input", path, 0),
        "attention_k_eq_v": False,  # map_tensors: from the full layers' tensors
    }
    full_base = float(get("rope.freq_base", 10_000.0))  # llama.cpp's default
    config["rope_parameters"] = {
        FULL: {"rope_type": "default", "rope_theta": full_base},  # map_tensors: rope_freqs
        SLIDING: {
            "rope_type": "default",
            "rope_theta": float(get("rope.freq_base_swa", full_base)),
        },
    }
    if SLIDING in types:
        config["sliding_window"] = _int(get, "attention.sliding_window", path)
    experts = _int(get, "expert_count", path, 0)
    if experts:
        gating = get("expert_gating_func")
        if gating is not None and gating != _SOFTMAX_GATING:
            raise refuse("gemma4.expert_gating_func", gating, "Gemma 4 routes by softmax", path)
        config["enable_moe_block"] = True
        config["num_experts"] = experts
        config["top_k_experts"] = _int(get, "expert_used_count", path)
        config["moe_intermediate_size"] = _int(get, "expert_feed_forward_length", path)
    vocab = get("vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config["vocab_size"] = _int(get, "vocab_size", path) if vocab is not None else len(tokens)
    config["vocab_size_per_layer_input"] = config["vocab_size"]  # map_tensors: from the table
    return config


def _full_rope(factors: mx.array, config: dict) -> dict:
    """The full layers' RoPE entry from ``rope_freqs`` (module docstring)."""
    values = np.array(factors.astype(mx.float32)).reshape(-1)
    theta = config["rope_parameters"][FULL]["rope_theta"]
    head_dim = next(iter(config["per_layer_config"].values()))["head_dim"]
    if values.size != head_dim // 2:
        raise malformed("rope_freqs", f"{values.size} factors for {head_dim // 2} pairs", None)
    rotated = int(np.argmax(values >= _NO_ROTATION)) if (values >= _NO_ROTATION).any() else None
    pairs = values.size if rotated is None else rotated
    kept, stopped = values[:pairs], values[pairs:]
    if pairs == 0 or not (kept == kept[0]).all() or not (stopped >= _NO_ROTATION).all():
        why = "leading pairs with one factor, the rest stopped (proportional RoPE)"
        shown = f"{values.size} factors from {values.min():g} to {values.max():g}"
        raise refuse("rope_freqs", shown, why, None)
    if pairs == values.size and kept[0] == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    share = 2 * pairs / head_dim
    if int(share * head_dim // 2) != pairs:  # the config reader floors share * head_dim / 2
        share = math.nextafter(share, 1.0)
    return {
        "rope_type": "proportional",
        "partial_rotary_factor": share,
        "rope_theta": theta,
        "factor": float(kept[0]),
    }


def map_tensors(weights: dict, config: dict) -> dict:
    """Rename a ``gemma4`` file's tensors to the runner's Hugging Face names, and complete
    ``config`` with what only the tensors say (module docstring). Unknown tensors stay under
    their GGUF names, surfacing as extras."""
    out: dict = {}
    for name, w in weights.items():
        stem, _, suffix = name.rpartition(".")
        if stem == "rope_freqs":
            config["rope_parameters"][FULL] = _full_rope(w, config)
            continue
        if stem in _TOP and suffix == "weight":
            out[f"{_TOP[stem]}.weight"] = w
            if stem == "per_layer_token_embd":
                config["vocab_size_per_layer_input"] = int(w.shape[0])
            continue
        if not stem.startswith("blk.") or (stem.split(".", 2)[2], suffix) not in _LAYER:
            out[name] = w
            continue
        _, index, part = stem.split(".", 2)
        base = f"model.layers.{index}."
        if part == "ffn_gate_up_exps":
            gate, up = mx.split(dense_stack(w), 2, axis=1)  # gate rows first
            out[base + "experts.gate_proj.weight"] = gate
            out[base + "experts.up_proj.weight"] = up
            continue
        if part.endswith("_exps") and suffix == "weight":
            w = dense_stack(w)
        elif part == "ffn_gate_inp" and isinstance(w, GGUFQuantized):
            w = mx.array(affine_dense(*w.unpack()))  # the router stays float32
        out[base + _LAYER[(part, suffix)]] = w
    _complete(out, config, set(weights))
    return out


def _complete(out: dict, config: dict, names: set[str]) -> None:
    """Refuse tensors the metadata does not enable (``_ENABLED_BY``; attention biases, which
    Gemma 4 has none of), decide keys-as-values from the full layers' tensors and give every
    layer a scalar (llama.cpp treats a missing ``layer_output_scale`` as 1)."""
    enabled = {
        "embedding_length_per_layer_input": bool(config.get("hidden_size_per_layer_input")),
        "expert_count": bool(config.get("enable_moe_block")),
    }
    for name in sorted(names):
        stem, _, suffix = name.rpartition(".")
        part = stem.split(".", 2)[2] if stem.startswith("blk.") and stem.count(".") >= 2 else stem
        for key, parts in _ENABLED_BY.items():
            if part in parts and not enabled[key]:
                raise malformed(name, f"present, but the file has no gemma4.{key}", None)
        if suffix == "bias" and part.startswith("attn_"):
            raise refuse(name, "present", "Gemma 4's attention projections have no bias", None)
    layers, types = config["num_hidden_layers"], config["layer_types"]
    computing = range(layers - config["num_kv_shared_layers"])
    has_v = {i: f"model.layers.{i}.self_attn.v_proj.weight" in out for i in computing}
    full = {has_v[i] for i in computing if types[i] == FULL}
    if len(full) > 1:
        why = "every full layer with attn_v, or none (attention_k_eq_v)"
        raise refuse("attn_v", sorted(i for i in computing if not has_v[i]), why, None)
    if not all(has_v[i] for i in computing if types[i] == SLIDING):
        why = "sliding layers compute their own values"
        raise refuse("attn_v", sorted(i for i in computing if not has_v[i]), why, None)
    config["attention_k_eq_v"] = full == {False}
    for i in range(layers):
        out.setdefault(f"model.layers.{i}.layer_scalar", mx.ones((1,)))


def hf_tokenizer(meta: dict, path: str):
    """A ``tokenizers.Tokenizer`` for a ``gemma4`` GGUF vocabulary (module docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type")
    if not tokens or merges is None:
        raise UnsupportedTokenizer("GGUF gemma4 vocabulary lacks tokens or merges", path=path)
    if types is not None and len(types) != len(tokens):
        raise CorruptModelFile("GGUF token types do not match the tokens", path=path)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    if types is not None:
        # 3 = control, 4 = user-defined: matched whole before BPE.
        special = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]
        hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return hf
