"""Multi-head Latent Attention: DeepSeek-V3 (``deepseek_v3``) and GLM-4.7-Flash
(``glm4_moe_lite``) as transformers 5.24 defines them, with the MTP layer their checkpoints
ship. The config is read by ``runner.models.mla_config`` (every key, and what is refused).

**Attention** (transformers' ``DeepseekV3Attention``, which ``Glm4MoeLiteAttention`` is):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) without q_lora_rank
             per head [q_nope (qk_nope_head_dim), q_rot (qk_rope_head_dim)]
    c, k_r = kv_a_proj_with_mqa(x) split [kv_lora_rank, qk_rope_head_dim]
    c      = kv_a_layernorm(c)                    the latent, one per position for all heads
    q_rot, k_r rotated (RoPE on the rope part only; k_r is one key shared by every head)
    per head h: k = [W_uk[h] c, k_r], v = W_uv[h] c   (kv_b_proj = [W_uk; W_uv] per head)
    out    = o_proj(concat_h softmax(scale q k^T) v)

**The latent cache.** Each layer keeps a ``cache.kv.KVCache`` whose "keys" are the latents
``c`` ``[B, 1, T, kv_lora_rank]`` and whose "values" are the rotated rope keys ``k_r``
``[B, 1, T, qk_rope_head_dim]``: ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
layer, where expanded heads would hold ``heads * (qk_nope + qk_rope + v_head_dim)``
(:func:`cache_bytes_per_token`; DeepSeek-V3 576 against 40960, 71x less). Being a plain
``KVCache`` (one "head"), snapshots, rewinds and the prefix cache handle it unchanged, and
the MTP layer's draft cache is one as well.

**Two forms of the same attention.** *Absorbed*: ``q_nope W_uk[h]`` moves the queries into
the latent space, so the scores are ``(q_nope W_uk) c^T + q_rot k_r^T``, the weighted sum
``w c`` stays a latent and ``W_uv[h]`` maps it to the head's value afterwards; nothing is
expanded, each cached latent is read once for all the heads (``heads x rows`` query rows in
one product), at ``2 kv_lora_rank + qk_rope_head_dim`` per query row, head and key.
*Expanded*: ``kv_b_proj`` turns every cached latent into per-head keys and values, and the
attention is ordinary multi-head attention at ``qk_head_dim + v_head_dim`` per query row,
head and key, plus ``kv_lora_rank x heads x (qk_nope + v)`` per key for the expansion, shared
by the feed's rows. Which pays where (measured on the CPU at GLM-4.7-Flash's and DeepSeek's
head shapes):

- decode steps, verify rows, short feeds: absorbed, 40 to 80 times faster than re-expanding
  the whole cache every step;
- feeds the blocked kernel of ``runner.models.attention`` serves (float32 on the CPU, from
  ``MIN_ROWS`` rows: prefill chunks): absorbed through it as one-KV-head attention, the
  latent with its rope key ``[c, k_r]`` both key and value (the value's rope columns cut off
  after): 64-row feeds in about a third of the expanded form's time, 256-row ones in 0.6 to
  0.9 of it, 512-row chunks about even (0.7 to 1.5), with a transient of
  ``T x (kv_lora_rank + qk_rope_head_dim)`` instead of ``T x heads x (qk_head_dim +
  v_head_dim)``;
- elsewhere (a GPU, bfloat16: composed kernels): expanded from
  :attr:`MLAttention.expand_rows` rows on, where the two costs above cross
  (``kv_lora_rank (qk_nope + v) / (2 kv_lora_rank - qk_nope - v)``: DeepSeek-V3 171,
  GLM-4.7-Flash 399), absorbed below.

A causal feed of up to ``ROW_BY_ROW`` rows (a speculative verify) attends row by row in the
absorbed form, each row over the keys up to its own position: the computation and shapes of
decoding those tokens one at a time, so verify rows give plain decoding's bits. The absorbed
products read ``kv_b_proj``'s weight as per-head views; it stays a plain ``nn.Linear`` in the
Hugging Face layout (device tuning packs only the runner's ``Linear``), so neither form keeps
a second copy of it.

**MLP**: layers before ``first_k_dense_replace`` (deepseek_v3) or marked ``dense`` in
``mlp_layer_types`` (glm4_moe_lite) are dense SiLU MLPs; the rest are ``runner.models.moe``'s
``SparseMoE`` with DeepSeek's routing (sigmoid scores, ``e_score_correction_bias`` for the
choice only, group-limited top-k, ``norm_topk_prob``, ``routed_scaling_factor``, plain shared
experts).

**The MTP layer** (``model.layers.{N}``, N = ``num_hidden_layers``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` and a whole decoder layer; DeepSeek's naming, which
``drafting.load`` reads) runs :func:`head_layer`, this family's block with a MoE MLP (both
families ship a sparse MTP layer; transformers' ``MtpModel`` sets ``first_k_dense_replace`` 0
for it), its own latent ``KVCache``.

Shared forwards (``hidden_rows``, ``--parallel``) work as for the llama family: the rows share
every product and each attends, absorbed, over its own latent cache. RoPE runs through the
composed kernel on every device (``runner.device.set_kernels`` switches llama's ``Attention``
only), yarn's attention factor and the softmax scale's mscale included.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from protocol.errors import UnsupportedArchitecture
from runner.models.attention import blocked_attention, causal_mask
from runner.models.attention import serves as serves_blocked
from runner.models.layers import Linear, dense_weight
from runner.models.llama import MLP, ROW_BY_ROW, DecoderLayer, Mask, ModelArgs
from runner.models.mla_config import FAMILIES, LATENT_NORM_EPS, MLASettings
from runner.models.mla_config import model_args as model_args
from runner.models.mla_config import settings as mla_settings
from runner.models.moe import MoEModel, MoEStack, SparseMoE
from runner.models.moe import settings as moe_settings
from runner.models.rope import RoPE, RopeTables

__all__ = ["FAMILIES", "MLASettings", "Model", "head_layer", "model_args"]


class MLAttention(nn.Module):
    """Multi-head latent attention over a latent ``KVCache`` (module docstring). Exposes the
    pieces ``runner.models.llama.DecoderLayer`` and ``Model`` call: ``rope``,
    ``queries_keys_values``, ``attend_cached``, ``output``."""

    # The composed kernels only (llama's Attention flags, read by Model.layer_outputs).
    fast = False
    softcap = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        m = mla_settings(args)
        dim, heads, bias = args.hidden_size, args.num_attention_heads, args.attention_bias
        self.n_heads, self.settings = heads, m
        self.nope, self.rope_dim = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.rank, self.v_dim = m.kv_lora_rank, m.v_head_dim
        self.scale = m.scale
        # Where the expanded form's cost drops below the absorbed one's (module docstring).
        gain = 2 * self.rank - self.nope - self.v_dim
        self.expand_rows = -(-self.rank * (self.nope + self.v_dim) // gain) if gain > 0 else None
        if m.q_lora_rank is None:
            self.q_proj = Linear(dim, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(dim, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(dim, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS)
        # A plain nn.Linear: device tuning leaves it in the Hugging Face layout, whose
        # per-head views the absorbed form multiplies by (module docstring).
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * m.v_head_dim, dim, bias=bias)
        self.rope = RoPE(
            m.qk_rope_head_dim,
            base=args.rope_theta,
            traditional=m.rope_interleave,
            scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    # --- before the cache (fixed shapes: compiled for decode and verify rows)

    def queries_keys_values(
        self, x: mx.array, rope: RopeTables
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The queries ``[B, heads, L, qk_head_dim]`` (rope part rotated), the latents
        ``[B, 1, L, kv_lora_rank]`` and the rotated rope keys ``[B, 1, L, qk_rope_head_dim]``:
        the last two are what the cache stores."""
        batch, length, _ = x.shape
        if "q_proj" in self:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_rot = self.rope.apply(q[..., self.nope :], rope)
        q = mx.concatenate([q[..., : self.nope], q_rot], axis=-1)
        kv = self.kv_a_proj_with_mqa(x)[:, None]  # [B, 1, L, rank + rope]
        latent = self.kv_a_layernorm(kv[..., : self.rank])
        return q, latent, self.rope.apply(kv[..., self.rank :], rope)

    # --- the cache and attention

    def attend_cached(
        self, q: mx.array, latent: mx.array, k_rot: mx.array, mask: Mask, cache
    ) -> mx.array:
        """Append the latents and rope keys to ``cache`` and attend over everything it holds:
        the heads' values ``[B, heads, L, v_head_dim]``. A causal feed of a few rows attends
        row by row (module docstring)."""
        latent, k_rot = cache.update_and_fetch(latent, k_rot)
        rows = q.shape[2]
        if 1 < rows <= ROW_BY_ROW and isinstance(mask, str):
            keys = latent.shape[2] - rows
            return mx.concatenate(
                [
                    self.absorbed(
                        q[:, :, i : i + 1],
                        latent[:, :, : keys + i + 1],
                        k_rot[:, :, : keys + i + 1],
                        None,
                    )
                    for i in range(rows)
                ],
                axis=2,
            )
        if serves_blocked(rows, q.dtype, mask):
            return self.absorbed_blocked(q, latent, k_rot, mask)
        if self.expand_rows is not None and rows >= self.expand_rows:
            return self.expanded(q, latent, k_rot, mask)
        return self.absorbed(q, latent, k_rot, mask)

    def up_projections(self) -> tuple[mx.array, mx.array]:
        """``W_uk`` ``[heads, qk_nope, rank]`` and ``W_uv`` ``[heads, v, rank]``: views of
        ``kv_b_proj``'s weight (a quantized one dequantized once and kept)."""
        layer = self.kv_b_proj
        if isinstance(layer, nn.QuantizedLinear):
            kept = self.__dict__.get("_dense_kv_b")
            if kept is None or kept[0] is not layer.weight:
                kept = (layer.weight, dense_weight(layer))
                object.__setattr__(self, "_dense_kv_b", kept)
            weight = kept[1]
        else:
            weight = layer.weight
        weight = weight.reshape(self.n_heads, self.nope + self.v_dim, self.rank)
        return weight[:, : self.nope], weight[:, self.nope :]

    def absorbed(self, q: mx.array, latent: mx.array, k_rot: mx.array, mask: Mask) -> mx.array:
        """Attention in the latent space: one product of every head's rows by the cached
        latents and one by the rope keys, the weighted latents mapped to values last."""
        batch, heads, length, _ = q.shape
        keys = latent.shape[2]
        w_uk, w_uv = self.up_projections()
        q_latent = (q[..., : self.nope] * self.scale) @ w_uk  # [B, H, L, rank]
        q_rot = q[..., self.nope :] * self.scale
        rows = heads * length
        scores = q_latent.reshape(batch, 1, rows, self.rank) @ latent.swapaxes(-1, -2)
        scores = scores + q_rot.reshape(batch, 1, rows, self.rope_dim) @ k_rot.swapaxes(-1, -2)
        scores = scores.reshape(batch, heads, length, keys)
        weights = mx.softmax(_masked(scores, mask, keys - length), axis=-1, precise=True)
        out = weights.reshape(batch, 1, rows, keys) @ latent
        return out.reshape(batch, heads, length, self.rank) @ w_uv.swapaxes(-1, -2)

    def absorbed_blocked(
        self, q: mx.array, latent: mx.array, k_rot: mx.array, mask: Mask
    ) -> mx.array:
        """The absorbed form through ``runner.models.attention.blocked_attention`` (the native
        fused kernel where built): one KV head whose key and value are both ``[c, k_r]``."""
        w_uk, w_uv = self.up_projections()
        q = mx.concatenate([q[..., : self.nope] @ w_uk, q[..., self.nope :]], axis=-1)
        kv = mx.concatenate([latent, k_rot], axis=-1)
        out = blocked_attention(q, kv, kv, scale=self.scale, mask=mask)[..., : self.rank]
        return out @ w_uv.swapaxes(-1, -2)

    def expanded(self, q: mx.array, latent: mx.array, k_rot: mx.array, mask: Mask) -> mx.array:
        """Ordinary multi-head attention over the latents expanded by ``kv_b_proj``."""
        batch, heads, length, _ = q.shape
        keys = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).reshape(batch, keys, heads, self.nope + self.v_dim)
        kv = kv.transpose(0, 2, 1, 3)
        k_rot = mx.broadcast_to(k_rot, (batch, heads, keys, self.rope_dim))
        k = mx.concatenate([kv[..., : self.nope], k_rot], axis=-1)
        scores = (q * self.scale) @ k.swapaxes(-1, -2)
        weights = mx.softmax(_masked(scores, mask, keys - length), axis=-1, precise=True)
        return weights @ kv[..., self.nope :]

    def output(self, attended: mx.array) -> mx.array:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _masked(scores: mx.array, mask: Mask, offset: int) -> mx.array:
    """``scores`` ``[B, H, L, T]`` with ``mask`` applied: None, "causal" (row i at position
    ``offset + i``), an additive or boolean ``[L, T]`` or per-sequence ``[B, 1, L, T]``."""
    if isinstance(mask, str):
        mask = causal_mask(offset, scores.shape[2], scores.dtype)
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask


class MLADecoderLayer(DecoderLayer):
    """llama's pre-norm block (``before_cache``, the cache and attention, ``after_attention``;
    compiled parts, shared forwards) with :class:`MLAttention` and a dense or sparse MLP."""

    def __init__(self, args: ModelArgs, sparse: bool) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAttention(args)
        self.mlp = SparseMoE(args, moe_settings(args)) if sparse else MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.compiled = None


class MLAStack(MoEStack):
    layer = MLADecoderLayer


def head_layer(args: ModelArgs) -> MLADecoderLayer:
    """The MTP layer's block: this family's layer with a MoE MLP (the checkpoints' MTP layer
    is sparse), over its own latent ``KVCache``."""
    return MLADecoderLayer(args, sparse=True)


class Model(MoEModel):
    """A DeepSeek-V3 / GLM-4.7-Flash causal LM with the llama family's interface."""

    inner = MLAStack
    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included
    ragged_rows: int = 0  # shared forwards take one row per sequence (no verify rows)

    def prepare_weights(
        self, weights: dict[str, mx.array], sources: dict[str, str]
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        split = next((n for n in weights if n.endswith("self_attn.embed_q.weight")), None)
        if split is not None:
            raise UnsupportedArchitecture(
                "mlx-lm's split kv_b_proj (embed_q / unembed_out): load the Hugging Face "
                "checkpoint, whose kv_b_proj this family reads",
                path=sources.get(split),
                tensor=split,
            )
        return super().prepare_weights(weights, sources)


def cache_bytes_per_token(args: ModelArgs, itemsize: int = 2) -> tuple[int, int]:
    """Bytes one token costs the target's caches, all layers: ``(latent, expanded)``, the
    latent cache's ``kv_lora_rank + qk_rope_head_dim`` per layer against the per-head keys
    ``heads * (qk_nope + qk_rope)`` and values ``heads * v_head_dim`` an expanded cache
    would hold; ``itemsize`` the cache dtype's bytes (2: bfloat16)."""
    m = mla_settings(args)
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    expanded = args.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
    layers = args.num_hidden_layers
    return layers * latent * itemsize, layers * expanded * itemsize
