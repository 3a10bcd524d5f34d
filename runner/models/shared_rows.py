"""Forwards shared by several sequences (``runner.batch``): rows of different requests in one
pass over the weights, each sequence's rows attending over its own cache.

The rows share every product (one pass over the weights, the point of batching); the RoPE
tables are built per row for its own position, norms are per row, and each sequence's rows
attend over its own cache and causally over each other, the very computation a forward of
their own runs, so a sequence's rows keep their bits whatever else is in the forward
(wherever the products' arithmetic does not depend on the row count: ``runner.native``'s
panel products, which the CPU layout uses).

Per layer, each sequence costs graph nodes of its own: its key and value writes into its
cache and its attention. Where every cache is a plain ``KVCache`` and the layer attends
through ``runner.native``'s row attention, the attention of all sequences is one node over
the caches' whole buffers (``native.rows_attention``: no fetched views either), so a layer
takes two nodes a sequence (the writes) and three besides, where it took five a sequence.
"""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx

from cache.kv import KVCache
from runner import native
from runner.models.attention import ROW_BY_ROW
from runner.models.rope import RopeTables


class SharedRows:
    """``hidden_rows`` and ``layer_rows`` for a model with the llama family's stack
    (``embed``, ``model.layers`` of ``DecoderLayer`` shape, ``draft_rows``)."""

    # The most rows ``hidden_rows`` takes with several per sequence (verify feeds in a shared
    # forward; 0: one each). A family sets it to the row counts its blocks serve compiled.
    ragged_rows: int = 0

    def hidden_rows(
        self, tokens: mx.array, caches: list[list[KVCache]], counts: list[int] | None = None
    ) -> mx.array:
        """Rows of several sequences in one forward: ``tokens`` ``[R]``, ``counts[i]`` of them
        (one each when None) fed after ``caches[i]`` (a per-layer cache list, each at its own
        offset), in order; returns the post-norm hiddens ``[R, D]``. Sequence i's rows have
        the bits of a causal ``hidden`` of them after ``caches[i]`` (module docstring)."""
        counts = [1] * len(caches) if counts is None else counts
        if tokens.shape[0] != sum(counts) or len(counts) != len(caches):
            raise ValueError(f"{tokens.shape[0]} rows for {len(caches)} cache lists ({counts})")
        x, streams = self.layer_rows(self.embed(tokens.reshape(1, -1)), caches, counts)
        return self.draft_rows(x, streams)[0]

    def layer_rows(
        self, x: mx.array, caches: list[list[KVCache]], counts: list[int] | None = None
    ) -> tuple[mx.array, list[mx.array]]:
        """:meth:`hidden_rows`' layers: rows ``x`` ``[1, R, D]``, ``counts[i]`` of them after
        ``caches[i]``; the last layer's output rows (before the final norm) and the draft
        streams. A split model's later ranks run their own layers on the rows they are
        handed."""
        counts = [1] * len(caches) if counts is None else counts
        if x.shape[1] != sum(counts) or len(counts) != len(caches) or min(counts) < 1:
            raise ValueError(f"{x.shape[1]} rows for {len(caches)} cache lists ({counts})")
        positions = [c[0].offset + j for c, n in zip(caches, counts, strict=True) for j in range(n)]
        # Where each sequence's rows end: one split a tensor gives every sequence's rows as
        # views (one node where a slice per sequence was one each, and each node is a task of
        # its own on the CPU stream).
        ends = list(itertools.accumulate(counts))[:-1]
        tables: dict[str, RopeTables] = {}
        wanted = self.draft_stream_layers
        streams = []
        for index, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            rope = tables.get(layer.rope_group)
            if rope is None:
                rope = tables[layer.rope_group] = attn.rope.row_tables(positions, x.dtype)
            before, after = layer.before_cache, layer.after_attention
            if layer.compiled is not None and layer.compiled.serves(x):
                before, after = layer.compiled.before_cache, layer.compiled.after_attention
            q, k, v = before(x, *rope)
            own = [c[index] for c in caches]
            x = after(x, attend_rows(attn, q, k, v, own, counts, ends))
            # Start each layer as soon as it is built (drafting.mlx_ops.dispatch_layer says why).
            mx.async_eval(x)
            if index in wanted:
                streams.append(x)
        return x, streams


def attend_rows(
    attn: Any,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    caches: list,
    counts: list[int],
    ends: list[int],
) -> mx.array:
    """One layer's attention for several sequences' rows (``[1, heads, R, dim]`` each of q, k,
    v; ``counts[i]`` rows of sequence i, split at ``ends``): each sequence's keys and values
    appended to its cache and its rows attended over it, in one native node where every
    cache is a plain ``KVCache`` and the layer attends through the row attention."""
    if not ends:
        return attn.attend_cached(q, k, v, None if counts[0] == 1 else "causal", caches[0])
    keys, values = mx.split(k, ends, axis=2), mx.split(v, ends, axis=2)
    if q.dtype == mx.float32 and in_one_node(attn, caches, counts):
        lengths = [c.append(ki, vi) for c, ki, vi in zip(caches, keys, values, strict=True)]
        return native.rows_attention(
            q,
            [c.keys for c in caches],
            [c.values for c in caches],
            lengths,
            counts,
            scale=attn.scale,
            threads=attn.row_threads,
        )
    parts = [
        attn.attend_cached(qi, ki, vi, None if n == 1 else "causal", cache)
        for qi, ki, vi, n, cache in zip(
            mx.split(q, ends, axis=2), keys, values, counts, caches, strict=True
        )
    ]
    return mx.concatenate(parts, axis=2)


def in_one_node(attn: Any, caches: list, counts: list[int]) -> bool:
    """Whether one native node can attend these sequences' rows: the conditions under which
    llama's ``attend_cached`` takes the native row attention, over plain float caches (a
    family whose attention sets no ``rows_native`` attends sequence by sequence)."""
    return (
        getattr(attn, "rows_native", False)
        and not attn.fast
        and attn.softcap is None
        and max(counts) <= ROW_BY_ROW
        and native.rows_attention_available()
        and all(type(c) is KVCache for c in caches)
    )
