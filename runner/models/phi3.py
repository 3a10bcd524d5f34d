"""Phi-3 (and Phi-4-mini, which is ``phi3``) on the llama family's pieces.

What differs from ``runner.models.llama`` (transformers 5.24's ``modeling_phi3``): the
checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``; RoPE is
usually LongRoPE (``runner.models.rope``: short factors up to
``original_max_position_embeddings``, long ones past it) and may rotate only part of the head
(``partial_rotary_factor``); ``sliding_window``, when set, slides every layer (Phi-3-mini-4k:
2047). No biases anywhere.

The fused weights are what ``runner.device.tune`` would build anyway: packed, each becomes
the block's fused product directly (``fuse`` marks it, so the verify-row copy skips it and the
panel layout converts it as one matrix), and llama's fused code paths run it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.activations import silu_mul
from runner.models.layers import fused_to_panels
from runner.models.llama import MLP, Attention, DecoderLayer, Linear, LlamaModel, ModelArgs
from runner.models.llama import Model as LlamaCausalLM
from runner.models.rope import RoPE
from runner.models.rope_config import read_rope

FAMILIES = ("phi3",)
# transformers 5's Phi3Config defaults.
_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 1.0,
}


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``phi3`` config (either layout); keys that change the math and are
    not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    required = cfgs.positive_ints(cfg, cfgs.SHAPE_KEYS, path, prefix)
    heads = required["num_attention_heads"]

    def get(key):
        value = cfg.get(key)
        return _DEFAULTS.get(key) if value is None else value

    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise cfgs.malformed("num_key_value_heads", f"{kv} does not divide the heads", path)
    head_dim = required["hidden_size"] // heads
    max_pos = int(get("max_position_embeddings"))
    act = cfg.get("hidden_act", "silu")
    if act not in cfgs.ACTIVATIONS:
        raise cfgs.refuse("hidden_act", act, "only silu (swish) MLPs are implemented", path)
    cfgs.refuse_foreign(cfg, "phi3", prefix, path)
    # Phi3Config: rope_scaling wins over rope_parameters; "su" and "yarn" are LongRoPE's old names.
    rope_cfg = dict(cfg)
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params.pop("type", None)
        params["rope_type"] = "longrope"
    rope_cfg["rope_scaling"], rope_cfg["rope_parameters"] = params or None, None
    rope_cfg.setdefault("rope_theta", _DEFAULTS["rope_theta"])
    rope_cfg["original_max_position_embeddings"] = get("original_max_position_embeddings")
    rope = read_rope(rope_cfg, head_dim=head_dim, max_position_embeddings=max_pos, path=path)
    if isinstance(rope, dict):
        raise cfgs.refuse("rope_parameters", sorted(rope), "phi3 has one RoPE", path)
    window = cfgs.window_size(cfg.get("sliding_window"), prefix + "sliding_window", path)
    layers = required["num_hidden_layers"]
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["partial_rotary_factor"] = rope.partial_rotary_factor
    tie = cfg.get("tie_word_embeddings")
    return ModelArgs(
        model_type="phi3",
        **required,
        num_key_value_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        tie_word_embeddings=bool(_DEFAULTS["tie_word_embeddings"] if tie is None else tie),
        max_position_embeddings=max_pos,
        sliding_window=window,
        layer_types=["sliding_attention"] * layers if window is not None else None,
        extra=extra,
    )


class Phi3Attention(Attention):
    """q, k and v from one ``qkv_proj`` (split in that order), no biases."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
            if name in self:
                delattr(self, name)
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, width, bias=False)

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        """Partial rotary: the first ``head_dim * partial_rotary_factor`` dims rotate."""
        partial = float(args.extra.get("partial_rotary_factor", 1.0))
        return RoPE(
            int(self.head_dim * partial),
            base=args.rope_theta,
            scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
            head_dim=self.head_dim,
        )

    def fuse(self) -> bool:
        """The packed ``qkv_proj`` is the fused product already: use it as one."""
        return _adopt(self, "_qkv_t", self.qkv_proj)

    def fused_to_panels(self) -> bool:
        return fused_to_panels(self, "_qkv_t", [self.qkv_proj])

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "_qkv_t" in self:
            return super()._project(x)
        qkv = self.qkv_proj(x)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (
            qkv[..., :q_width],
            qkv[..., q_width : q_width + kv_width],
            qkv[..., q_width + kv_width :],
        )


class Phi3MLP(MLP):
    """``down(silu(gate) * up)`` with gate and up the two halves of ``gate_up_proj``."""

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_up_proj = Linear(dim, 2 * hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def fuse(self) -> bool:
        return _adopt(self, "_gate_up_t", self.gate_up_proj)

    def fused_to_panels(self) -> bool:
        return fused_to_panels(self, "_gate_up_t", [self.gate_up_proj])

    def __call__(self, x: mx.array) -> mx.array:
        if "_gate_up_t" in self:
            return super().__call__(x)
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(silu_mul(gate, up))


def _adopt(owner: nn.Module, key: str, linear: nn.Module) -> bool:
    """Make a packed fused checkpoint weight ``owner[key]``, the fused product's matrix (False
    when it is not a packed ``Linear``: quantized or unpacked, it stays a plain product)."""
    if not isinstance(linear, Linear) or "_wt" not in linear or getattr(linear, "fused", False):
        return False
    owner[key] = linear._wt
    linear.fused = True  # add_row_layout and linears_to_panels leave it to the fused product
    return True


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.self_attn = Phi3Attention(args)
        self.mlp = Phi3MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.compiled = None


def head_layer(args: ModelArgs) -> Phi3DecoderLayer:
    """An MTP head's block for a Phi-3 target (full attention: the head keeps a ``KVCache``)."""
    return Phi3DecoderLayer(args)


class Phi3Stack(LlamaModel):
    layer = Phi3DecoderLayer


class Model(LlamaCausalLM):
    """A Phi-3 causal LM with the llama family's interface."""

    inner = Phi3Stack
    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included
