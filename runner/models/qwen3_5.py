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
- the MLP (``qwen3_5_config.read_moe``): Qwen3.5 is dense; Qwen3.5-MoE makes every layer a
  sparse MoE block (softmax top-k, always renormalised, and a shared expert gated by
  ``sigmoid(shared_expert_gate(x))``); Qwen3-Next the same block on the layers that
  ``mlp_only_layers`` / ``decoder_sparse_step`` make sparse (``norm_topk_prob`` as
  configured), a dense MLP on the others.

**Weights** (:func:`prepare_weights`, run by the loader before the checks). Every source ends
in one layout: the gains of the zero-centred norms stored shifted (``1 + w``, so the blocks use
plain ``nn.RMSNorm``), the conv weight in MLX's ``[C, K, 1]``, Qwen3-Next's fused rows
regrouped as ``[q | k | v | z]`` and ``[b | a]``. A Hugging Face checkpoint (conv ``[C, 1,
K]``) is converted, norms shifted once; a checkpoint whose conv weight is already ``[C, K, 1]``
was converted by mlx-lm, which shifts the norms when it moves the conv (its ``sanitize``), so
its norms are left alone. Routed experts, in any of ``runner.models.moe_weights``' layouts, end
stacked as ``switch_mlp`` (an inline MTP layer's too). Names: ``model.`` (text-only saves),
``model.language_model.`` (``Qwen3_5ForConditionalGeneration``), ``language_model.model.``
(mlx-lm); the vision tower (``model.visual.*`` and the other roots) is set aside for
``runner.vision_load`` (``Model.vision_tensors``); an MTP head
(``mtp.*``) stays for ``runner.heads`` among the loader's extra weights; its block is
:func:`head_layer`'s.

Config reading, its defaults and its refusals: ``runner.models.qwen3_5_config``.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from cache.recurrent import RecurrentCache
from protocol.errors import CorruptModelFile
from runner import native
from runner.images import rope_tables
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
from runner.models.moe import SparseMoE
from runner.models.moe_weights import stack_experts
from runner.models.qwen3_5_config import FAMILIES as FAMILIES
from runner.models.qwen3_5_config import HybridSettings, settings
from runner.models.qwen3_5_config import model_args as model_args
from runner.models.rope import RoPE, RopeTables
from runner.models.shared_rows import SequenceRows, attend_rows

log = logging.getLogger("mtp_runner.models")

# --- weights

# Zero-centred gains (applied as 1 + w); the gated norm (linear_attn.norm) is plain.
_SHIFTED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_FINAL_NORM = "model.norm.weight"
CONV = ".linear_attn.conv1d.weight"
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
VISION_ROOTS = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


def prepare_weights(
    weights: dict[str, mx.array],
    sources: dict[str, str],
    args: ModelArgs,
    vision: dict[str, mx.array] | None = None,
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Every checkpoint layout of these families in the one the model loads (module
    docstring): names, the vision tower set aside (into ``vision``, under the checkpoint's
    names), conv weights ``[C, K, 1]``, zero-centred gains shifted exactly once, Qwen3-Next's
    fused rows regrouped."""
    out, where = {}, {}
    vision = {} if vision is None else vision
    for name, value in weights.items():
        new = name
        for old, plain in _RENAMES:
            if name.startswith(old):
                new = plain + name[len(old) :]
                break
        if new.startswith(VISION_ROOTS):
            vision[name] = value
            continue
        out[new] = value
        if name in sources:
            where[new] = sources[name]
    if vision:
        log.info("%d vision-tower tensors (%s, ...) set aside", len(vision), next(iter(vision)))
    convs = {k: v for k, v in out.items() if k.startswith("model.") and k.endswith(CONV)}
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
        # A plain attribute (an nn.Module would keep a tuple among its parameters).
        object.__setattr__(self, "mrope_section", settings(args).mrope_section)

    def __call__(self, x: mx.array, mask: Mask, cache, rope: RopeTables | None = None) -> mx.array:
        if rope is None:  # a layer run on its own (the MTP head): its cache's request layout
            rope = self.rope_tables(cache.layout, cache.offset, x.shape[1], x.dtype)
        before, after = self.parts(x)
        q, k, v, gate = before(x, *rope)
        return after(x, self.self_attn.attend_cached(q, k, v, mask, cache), gate)

    def rows(self, x: mx.array, rope: RopeTables, caches: list, rows: SequenceRows) -> mx.array:
        """Rows of several sequences (``runner.models.shared_rows``), the gate carried."""
        before, after = self.parts(x)
        q, k, v, gate = before(x, *rope)
        return after(x, attend_rows(self, q, k, v, caches, rows), gate)

    def rope_tables(self, layout, offset: int, length: int, dtype: mx.Dtype) -> RopeTables:
        """The tables of rows ``offset..`` of a request with this ``layout`` (None: plain)."""
        return rope_tables(self.self_attn.rope, layout, offset, length, dtype, self.mrope_section)

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


def state_bytes(args: ModelArgs, dtype: mx.Dtype) -> int:
    """Bytes of one linear-attention layer's cache at any position past 0: the last
    ``conv_kernel - 1`` rows its conv fed (q, k and v channels, in the compute ``dtype``) and
    its float32 state ``[Hv, Dk, Dv]``."""
    h = settings(args)
    channels = 2 * h.key_heads * h.key_dim + h.value_heads * h.value_dim
    state = h.value_heads * h.key_dim * h.value_dim * mx.float32.size
    return (h.conv_kernel - 1) * channels * dtype.size + state


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

    def row(
        self, qkv: mx.array, b: mx.array, a: mx.array, conv: mx.array, state: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """:meth:`mix` for one row after a conv history: on the CPU in float32, one native
        node (``runner.native.delta_row``: conv, norms, decay and the delta step) where the
        composed mixer takes a dozen small ones; the outputs, conv rows and state after."""
        if qkv.dtype == mx.float32 and mx.default_device() == mx.cpu and native.delta_available():
            weight, heads = self.conv1d.weight, self.key_heads
            y, conv, state = native.delta_row(
                qkv, conv, weight, b, a, self.A_log, self.dt_bias, state, heads
            )
            return y, conv, state
        y, conv, state, _ = self.mix(qkv, b, a, conv, state)
        return y, conv, state

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
        compiled = self.compiled is not None and self.compiled.serves(x)
        before, after = self.parts(x)
        qkv, z, b, a = before(x)
        y = self.recur(qkv, b, a, cache, compiled)
        return after(x, y, z)

    def rows(self, x: mx.array, rope: RopeTables, caches: list, rows: SequenceRows) -> mx.array:
        """Rows of several sequences (``runner.models.shared_rows``): the projections
        shared, each sequence's conv and state fed its own rows as a feed of its own feeds
        them (a verify's rows keep the states its round asked for)."""
        compiled = self.compiled is not None and self.compiled.serves(x)
        before, after = self.parts(x)
        qkv, z, b, a = before(x)
        if rows.ends:
            split = zip(*(mx.split(t, rows.ends, axis=1) for t in (qkv, b, a)), caches, strict=True)
            y = mx.concatenate([self.recur(*t, cache, compiled) for *t, cache in split], axis=1)
        else:
            y = self.recur(qkv, b, a, caches[0], compiled)
        return after(x, y, z)

    def recur(
        self, qkv: mx.array, b: mx.array, a: mx.array, cache: RecurrentCache, compiled: bool = False
    ) -> mx.array:
        """The mixer over the cache: the states the cache wants come back with the forward."""
        length = qkv.shape[1]
        wanted = tuple(cache.wanted(length))  # none for one row: only rows before the last
        conv, state = cache.conv, cache.recurrent
        if length == 1 and conv is not None:
            if not compiled:
                y, conv, state = self.linear_attn.row(qkv, b, a, conv, state)
            else:
                if self._step_of is not self.compiled:  # compiled parts keep what they traced
                    self._step = mx.compile(self.linear_attn.row)
                    self._step_of = self.compiled
                y, conv, state = self._step(qkv, b, a, conv, state)
            kept = []
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
    convs = [v for k, v in weights.items() if k.endswith(CONV)]
    return not convs or any(v.ndim == 3 and v.shape[1] == 1 and v.shape[2] != 1 for v in convs)


class Model(LlamaCausalLM):
    """A Qwen3.5 / Qwen3-Next hybrid causal LM with the llama family's interface;
    ``make_caches`` gives a ``KVCache`` per attention layer and a ``RecurrentCache`` per
    Gated DeltaNet layer."""

    inner = HybridStack
    serves_draft_features = False  # its own ``hidden`` returns the final hidden only
    # Its ``hidden`` takes no ``on_layer``, and a recurrent state does not rewind to any
    # offset of the last feed: prefill feeds a chunk at a time.
    takes_layer_hook: bool = False

    def prepare_weights(
        self, weights: dict[str, mx.array], sources: dict[str, str]
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        """The loader's hook: :func:`prepare_weights` for this model's settings. Records
        whether an inline MTP head's gains still need the shift (``runner.heads`` reads it)."""
        self.head_norm_shift = stores_zero_centred(weights)
        vision: dict[str, mx.array] = {}
        prepared = prepare_weights(weights, sources, self.args, vision)
        object.__setattr__(self, "vision_tensors", vision)  # not a parameter of the text model
        return prepared

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
        layout = caches[0].layout  # a prompt with images: feature rows, 3-channel positions
        if layout is not None:
            x = layout.overlay(x, offset, "target")
        attention = [layer for layer in self.model.layers if isinstance(layer, AttentionBlock)]
        # "causal": each attention layer's kernel builds or skips what it needs (a few layers
        # of a hybrid attend, so a shared mask array saves little).
        full = "causal" if length > 1 else None
        rope = None
        if attention:
            rope = attention[0].rope_tables(layout, offset, length, x.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, full, cache, rope)
        return x if prenorm else self.model.norm(x)
