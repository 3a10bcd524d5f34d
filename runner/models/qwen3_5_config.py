"""How a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config is read; ``runner.models.qwen3_5`` builds
the hybrid from what :func:`model_args` returns.

A config is read flat or under ``text_config`` into llama's ``ModelArgs``, keys it omits
taking transformers 5.24's config-class defaults for the family. What the hybrids decide
beyond ``ModelArgs`` travels in ``args.extra``: :class:`HybridSettings` (``"hybrid"``: the
layer schedule, the Gated DeltaNet shapes, the partial rotary factor, Qwen3-Next's fused
projections, the MTP depth) and, where some layer is sparse, ``runner.models.moe``'s
``MoESettings`` (``"moe"``, :func:`read_moe`). The layer schedule is ``layer_types``
(``linear_attention`` / ``full_attention``), else every ``full_attention_interval``-th layer
is full attention. RoPE is read by ``runner.models.rope_config``; a per-layer-type RoPE keeps
its ``full_attention`` entry, the only layers that rotate.

Refused by name: experts in a dense Qwen3.5 config (that is ``qwen3_5_moe``), schedule or
routing keys a Qwen3.5-MoE config sets against what its reference always does,
``attn_output_gate`` false, activations other than SiLU, layer types other than the two
above, a conv narrower than 2, and the llama family's foreign keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.llama import ModelArgs
from runner.models.moe import MoESettings, read_qwen_moe
from runner.models.rope_config import read_rope

FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
# transformers 5.24's config-class defaults for keys a config.json may omit.
_COMMON = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
}
_DEFAULTS = {
    "qwen3_next": {**_COMMON, "num_key_value_heads": 2},
    "qwen3_5_text": {**_COMMON, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_COMMON, "num_key_value_heads": 2},
}
# Their MoE keys' defaults (read_qwen_moe's names).
_MOE_DEFAULTS = {
    "qwen3_next": {
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 512,
    },
    "qwen3_5_moe_text": {
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 512,
    },
}
_LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclass(frozen=True)
class HybridSettings:
    """What a hybrid config decides beyond ``ModelArgs`` (kept in ``args.extra["hybrid"]``)."""

    layer_types: tuple[str, ...]
    partial_rotary_factor: float
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    mtp_layers: int  # the config's MTP depth (the head itself is runner.heads' business)
    # Interleaved multimodal RoPE: how many frequencies read the temporal, height and width
    # position channels (image rows; a text row's three channels are equal, plain RoPE).
    mrope_section: tuple[int, int, int] = (11, 11, 10)


def settings(args: ModelArgs) -> HybridSettings:
    found = args.extra.get("hybrid")
    if not isinstance(found, HybridSettings):
        raise ValueError(f"{args.model_type} args carry no hybrid settings (use model_args)")
    return found


def _layer_types(cfg: dict, layers: int, get, prefix: str, path: str | None) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        interval = get("full_attention_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise cfgs.malformed(prefix + "full_attention_interval", f"found {interval!r}", path)
        return [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
        ]
    if not isinstance(types, list) or len(types) != layers:
        raise cfgs.malformed(prefix + "layer_types", f"expected a list of {layers} entries", path)
    for t in types:
        if t not in LAYER_TYPES:
            raise cfgs.refuse(
                prefix + "layer_types", t, f"implemented: {', '.join(LAYER_TYPES)}", path
            )
    return list(types)


def read_moe(
    cfg: dict, kind: str, layers: int, prefix: str, path: str | None
) -> MoESettings | None:
    """The MoE settings of a hybrid config, or None where every layer is dense. Qwen3.5's
    reference builds no experts; Qwen3.5-MoE's makes every layer sparse and always
    renormalises the top-k, so a config saying otherwise is refused; Qwen3-Next's follows
    ``mlp_only_layers`` / ``decoder_sparse_step`` and ``norm_topk_prob``."""
    experts = cfg.get("num_experts")
    if kind in ("qwen3_5", "qwen3_5_text"):
        if experts:
            raise cfgs.refuse(prefix + "num_experts", experts, "MoE Qwen3.5 is qwen3_5_moe", path)
        return None
    family = "qwen3_next" if kind == "qwen3_next" else "qwen3_5_moe_text"
    if family == "qwen3_5_moe_text":
        for key, always in (("norm_topk_prob", True), ("decoder_sparse_step", 1)):
            if cfg.get(key) not in (None, always):
                raise cfgs.refuse(
                    prefix + key, cfg[key], f"qwen3_5_moe always uses {always!r}", path
                )
        if cfg.get("mlp_only_layers"):
            raise cfgs.refuse(
                prefix + "mlp_only_layers",
                cfg["mlp_only_layers"],
                "every qwen3_5_moe layer is sparse",
                path,
            )
    s = read_qwen_moe(cfg, layers, prefix, path, shared=True, defaults=_MOE_DEFAULTS[family])
    if family == "qwen3_5_moe_text" and not s.num_experts:
        raise cfgs.malformed(prefix + "num_experts", "qwen3_5_moe needs experts (found 0)", path)
    return s if any(s.sparse_layers) else None


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``qwen3_5`` / ``qwen3_5_text`` / ``qwen3_next`` config (flat or under
    ``text_config``); keys that change the math and are not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    defaults = _DEFAULTS[
        "qwen3_next"
        if kind == "qwen3_next"
        else "qwen3_5_moe_text"
        if kind in MOE_FAMILIES
        else "qwen3_5_text"
    ]

    def get(key):
        value = cfg.get(key)
        return defaults.get(key) if value is None else value

    shape = dict(cfg)
    if kind in MOE_FAMILIES and shape.get("intermediate_size") is None:
        # Every layer is sparse, so no dense MLP reads it; ModelArgs wants a width all the same.
        shape["intermediate_size"] = (
            get("moe_intermediate_size")
            or _MOE_DEFAULTS["qwen3_5_moe_text"]["moe_intermediate_size"]
        )
    required = cfgs.positive_ints(shape, cfgs.SHAPE_KEYS, path, prefix)
    layers, heads = required["num_hidden_layers"], required["num_attention_heads"]
    linear = cfgs.positive_ints({k: get(k) for k in _LINEAR_KEYS}, _LINEAR_KEYS, path, prefix)
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise cfgs.malformed(
            prefix + "linear_num_value_heads", "not a multiple of linear_num_key_heads", path
        )
    if linear["linear_conv_kernel_dim"] < 2:
        raise cfgs.refuse(
            prefix + "linear_conv_kernel_dim",
            linear["linear_conv_kernel_dim"],
            "a conv of width 1 keeps no state (and its weight layout is ambiguous)",
            path,
        )
    act = get("hidden_act")
    if act not in cfgs.ACTIVATIONS:
        raise cfgs.refuse(prefix + "hidden_act", act, "only silu is implemented", path)
    if cfg.get("attn_output_gate") is False:
        raise cfgs.refuse(prefix + "attn_output_gate", False, "the reference always gates", path)
    cfgs.refuse_foreign(cfg, kind, prefix, path)
    moe = read_moe(cfg, kind, layers, prefix, path)
    types = _layer_types(cfg, layers, get, prefix, path)
    kv = int(get("num_key_value_heads"))
    if kv < 1 or heads % kv:
        raise cfgs.malformed(
            prefix + "num_key_value_heads", f"{kv} does not divide the heads", path
        )
    head_dim, max_pos = int(get("head_dim")), int(get("max_position_embeddings"))
    rope_cfg = dict(cfg)
    rope_cfg["partial_rotary_factor"] = get("partial_rotary_factor")
    rope = read_rope(
        rope_cfg,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        layer_types=types,
        path=path,
        prefix=prefix,
    )
    if isinstance(rope, dict):  # nested per layer type: only the attention layers rotate
        if "full_attention" not in rope:
            raise cfgs.refuse(
                prefix + "rope_parameters", sorted(rope), "no full_attention entry", path
            )
        rope = rope["full_attention"]
    mtp = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0
    section = _mrope_section(cfg, prefix, path)
    hybrid = HybridSettings(
        layer_types=tuple(types),
        partial_rotary_factor=rope.partial_rotary_factor,
        key_heads=linear["linear_num_key_heads"],
        value_heads=linear["linear_num_value_heads"],
        key_dim=linear["linear_key_head_dim"],
        value_dim=linear["linear_value_head_dim"],
        conv_kernel=linear["linear_conv_kernel_dim"],
        fused_projections=kind == "qwen3_next",
        mtp_layers=int(mtp),
        mrope_section=section,
    )
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["hybrid"] = hybrid
    if moe is not None:
        extra["moe"] = moe
    tie = cfg.get("tie_word_embeddings")
    return ModelArgs(
        model_type=kind,
        **required,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings") if tie is None else tie),
        attention_bias=bool(get("attention_bias")),
        qk_norm=True,
        max_position_embeddings=max_pos,
        extra=extra,
    )


def _mrope_section(cfg: dict, prefix: str, path: str | None) -> tuple[int, int, int]:
    """``mrope_section`` of the RoPE dict (either name), three non-negative ints; absent:
    the released models' (11, 11, 10), as transformers defaults it."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # nested per layer type
        rope = rope["full_attention"]
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    if section is None:
        return (11, 11, 10)
    ok = isinstance(section, list) and len(section) == 3
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in section):
        raise cfgs.malformed(prefix + "rope_parameters.mrope_section", f"found {section!r}", path)
    return (int(section[0]), int(section[1]), int(section[2]))
