"""The layer split: which contiguous run of decoder layers each rank holds, by bytes.

Rank 0 also holds what only it runs (the embedding, the final norm and the output
projection, an inline MTP head, a vision tower), so its share starts with those bytes and
it gets fewer layers. The split minimises the largest share (every rank is assumed to have
the same memory), every rank holding at least one layer so the pipeline has no idle hop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx

from runner.models.qwen3_5 import VISION_ROOTS

# A decoder layer's tensors: ``model.layers.{i}.…`` (after ``runner.loader.text_name``).
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# The tensors rank 0 holds besides its layers: an inline MTP head's too (the head drafts
# there), and a vision tower's (rank 0 embeds, so it encodes the images).
FIRST_RANK = ("model.embed_tokens.", "model.norm.", "lm_head.", "mtp.", *VISION_ROOTS)


@dataclass(frozen=True)
class LayerPlan:
    """``ranges[r]``: the global layer indices rank r holds; ``shares[r]``: the bytes of
    weights it holds as loaded for the device."""

    ranges: tuple[range, ...]
    shares: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranges)

    def describe(self) -> str:
        return "; ".join(
            f"rank {r}: layers {lo.start}-{lo.stop - 1} ({share} bytes)"
            for r, (lo, share) in enumerate(zip(self.ranges, self.shares, strict=True))
        )


def held_bytes(tensor, dtype: mx.Dtype) -> int:
    """Bytes ``tensor`` takes once loaded: a float tensor cast to ``dtype`` (the loader casts
    floats), any other (a quantized triple's packed words, scales stay float; a GGUF file's
    quantized matrix, or a list of them for stacked experts) as stored."""
    if isinstance(tensor, list):
        return sum(held_bytes(t, dtype) for t in tensor)
    if not isinstance(tensor, mx.array):
        return tensor.nbytes
    if mx.issubdtype(tensor.dtype, mx.floating):
        return tensor.size * dtype.size
    return tensor.nbytes


def weight_sizes(
    tensors: Mapping[str, mx.array], layers: int, dtype: mx.Dtype, output_copy: bool
) -> tuple[list[int], int]:
    """Bytes per decoder layer and rank 0's own bytes, from ``tensors`` (lazy arrays: only
    shapes and dtypes are read). ``output_copy``: a tied embedding is held twice on rank 0
    (the lookup table and the output product's own layout, ``runner.device``)."""
    per_layer = [0] * layers
    first = 0
    for name, tensor in tensors.items():
        match = LAYER.match(name)
        size = held_bytes(tensor, dtype)
        if match is not None and int(match[1]) < layers:
            per_layer[int(match[1])] += size
        elif name.startswith(FIRST_RANK):
            first += size
            if output_copy and name == "model.embed_tokens.weight":
                first += size
    return per_layer, first


def plan_layers(per_layer: Sequence[int], first: int, ranks: int) -> LayerPlan:
    """Contiguous layer runs for ``ranks`` ranks minimising the largest share (rank 0 carries
    ``first`` bytes besides its layers), each rank at least one layer; the earliest split
    among equally good ones."""
    layers = len(per_layer)
    if ranks < 1 or layers < ranks:
        raise ValueError(f"{layers} layers cannot be split over {ranks} ranks (one each at least)")
    prefix = [0]
    for size in per_layer:
        prefix.append(prefix[-1] + size)

    def share(rank: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first if rank == 0 else 0)

    # best[r][i]: the smallest largest share placing layers [0, i) on ranks [0, r].
    best = [[0] * (layers + 1) for _ in range(ranks)]
    cut = [[0] * (layers + 1) for _ in range(ranks)]
    for i in range(1, layers + 1):
        best[0][i] = share(0, 0, i)
    for r in range(1, ranks):
        for i in range(r + 1, layers + 1):
            options = [(max(best[r - 1][j], share(r, j, i)), j) for j in range(r, i)]
            best[r][i], cut[r][i] = min(options)
    bounds = [layers]
    for r in range(ranks - 1, 0, -1):
        bounds.append(cut[r][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    ranges = tuple(range(bounds[r], bounds[r + 1]) for r in range(ranks))
    shares = tuple(share(r, run.start, run.stop) for r, run in enumerate(ranges))
    return LayerPlan(ranges, shares)
