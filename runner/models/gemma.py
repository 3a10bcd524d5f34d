"""Gemma 2 and Gemma 3 (text) on the llama family's pieces.

What differs from ``runner.models.llama`` (transformers 5.24's ``modeling_gemma2`` /
``modeling_gemma3``):

- RMSNorm gains are zero-centred, applied as ``1 + w`` (computed in float32, like
  transformers), and every block has four of them: input, post-attention, pre- and
  post-feedforward (``after_attention``);
- embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the weights' dtype);
- the MLP is ``down(gelu_tanh(gate) * up)``;
- attention scales by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- Gemma 2 soft-caps attention scores (``attn_logit_softcapping``, the composed kernel only:
  ``mx.fast`` has no cap) and both soft-cap the final logits (``final_logit_softcapping``);
- sliding and full layers alternate (``layer_types``, or Gemma 2's every-other-layer default,
  Gemma 3's ``sliding_window_pattern``); sliding layers keep a ``RotatingKVCache``;
- Gemma 3 adds ``1 + w`` q/k norms before RoPE and rotates sliding layers with their own local
  base (``rope_local_base_freq``, or the ``sliding_attention`` entry of a nested
  ``rope_parameters``), full layers with the global one and its scaling.

Projections, fusion, packing, compiled blocks and the composed / ``mx.fast`` attention are the
llama family's, so ``runner.device.tune`` lays these models out the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    ModelArgs,
    fused_product,
)
from runner.models.llama import Model as LlamaCausalLM
from runner.models.rope import RoPE
from runner.models.rope_config import Rope, read_rope, rope_spec

FAMILIES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers 5's defaults for keys a config.json may omit (its config classes).
_DEFAULTS = {
    "gemma2": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}
_THETA = {"gemma2": (10000.0, 10000.0), "gemma3_text": (1_000_000.0, 10_000.0)}  # global, local
# transformers' "gelu_pytorch_tanh" / "gelu_new" are the tanh approximation; "gelu" is exact.
ACTIVATIONS = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "gelu": nn.gelu,
}
# Keys of other architectures that change the math unless neutral (runner.models.config's list
# without Gemma's own soft-caps and query scale).
_FOREIGN = {
    k: v
    for k, v in cfgs.FOREIGN_KEYS.items()
    if k not in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
}


@dataclass(frozen=True)
class GemmaSettings:
    """What a Gemma config decides beyond ``ModelArgs`` (kept in ``args.extra["gemma"]``)."""

    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    activation: str
    qk_norm: bool
    ropes: dict[str, Rope]  # per layer type

    def rope(self, layer_type: str) -> Rope:
        return self.ropes[layer_type]


def settings(args: ModelArgs) -> GemmaSettings:
    found = args.extra.get("gemma")
    if not isinstance(found, GemmaSettings):
        raise ValueError(f"{args.model_type} args carry no Gemma settings (use model_args)")
    return found


def _number(cfg: dict, key: str, default, path: str | None, *, optional: bool = False):
    value = cfg.get(key, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise cfgs.malformed(key, f"expected a positive number, found {value!r}", path)
    return float(value)


def layer_types(cfg: dict, family: str, layers: int, path: str | None) -> list[str]:
    """``layer_types``, else Gemma 2's alternation or Gemma 3's ``sliding_window_pattern``
    (layer i is full when ``(i + 1) % pattern == 0``), as transformers' config classes do."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = 2 if family == "gemma2" else cfg.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise cfgs.malformed("sliding_window_pattern", f"found {pattern!r}", path)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if not isinstance(types, list) or len(types) != layers:
        raise cfgs.malformed("layer_types", f"expected a list of {layers} layer types", path)
    for t in types:
        if t not in LAYER_TYPES:
            raise cfgs.refuse("layer_types", t, f"implemented: {', '.join(LAYER_TYPES)}", path)
    return list(types)


def _ropes(cfg: dict, family: str, head_dim: int, max_pos: int, path: str | None):
    """One ``Rope`` per layer type. Gemma 2: one RoPE for every layer. Gemma 3: transformers'
    ``convert_rope_params_to_dict`` (a nested ``rope_parameters``, or ``rope_scaling`` over the
    full layers' entry; ``rope_theta`` / ``rope_local_base_freq`` as their bases)."""
    theta_global, theta_local = _THETA[family]
    if family == "gemma2":
        flat = dict(cfg)
        flat.setdefault("rope_theta", theta_global)
        rope = read_rope(flat, head_dim=head_dim, max_position_embeddings=max_pos, path=path)
        if isinstance(rope, dict):
            raise cfgs.refuse("rope_parameters", sorted(rope), "gemma2 has one RoPE", path)
        return {t: rope for t in LAYER_TYPES}
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and any(t in params for t in LAYER_TYPES)
    params = {t: dict(params.get(t) or {}) for t in LAYER_TYPES} if nested else {}
    full = params.setdefault("full_attention", {"rope_type": "default"})
    sliding = params.setdefault("sliding_attention", {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", theta_global))
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", theta_local))
    out = {}
    for t in LAYER_TYPES:
        spec = rope_spec(
            params[t],
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            where=f"rope_parameters.{t}",
            path=path,
        )
        out[t] = spec
    return out


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``gemma2`` / ``gemma3_text`` config (either layout); keys that
    change the math and are not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {family!r}", path=path)
    defaults = _DEFAULTS[family]

    def get(key):
        value = cfg.get(key)
        return defaults.get(key) if value is None else value

    required = cfgs.positive_ints(cfg, cfgs.SHAPE_KEYS, path, prefix)
    layers = required["num_hidden_layers"]
    head_dim = int(get("head_dim"))
    max_pos = int(get("max_position_embeddings"))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or defaults["hidden_activation"]
    if act not in ACTIVATIONS:
        raise cfgs.refuse("hidden_activation", act, f"implemented: {', '.join(ACTIVATIONS)}", path)
    cfgs.refuse_foreign(cfg, family, prefix, path, _FOREIGN)
    types = layer_types(cfg, family, layers, path)
    window = cfgs.window_size(
        cfg.get("sliding_window", defaults["sliding_window"]), prefix + "sliding_window", path
    )
    if window is None and "sliding_attention" in types:
        raise cfgs.refuse("layer_types", types, "sliding layers but no sliding_window", path)
    ropes = _ropes(cfg, family, head_dim, max_pos, path)
    for t, rope in ropes.items():
        if rope.partial_rotary_factor != 1.0:
            key = f"rope_parameters.{t}.partial_rotary_factor"
            why = f"{family} rotates the whole head"
            raise cfgs.refuse(key, rope.partial_rotary_factor, why, path)
    gemma = GemmaSettings(
        query_pre_attn_scalar=_number(
            cfg, "query_pre_attn_scalar", defaults["query_pre_attn_scalar"], path
        ),
        attn_softcap=(
            _number(
                cfg,
                "attn_logit_softcapping",
                defaults["attn_logit_softcapping"],
                path,
                optional=True,
            )
            if family == "gemma2"  # transformers' Gemma 3 never passes the cap to attention
            else None
        ),
        final_softcap=_number(
            cfg, "final_logit_softcapping", defaults["final_logit_softcapping"], path, optional=True
        ),
        activation=act,
        qk_norm=family == "gemma3_text",
        ropes=ropes,
    )
    kv = get("num_key_value_heads")
    if required["num_attention_heads"] % kv:
        raise cfgs.malformed("num_key_value_heads", f"{kv} does not divide the heads", path)
    tie = cfg.get("tie_word_embeddings")
    full = ropes["full_attention"]
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["gemma"] = gemma
    return ModelArgs(
        model_type=family,
        **required,
        num_key_value_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=full.theta,
        rope_scaling=full.scaling,
        tie_word_embeddings=bool(defaults["tie_word_embeddings"] if tie is None else tie),
        attention_bias=bool(get("attention_bias")),
        max_position_embeddings=max_pos,
        sliding_window=window if "sliding_attention" in types else None,
        layer_types=types if "sliding_attention" in types else None,
        extra=extra,
    )


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: zero-centred gain applied as ``1 + w``, in float32 (transformers:
    ``(x * (1 + w.float())).type_as(x)``, so a bfloat16 ``1 + w`` never rounds the gain)."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        gain = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), gain, self.eps).astype(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, args: ModelArgs, layer_type: str = "full_attention") -> None:
        super().__init__(args, layer_type)
        gemma = settings(args)
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.softcap = gemma.attn_softcap
        for name in ("q_norm", "k_norm"):
            if name in self:
                delattr(self, name)
        if gemma.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        """Sliding and global layers may rotate with different bases (Gemma 3)."""
        rope = settings(args).rope(layer_type)
        return RoPE(
            self.head_dim,
            base=rope.theta,
            scaling=rope.scaling,
            max_position_embeddings=args.max_position_embeddings,
        )


class GemmaMLP(MLP):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.act = ACTIVATIONS[settings(args).activation]

    def __call__(self, x: mx.array) -> mx.array:
        if "_gate_up_t" in self:
            gate, up = mx.split(fused_product(self, "_gate_up_t", x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(DecoderLayer):
    """Norms around both the attention and the MLP output (``post_*``), ``1 + w`` gains."""

    def __init__(self, args: ModelArgs, layer_type: str = "full_attention") -> None:
        nn.Module.__init__(self)
        eps, dim = args.rms_norm_eps, args.hidden_size
        self.self_attn = GemmaAttention(args, layer_type)
        self.mlp = GemmaMLP(args)
        self.input_layernorm = RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps=eps)
        self.compiled = None
        gemma = settings(args)
        if gemma.rope("sliding_attention") != gemma.rope("full_attention"):
            self.rope_group = layer_type

    def after_attention(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn.output(attended))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def head_layer(args: ModelArgs) -> GemmaDecoderLayer:
    """An MTP head's block for a Gemma target: a full-attention layer (global RoPE); the head
    keeps a plain ``KVCache``."""
    return GemmaDecoderLayer(args, "full_attention")


class GemmaStack(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        types = args.layer_types or ["full_attention"] * args.num_hidden_layers
        self.layers = [GemmaDecoderLayer(args, t) for t in types]
        for layer, t in zip(self.layers, types, strict=True):
            layer.window = args.sliding_window if t == "sliding_attention" else None
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(LlamaCausalLM):
    """A Gemma 2 / Gemma 3 text causal LM with the llama family's interface."""

    inner = GemmaStack
    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self._embed_scale = math.sqrt(args.hidden_size)
        self._final_softcap = settings(args).final_softcap

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.model.embed_tokens(tokens)
        return h * mx.array(self._embed_scale, dtype=h.dtype)

    def unembed(self, hidden: mx.array) -> mx.array:
        logits = super().unembed(hidden)
        cap = self._final_softcap
        if cap is None:
            return logits
        return mx.tanh(logits / cap) * cap
