"""One reader for Hugging Face ``config.json`` files: what the model code needs, or a refusal.

**Layouts.** A config is read from its top level or, for a composite checkpoint, from its
``text_config`` (:func:`text_config`; keys the text section lacks, such as
``tie_word_embeddings``, fall back to the top level). RoPE comes in two layouts (transformers
5's ``rope_parameters``, flat or per layer type, and the older ``rope_theta`` /
``rope_scaling``), read alike by ``runner.models.rope_config``, whose docstring says how they
are normalised and resolved; its :func:`read_rope`, :func:`rope_spec` and :class:`Rope` are
readable here too, this module being the one config reader. Refusals are worded by
``runner.models.config_errors`` (:func:`refuse`, :func:`malformed`, readable here as well).

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

from dataclasses import dataclass
from typing import Any

from protocol.errors import UnsupportedArchitecture
from runner.models.config_errors import malformed, refuse
from runner.models.rope_config import Rope as Rope
from runner.models.rope_config import read_rope
from runner.models.rope_config import rope_spec as rope_spec

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
