"""Forwards shared by several sequences (``runner.batch``): rows of different requests in one
pass over the weights, each sequence's rows attending over its own cache.

The rows share every product (one pass over the weights, the point of batching); the RoPE
tables are built per row for its own position, norms are per row, and each sequence's rows
attend over its own cache and causally over each other, the very computation a forward of
their own runs, so a sequence's rows keep their bits whatever else is in the forward
(wherever the products' arithmetic does not depend on the row count: ``runner.native``'s
panel products, which the CPU layout uses).

Each layer takes its rows with ``rows`` (``DecoderLayer.rows``; the hybrid's blocks have
their own: a recurrent layer feeds each sequence's state its own rows). Each sequence's rows
attend with the mask a feed of its own builds (``FeedLayout``: causal over its own rows, a
sliding layer's window from its own offset), and a prompt with images keeps its positions and
feature rows.

Per layer, each sequence costs graph nodes of its own: its key and value writes into its
cache and its attention. Where every cache is a plain ``KVCache`` and the layer attends
through ``runner.native``'s row attention, the attention of all sequences is one node over
the caches' whole buffers (``native.rows_attention``: no fetched views either), so a layer
takes two nodes a sequence (the writes) and three besides, where it took five a sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cache.kv import KVCache
from runner import native
from runner.models.attention import ROW_BY_ROW, FeedLayout
from runner.models.rope import RopeTables


@dataclass
class SequenceRows:
    """How one shared forward's rows divide among its sequences: ``counts[i]`` rows of
    sequence i (in order; ``ends``: where each but the last ends), fed after ``caches[i]`` at
    ``offsets[i]`` (taken before the first layer appends; a RoPE group's tables are built at
    its first layer); ``feeds[i]``, the masks a feed of sequence i's own rows builds."""

    counts: list[int]
    ends: list[int]
    caches: list[list]
    offsets: list[int]
    feeds: list[FeedLayout]
    dtype: mx.Dtype

    @classmethod
    def of(
        cls, model: Any, x: mx.array, caches: list[list], counts: list[int] | None
    ) -> SequenceRows:
        """The division of rows ``x`` ``[1, R, D]``: ``counts[i]`` of them after ``caches[i]``
        (one each when None); a ``ValueError`` where they do not add up."""
        counts = [1] * len(caches) if counts is None else counts
        if x.shape[1] != sum(counts) or len(counts) != len(caches) or min(counts) < 1:
            raise ValueError(f"{x.shape[1]} rows for {len(caches)} cache lists ({counts})")
        dtype, layers = x.dtype, model.model.layers
        attn0 = next((layer.self_attn for layer in layers if "self_attn" in layer), None)
        offsets = [c[0].offset for c in caches]
        feeds = [  # none where no layer attends (a split hybrid's stage of recurrent layers)
            FeedLayout(attn0, offset, n, dtype, None)
            for offset, n in zip(offsets, counts, strict=True)
            if attn0 is not None
        ]
        ends = list(itertools.accumulate(counts))[:-1]
        return cls(counts, ends, caches, offsets, feeds, dtype)

    def rope_tables(self, layer: Any) -> RopeTables:
        """``layer``'s RoPE tables for every row: each at its sequence's next positions (a
        prompt with images at the positions its layout gives), rotated as a feed of that
        sequence's own rows rotates them (a RoPE whose periods depend on where the feed ends:
        each sequence's own)."""
        rope = layer.self_attn.rope
        layouts = [c[0].layout for c in self.caches]
        sequences = list(zip(layouts, self.offsets, self.counts, strict=True))
        if rope.depends_on_feed:
            parts = [rope.composed_tables(offset, n, self.dtype) for _, offset, n in sequences]
        elif any(layout is not None for layout in layouts):
            parts = [layer.rope_tables(*sequence, self.dtype) for sequence in sequences]
        else:
            positions = [offset + j for _, offset, n in sequences for j in range(n)]
            return rope.row_tables(positions, self.dtype)
        cos, sin = (mx.concatenate([p[i] for p in parts]) for i in (0, 1))
        return (cos, sin, *parts[0][2:])

    def overlay(self, x: mx.array) -> mx.array:
        """The embedded rows ``x`` ``[1, R, D]`` with a prompt's image feature rows in place
        (``ImageLayout.overlay``, which also notes what the target has embedded)."""
        layouts = [c[0].layout for c in self.caches]
        if all(layout is None for layout in layouts):
            return x
        parts = mx.split(x, self.ends, axis=1) if self.ends else [x]
        return mx.concatenate(
            [
                part if layout is None else layout.overlay(part, offset, "target")
                for part, layout, offset in zip(parts, layouts, self.offsets, strict=True)
            ],
            axis=1,
        )


class SharedRows:
    """``hidden_rows`` and ``layer_rows`` for a model with the llama family's stack
    (``embed``, ``model.layers`` whose blocks take ``rows``, ``draft_rows``)."""

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
        ids = tokens.reshape(1, -1)
        x, streams = self.layer_rows(self.embed(ids), caches, counts, ids=ids)
        return self.draft_rows(x, streams)[0]

    def layer_rows(
        self,
        x: mx.array,
        caches: list[list[KVCache]],
        counts: list[int] | None = None,
        ids: mx.array | None = None,
    ) -> tuple[mx.array, list[mx.array]]:
        """:meth:`hidden_rows`' layers: rows ``x`` ``[1, R, D]``, ``counts[i]`` of them after
        ``caches[i]``; the last layer's output rows (before the final norm) and the draft
        streams. ``ids``: the tokens ``x`` was just embedded from (image rows go in); None for
        a split model's later ranks, which run their own layers on the rows they are handed."""
        rows = SequenceRows.of(self, x, caches, counts)
        if max(rows.counts) > 1 and not self.ragged_rows:
            raise ValueError(f"{type(self).__name__} takes one row a sequence ({rows.counts})")
        if ids is not None:
            x = rows.overlay(x)
        tables: dict[str, RopeTables] = {}
        wanted = self.draft_stream_layers
        streams = []
        for index, layer in enumerate(self.model.layers):
            rope: RopeTables = ()
            if "self_attn" in layer:
                rope = tables.get(layer.rope_group) or rows.rope_tables(layer)
                tables[layer.rope_group] = rope
            x = layer.rows(x, rope, [c[index] for c in caches], rows)
            # Start each layer as soon as it is built (drafting.mlx_ops.dispatch_layer says why).
            mx.async_eval(x)
            if index in wanted:
                streams.append(x)
        return x, streams


def attend_rows(
    layer: Any, q: mx.array, k: mx.array, v: mx.array, caches: list, rows: SequenceRows
) -> mx.array:
    """One layer's attention for several sequences' rows (``[1, heads, R, dim]`` each of q, k,
    v; divided as ``rows`` says): each sequence's keys and values appended to its cache and
    its rows attended over it with its own feed's mask, in one native node where every cache
    is a plain ``KVCache`` and the layer attends through the row attention."""
    attn, counts = layer.self_attn, rows.counts
    if not rows.ends:
        mask = rows.feeds[0].layer_mask(layer, caches[0])
        return attn.attend_cached(q, k, v, mask, caches[0])
    keys, values = mx.split(k, rows.ends, axis=2), mx.split(v, rows.ends, axis=2)
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
    # Masks first: a sliding layer's window starts from the cache's offset before the feed.
    masks = [feed.layer_mask(layer, c) for feed, c in zip(rows.feeds, caches, strict=True)]
    parts = [
        attn.attend_cached(qi, ki, vi, mask, cache)
        for qi, ki, vi, mask, cache in zip(
            mx.split(q, rows.ends, axis=2), keys, values, masks, caches, strict=True
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
