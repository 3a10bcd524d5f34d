"""Qwen3.5 (``qwen3_5``, ``qwen3_5_text``), Qwen3.5-MoE (``qwen3_5_moe``, ``qwen3_5_moe_text``)
and Qwen3-Next (``qwen3_next``): hybrids of Gated DeltaNet and gated full attention, on the
llama family's pieces, with dense MLPs or ``runner.models.moe.SparseMoE`` blocks.

What differs from ``runner.models.llama`` (transformers 5.24's ``modeling_qwen3_next`` /
``modeling_qwen3_5``):

- the layer schedule: ``layer_types`` (``linear_attention`` / ``full_attention``), else every
  ``full_attention_interval``-th layer (default 4) is full attention, the others Gated
  DeltaNet;
- full attention is gated: ``q_proj`` emits, per head, the query then a gate of the same
  width; the output is ``o_proj(attention * sigmoid(gate))``; q/k RMS norms per head; partial
  RoPE over the first ``head_dim * partial_rotary_factor`` dims (default 0.25), GQA;
- Gated DeltaNet layers (:class:`GatedDeltaNet`): q/k/v, a gate ``z`` and per-value-head ``b``
  / ``a`` from the input (Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``; Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key-head
  group), a causal depthwise conv of width ``linear_conv_kernel_dim`` plus SiLU over q/k/v,
  the gated delta rule (``runner.models.gated_delta``) on a float32 state, then
  ``out_proj(rmsnorm(y) * silu(z))``; each keeps a ``cache.recurrent.RecurrentCache``;
- RMSNorm gains of the layer, final and q/k norms are zero-centred (``1 + w``); the gated
  norm's gain is plain;
- the MLP (:func:`read_moe`): Qwen3.5 is dense; Qwen3.5-MoE makes every layer a sparse MoE
  block (softmax top-k, always renormalised, and a shared expert gated by
  ``sigmoid(shared_expert_gate(x))``); Qwen3-Next the same block on the layers that
  ``mlp_only_layers`` / ``decoder_sparse_step`` make sparse (``norm_topk_prob`` as
  configured), a dense MLP on the others.

**Weights** (:func:`prepare_weights`, run by the loader before the checks). Every source ends
in one layout: the gains of the zero-centred norms stored shifted (``1 + w``, so the blocks use
plain ``nn.RMSNorm``), the conv weight in MLX's ``[C, K, 1]``, Qwen3-Next's fused rows
regrouped as ``[q | k | v | z]`` and ``[b | a]``. A Hugging Face checkpoint (conv ``[C, 1,
K]``) is converted, norms shifted once; a checkpoint whose conv weight is already ``[C, K, 1]``
was converted by mlx-lm, which shifts the norms when it moves the conv (its ``sanitize``), so
its norms are left alone. Routed experts, in any of ``runner.models.moe``'s layouts, end
stacked as ``switch_mlp`` (an inline MTP layer's too). Names: ``model.`` (text-only saves),
``model.language_model.`` (``Qwen3_5ForConditionalGeneration``), ``language_model.model.``
(mlx-lm); the vision tower (``model.visual.*``) is dropped with a log line; an MTP head
(``mtp.*``) stays for ``runner.heads`` among the loader's extra weights; its block is
:func:`head_layer`'s.

Refused by name: experts in a dense Qwen3.5 config (that is ``qwen3_5_moe``), schedule or
routing keys a Qwen3.5-MoE config sets against what its reference always does,
``attn_output_gate`` false, activations other than SiLU, layer types other than the two
above, a conv narrower than 2, and the llama family's foreign keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

import runner.models.config as cfgs
from cache.recurrent import RecurrentCache
from protocol.errors import CorruptModelFile, UnsupportedArchitecture
from runner.models.activations import silu
from runner.models.gated_delta import decay_and_beta, gated_delta, normalize_qk
from runner.models.layers import fused_product
from runner.models.llama import (
    MLP,
    Attention,
    CompiledBlock,
    DecoderLayer,
    Linear,
    Mask,
    ModelArgs,
)
from runner.models.llama import Model as LlamaCausalLM
from runner.models.moe import MoESettings, SparseMoE, read_qwen_moe, stack_experts
from runner.models.rope import RoPE, RopeTables

log = logging.getLogger("mtp_runner.models")

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
    rope = cfgs.read_rope(
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


# --- weights

# Zero-centred gains (applied as 1 + w); the gated norm (linear_attn.norm) is plain.
_SHIFTED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORM = "model.norm.weight"
_CONV = ".linear_attn.conv1d.weight"
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


def prepare_weights(
    weights: dict[str, mx.array], sources: dict[str, str], args: ModelArgs
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Every checkpoint layout of these families in the one the model loads (module
    docstring): names, the vision tower dropped, conv weights ``[C, K, 1]``, zero-centred
    gains shifted exactly once, Qwen3-Next's fused rows regrouped."""
    out, where = {}, {}
    vision = []
    for name, value in weights.items():
        new = name
        for old, plain in _RENAMES:
            if name.startswith(old):
                new = plain + name[len(old) :]
                break
        if new.startswith(_VISION):
            vision.append(name)
            continue
        out[new] = value
        if name in sources:
            where[new] = sources[name]
    if vision:
        log.info(
            "skipping %d vision-tower tensors (%s, ...): the runner serves text only",
            len(vision),
            vision[0],
        )
    convs = {k: v for k, v in out.items() if k.startswith("model.") and k.endswith(_CONV)}
    hf = {k for k, v in convs.items() if v.ndim == 3 and v.shape[1] == 1 and v.shape[2] != 1}
    if hf and len(hf) != len(convs):
        name = sorted(set(convs) - hf)[0]
        raise CorruptModelFile(
            "conv weights in both the Hugging Face [C, 1, K] and the MLX [C, K, 1] layout",
            path=where.get(name),
            tensor=name,
        )
    if hf or not convs:  # Hugging Face layout: zero-centred gains as stored
        for name in convs:
            out[name] = mx.swapaxes(out[name], 1, 2)
        for name in [k for k in out if k.startswith("model.")]:
            if name == _FINAL_NORM or name.endswith(_SHIFTED):
                out[name] = out[name].astype(mx.float32) + 1.0
    if settings(args).fused_projections:
        _regroup_fused(out, settings(args))
    moe = args.extra.get("moe")
    if moe is not None:
        out, where = stack_experts(out, where, moe.num_experts)
    return out, where


def _regroup_fused(weights: dict[str, mx.array], hybrid: HybridSettings) -> None:
    """Qwen3-Next stores ``in_proj_qkvz`` rows per key-head group as ``[q, k, v, z]`` of that
    group (and ``in_proj_ba`` as ``[b, a]``); regroup them as all q, all k, all v, all z (all
    b, all a), the order the projections are split in. Rows only, so quantized triples
    (weight, scales, biases) permute alike."""
    groups, per = hybrid.key_heads, hybrid.value_heads // hybrid.key_heads
    widths = {
        "in_proj_qkvz": [
            hybrid.key_dim,
            hybrid.key_dim,
            per * hybrid.value_dim,
            per * hybrid.value_dim,
        ],
        "in_proj_ba": [per, per],
    }
    for name in list(weights):
        module, _, leaf = name.rpartition(".")
        part = module.rpartition(".")[2]
        if (
            part not in widths
            or ".linear_attn." not in name
            or leaf not in ("weight", "scales", "biases")
        ):
            continue
        w = weights[name]
        sizes = widths[part]
        grouped = w.reshape(groups, sum(sizes), *w.shape[1:])
        pieces, start = [], 0
        for size in sizes:
            pieces.append(grouped[:, start : start + size].reshape(groups * size, *w.shape[1:]))
            start += size
        weights[name] = mx.concatenate(pieces, axis=0)


# --- blocks


class GatedAttention(Attention):
    """Full attention with an output gate: ``q_proj`` emits ``[query, gate]`` per head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        bias = args.attention_bias
        self.q_proj = Linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias=bias)

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        """Partial rotary: the first ``head_dim * partial_rotary_factor`` dims rotate."""
        partial = settings(args).partial_rotary_factor
        return RoPE(
            int(self.head_dim * partial),
            base=args.rope_theta,
            scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
            head_dim=self.head_dim,
        )

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "_qkv_t" not in self:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = fused_product(self, "_qkv_t", x)
        q_width, kv_width = 2 * self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (
            qkv[..., :q_width],
            qkv[..., q_width : q_width + kv_width],
            qkv[..., q_width + kv_width :],
        )

    def queries_keys_values_gate(
        self, x: mx.array, rope: RopeTables
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """q, k, v ``[B, heads, L, head_dim]`` (q and k normed and rotated) and the gate
        ``[B, L, heads * head_dim]``."""
        batch, length, _ = x.shape
        qg, k, v = self._project(x)
        qg = qg.reshape(batch, length, self.n_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(batch, length, self.n_kv_heads, self.head_dim))
        v = v.reshape(batch, length, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        gate = gate.reshape(batch, length, -1)
        return self.rope.apply(q, rope), self.rope.apply(k, rope), v, gate

    def gated_output(self, attended: mx.array, gate: mx.array) -> mx.array:
        batch, _, length, _ = attended.shape
        attended = attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self.o_proj(attended * mx.sigmoid(gate))


def _hybrid_block_parts(block: DecoderLayer, args: ModelArgs, mlp: nn.Module) -> None:
    """What both hybrid blocks hold besides their mixer: the given MLP, the two norms, no
    compiled parts yet (llama's ``DecoderLayer.__init__`` would build its own attention)."""
    nn.Module.__init__(block)
    block.mlp = mlp
    block.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    block.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    block.compiled = None


class AttentionBlock(DecoderLayer):
    """A gated full-attention layer in llama's three parts (before the cache, attention,
    after), the gate passed from the first to the last."""

    def __init__(self, args: ModelArgs, mlp: nn.Module) -> None:
        _hybrid_block_parts(self, args, mlp)
        self.self_attn = GatedAttention(args)

    def __call__(self, x: mx.array, mask: Mask, cache, rope: RopeTables | None = None) -> mx.array:
        if rope is None:
            rope = self.self_attn.rope.tables(cache.offset, x.shape[1], x.dtype)
        before, after = self.before_cache, self.after_attention
        if self.compiled is not None and self.compiled.serves(x):
            before, after = self.compiled.before_cache, self.compiled.after_attention
        q, k, v, gate = before(x, *rope)
        return after(x, self.self_attn.attend_cached(q, k, v, mask, cache), gate)

    def before_cache(self, x: mx.array, *rope: mx.array):
        return self.self_attn.queries_keys_values_gate(self.input_layernorm(x), rope)

    def after_attention(self, x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
        h = x + self.self_attn.gated_output(attended, gate)
        return h + self.mlp(self.post_attention_layernorm(h))


class DepthwiseConv(nn.Module):
    """The causal depthwise conv's weight, ``[C, K, 1]`` (MLX's ``Conv1d`` layout)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, kernel, 1))


def _conv_taps(*operands: mx.array) -> mx.array:
    """``sum_i rows_i * tap_i`` for the K shifted row windows then the K taps: the depthwise
    conv as one fused pass (eagerly it is 2K - 1 passes over ``[L, C]``)."""
    half = len(operands) // 2
    mixed = operands[0] * operands[half]
    for rows, tap in zip(operands[1:half], operands[half + 1 :], strict=True):
        mixed = mixed + rows * tap
    return mixed


# Shapeless: every feed length (prefill chunks, verify rows, decode steps) shares one trace;
# the only broadcast is the taps' over rows, which keeps the fused loop whole.
_conv_kernel = mx.compile(_conv_taps, shapeless=True)


class GatedDeltaNet(nn.Module):
    """One linear-attention mixer (module docstring); Hugging Face parameter names."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h = settings(args)
        self.key_heads, self.value_heads = h.key_heads, h.value_heads
        self.key_dim, self.value_dim, self.kernel = h.key_dim, h.value_dim, h.conv_kernel
        keys, values = h.key_heads * h.key_dim, h.value_heads * h.value_dim
        self.widths = (keys, keys, values)  # q, k, v channels of the conv
        dim = args.hidden_size
        if h.fused_projections:
            self.in_proj_qkvz = Linear(dim, 2 * keys + 2 * values, bias=False)
            self.in_proj_ba = Linear(dim, 2 * h.value_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(dim, 2 * keys + values, bias=False)
            self.in_proj_z = Linear(dim, values, bias=False)
            self.in_proj_b = Linear(dim, h.value_heads, bias=False)
            self.in_proj_a = Linear(dim, h.value_heads, bias=False)
        self.conv1d = DepthwiseConv(2 * keys + values, h.conv_kernel)
        self.dt_bias = mx.ones((h.value_heads,))
        self.A_log = mx.zeros((h.value_heads,))
        self.norm = nn.RMSNorm(h.value_dim, eps=args.rms_norm_eps)  # plain gain
        self.out_proj = Linear(values, dim, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``qkv`` (conv channels), ``z`` ``[B, L, Hv, Dv]``, ``b``, ``a`` ``[B, L, Hv]``."""
        batch, length, _ = x.shape
        channels = sum(self.widths)
        if "in_proj_qkvz" in self:  # rows regrouped at load (prepare_weights)
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
            qkv, z = qkvz[..., :channels], qkvz[..., channels:]
            b, a = ba[..., : self.value_heads], ba[..., self.value_heads :]
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z.reshape(batch, length, self.value_heads, self.value_dim), b, a

    def mix(
        self,
        qkv: mx.array,
        b: mx.array,
        a: mx.array,
        conv: mx.array | None,
        state: mx.array | None,
        states_at: tuple[int, ...] = (),
    ) -> tuple[mx.array, mx.array, mx.array, list]:
        """Conv and recurrence over ``L`` rows from ``(conv, state)`` (None: zeros): the
        outputs ``[B, L, Hv, Dv]``, the conv rows and state after the last row, and ``(conv,
        state)`` after each row count in ``states_at``. Pure, so a decode step compiles."""
        batch, length, channels = qkv.shape
        keep = self.kernel - 1
        if conv is None:
            conv = mx.zeros((batch, keep, channels), dtype=qkv.dtype)
        rows = mx.concatenate([conv, qkv], axis=1)  # the conv's input, K - 1 rows of history
        taps = self.conv1d.weight[:, :, 0].T.astype(qkv.dtype)  # [K, C]: a contiguous row each
        shifted = [rows[:, i : i + length] for i in range(self.kernel)]
        mixed = silu(_conv_kernel(*shifted, *[taps[i] for i in range(self.kernel)]))
        keys, _, _ = self.widths
        q = mixed[..., :keys].reshape(batch, length, self.key_heads, self.key_dim)
        k = mixed[..., keys : 2 * keys].reshape(batch, length, self.key_heads, self.key_dim)
        v = mixed[..., 2 * keys :].reshape(batch, length, self.value_heads, self.value_dim)
        q, k = normalize_qk(q, k)
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        y, state, kept = gated_delta(q, k, v, g, beta, state, states_at=states_at)
        kept = [(rows[:, r : r + keep], s) for r, s in zip(states_at, kept, strict=True)]
        return y.astype(qkv.dtype), rows[:, length:], state, kept

    def output(self, y: mx.array, z: mx.array) -> mx.array:
        """``out_proj(rmsnorm(y) * silu(z))``, the norm per value head, in float32."""
        batch, length = y.shape[:2]
        normed = mx.fast.rms_norm(
            y.astype(mx.float32), self.norm.weight.astype(mx.float32), self.norm.eps
        )
        gated = (normed * silu(z.astype(mx.float32))).astype(y.dtype)
        return self.out_proj(gated.reshape(batch, length, -1))


class LinearBlock(DecoderLayer):
    """A Gated DeltaNet layer in the same three parts: projections (compiled for few rows),
    conv and recurrence against the ``RecurrentCache`` (a one-row step compiled too), then
    the gated norm, output projection, residuals and MLP (compiled)."""

    def __init__(self, args: ModelArgs, mlp: nn.Module) -> None:
        _hybrid_block_parts(self, args, mlp)
        self.linear_attn = GatedDeltaNet(args)
        self._step = None  # the compiled one-row mix, built for the current CompiledBlock
        self._step_of: CompiledBlock | None = None

    def make_cache(self) -> RecurrentCache:
        return RecurrentCache()

    def __call__(
        self, x: mx.array, mask: Mask, cache: RecurrentCache, rope: RopeTables | None = None
    ) -> mx.array:
        before, after = self.before_cache, self.after_attention
        compiled = self.compiled is not None and self.compiled.serves(x)
        if compiled:
            before, after = self.compiled.before_cache, self.compiled.after_attention
        qkv, z, b, a = before(x)
        y = self.recur(qkv, b, a, cache, compiled)
        return after(x, y, z)

    def recur(
        self, qkv: mx.array, b: mx.array, a: mx.array, cache: RecurrentCache, compiled: bool = False
    ) -> mx.array:
        """The mixer over the cache: the states the cache wants come back with the forward."""
        length = qkv.shape[1]
        wanted = tuple(cache.wanted(length))
        conv, state = cache.conv, cache.recurrent
        if compiled and length == 1 and not wanted and conv is not None:
            if self._step_of is not self.compiled:  # compiled parts keep what they traced
                self._step = mx.compile(self.linear_attn.mix)
                self._step_of = self.compiled
            y, conv, state, kept = self._step(qkv, b, a, conv, state)
        else:
            y, conv, state, kept = self.linear_attn.mix(qkv, b, a, conv, state, wanted)
        cache.update(conv, state, length, dict(zip(wanted, kept, strict=True)))
        return y

    def before_cache(self, x: mx.array, *rope: mx.array):
        return self.linear_attn.project(self.input_layernorm(x))

    def after_attention(self, x: mx.array, y: mx.array, z: mx.array) -> mx.array:
        h = x + self.linear_attn.output(y, z)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridStack(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            (AttentionBlock if t == "full_attention" else LinearBlock)(args, self.make_mlp(args, i))
            for i, t in enumerate(settings(args).layer_types)
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    @staticmethod
    def make_mlp(args: ModelArgs, index: int) -> nn.Module:
        """Layer ``index``'s feed-forward block: sparse where the MoE schedule says so."""
        moe = args.extra.get("moe")
        return SparseMoE(args, moe) if moe is not None and moe.sparse_layers[index] else MLP(args)


def head_layer(args: ModelArgs) -> DecoderLayer:
    """The MTP head's block: a gated full-attention layer, even though the target is hybrid
    (``mtp.layers.0.*``: q_proj emits query and gate, q/k norms, partial RoPE); it keeps its
    own ``KVCache``. Its MLP is the target's layer 0 kind (the engines build the head's layer
    with index 0 under the target's MoE schedule: sparse for Qwen3.5-MoE and Qwen3-Next, dense
    for Qwen3.5). Its zero-centred gains are shifted by the head's loader
    (``runner.heads``) when the target's were (``Model.head_norm_shift``)."""
    return AttentionBlock(args, HybridStack.make_mlp(args, 0))


def stores_zero_centred(weights: dict[str, mx.array]) -> bool:
    """Whether a checkpoint stores the zero-centred gains as trained (``w``, applied as ``1 +
    w``): a Hugging Face save, conv weights ``[C, 1, K]``. A conversion by mlx-lm or mlx-vlm
    (conv ``[C, K, 1]``) stored every gain shifted, an MTP head's it kept included."""
    convs = [v for k, v in weights.items() if k.endswith(_CONV)]
    return not convs or any(v.ndim == 3 and v.shape[1] == 1 and v.shape[2] != 1 for v in convs)


class Model(LlamaCausalLM):
    """A Qwen3.5 / Qwen3-Next hybrid causal LM with the llama family's interface;
    ``make_caches`` gives a ``KVCache`` per attention layer and a ``RecurrentCache`` per
    Gated DeltaNet layer."""

    inner = HybridStack
    serves_draft_features = False  # its own ``hidden`` returns the final hidden only

    def prepare_weights(
        self, weights: dict[str, mx.array], sources: dict[str, str]
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        """The loader's hook: :func:`prepare_weights` for this model's settings. Records
        whether an inline MTP head's gains still need the shift (``runner.heads`` reads it)."""
        self.head_norm_shift = stores_zero_centred(weights)
        return prepare_weights(weights, sources, self.args)

    def hidden(
        self,
        tokens: mx.array,
        caches: list,
        mask: Mask = None,
        prenorm: bool = False,
    ) -> mx.array:
        """Run the stack over ``tokens`` ``[B, L]`` (causal over the cached prefix)."""
        if mask is not None:
            raise ValueError(
                "hybrid models take no per-sequence mask: padding would enter the recurrent state"
            )
        x = self.embed(tokens)
        offset, length = caches[0].offset, tokens.shape[1]
        attention = [layer for layer in self.model.layers if isinstance(layer, AttentionBlock)]
        # "causal": each attention layer's kernel builds or skips what it needs (a few layers
        # of a hybrid attend, so a shared mask array saves little).
        full = "causal" if length > 1 else None
        rope = None
        if attention:
            rope = attention[0].self_attn.rope.tables(offset, length, x.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, full, cache, rope)
        return x if prenorm else self.model.norm(x)
