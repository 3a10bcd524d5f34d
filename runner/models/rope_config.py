"""The RoPE part of the one config reader (``runner.models.config``): a config's rotary
embedding as a :class:`Rope`, or a refusal naming the key.

A config's RoPE comes in two layouts, read alike:

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

Every family's config reader goes through :func:`read_rope` (a whole config) or
:func:`rope_spec` (one dict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

from runner.models.config_errors import malformed, refuse

DEFAULT_THETA = 10000.0
# rope_type -> the keys transformers' validation knows for it (besides rope_type / type /
# rope_theta / partial_rotary_factor); freq_factors is GGUF's (runner.gguf: per-pair divisors).
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {
            "short_factor",
            "long_factor",
            "original_max_position_embeddings",
            "factor",
            "attention_factor",
        }
    ),
    "freq_factors": frozenset({"factors"}),
}
ROPE_TYPES = tuple(ROPE_KEYS)
_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")


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
