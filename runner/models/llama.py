"""The Llama family on MLX: llama, mistral, qwen2, qwen3 (SmolLM2 is llama).

Parameter names follow Hugging Face checkpoints so safetensors load without renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from cache.kv import KVCache, RotatingKVCache
from cache.kv_quantized import QuantizedKVCache
from runner import native
from runner.models.activations import silu_mul
from runner.models.attention import (
    ROW_BY_ROW,
    FeedLayout,
    blocked_attention,
    causal_mask,
    packed_attention,
)
from runner.models.attention import serves as serves_blocked
from runner.models.config import read_llama_family, text_config
from runner.models.layers import (
    Linear,
    dense_weight,
    fuse_linears,
    fused_product,
    fused_to_panels,
    product,
)
from runner.models.rope import RoPE, RopeTables
from runner.models.shared_rows import SequenceRows, SharedRows, attend_rows

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Attention honours ModelArgs.sliding_window / layer_types (runner/models/config.py): sliding
# layers keep a RotatingKVCache and mask each row to its window (window_mask).

# None (one row, or no mask), "causal", or an additive / boolean array.
Mask = mx.array | str | None
# Called after each layer of a forward with (layer index, its lazy output): Model.hidden.
LayerHook = Callable[[int, mx.array], None]


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    # The window of "sliding_attention" layers (None: no layer slides) and one layer type per
    # layer (None: all "full_attention"); runner/models/config.py says how they are resolved.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen3":
            self.qk_norm = True

    @classmethod
    def from_config(cls, config: dict, path: str | None = None) -> ModelArgs:
        """Read a Hugging Face ``config.json`` dict, either layout, flat or nested
        (``runner.models.config.read_llama_family`` decides every key: a key that changes the
        math and is not implemented is refused there, naming it and ``path``). Keys that are
        not fields go to ``extra``."""
        args = read_llama_family(config, path)
        cfg, _ = text_config(config)
        extra = {k: v for k, v in cfg.items() if k not in cls.__dataclass_fields__}
        return cls(**args, extra=extra)


class Attention(nn.Module):
    # A few rows attend through runner.native's row attention (one op per layer instead of
    # five per row; inference only, no gradient): set by runner.device.tune on the CPU.
    rows_native = False
    row_threads = 1  # the native row attention's threads (runner.device.set_row_threads)

    def __init__(self, args: ModelArgs, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        # qwen2 puts biases on q/k/v only; llama's attention_bias covers o_proj too.
        o_bias = bias and args.model_type != "qwen2"
        self.o_proj = Linear(self.n_heads * self.head_dim, dim, bias=o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = self.make_rope(args, layer_type)
        # mx.fast attention instead of the composed kernel (runner.device.set_kernels).
        self.fast = False
        # tanh soft-capping of the attention scores (Gemma 2): the composed kernel only.
        self.softcap: float | None = None

    def make_rope(self, args: ModelArgs, layer_type: str) -> RoPE:
        """The layer's rotation (families override it: partial rotary, per-layer-type bases)."""
        return RoPE(
            self.head_dim,
            base=args.rope_theta,
            traditional=args.rope_traditional,
            scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def fuse(self) -> bool:
        """Compute q, k and v in one product (see ``fuse_linears``)."""
        return fuse_linears(self, "_qkv_t", [self.q_proj, self.k_proj, self.v_proj])

    def fused_to_panels(self) -> bool:
        return fused_to_panels(self, "_qkv_t", [self.q_proj, self.k_proj, self.v_proj])

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "_qkv_t" not in self:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = fused_product(self, "_qkv_t", x)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (
            qkv[..., :q_width],
            qkv[..., q_width : q_width + kv_width],
            qkv[..., q_width + kv_width :],
        )

    def queries_keys_values(
        self, x: mx.array, rope: RopeTables
    ) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v ``[B, heads, L, head_dim]`` of ``x``, q and k rotated: everything before
        the cache (fixed shapes for a given row count, so it compiles; see
        ``runner.device.compile_blocks``)."""
        batch, length, _ = x.shape
        q, k, v = self._project(x)
        q = q.reshape(batch, length, self.n_heads, self.head_dim)
        k = k.reshape(batch, length, self.n_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return self.rope.apply(q, rope), self.rope.apply(k, rope), v

    def attend_cached(
        self, q: mx.array, k: mx.array, v: mx.array, mask: Mask, cache: KVCache
    ) -> mx.array:
        """Append k, v to the cache and attend over what it returns (everything cached, or a
        sliding window's keys with ``mask`` from :func:`window_mask`): ``[B, heads, L, dim]``.

        A causal feed of a few rows (a speculative verify) attends row by row, each row over
        the keys up to its own position: the very computation, shapes and all, that decoding
        those tokens one at a time runs, so verify rows give plain decoding's bits (with int8
        activations a last-bit difference in one layer moves the roundings of the next)."""
        k, v = cache.update_and_fetch(k, v)
        rows = q.shape[2]
        causal_rows = (rows == 1 and mask is None) or (
            1 < rows <= ROW_BY_ROW and isinstance(mask, str)
        )
        native_rows = causal_rows and not self.fast and self.softcap is None and self.rows_native
        if isinstance(cache, QuantizedKVCache):  # packed rows (--kv-bits)
            fused = not self.fast and self.softcap is None
            out = packed_attention(
                q, k, v, mask, cache, self.scale, native_rows, fused, self.row_threads
            )
            if out is not None:
                return out
            k, v = cache.dequantize(k, v)  # any other reader: this call's float copy
        if native_rows:
            # One native op per layer, each row alone over its keys (runner.native).
            return native.row_attention(q, k, v, scale=self.scale, threads=self.row_threads)
        if 1 < rows <= ROW_BY_ROW and isinstance(mask, str) and not self.fast:
            keys = k.shape[2] - rows
            return mx.concatenate(
                [
                    self._attend(
                        q[:, :, i : i + 1], k[:, :, : keys + i + 1], v[:, :, : keys + i + 1], None
                    )
                    for i in range(rows)
                ],
                axis=2,
            )
        if self.softcap is not None or (
            not self.fast and (mask is None or isinstance(mask, str) or mask.ndim == 2)
        ):
            return self._attend(q, k, v, mask)
        # The fused kernel (a GPU), or a per-sequence mask (left-padded batches).
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def output(self, attended: mx.array) -> mx.array:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Mask) -> mx.array:
        """Grouped-query attention in five ops, the composed kernel: on the CPU
        ``mx.fast.scaled_dot_product_attention`` falls back to a longer composition that also
        builds its causal mask in every layer. ``mask``: None, "causal" or an additive ``[L, T]``
        array shared by all layers of a forward. Feeds of many rows (prefill chunks) take
        ``runner.models.attention.blocked_attention`` instead: the same softmax over query
        blocks and key tiles, skipping the keys a causal block cannot see."""
        if serves_blocked(q.shape[2], q.dtype, mask):
            return blocked_attention(q, k, v, scale=self.scale, mask=mask, softcap=self.softcap)
        batch, heads, length, dim = q.shape
        groups, keys = self.n_kv_heads, k.shape[2]
        per_group = heads // groups
        q = (q * self.scale).reshape(batch, groups, per_group * length, dim)
        scores = q @ k.transpose(0, 1, 3, 2)
        if self.softcap is not None:
            scores = mx.tanh(scores / self.softcap) * self.softcap
        if isinstance(mask, str):
            mask = causal_mask(keys - length, length, scores.dtype)
        if mask is not None:
            scores = scores.reshape(batch, groups, per_group, length, keys)
            if mask.ndim == 4:  # per sequence [B, 1, L, T]: broadcast over the query groups
                mask = mask[:, :, None]
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, -mx.inf)
            else:
                scores = scores + mask
            scores = scores.reshape(batch, groups, per_group * length, keys)
        weights = mx.softmax(scores, axis=-1, precise=True)
        return (weights @ v).reshape(batch, heads, length, dim)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = Linear(dim, hidden, bias=bias)
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)

    def fuse(self) -> bool:
        """Compute gate and up in one product (see ``fuse_linears``)."""
        return fuse_linears(self, "_gate_up_t", [self.gate_proj, self.up_proj])

    def fused_to_panels(self) -> bool:
        return fused_to_panels(self, "_gate_up_t", [self.gate_proj, self.up_proj])

    def __call__(self, x: mx.array) -> mx.array:
        if "_gate_up_t" in self:
            gate, up = mx.split(fused_product(self, "_gate_up_t", x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_mul(gate, up))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block; MTP heads reuse it with their own KV cache.

    The block runs as three parts: ``before_cache`` (norm, projections, rotation), the cache
    append and attention (shapes change with every position), ``after_attention`` (output
    projection, residuals, MLP). ``runner.device.compile_blocks`` compiles the first and
    last for the few rows of a decode step or a verify; prefill chunks and batches run them
    eagerly.
    """

    # The layer's sliding window (None: full attention) and which RoPE its forward shares
    # with other layers (``Model.hidden`` builds one table per group); set by the model.
    window: int | None = None
    rope_group: str = "full_attention"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.compiled: CompiledBlock | None = None

    def make_cache(self) -> KVCache | RotatingKVCache:
        """A full cache, or one bounded by the layer's window."""
        return KVCache() if self.window is None else RotatingKVCache(self.window)

    def __call__(
        self, x: mx.array, mask: Mask, cache: KVCache, rope: RopeTables | None = None
    ) -> mx.array:
        if rope is None:
            rope = self.self_attn.rope.tables(cache.offset, x.shape[1], x.dtype)
        before, after = self.parts(x)
        q, k, v = before(x, *rope)
        return after(x, self.self_attn.attend_cached(q, k, v, mask, cache))

    def rows(self, x: mx.array, rope: RopeTables, caches: list, rows: SequenceRows) -> mx.array:
        """Rows of several sequences (``runner.models.shared_rows``), each attending over its
        own cache in ``caches``."""
        before, after = self.parts(x)
        q, k, v = before(x, *rope)
        return after(x, attend_rows(self, q, k, v, caches, rows))

    def parts(self, x: mx.array) -> tuple[Callable, Callable]:
        """``before_cache`` and ``after_attention``, compiled where the blocks serve ``x``."""
        if self.compiled is not None and self.compiled.serves(x):
            return self.compiled.before_cache, self.compiled.after_attention
        return self.before_cache, self.after_attention

    def before_cache(self, x: mx.array, *rope: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.queries_keys_values(self.input_layernorm(x), rope)

    def after_attention(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.self_attn.output(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


# Row counts served by compiled blocks: decode steps, verify rows, small draft-head flushes.
# Every count compiles once per block (the first call traces it); longer prefill chunks would
# add a trace per distinct length for little gain, so they stay eager.
COMPILED_MAX_ROWS = 16


class CompiledBlock:
    """``mx.compile``d parts of one ``DecoderLayer`` (a plain object, outside the parameter
    tree). Compiled functions capture the weights they read when they first trace a shape:
    compile only after the weights are final (packed, fused, row layout added), and call
    ``runner.device.uncompile_blocks`` before changing any of them."""

    __slots__ = ("before_cache", "after_attention")

    def __init__(self, layer: DecoderLayer) -> None:
        self.before_cache = mx.compile(layer.before_cache)
        self.after_attention = mx.compile(layer.after_attention)

    @staticmethod
    def serves(x: mx.array) -> bool:
        return x.shape[0] == 1 and x.shape[1] <= COMPILED_MAX_ROWS


class LlamaModel(nn.Module):
    layer = DecoderLayer  # the block a family builds its stack from

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.layer(args) for _ in range(args.num_hidden_layers)]
        for layer, window in zip(self.layers, layer_windows(args), strict=True):
            layer.window = window
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a llama-family config (``ModelArgs.from_config``)."""
    return ModelArgs.from_config(config, path)


def head_layer(args: ModelArgs) -> DecoderLayer:
    """The decoder layer of an MTP head for a target of this family (full attention: the head
    keeps a plain ``KVCache``)."""
    return DecoderLayer(args)


def window_layout(args: ModelArgs) -> tuple[int | None, list[str] | None]:
    """``(sliding_window, layer_types)`` as ``runner.models.config`` resolves them: the one
    place the attention code reads a config's window keys."""
    return args.sliding_window, args.layer_types


def layer_windows(args: ModelArgs) -> list[int | None]:
    """Each layer's sliding window, or None for full attention."""
    window, types = window_layout(args)
    if window is None or types is None:
        return [None] * args.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


class Model(SharedRows, nn.Module):
    """A Llama-family causal LM. ``forward`` returns logits and post-final-norm hidden rows."""

    inner = LlamaModel  # the decoder stack (``embed_tokens``, ``layers``, ``norm``)
    # A fused-feature draft head's streams (k: after k layers): while set, ``hidden`` and
    # ``hidden_rows`` return them ahead of the final hidden, ``[..., (F + 1) * D]``, and
    # ``unembed`` reads the last D columns, so every path that hands the head its rows
    # (prefill, decode, verify, replay, shared rows) carries them at no extra cost.
    draft_features: tuple[int, ...] = ()
    draft_stream_layers: frozenset[int] = frozenset()  # their layer indices (k - 1)
    serves_draft_features = True  # a family with its own ``hidden`` sets False
    # Whether a head's norms store ``w - 1`` as this checkpoint's do (``runner.heads``); None:
    # the family does not know, and the head's own weights decide.
    head_norm_shift: bool | None = None
    # ``hidden`` takes ``on_layer`` (and the caches rewind to any offset of the last feed):
    # prefill evaluates and polls long chunks layer by layer. A family with its own
    # ``hidden`` states its own.
    takes_layer_hook: bool = True
    # A multimodal checkpoint's vision-tower tensors, set aside by the family's loader hook
    # for ``runner.vision_load`` (None: the family keeps none).
    vision_tensors: dict | None = None
    # ``hidden_rows`` with several rows per sequence (``runner.models.shared_rows``): up to the
    # compiled blocks' row counts, past which a forward runs eager at about twice the cost.
    ragged_rows: int = COMPILED_MAX_ROWS

    def use_draft_features(self, layers: tuple[int, ...]) -> None:
        """Set ``draft_features`` (a plain attribute: an ``nn.Module`` would keep a tuple
        among its parameters); strictly increasing, as the streams are kept in layer order."""
        top = len(self.layers) - 1
        if any(not 1 <= k <= top for k in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"feature layers must increase strictly within 1..{top}: {layers}")
        object.__setattr__(self, "draft_features", tuple(layers))
        object.__setattr__(self, "draft_stream_layers", frozenset(k - 1 for k in layers))

    def draft_rows(self, x: mx.array, streams: list[mx.array]) -> mx.array:
        """What a forward hands the draft head: the post-norm hidden of the last layer's
        output ``x``, the streams (the ``draft_stream_layers`` outputs, in layer order) ahead
        of it. Every forward builds its rows here, so none can hand the head other rows."""
        h = self.model.norm(x)
        return mx.concatenate([*streams, h], axis=-1) if streams else h

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.inner(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_caches(self) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: a ``KVCache``, or a ``RotatingKVCache`` for a sliding layer."""
        return [layer.make_cache() for layer in self.model.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def hidden(
        self,
        tokens: mx.array,
        caches: list[KVCache],
        mask: Mask = None,
        prenorm: bool = False,
        on_layer: LayerHook | None = None,
    ) -> mx.array:
        """Run the decoder stack over ``tokens`` (``[B, L]``); return ``[B, L, D]`` hiddens.

        ``mask`` defaults to causal over the cached prefix; pass an additive or boolean array
        for left-padded batches. ``prenorm`` returns the hidden before the final norm.
        ``on_layer(i, x)`` is called with each layer's (lazy) output as soon as its graph is
        built, layer ``i``'s cache already appended: prefill evaluates and polls for a cancel
        there. An exception it raises leaves layers ``0..i`` appended and the rest untouched.
        With a fused head's layers set (``use_draft_features``) the rows are ``draft_rows``:
        the streams ahead of the final hidden.
        """
        layers = self.draft_features  # validated when set
        x, streams = self._stack(tokens, caches, mask, on_layer, layers)
        if layers:
            return (
                mx.concatenate([*streams, x], axis=-1) if prenorm else self.draft_rows(x, streams)
            )
        return x if prenorm else self.model.norm(x)

    def hidden_features(
        self, tokens: mx.array, caches: list[KVCache], features: tuple[int, ...], mask: Mask = None
    ) -> tuple[mx.array, mx.array | None]:
        """The final hidden and the residual streams after ``features`` layers (k: the stream
        after k layers, 1 <= k < L), concatenated ``[B, L, len(features) * D]`` (None for no
        features): what a head fusing several layers drafts from, at no extra cost."""
        if any(not 1 <= k < len(self.layers) for k in features):
            raise ValueError(f"feature layers must lie in 1..{len(self.layers) - 1}: {features}")
        x, streams = self._stack(tokens, caches, mask, None, features)
        return self.model.norm(x), (mx.concatenate(streams, axis=-1) if streams else None)

    def _stack(
        self,
        tokens: mx.array,
        caches: list[KVCache],
        mask: Mask,
        on_layer: LayerHook | None,
        layers: tuple[int, ...],
    ) -> tuple[mx.array, list[mx.array]]:
        """The last layer's output and the streams after ``layers``."""
        wanted = {k - 1: j for j, k in enumerate(layers)}
        streams: list[mx.array | None] = [None] * len(wanted)
        x = None
        for index, x in self.layer_outputs(tokens, caches, mask):
            if index in wanted:
                streams[wanted[index]] = x
            if on_layer is not None:
                on_layer(index, x)
        return x, streams

    def layer_outputs(
        self, tokens: mx.array, caches: list[KVCache], mask: Mask = None
    ) -> Iterator[tuple[int, mx.array]]:
        """:meth:`hidden` one layer at a time: yields ``(i, x)`` once layer ``i``'s graph is
        built (its cache appended), before the final norm. A caller may evaluate and pause
        between layers (prefill interleaved with other requests' decode steps)."""
        x = self.embed(tokens)
        feed = FeedLayout(
            self.model.layers[0].self_attn, caches[0].offset, tokens.shape[1], x.dtype, mask
        )
        for index, (layer, cache) in enumerate(zip(self.model.layers, caches, strict=True)):
            layer_mask, rope = feed.layer_mask_and_rope(layer, cache)
            x = layer(x, layer_mask, cache, rope)
            yield index, x

    def rows_refusal(self) -> str | None:
        """Why :meth:`hidden_rows` cannot serve this model (None: it can). It needs blocks
        that take rows of several sequences (``DecoderLayer.rows``, or a block's own)."""
        for layer in self.model.layers:
            kind = type(layer)
            if kind.__call__ is not DecoderLayer.__call__ and kind.rows is DecoderLayer.rows:
                return f"{kind.__name__} blocks are not batched across sequences"
        return None

    def unembed(self, hidden: mx.array) -> mx.array:
        """Project post-norm hidden rows to vocabulary logits (rows carrying a fused head's
        streams ahead of the hidden: its last D columns)."""
        if hidden.shape[-1] != self.args.hidden_size:
            hidden = hidden[..., -self.args.hidden_size :]
        if "_embed_t" in self:
            return product(hidden, self._embed_t)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def output_weight(self) -> mx.array:
        """The dense ``[V, D]`` output projection (tied embedding or ``lm_head``)."""
        tied = self.args.tie_word_embeddings
        return dense_weight(self.model.embed_tokens if tied else self.lm_head)

    def forward(
        self, tokens: mx.array, caches: list[KVCache], mask: Mask = None
    ) -> tuple[mx.array, mx.array]:
        """Logits ``[B, L, V]`` for every fed row and the post-final-norm hiddens ``[B, L, D]``.

        Both are lazy: a caller that only needs the last row slices the hidden and calls
        :meth:`unembed` itself so the full-vocabulary projection runs once.
        """
        h = self.hidden(tokens, caches, mask)
        return self.unembed(h), h

    def __call__(self, tokens: mx.array, caches: list[KVCache]) -> mx.array:
        return self.forward(tokens, caches)[0]
