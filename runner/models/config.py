"""One reader for Hugging Face ``config.json`` files: what the model code needs, or a refusal.

**Layouts.** A config is read from its top level or, for a composite checkpoint, from its
``text_config`` (:func:`text_config`; keys the text section lacks, such as
``tie_word_embeddings``, fall back to the top level). RoPE comes in two layouts, read alike:

- transformers 5 (``rope_parameters``): one dict holding ``rope_type``, ``rope_theta`` and the
  type's scaling keys, or one such dict per layer type, keyed by the entries of
  ``layer_types`` (``{"full_attention": {...}, "sliding_attention": {...}}``);
- before (Hub checkpoints): a top-level ``rope_theta`` and ``rope_scaling`` (``type`` or
  ``rope_type`` plus the scaling keys), ``null`` for none.

Both are normalised as transformers' ``standardize_rope_params`` does: ``rope_scaling`` wins
over ``rope_parameters``, a dict without ``rope_theta`` takes the top-level one (else 10000),
``type`` is the old name of ``rope_type``, and for llama3 / yarn / longrope a top-level
``original_max_position_embeddings`` wins over the dict's (Phi-3 keeps it there), else the dict's,
else ``max_position_embeddings``. :func:`rope_spec` turns one dict into a :class:`Rope` whose
``scaling`` is a plain dict with every value resolved (``runner.models.rope.RoPE`` reads it):
yarn's and longrope's ``factor`` (absent or null: ``max_position_embeddings`` over the original
length) and ``attention_factor`` (from ``mscale`` / ``mscale_all_dim`` or the paper's formula),
yarn's ``beta_fast`` / ``beta_slow`` (32 / 1) and ``truncate`` (true), dynamic's context.
Two leniencies where transformers raises: llama3 without ``low_freq_factor`` /
``high_freq_factor`` takes Meta's 1 / 4 (as mlx-lm does), yarn without ``factor`` the ratio.

**The rule.** A key that changes what the model computes is either implemented or refused with
``UnsupportedArchitecture`` naming the key and the config file; nothing that changes the math
is ignored silently. A malformed value (a missing required RoPE key, a table of the wrong
length) is ``CorruptModelFile``, also naming the key. For the llama family (llama, mistral,
qwen2, qwen3, and the smollm aliases) :func:`read_llama_family` decides every key that
transformers' configuration and modeling code for these families reads (transformers 5.24):

- read and implemented: ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
  ``num_attention_heads``, ``vocab_size`` (required), ``num_key_value_heads``, ``head_dim``,
  ``rms_norm_eps``, ``max_position_embeddings``, ``tie_word_embeddings`` (each with the
  family's own default when absent, as transformers' config classes set them),
  ``attention_bias`` (llama: q/k/v/o biases; qwen3: q/k/v/o; qwen2 always has q/k/v biases and
  none on o; mistral never has any: transformers ignores the key there, so do we),
  ``mlp_bias`` (llama only, as in transformers), ``hidden_act`` (``silu``/``swish`` only; any
  other activation is refused), the RoPE keys above with ``rope_type`` one of default, linear,
  dynamic, llama3, yarn, longrope (anything else, e.g. ``proportional`` or ``mrope``, is
  refused), ``rope_traditional`` (mlx-lm's own key: interleaved pairs), and the window keys
  below;
- refused: ``partial_rotary_factor`` other than 1 (transformers' llama-family code rotates the
  whole head or fails), per-layer-type RoPE dicts that differ between layers,
  ``attention_chunk_size`` (chunked attention), ``layer_types`` entries other than
  ``full_attention`` / ``sliding_attention``, a window that would apply (see below), and keys
  of other architectures that would change the math if the checkpoint relied on them
  (:data:`FOREIGN_KEYS`: soft-capping, logit / embedding / residual / attention multipliers,
  q/k norms on llama, NoPE layers, interleaved or multimodal RoPE, parallel residuals, QKV
  clipping, bidirectional attention) unless they hold their neutral value;
- irrelevant at inference, ignored: ``attention_dropout`` (and every ``*_pdrop``),
  ``initializer_range``, ``use_cache``, ``pretraining_tp`` (transformers 5 does not read it;
  before, values > 1 only split the same products into slices), ``pad_token_id`` (only the
  embedding's gradient), ``bos_token_id`` / ``eos_token_id`` (the tokenizer's business),
  ``torch_dtype`` / ``dtype`` (storage; the runner picks its compute dtype), naming and
  bookkeeping keys (``architectures``, ``transformers_version``, ``_name_or_path``, ...), and
  RoPE-dict keys that transformers itself warns about and ignores (e.g. ``mrope_section`` on a
  text-only model, where multimodal RoPE reduces to plain RoPE).

Quantization keys (``quantization``, ``quantization_config``) are read by the loader
(``drafting.weights.Quantization``): mlx-lm's affine layout with per-module overrides; any
other ``mode`` or a foreign ``quant_method`` is refused by name.

**Sliding windows: the fields.** :func:`read_llama_family` reads the window keys
(``sliding_window``, ``use_sliding_window``, ``max_window_layers``, ``layer_types``) the way
transformers resolves them and hands the attention code two ``ModelArgs`` fields:

- ``sliding_window: int | None``: how many keys a sliding layer sees, transformers' semantics
  (the query at position i sees the keys at positions j with i - window < j <= i); None when
  no layer slides;
- ``layer_types: list[str] | None``: one ``"full_attention"`` or ``"sliding_attention"`` per
  layer; None when every layer is full attention.

Resolution: mistral slides every layer when ``sliding_window`` is set (transformers' default
4096 when the key is absent); qwen2 / qwen3 only with ``use_sliding_window``, layer i sliding
when ``layer_types`` says so or, without it, when i >= ``max_window_layers`` (default 28);
llama's reference code masks causally but keeps a windowed cache (an inconsistent model), so a
llama window that applies is refused for good. A window applies when it is shorter than
``max_position_embeddings`` (the context the runner serves); a longer one never hides a key and
is harmless. A window that applies is served by the windowed caches and masks of
``runner.models.llama``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

from protocol.errors import CorruptModelFile, UnsupportedArchitecture

DEFAULT_THETA = 10000.0
# rope_type -> the keys transformers' validation knows for it (besides rope_type / type /
# rope_theta / partial_rotary_factor); freq_factors is GGUF's (runner.gguf: per-pair divisors).
# fmt: off
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
         "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    ),
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
         "attention_factor"}
    ),
    "freq_factors": frozenset({"factors"}),
}
# fmt: on
ROPE_TYPES = tuple(ROPE_KEYS)
_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")

# Keys of other architectures that change the math when they hold anything but these neutral
# values; a llama-family config carrying one was made for code we do not run.
FOREIGN_KEYS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "logits_scaling": (None, 1, 1.0),
    "logit_scale": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "scale_emb": (None, 1, 1.0),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "no_rope_layers": (None,),
    "no_rope_layer_interval": (None,),
    "use_mrope": (None, False),
    "rope_interleaved": (None, False),
    "use_parallel_residual": (None, False),
    "clip_qkv": (None,),
    "use_bidirectional_attention": (None, False),
    "attention_chunk_size": (None,),
}

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ALIASES = {"smollm": "llama", "smollm2": "llama"}
SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)
# transformers 5's defaults for keys a config.json may omit (its config classes).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
    },
    "qwen2": {
        "num_key_value_heads": 32,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
ACTIVATIONS = ("silu", "swish")


def refuse(key: str, value: Any, why: str, path: str | None) -> UnsupportedArchitecture:
    """The refusal of a config key we do not implement (raise it)."""
    return UnsupportedArchitecture(f"unsupported config key {key} = {value!r}: {why}", path=path)


def positive_ints(
    cfg: dict, keys: tuple[str, ...], path: str | None, prefix: str = ""
) -> dict[str, int]:
    """``{key: cfg[key]}`` for keys that must be positive integers (else ``malformed``)."""
    found = {}
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise malformed(prefix + key, f"expected a positive integer, found {value!r}", path)
        found[key] = value
    return found


def malformed(key: str, why: str, path: str | None) -> CorruptModelFile:
    return CorruptModelFile(f"bad config key {key}: {why}", path=path)


# --- layouts


def text_config(config: dict) -> tuple[dict, str]:
    """The text model's keys and the prefix naming them in messages (``""`` or
    ``"text_config."``). A composite config's ``text_config`` wins; keys it lacks fall back to
    the top level (``tie_word_embeddings``, ``quantization`` and the like live there)."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config, ""
    merged = {k: v for k, v in config.items() if k not in ("text_config", "model_type")}
    merged.update(nested)
    return merged, "text_config."


def model_type(config: dict) -> str | None:
    """The ``model_type`` that picks the family: the text section's in a composite config."""
    cfg, _ = text_config(config)
    value = cfg.get("model_type")
    return value if isinstance(value, str) else None


def is_nested(config: dict) -> bool:
    return isinstance(config.get("text_config"), dict)


# --- RoPE


@dataclass(frozen=True)
class Rope:
    """One layer type's rotary embedding: the base, the scaling (None: plain RoPE; else a
    dict with ``rope_type`` and every value the type needs, resolved) and the rotated part of
    the head."""

    theta: float
    scaling: dict | None = None
    partial_rotary_factor: float = 1.0

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling["rope_type"]


def _number(params: dict, key: str, where: str, path: str | None, *, positive: bool = True):
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise malformed(f"{where}.{key}", f"expected a number, found {value!r}", path)
    if positive and value <= 0:
        raise malformed(f"{where}.{key}", f"expected a positive number, found {value!r}", path)
    return float(value)


def _table(params: dict, key: str, pairs: int, where: str, path: str | None) -> list[float]:
    value = params.get(key)
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, Real) and not isinstance(v, bool) and v > 0 for v in value
    ):
        raise malformed(f"{where}.{key}", "expected a list of positive numbers", path)
    if len(value) != pairs:
        raise malformed(
            f"{where}.{key}",
            f"expected {pairs} entries (one per rotated pair), found {len(value)}",
            path,
        )
    return [float(v) for v in value]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_spec(
    params: dict | None,
    *,
    head_dim: int,
    max_position_embeddings: int,
    theta: float | None = None,
    original_max_position_embeddings: int | None = None,
    partial_rotary_factor: float | None = None,
    where: str = "rope_parameters",
    path: str | None = None,
) -> Rope:
    """One RoPE dict (either layout, old ``type`` included) as a :class:`Rope`.

    ``theta`` / ``partial_rotary_factor``: the top-level values a dict without its own takes;
    ``original_max_position_embeddings``: a top-level value, which wins for llama3 / yarn /
    longrope (as in transformers). Unknown types are refused; missing or malformed values are
    ``CorruptModelFile``; keys transformers ignores for the type are ignored.
    """
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind is None:
        kind = "default"
    if kind not in ROPE_KEYS:
        raise refuse(
            f"{where}.rope_type", kind, f"RoPE types implemented: {', '.join(ROPE_TYPES)}", path
        )
    base = params.get("rope_theta")
    if base is None:
        base = DEFAULT_THETA if theta is None else theta
    params["rope_theta"] = base
    base = _number(params, "rope_theta", where, path)
    partial = params.get("partial_rotary_factor", partial_rotary_factor)
    if partial is None:
        partial = 1.0
    params["partial_rotary_factor"] = partial
    partial = _number(params, "partial_rotary_factor", where, path)
    if partial > 1.0:
        raise malformed(f"{where}.partial_rotary_factor", f"{partial} > 1", path)
    dims = int(head_dim * partial)
    if dims < 2 or dims % 2:
        raise malformed(
            f"{where}.partial_rotary_factor", f"rotates {dims} of {head_dim} dims (not even)", path
        )
    if kind == "default":
        return Rope(base, None, partial)
    pairs = dims // 2
    scaling: dict[str, Any] = {"rope_type": kind}
    if kind in _ORIGINAL_MAX_TYPES:
        original = original_max_position_embeddings
        if original is None:
            original = params.get("original_max_position_embeddings", max_position_embeddings)
        params["original_max_position_embeddings"] = original
        original = _number(params, "original_max_position_embeddings", where, path)
        scaling["original_max_position_embeddings"] = int(original)
    if kind in ("linear", "dynamic", "llama3"):
        scaling["factor"] = _number(params, "factor", where, path)
    if kind == "dynamic":
        scaling["max_position_embeddings"] = int(max_position_embeddings)
    elif kind == "llama3":
        # Meta's values when absent, as mlx-lm reads them (transformers requires both keys).
        params.setdefault("low_freq_factor", 1.0)
        params.setdefault("high_freq_factor", 4.0)
        low = _number(params, "low_freq_factor", where, path)
        high = _number(params, "high_freq_factor", where, path)
        if high <= low:
            raise malformed(f"{where}.high_freq_factor", f"{high} <= low_freq_factor {low}", path)
        scaling.update(low_freq_factor=low, high_freq_factor=high)
    elif kind in ("yarn", "longrope"):
        original = scaling["original_max_position_embeddings"]
        factor = params.get("factor")
        if factor is None:  # transformers: the ratio of the two lengths
            factor = max_position_embeddings / original
        params["factor"] = factor
        factor = _number(params, "factor", where, path)
        attention = params.get("attention_factor")
        if kind == "yarn":
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if attention is None:
                if mscale and mscale_all:
                    attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                        factor, float(mscale_all)
                    )
                else:
                    attention = _yarn_mscale(factor)
            scaling.update(
                factor=factor,
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1),
                truncate=bool(params.get("truncate", True)),  # as transformers tests it
            )
        else:
            if attention is None:
                attention = (
                    1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
                )
            scaling.update(
                factor=factor,
                short_factor=_table(params, "short_factor", pairs, where, path),
                long_factor=_table(params, "long_factor", pairs, where, path),
            )
        params["attention_factor"] = attention
        scaling["attention_factor"] = _number(params, "attention_factor", where, path)
    elif kind == "freq_factors":
        scaling["factors"] = _table(params, "factors", pairs, where, path)
    return Rope(base, scaling, partial)


def nested_rope_keys(rope: dict, layer_types: list | None) -> list[str]:
    """The keys a per-layer-type ``rope_parameters`` is nested under (transformers: only the
    layer types the config declares count), or [] for one flat dict."""
    labels = set(layer_types or ())
    return [k for k in rope if k in labels]


def read_rope(
    cfg: dict,
    *,
    head_dim: int,
    max_position_embeddings: int,
    layer_types: list[str] | None = None,
    path: str | None = None,
    prefix: str = "",
) -> Rope | dict[str, Rope]:
    """The RoPE a (text) config describes: one :class:`Rope`, or one per layer type when
    ``rope_parameters`` is nested by the entries of ``layer_types``."""
    scaling = cfg.get("rope_scaling")
    key = "rope_scaling" if scaling else "rope_parameters"
    params = scaling or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise malformed(prefix + key, f"expected an object, found {params!r}", path)
    common = dict(
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        theta=cfg.get("rope_theta"),
        partial_rotary_factor=cfg.get("partial_rotary_factor"),
        path=path,
    )
    nested = nested_rope_keys(params, layer_types)
    if not nested:
        return rope_spec(
            params,
            original_max_position_embeddings=cfg.get("original_max_position_embeddings"),
            where=prefix + key,
            **common,
        )
    out = {}
    for layer_type in nested:
        entry = params[layer_type]
        if entry is None:
            raise refuse(f"{prefix}{key}.{layer_type}", None, "layers without RoPE", path)
        if not isinstance(entry, dict):
            raise malformed(f"{prefix}{key}.{layer_type}", "expected an object", path)
        out[layer_type] = rope_spec(entry, where=f"{prefix}{key}.{layer_type}", **common)
    return out


# --- the llama family


@dataclass(frozen=True)
class Window:
    sliding_window: int | None
    layer_types: list[str] | None

    def applies(self, max_position_embeddings: int) -> bool:
        """Whether some key is ever out of a sliding layer's window within the context."""
        return self.sliding_window is not None and self.sliding_window < max_position_embeddings


def _layer_types(cfg: dict, layers: int, prefix: str, path: str | None) -> list[str] | None:
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers:
        raise malformed(prefix + "layer_types", f"expected a list of {layers} layer types", path)
    for t in types:
        if t not in LAYER_TYPES:
            raise refuse(
                prefix + "layer_types",
                t,
                f"layer types implemented: {', '.join(LAYER_TYPES)}",
                path,
            )
    return list(types)


def window_size(value, key: str, path: str | None) -> int | None:
    """A ``sliding_window`` value: a positive integer or None (else ``malformed``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise malformed(key, f"expected a positive integer or null, found {value!r}", path)
    return value


def refuse_foreign(
    cfg: dict, family: str, prefix: str, path: str | None, keys: dict | None = None
) -> None:
    """Refuse, by name, a key of another architecture (``keys``, default ``FOREIGN_KEYS``)
    whose value is not its neutral one."""
    for key, neutral in (FOREIGN_KEYS if keys is None else keys).items():
        if key in cfg and not any(cfg[key] is n or cfg[key] == n for n in neutral):
            raise refuse(
                prefix + key,
                cfg[key],
                f"not part of the {family} architecture the runner "
                "implements (the checkpoint needs other model code)",
                path,
            )


def read_window(
    cfg: dict, family: str, layers: int, *, prefix: str = "", path: str | None = None
) -> Window:
    """The sliding-window layout transformers gives a llama-family config (module docstring)."""
    defaults = _DEFAULTS[family]
    types = _layer_types(cfg, layers, prefix, path)
    window = cfg.get("sliding_window", defaults.get("sliding_window"))
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", defaults["use_sliding_window"]):
            window = None
        window = window_size(window, prefix + "sliding_window", path)
        if types is None and window is not None:
            first = cfg.get("max_window_layers", defaults["max_window_layers"])
            if isinstance(first, bool) or not isinstance(first, int):
                raise malformed(prefix + "max_window_layers", f"found {first!r}", path)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    else:
        window = window_size(window, prefix + "sliding_window", path)
        if family == "mistral" and window is not None:
            # transformers' mistral masks every layer with the window, whatever layer_types say.
            if types is not None and "full_attention" in types:
                raise refuse(
                    prefix + "layer_types",
                    types,
                    "mistral's reference code slides every layer; a mix needs another family",
                    path,
                )
            types = ["sliding_attention"] * layers
        elif family == "llama" and window is not None and types is None:
            types = ["sliding_attention"] * layers
    if types is not None and "sliding_attention" in types and window is None:
        raise refuse(
            prefix + "layer_types", types, "sliding_attention layers but no sliding_window", path
        )
    if types is None or "sliding_attention" not in types:
        return Window(None, None)
    return Window(window, types)


def _int(cfg: dict, key: str, prefix: str, path: str | None, *, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise malformed(prefix + key, f"expected an integer >= {minimum}, found {value!r}", path)
    return value


def read_llama_family(config: dict, path: str | None = None) -> dict:
    """``ModelArgs`` keyword arguments for a llama-family config (either layout, flat or
    nested), or a typed refusal naming the key (see the module docstring for every key)."""
    cfg, prefix = text_config(config)
    kind = cfg.get("model_type")
    family = ALIASES.get(kind, kind)
    if family not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    defaults = _DEFAULTS[family]
    for key in SHAPE_KEYS:
        if key not in cfg:
            raise malformed(prefix + key, "required key missing", path)
    args: dict[str, Any] = {"model_type": family}
    for key in SHAPE_KEYS:
        args[key] = _int(cfg, key, prefix, path)
    heads = args["num_attention_heads"]

    def get(key):
        value = cfg.get(key)
        return defaults.get(key) if value is None else value

    kv_heads = get("num_key_value_heads")
    args["num_key_value_heads"] = heads if kv_heads is None else int(kv_heads)
    if args["num_key_value_heads"] < 1 or heads % args["num_key_value_heads"]:
        raise malformed(
            prefix + "num_key_value_heads",
            f"{args['num_key_value_heads']} does not divide num_attention_heads {heads}",
            path,
        )
    head_dim = get("head_dim")
    args["head_dim"] = args["hidden_size"] // heads if head_dim is None else int(head_dim)
    args["rms_norm_eps"] = float(get("rms_norm_eps"))
    args["max_position_embeddings"] = int(get("max_position_embeddings"))
    tie = cfg.get("tie_word_embeddings")
    args["tie_word_embeddings"] = bool(defaults["tie_word_embeddings"] if tie is None else tie)
    if family == "llama":
        args["attention_bias"] = bool(cfg.get("attention_bias") or False)
        args["mlp_bias"] = bool(cfg.get("mlp_bias") or False)
    elif family == "qwen3":
        args["attention_bias"] = bool(cfg.get("attention_bias") or False)
    elif family == "qwen2":
        args["attention_bias"] = True  # q/k/v biases whatever the config says (transformers)
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise refuse(prefix + "hidden_act", act, "only silu (swish) MLPs are implemented", path)
    refuse_foreign(cfg, family, prefix, path)
    traditional = cfg.get("rope_traditional", False)
    if not isinstance(traditional, bool):
        raise malformed(prefix + "rope_traditional", f"found {traditional!r}", path)
    args["rope_traditional"] = traditional

    window = read_window(cfg, family, args["num_hidden_layers"], prefix=prefix, path=path)
    max_pos = args["max_position_embeddings"]
    if window.applies(max_pos):
        if family == "llama":
            raise refuse(
                prefix + "sliding_window",
                window.sliding_window,
                "transformers' llama masks causally but keeps a windowed cache; no consistent "
                "model to reproduce",
                path,
            )
    args["sliding_window"] = window.sliding_window
    args["layer_types"] = window.layer_types

    rope = read_rope(
        cfg,
        head_dim=args["head_dim"],
        max_position_embeddings=max_pos,
        layer_types=cfg.get("layer_types"),
        path=path,
        prefix=prefix,
    )
    if isinstance(rope, dict):
        specs = list(rope.values())
        if any(s != specs[0] for s in specs[1:]):
            raise refuse(
                prefix + "rope_parameters",
                sorted(rope),
                f"different RoPE per layer type is not part of the {family} architecture",
                path,
            )
        rope = specs[0]
    if rope.partial_rotary_factor != 1.0:
        raise refuse(
            prefix + "partial_rotary_factor",
            rope.partial_rotary_factor,
            f"{family} rotates the whole head",
            path,
        )
    args["rope_theta"] = rope.theta
    args["rope_scaling"] = rope.scaling
    return args
