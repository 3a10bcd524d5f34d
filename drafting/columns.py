"""The columns of logits over part of the vocabulary (the draft head's vocabulary), as the
sampler reads them (``runner.sampler.Sampler.tokens(..., columns=)``)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


class Columns:
    """Logits over part of the vocabulary: column j of a row is token ``ids[j]`` (distinct ids
    in any order; the draft head's vocabulary, most frequent first). The sampler reads such a
    row in ascending id order, so its draw is the draw from the full row with every other
    token at -inf: the same top-k and ties, the same kept probabilities in the same order,
    the same noise per id (when at least top-k of the columns are finite; with fewer, or
    without top-k, the same distribution, whose sums may round differently), at the cost of
    the columns instead of the vocabulary."""

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        ids = [int(t) for t in ids]
        if len(set(ids)) != len(ids) or not all(0 <= t < vocab_size for t in ids):
            raise ValueError(f"columns must be distinct ids in [0, {vocab_size})")
        order = sorted(range(len(ids)), key=ids.__getitem__)
        self.count = len(ids)
        self.vocab_size = int(vocab_size)
        self.listed = mx.array(ids, dtype=mx.int32)  # the columns' ids as the rows hold them
        self.order = mx.array(order, dtype=mx.int32)  # ascending id order of the columns
        self.ids = mx.array([ids[j] for j in order], dtype=mx.int32)  # ascending
        # Each token id's place in the ascending row; every other id (and the penalty
        # window's padding id, vocab_size) goes to a dropped column at ``count``.
        inverse = [self.count] * (vocab_size + 1)
        for place, j in enumerate(order):
            inverse[ids[j]] = place
        self.inverse = mx.array(inverse, dtype=mx.int32)
