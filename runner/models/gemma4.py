"""Gemma 4 text models (``gemma4_text``, flat or the text side of a ``gemma4`` checkpoint) on
the llama family's pieces, as transformers 5.24's ``Gemma4ForCausalLM`` computes them. The
config is read by ``runner.models.gemma4_config`` (every key, and what is refused).

What differs from Gemma 3 (``runner.models.gemma``):

- RMSNorm gains are plain ``w`` (not ``1 + w``), applied in float32; values get a gainless
  norm too (``v_norm``), and queries are normed instead of scaled: the softmax scale is 1;
- sliding and full layers have their own head shapes (``per_layer_config``), and a full
  layer may have one key head whose raw projection is also the values (``attention_k_eq_v``);
- RoPE per layer type, ``proportional`` for the full layers: the first pairs of the head
  rotate at ``theta ** (-2i / head_dim)`` and the rest not at all (:func:`make_rope`);
- the last ``num_kv_shared_layers`` layers compute no keys or values: each attends over the
  keys and values the last earlier layer of its type fetched from its cache in the same
  forward, with that layer's mask. Such a layer has no cache (``make_caches`` returns one per
  computing layer, in layer order), so shared layers cost neither memory nor cache moves,
  and every cache operation (rewinds, snapshots, the prefix cache) sees only real caches;
- per-layer inputs (``hidden_size_per_layer_input``): a packed per-layer embedding of the
  token plus a projection of the scaled embedding, normed, averaged (``/ sqrt 2``), one slice
  per layer, gated into the residual after the MLP (:meth:`Gemma4DecoderLayer.after_attention`);
- with ``enable_moe_block`` every layer runs an expert block beside its MLP (routed from the
  residual, its own norms; ``runner.models.moe``'s gathered experts with GELU), the two
  outputs normed and added;
- every layer's output is multiplied by its stored ``layer_scalar``.

``store_layer`` / ``store_cache`` name the last computing layer of each type, whose caches an
assistant drafter reads (``runner.models.gemma4_assistant``).

Projections, packing, compiled blocks and the composed / ``mx.fast`` attention are the llama
family's (``Attention.attend_cached``: row-by-row verify feeds, the blocked kernel for long
feeds), so ``runner.device.tune`` lays these models out the same way; q/k/v fuse only where
all three exist. Shared forwards across sequences (``--parallel``: ``Model.layer_rows``) walk
the shorter cache lists as ``layer_outputs`` does, each sequence's fetched keys kept for the
layers sharing them; ``--kv-bits`` falls back to float caches when layers share keys and
values (the engine finds fewer caches than layers).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cache.kv import KVCache
from cache.kv_quantized import QuantizedKVCache
from runner.models.attention import FeedLayout
from runner.models.gemma import ACTIVATIONS
from runner.models.gemma4_config import FAMILIES, SLIDING, LayerSpec, MoESpec, RopeSpec, settings
from runner.models.gemma4_config import model_args as model_args
from runner.models.layers import Linear
from runner.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    Mask,
    ModelArgs,
    fused_product,
)
from runner.models.llama import Model as LlamaCausalLM
from runner.models.moe import SwitchGLU, gathered
from runner.models.rope import RoPE, RopeTables
from runner.models.shared_rows import SequenceRows, attend_rows

__all__ = ["FAMILIES", "Model", "head_layer", "model_args"]

# Where a layer's fetched keys and values go for the layers that read them (layer index ->
# (keys, values)), filled during one forward.
SharedKV = dict[int, tuple[mx.array, mx.array]]


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x / rms(x) * w`` in float32 (no gain: ``with_scale=False``)."""

    def __init__(self, dims: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        if with_scale:
            self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        gain = self.weight.astype(mx.float32) if "weight" in self else None
        return mx.fast.rms_norm(x.astype(mx.float32), gain, self.eps).astype(x.dtype)


def make_rope(spec: RopeSpec, max_positions: int) -> RoPE:
    """The composed / ``mx.fast`` RoPE over the whole head with ``spec``'s periods: a pair past
    ``spec.pairs`` gets an infinite period (angle 0, left as it is), as transformers'
    proportional RoPE gives it a zero frequency."""
    rope = RoPE(spec.head_dim, base=spec.theta, max_position_embeddings=max_positions)
    exps = np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim
    periods = np.full(spec.head_dim // 2, np.inf)
    periods[: spec.pairs] = spec.factor * spec.theta ** exps[: spec.pairs]
    if spec.pairs < spec.head_dim // 2 or spec.factor != 1.0:
        rope._period_table = mx.array(periods.astype(np.float32))
        rope._freqs = rope._period_table  # mx.fast.rope reads periods where a base cannot say
    return rope


class Gemma4Attention(Attention):
    """q/k/v-normed attention at scale 1 with this layer's head shape; a shared layer has only
    ``q_proj`` and ``o_proj``, a keys-are-values layer no ``v_proj``."""

    def __init__(self, args: ModelArgs, spec: LayerSpec) -> None:
        layer_args = dataclasses.replace(
            args, head_dim=spec.head_dim, num_key_value_heads=spec.kv_heads, qk_norm=False
        )
        super().__init__(layer_args, spec.layer_type)
        self.spec = spec
        self.scale = 1.0
        self.q_norm = RMSNorm(spec.head_dim, eps=args.rms_norm_eps)
        if spec.kv_source is not None:
            del self.k_proj, self.v_proj
        else:
            self.k_norm = RMSNorm(spec.head_dim, eps=args.rms_norm_eps)
            self.v_norm = RMSNorm(spec.head_dim, eps=args.rms_norm_eps, with_scale=False)
            if spec.k_eq_v:
                del self.v_proj

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        return make_rope(settings(args).ropes[layer_type], args.max_position_embeddings)

    def fuse(self) -> bool:
        return "v_proj" in self and "k_proj" in self and super().fuse()

    def fused_to_panels(self) -> bool:
        return "_qkv_t" in self and super().fused_to_panels()

    def queries_keys_values(self, x: mx.array, rope: RopeTables) -> tuple[mx.array, ...]:
        """The rotated queries, and for a layer computing its own: the rotated keys and the
        normed values (``[B, heads, L, head_dim]``)."""
        batch, length, _ = x.shape

        def heads(y: mx.array) -> mx.array:
            return y.reshape(batch, length, -1, self.head_dim)

        if "_qkv_t" in self:
            q, k, v = self._project(x)
        else:
            q = self.q_proj(x)
            k = self.k_proj(x) if "k_proj" in self else None
            v = self.v_proj(x) if "v_proj" in self else k
        q = self.rope.apply(self.q_norm(heads(q)).transpose(0, 2, 1, 3), rope)
        if k is None:
            return (q,)
        k = self.rope.apply(self.k_norm(heads(k)).transpose(0, 2, 1, 3), rope)
        return q, k, self.v_norm(heads(v)).transpose(0, 2, 1, 3)


class FetchedKV:
    """A stand-in cache for ``Attention.attend_cached`` over keys and values already fetched
    (a shared layer's, or a computing layer's whose fetch others read)."""

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        self.kv = (keys, values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.kv


class Gemma4MLP(MLP):
    def __init__(self, args: ModelArgs, width: int) -> None:
        super().__init__(dataclasses.replace(args, intermediate_size=width, mlp_bias=False))
        self.act = ACTIVATIONS[settings(args).activation]

    def __call__(self, x: mx.array) -> mx.array:
        if "_gate_up_t" in self:
            gate, up = mx.split(fused_product(self, "_gate_up_t", x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Gemma4Router(nn.Module):
    """The expert choice: a gainless norm times ``scale / sqrt(D)``, a softmax (float32) over
    the experts, the top-k renormalised to sum to 1, times each chosen expert's scale."""

    def __init__(self, dim: int, spec: MoESpec, eps: float) -> None:
        super().__init__()
        self.proj = Linear(dim, spec.num_experts, bias=False)
        self.scale = mx.ones((dim,))
        self.per_expert_scale = mx.ones((spec.num_experts,))
        self.top_k, self.eps = spec.top_k, eps

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The experts ``[T, k]`` of rows ``x`` ``[T, D]`` and their weights (float32)."""
        h = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype)
        h = h * self.scale * mx.array(x.shape[-1] ** -0.5, dtype=x.dtype)
        probs = mx.softmax(self.proj(h).astype(mx.float32), axis=-1)
        experts = mx.argpartition(-probs, self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(probs, experts, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return experts, weights * self.per_expert_scale[experts].astype(mx.float32)


class Gemma4Experts(SwitchGLU):
    """``runner.models.moe``'s routed experts (its layouts, gathered and panel products) with
    this model's activation instead of SiLU."""

    def __init__(self, dims: int, hidden: int, num_experts: int, act) -> None:
        super().__init__(dims, hidden, num_experts)
        self.act = act

    def _glu(self, x: mx.array, experts: mx.array, ordered: bool) -> mx.array:
        gate, up = self.gate_proj(x, experts, ordered), self.up_proj(x, experts, ordered)
        return self.down_proj(self.act(gate) * up, experts, ordered)

    def _panels(self, x: mx.array, experts: mx.array) -> mx.array:
        rows = x[:, None, :]
        if "_gate_up_p" in self:
            fused = gathered(rows, self._gate_up_p, experts, 2 * self.hidden)
            gate, up = mx.split(fused, 2, axis=-1)
        else:
            gate = self.gate_proj.panel_product(rows, experts)
            up = self.up_proj.panel_product(rows, experts)
        return self.down_proj.panel_product(self.act(gate) * up, experts)


class Gemma4DecoderLayer(DecoderLayer):
    """Gemma's four norms around attention and MLP, then the per-layer input's gated residual
    and the layer's scalar."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        nn.Module.__init__(self)
        g = settings(args)
        spec = g.layers[index]
        eps, dim = args.rms_norm_eps, args.hidden_size
        self.self_attn = Gemma4Attention(args, spec)
        self.mlp = Gemma4MLP(args, spec.intermediate_size)
        self.input_layernorm = RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps=eps)
        if g.per_layer_dim:
            self.per_layer_input_gate = Linear(dim, g.per_layer_dim, bias=False)
            self.per_layer_projection = Linear(g.per_layer_dim, dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(dim, eps=eps)
        if g.moe is not None:
            self.router = Gemma4Router(dim, g.moe, eps)
            self.experts = Gemma4Experts(
                dim, g.moe.intermediate_size, g.moe.num_experts, ACTIVATIONS[g.activation]
            )
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm_1 = RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.act = ACTIVATIONS[g.activation]
        self.compiled = None
        self.rope_group = spec.layer_type
        self.window = args.sliding_window if spec.layer_type == SLIDING else None
        self.index, self.kv_source, self.shares_kv = index, spec.kv_source, spec.shares_kv

    def make_cache(self):
        if self.kv_source is not None:
            raise ValueError("a shared-KV layer keeps no cache")
        return super().make_cache()

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: KVCache | None,
        rope: RopeTables | None = None,
        per_layer: mx.array | None = None,
        shared: SharedKV | None = None,
    ) -> mx.array:
        """One block; a shared layer reads ``shared[kv_source]``, a layer others read writes
        its fetched keys and values there."""
        attn = self.self_attn
        if rope is None:
            rope = attn.rope.tables(cache.offset, x.shape[1], x.dtype)
        before, after = self.before_cache, self.after_attention
        if self.compiled is not None and self.compiled.serves(x):
            before, after = self.compiled.before_cache, self.compiled.after_attention
        q, *kv = before(x, *rope)
        if self.kv_source is not None:
            keys, values = shared[self.kv_source]
            attended = attn.attend_cached(q, keys, values, mask, FetchedKV(keys, values))
        elif self.shares_kv and shared is not None and not isinstance(cache, QuantizedKVCache):
            keys, values = cache.update_and_fetch(*kv)
            shared[self.index] = (keys, values)
            attended = attn.attend_cached(q, keys, values, mask, FetchedKV(keys, values))
        else:
            attended = attn.attend_cached(q, *kv, mask, cache)
        return after(x, attended) if per_layer is None else after(x, attended, per_layer)

    def rows(
        self,
        x: mx.array,
        rope: RopeTables,
        caches: list,
        rows: SequenceRows,
        per_layer: mx.array | None = None,
        shared: list[SharedKV] | None = None,
    ) -> mx.array:
        """Rows of several sequences (``Model.layer_rows``): ``caches[i]`` sequence i's cache
        of this layer (a shared layer: its source's), ``shared[i]`` its fetched keys and
        values by layer, each sequence attending as a forward of its own attends."""
        before, after = self.parts(x)
        q, *kv = before(x, *rope)
        # Packed caches take no fetch to share (``--kv-bits`` keeps such models float).
        packed = isinstance(caches[0], QuantizedKVCache)
        if self.kv_source is None and (not self.shares_kv or packed):
            attended = attend_rows(self, q, *kv, caches, rows)
        else:
            attended = self._fetched_rows(q, kv, caches, rows, shared)
        return after(x, attended) if per_layer is None else after(x, attended, per_layer)

    def _fetched_rows(self, q, kv, caches: list, rows: SequenceRows, shared: list[SharedKV]):
        """A shared layer's attention (each sequence reading its source's fetched keys), or
        a source's (each sequence's fetch kept for the layers that read it), sequence by
        sequence with each one's own mask, as ``__call__`` attends for one sequence."""
        split = [mx.split(t, rows.ends, axis=2) if rows.ends else [t] for t in (q, *kv)]
        attn, parts = self.self_attn, []
        for i, (cache, feed) in enumerate(zip(caches, rows.feeds, strict=True)):
            mask = feed.layer_mask(self, cache)  # before the fetch moves the cache's offset
            qi, *kvi = (t[i] for t in split)
            if self.kv_source is not None:
                keys, values = shared[i][self.kv_source]
            else:
                keys, values = shared[i][self.index] = cache.update_and_fetch(*kvi)
            parts.append(attn.attend_cached(qi, keys, values, mask, FetchedKV(keys, values)))
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    def before_cache(self, x: mx.array, *rope: mx.array) -> tuple[mx.array, ...]:
        return self.self_attn.queries_keys_values(self.input_layernorm(x), rope)

    def after_attention(
        self, x: mx.array, attended: mx.array, per_layer: mx.array | None = None
    ) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn.output(attended))
        y = self.mlp(self.pre_feedforward_layernorm(h))
        if "experts" in self:  # the expert block beside the MLP, routed from the residual
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(
                self.routed(h)
            )
        h = h + self.post_feedforward_layernorm(y)
        if per_layer is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar.astype(h.dtype)

    def routed(self, h: mx.array) -> mx.array:
        """The expert block's output for the residual ``h``: each row through its experts,
        weighted and summed in float32."""
        rows = h.reshape(-1, h.shape[-1])
        experts, weights = self.router(rows)
        y = self.experts(self.pre_feedforward_layernorm_2(rows), experts)  # [T, k, D]
        y = (y.astype(mx.float32) * weights[..., None]).sum(axis=1)
        return y.astype(h.dtype).reshape(h.shape)


def head_layer(args: ModelArgs) -> Gemma4DecoderLayer:
    """An MTP head's block for a Gemma 4 target: the last layer's shape (full attention) with
    its own keys and values, over a plain ``KVCache``."""
    g = settings(args)
    last = dataclasses.replace(g.layers[-1], kv_source=None, shares_kv=False)
    own = dataclasses.replace(g, layers=(*g.layers[:-1], last), per_layer_dim=0)
    extra = {**args.extra, "gemma4": own}
    return Gemma4DecoderLayer(dataclasses.replace(args, extra=extra), len(g.layers) - 1)


class Gemma4Stack(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        g = settings(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Gemma4DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if g.per_layer_dim:
            width = args.num_hidden_layers * g.per_layer_dim
            self.embed_tokens_per_layer = nn.Embedding(g.per_layer_vocab, width)
            self.per_layer_model_projection = Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(g.per_layer_dim, eps=args.rms_norm_eps)


class Model(LlamaCausalLM):
    """A Gemma 4 text causal LM with the llama family's interface."""

    inner = Gemma4Stack
    takes_layer_hook: bool = True  # llama's ``hidden`` over this loop, ``on_layer`` included

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        g = settings(args)
        self._final_softcap = g.final_softcap
        self._per_layer_dim = g.per_layer_dim
        # Each layer's cache in make_caches' list (shared layers: their source's).
        owners = [i for i, layer in enumerate(self.layers) if layer.kv_source is None]
        slot = {layer: n for n, layer in enumerate(owners)}
        cache_of = tuple(
            slot[i if layer.kv_source is None else layer.kv_source]
            for i, layer in enumerate(self.layers)
        )
        object.__setattr__(self, "_cache_of", cache_of)  # not a module child

    def cache_of_layer(self, index: int) -> int:
        """Layer ``index``'s cache in ``make_caches``' list (a shared layer: its source's),
        for code that walks the layers over that shorter list (``runner.prefill``)."""
        return self._cache_of[index]

    def store_layer(self, layer_type: str) -> int:
        """The last layer of ``layer_type`` that computes its own keys and values: the one an
        assistant drafter reads (transformers' ``"store"`` layer)."""
        found = [
            i
            for i, layer in enumerate(self.layers)
            if layer.kv_source is None and layer.rope_group == layer_type
        ]
        if not found:
            raise ValueError(f"no {layer_type} layer computes keys and values")
        return found[-1]

    def store_cache(self, layer_type: str) -> int:
        """The index in ``make_caches``' list of :meth:`store_layer`'s cache."""
        return self._cache_of[self.store_layer(layer_type)]

    def make_caches(self) -> list:
        """One cache per layer that computes keys and values (shared layers have none)."""
        return [layer.make_cache() for layer in self.layers if layer.kv_source is None]

    def prepare_weights(
        self, weights: dict[str, mx.array], sources: dict[str, str]
    ) -> tuple[dict[str, mx.array], dict[str, str]]:
        """Drop the key/value tensors a checkpoint may keep for shared layers (transformers
        ignores them too) and split the experts' fused ``gate_up_proj`` ``[E, 2I, D]`` into
        the stacked gate and up projections ``runner.models.moe`` lays out."""
        unused = {
            f"model.layers.{i}.self_attn.{part}"
            for i, layer in enumerate(self.layers)
            if layer.kv_source is not None
            for part in ("k_proj", "v_proj", "k_norm", "v_norm")
        }
        keep = [k for k in weights if k.rpartition(".")[0] not in unused]
        weights, sources = (
            {k: weights[k] for k in keep},
            {k: sources[k] for k in keep if k in sources},
        )
        for name in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
            base, source = name[: -len("gate_up_proj")], sources.pop(name, None)
            gate, up = mx.split(weights.pop(name), 2, axis=1)
            down = weights.pop(base + "down_proj", None)
            parts = {"gate_proj": gate, "up_proj": up} | (
                {} if down is None else {"down_proj": down}
            )
            for part, value in parts.items():
                weights[f"{base}{part}.weight"] = value
                if source is not None:
                    sources[f"{base}{part}.weight"] = source
        return weights, sources

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.model.embed_tokens(tokens)
        return h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)

    def per_layer_inputs(self, tokens: mx.array, embedded: mx.array) -> mx.array | None:
        """``[B, L, layers, P]``: the token's per-layer embedding (scaled by ``sqrt P``) and
        the normed projection of its scaled embedding, averaged by ``1 / sqrt 2``."""
        dim = self._per_layer_dim
        if not dim:
            return None
        stack, shape = self.model, (*tokens.shape, len(self.layers), dim)
        token_part = stack.embed_tokens_per_layer(tokens)
        token_part = token_part * mx.array(math.sqrt(dim), dtype=token_part.dtype)
        projected = stack.per_layer_model_projection(embedded)
        projected = projected * mx.array(self.args.hidden_size**-0.5, dtype=projected.dtype)
        projected = stack.per_layer_projection_norm(projected.reshape(shape))
        return (projected + token_part.reshape(shape)) * mx.array(2**-0.5, dtype=projected.dtype)

    def layer_outputs(self, tokens: mx.array, caches: list, mask: Mask = None):
        """llama's layer loop with per-layer inputs and shared keys and values: yields
        ``(i, x)`` once layer ``i``'s graph is built."""
        x = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, x)
        feed = FeedLayout(
            self.layers[0].self_attn, caches[0].offset, tokens.shape[1], x.dtype, mask
        )
        shared: SharedKV = {}
        for index, layer in enumerate(self.layers):
            cache = caches[self._cache_of[index]]
            layer_mask, rope = feed.layer_mask_and_rope(layer, cache)
            own = cache if layer.kv_source is None else None
            row = None if per_layer is None else per_layer[:, :, index]
            x = layer(x, layer_mask, own, rope, row, shared)
            yield index, x

    def layer_rows(
        self,
        x: mx.array,
        caches: list,
        counts: list[int] | None = None,
        ids: mx.array | None = None,
    ) -> tuple[mx.array, list[mx.array]]:
        """``SharedRows.layer_rows`` over this model's shorter cache lists (a shared layer
        reads its source's cache), each sequence's fetched keys kept for the layers sharing
        them, the per-layer inputs of the tokens ``ids`` with every row."""
        rows = SequenceRows.of(self, x, caches, counts)
        per_layer = None if ids is None else self.per_layer_inputs(ids, x)
        shared: list[SharedKV] = [{} for _ in caches]
        tables: dict[str, RopeTables] = {}
        for index, layer in enumerate(self.layers):
            rope = tables.get(layer.rope_group) or rows.rope_tables(layer)
            tables[layer.rope_group] = rope
            own = [c[self._cache_of[index]] for c in caches]
            row = None if per_layer is None else per_layer[:, :, index]
            x = layer.rows(x, rope, own, rows, row, shared)
            mx.async_eval(x)  # each layer starts as soon as it is built
        return x, []

    def unembed(self, hidden: mx.array) -> mx.array:
        logits = super().unembed(hidden)
        cap = self._final_softcap
        return logits if cap is None else mx.tanh(logits / cap) * cap
