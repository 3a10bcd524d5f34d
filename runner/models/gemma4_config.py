"""The config reader of the Gemma 4 text models (``runner.models.gemma4``): ``gemma4_text``,
flat or as the ``text_config`` of a ``gemma4`` checkpoint, as transformers 5.24's
``Gemma4TextConfig`` and ``modeling_gemma4`` read it, or a typed refusal naming the key (the
rule of ``runner.models.config``).

Read and implemented (each absent key takes ``Gemma4TextConfig``'s default):

- the shape keys (``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
  ``num_attention_heads``, ``vocab_size``: required), ``num_key_value_heads``, ``head_dim``,
  ``rms_norm_eps``, ``max_position_embeddings``, ``tie_word_embeddings`` (a ``gemma4``
  checkpoint's top-level one, as ``Gemma4ForConditionalGeneration`` ties by it),
  ``attention_bias``, ``hidden_activation`` (the GELU forms; ``hidden_act`` is ignored, as
  transformers ignores it);
- the layer pattern: ``layer_types`` (default: every sixth layer full), the last layer forced
  to full attention as transformers forces it, ``sliding_window``;
- per-layer shapes: ``per_layer_config`` (layer index -> ``head_dim`` /
  ``num_key_value_heads``, as transformers saves it) or, without it, ``global_head_dim`` for
  the full layers and, with ``attention_k_eq_v``, ``num_global_key_value_heads``;
  ``attention_k_eq_v`` (full layers use the raw key projection as the values);
- RoPE per layer type (``rope_parameters.{sliding_attention,full_attention}``): ``default``
  (transformers' Gemma 4 default ignores every key but ``rope_theta``) and ``proportional``
  (``partial_rotary_factor`` of the head's pairs rotate at ``theta ** (-2i / head_dim)``, the
  rest not at all; ``factor`` divides the frequencies);
- ``num_kv_shared_layers`` (the last layers read the keys and values of the last earlier
  layer of their type), ``use_double_wide_mlp`` (those layers' MLPs twice as wide);
- per-layer inputs: ``hidden_size_per_layer_input`` (0 or null: none),
  ``vocab_size_per_layer_input``;
- ``final_logit_softcapping``; ``use_bidirectional_attention`` null or ``"vision"`` (text
  attends causally either way);
- ``enable_moe_block`` (the expert block beside every layer's MLP) with ``num_experts``,
  ``top_k_experts`` and ``moe_intermediate_size`` (required then).

Refused by name: ``use_bidirectional_attention: "all"``, a ``rope_type`` other than the two above, a
``per_layer_config`` override other than the head shapes, layer types other than sliding and
full, and ``runner.models.config.FOREIGN_KEYS`` (Gemma 2's attention soft-cap and query scale
among them: Gemma 4 scales queries by their norm). Ignored: the vision and audio configs
(the runner serves the text model), the expert keys without ``enable_moe_block``, and the
usual bookkeeping keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.gemma import ACTIVATIONS
from runner.models.llama import ModelArgs
from runner.models.moe import read_field

FAMILIES = ("gemma4_text",)
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
# Gemma4TextConfig's defaults for keys a config.json may omit.
_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "num_kv_shared_layers": 0,
}
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")
# runner.models.config's foreign keys but the ones Gemma 4 reads itself.
_FOREIGN = {
    k: v
    for k, v in cfgs.FOREIGN_KEYS.items()
    if k not in ("final_logit_softcapping", "use_bidirectional_attention")
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its type, head shape, whether its values are its keys, the layer
    whose keys and values it reads (None: its own), whether later layers read its keys and
    values, and its MLP width."""

    layer_type: str
    head_dim: int
    kv_heads: int
    k_eq_v: bool
    kv_source: int | None
    shares_kv: bool
    intermediate_size: int


@dataclass(frozen=True)
class RopeSpec:
    """A layer type's rotation: ``pairs`` of the head's ``head_dim / 2`` rotate, pair i at
    ``theta ** (-2i / head_dim) / factor``."""

    theta: float
    head_dim: int
    pairs: int
    factor: float


@dataclass(frozen=True)
class MoESpec:
    """The expert block every layer runs beside its MLP (``enable_moe_block``)."""

    num_experts: int
    top_k: int
    intermediate_size: int


@dataclass(frozen=True)
class Gemma4Settings:
    """What a Gemma 4 config decides beyond ``ModelArgs`` (``ModelArgs.extra["gemma4"]``)."""

    layers: tuple[LayerSpec, ...]
    ropes: dict[str, RopeSpec]
    activation: str
    final_softcap: float | None
    per_layer_dim: int  # 0: no per-layer inputs
    per_layer_vocab: int
    moe: MoESpec | None = None


def settings(args: ModelArgs) -> Gemma4Settings:
    found = args.extra.get("gemma4")
    if not isinstance(found, Gemma4Settings):
        raise ValueError(f"{args.model_type} args carry no Gemma 4 settings (use model_args)")
    return found


def _layer_types(cfg: dict, layers: int, prefix: str, path: str | None) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise cfgs.malformed(prefix + "layer_types", f"expected {layers} layer types", path)
    for t in types:
        if t not in LAYER_TYPES:
            raise cfgs.refuse(prefix + "layer_types", t, f"implemented: {LAYER_TYPES}", path)
    return [*types[:-1], FULL]  # transformers forces the last layer to full attention


def _head_shapes(
    cfg: dict, types: list[str], head_dim: int, kv_heads: int, prefix: str, path: str | None
) -> list[tuple[int, int]]:
    """(head_dim, kv_heads) per layer, from ``per_layer_config`` or the global keys."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        full: dict[str, int] = {"head_dim": _int(cfg, "global_head_dim", 1, prefix, path)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = _int(cfg, "num_global_key_value_heads", 1, prefix, path)
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    if not isinstance(overrides, dict):
        raise cfgs.malformed(prefix + "per_layer_config", "expected a dict by layer", path)
    shapes = [(head_dim, kv_heads)] * len(types)
    for key, override in overrides.items():
        where = f"{prefix}per_layer_config.{key}"
        index = int(key) if isinstance(key, int | str) and str(key).isdigit() else -1
        if not 0 <= index < len(types) or not isinstance(override, dict):
            raise cfgs.malformed(where, "expected a layer index and a dict of overrides", path)
        for name in override:
            if name not in _LAYER_OVERRIDES:
                raise cfgs.refuse(f"{where}.{name}", override[name], "per-layer override", path)
        shapes[index] = (
            _int(override, "head_dim", 1, where + ".", path, head_dim),
            _int(override, "num_key_value_heads", 1, where + ".", path, kv_heads),
        )
    for t in set(types):
        if len({shapes[i] for i in range(len(types)) if types[i] == t}) != 1:
            raise cfgs.refuse(
                prefix + "per_layer_config", t, "head shapes differ within a layer type", path
            )
    return shapes


def _int(
    cfg: dict, key: str, minimum: int, prefix: str, path: str | None, default: int | None = None
) -> int:
    fallback = _DEFAULTS.get(key) if default is None else default
    return read_field(cfg, key, fallback, int, prefix, path, minimum=minimum)


def _kv_sources(types: list[str], shared: int, prefix: str, path: str | None):
    """Per layer the layer it reads keys and values from (None: its own), and which layers
    are read by others: transformers' ``kv_sharing_modes`` (the last ``shared`` layers read
    the last earlier layer of their own type)."""
    first = len(types) - shared
    if not 0 <= shared <= len(types):
        raise cfgs.malformed(prefix + "num_kv_shared_layers", f"found {shared}", path)
    if shared and first == 0:
        raise cfgs.refuse(prefix + "num_kv_shared_layers", shared, "no layer computes KV", path)
    producers = {t: max((i for i in range(first) if types[i] == t), default=None) for t in types}
    if shared and None in producers.values():
        raise cfgs.malformed(
            prefix + "num_kv_shared_layers", "a shared layer type has no earlier layer", path
        )
    sources = [None if i < first else producers[types[i]] for i in range(len(types))]
    return sources, {s for s in sources if s is not None}


def _rope(cfg: dict, t: str, head_dim: int, prefix: str, path: str | None) -> RopeSpec:
    if cfg.get("rope_scaling"):
        why = "Gemma 4 reads rope_parameters by layer type"
        raise cfgs.refuse(prefix + "rope_scaling", cfg["rope_scaling"], why, path)
    params = cfg.get("rope_parameters") or _DEFAULT_ROPE
    where = f"{prefix}rope_parameters.{t}"
    entry = params.get(t) if isinstance(params, dict) else None
    if not isinstance(entry, dict):
        raise cfgs.malformed(where, "expected a dict per layer type", path)
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise cfgs.refuse(where + ".rope_type", kind, f"implemented: {ROPE_TYPES}", path)
    theta = read_field(entry, "rope_theta", None, float, where + ".", path, minimum=0)
    if kind == "default":
        return RopeSpec(theta, head_dim, head_dim // 2, 1.0)
    share = read_field(entry, "partial_rotary_factor", 1.0, float, where + ".", path, minimum=0)
    factor = read_field(entry, "factor", 1.0, float, where + ".", path, minimum=0)
    if share > 1 or factor <= 0:
        raise cfgs.malformed(where, f"partial_rotary_factor {share}, factor {factor}", path)
    return RopeSpec(theta, head_dim, int(share * head_dim // 2), factor)


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``gemma4_text`` config (flat or a ``gemma4`` ``text_config``)."""
    cfg, prefix = cfgs.text_config(config)
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {family!r}", path=path)
    required = cfgs.positive_ints(cfg, cfgs.SHAPE_KEYS, path, prefix)
    layers = required["num_hidden_layers"]
    moe = None
    if read_field(cfg, "enable_moe_block", False, bool, prefix, path):
        experts = _int(cfg, "num_experts", 1, prefix, path)
        top_k = _int(cfg, "top_k_experts", 1, prefix, path)
        if top_k > experts:
            raise cfgs.malformed(prefix + "top_k_experts", f"{top_k} of {experts} experts", path)
        moe = MoESpec(experts, top_k, _int(cfg, "moe_intermediate_size", 1, prefix, path))
    bidirectional = cfg.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        why = "text attends causally (null or 'vision' only)"
        raise cfgs.refuse(prefix + "use_bidirectional_attention", bidirectional, why, path)
    # Gemma4TextConfig reads ``hidden_activation`` only: a ``hidden_act`` beside it (another
    # family's key) leaves its default in place, so it does here.
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise cfgs.refuse(prefix + "hidden_activation", act, f"implemented: {ACTIVATIONS}", path)
    cfgs.refuse_foreign(cfg, family, prefix, path, _FOREIGN)
    types = _layer_types(cfg, layers, prefix, path)
    window = cfgs.window_size(
        cfg.get("sliding_window", _DEFAULTS["sliding_window"]), prefix + "sliding_window", path
    )
    if window is None and SLIDING in types:
        why = "sliding layers need a window (layer_types has them)"
        raise cfgs.refuse(prefix + "sliding_window", window, why, path)
    heads = required["num_attention_heads"]
    head_dim, kv_heads = (
        _int(cfg, "head_dim", 1, prefix, path),
        _int(cfg, "num_key_value_heads", 1, prefix, path),
    )
    shapes = _head_shapes(cfg, types, head_dim, kv_heads, prefix, path)
    for i, (_, kv) in enumerate(shapes):
        if heads % kv:
            raise cfgs.malformed(prefix + "num_key_value_heads", f"layer {i}: {kv} kv heads", path)
    k_eq_v = read_field(cfg, "attention_k_eq_v", False, bool, prefix, path)
    shared = _int(cfg, "num_kv_shared_layers", 0, prefix, path)
    sources, producers = _kv_sources(types, shared, prefix, path)
    wide = read_field(cfg, "use_double_wide_mlp", False, bool, prefix, path)
    width = required["intermediate_size"]
    specs = tuple(
        LayerSpec(
            layer_type=t,
            head_dim=shapes[i][0],
            kv_heads=shapes[i][1],
            k_eq_v=k_eq_v and t == FULL,
            kv_source=sources[i],
            shares_kv=i in producers,
            intermediate_size=width * (2 if wide and sources[i] is not None else 1),
        )
        for i, t in enumerate(types)
    )
    dims = {t: next(s.head_dim for s in specs if s.layer_type == t) for t in set(types)}
    key = "hidden_size_per_layer_input"
    per_layer = cfg.get(key, _DEFAULTS[key])
    per_layer = read_field({key: per_layer or 0}, key, 0, int, prefix, path, minimum=0)
    softcap = cfg.get("final_logit_softcapping")
    if softcap is not None:
        softcap = read_field(cfg, "final_logit_softcapping", None, float, prefix, path, minimum=0)
    gemma4 = Gemma4Settings(
        layers=specs,
        ropes={t: _rope(cfg, t, dims[t], prefix, path) for t in dims},
        activation=act,
        final_softcap=softcap or None,
        per_layer_dim=per_layer,
        per_layer_vocab=_int(cfg, "vocab_size_per_layer_input", 1, prefix, path)
        if per_layer
        else 0,
        moe=moe,
    )
    # A ``gemma4`` checkpoint's head is tied by its top-level key (``Gemma4ForConditional
    # Generation``): its text_config's own is saved at the default whatever the top says.
    tie = (config if cfgs.is_nested(config) else cfg).get("tie_word_embeddings")
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["gemma4"] = gemma4
    return ModelArgs(
        model_type=family,
        **required,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(read_field(cfg, "rms_norm_eps", 1e-6, float, prefix, path, minimum=0)),
        rope_theta=gemma4.ropes[types[-1]].theta,
        tie_word_embeddings=bool(_DEFAULTS["tie_word_embeddings"] if tie is None else tie),
        attention_bias=bool(cfg.get("attention_bias") or False),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 1, prefix, path),
        sliding_window=window if SLIDING in types else None,
        layer_types=types,
        extra=extra,
    )
