"""A request's images as its forwards see them: where each row sits in RoPE terms, and the
vision features that replace the embeddings of the image's pad rows.

A prompt with images holds, per image, a start token, ``rows`` pad tokens (one per merged
2x2 patch block, raster order) and an end token. The target embeds every pad row as the
image's feature row instead of the pad token's embedding, and rotates it by a 3-channel
position (temporal, height, width): the image's rows share the temporal position where it
starts and add their block row and column on the other two; the text after an image
continues from ``start + max(block rows, block columns)``. So every row past the prompt sits
at ``index + delta`` (``delta <= 0``) on all three channels, which is plain RoPE at a shifted
position: only prompt rows inside images need 3-channel tables.

The layout rides with the request's caches (``BaseCache.layout``): every forward over them,
whoever runs it (prefill chunks, plain decode, a verify feed, the draft head's pairs and
drafts), reads positions and feature rows from it, so none can use the cache offset where
the layout says otherwise. A position depends only on the prompt before it, so chunked
prefill (a chunk may end inside an image), prefix-cache restores and later turns agree.

Features are encoded lazily, by the first forward that needs one of the image's rows (the
chunk's forward evaluates the encoder with it), and held until every reader of the request
(the target, and the draft head, which embeds pad row ``r`` at slot ``r - 1`` in a deferred
flush) has gone past the image's last pad row; then they are released.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# Prefix-cache keys of image rows: a hash of the image with this bit set, above every token
# id (vocabularies stay below 2**31), so an image row never matches a token, and the same
# image at the same size matches itself in a later request.
IMAGE_KEY_BIT = 1 << 31

Encoder = Callable[[object], mx.array]  # a prepared image -> its feature rows [rows, D]


def image_key(digest: bytes) -> int:
    """The prefix-cache key of every pad row of an image with this ``digest`` (its bytes and
    preprocessed size): 31 bits of a hash, with :data:`IMAGE_KEY_BIT` set."""
    low = int.from_bytes(hashlib.blake2b(digest, digest_size=4).digest(), "little")
    return IMAGE_KEY_BIT | (low & (IMAGE_KEY_BIT - 1))


@dataclass
class ImageSpan:
    """One image in the prompt: its pad rows ``[start, start + rows)``, its merged grid
    ``(block rows, block columns)``, the prepared pixels until encoded and the features
    until released."""

    index: int  # its place in the request's ``images``
    start: int
    grid: tuple[int, int]
    key: int
    image: object | None  # the preprocessed image (pixels), dropped once encoded
    features: mx.array | None = None
    released: bool = False

    @property
    def rows(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def end(self) -> int:
        return self.start + self.rows


def prompt_positions(length: int, spans: Sequence[ImageSpan]) -> tuple[np.ndarray, int]:
    """The 3-channel positions ``[3, length]`` of a prompt's rows and the ``delta`` of every
    row after it (``index + delta``): text rows count on from the previous row on all
    channels; an image's rows take ``(t, t + block row, t + block column)`` and the text after
    it continues at ``t + max(grid)``."""
    positions = np.zeros((3, length), dtype=np.int64)
    index = current = 0
    for span in spans:
        run = span.start - index
        positions[:, index : span.start] = np.arange(current, current + run)
        current += run
        rows, cols = span.grid
        block = np.arange(span.rows)
        positions[0, span.start : span.end] = current
        positions[1, span.start : span.end] = current + block // cols
        positions[2, span.start : span.end] = current + block % cols
        current += max(rows, cols)
        index = span.end
    positions[:, index:] = np.arange(current, current + length - index)
    last = int(positions[:, -1].max()) if length else -1
    return positions, last + 1 - length


def plain_first(rows: np.ndarray) -> int | None:
    """The first position of ``rows`` ``[3, L]`` where they are consecutive with equal
    channels (plain RoPE applies), else None."""
    first = int(rows[0, 0])
    if (rows == np.arange(first, first + rows.shape[1])).all():
        return first
    return None


class PlacedRows:
    """One forward's rows as a request's layout placed them, where only their positions are
    known (a later rank of a split model, ``runner.distributed``: rank 0 embedded the rows
    and sends their positions with them): what that rank's attention layers read in place of
    the ``ImageLayout``; nothing to overlay."""

    def __init__(self, start: int, positions: np.ndarray) -> None:
        self.start = start
        self.positions = positions  # [3, L]

    def rows(self, start: int, length: int) -> np.ndarray:
        if (start, length) != (self.start, self.positions.shape[1]):
            raise ValueError(
                f"rows {start}..{start + length - 1} asked of the positions of rows "
                f"{self.start}..{self.start + self.positions.shape[1] - 1}"
            )
        return self.positions

    def plain_start(self, start: int, length: int) -> int | None:
        return plain_first(self.rows(start, length))

    def overlay(self, embedded: mx.array, start: int, reader: str) -> mx.array:
        return embedded


@dataclass(eq=False)  # compared and hashed by identity (the engine's set of open layouts)
class ImageLayout:
    """Positions and feature rows of one request's prompt (see the module docstring)."""

    prompt_length: int
    spans: list[ImageSpan]
    encode: Encoder
    positions: np.ndarray = field(init=False)
    delta: int = field(init=False)
    # Reader -> the end of the rows it has embedded (the target, and the draft head if any).
    readers: dict[str, int] = field(default_factory=lambda: {"target": 0})

    def __post_init__(self) -> None:
        self.positions, self.delta = prompt_positions(self.prompt_length, self.spans)

    # ------------------------------------------------------------------ positions
    def rows(self, start: int, length: int) -> np.ndarray:
        """Positions ``[3, length]`` of rows ``start..start + length - 1``."""
        end = start + length
        inside = min(end, self.prompt_length)
        out = np.empty((3, length), dtype=np.int64)
        if start < inside:
            out[:, : inside - start] = self.positions[:, start:inside]
        after = max(start, self.prompt_length)
        out[:, after - start :] = np.arange(after, end) + self.delta
        return out

    def plain_start(self, start: int, length: int) -> int | None:
        """The position of row ``start`` when rows ``start..`` sit at consecutive positions
        with equal channels (plain RoPE from there applies), else None."""
        if start >= self.prompt_length:
            return start + self.delta
        return plain_first(self.rows(start, length))

    # ------------------------------------------------------------------ features
    def reads(self, reader: str) -> None:
        """Register a reader whose progress holds the features (the draft head)."""
        self.readers.setdefault(reader, 0)

    def overlay(self, embedded: mx.array, start: int, reader: str) -> mx.array:
        """``embedded`` ``[1, n, D]`` (rows ``start..start + n - 1``) with every pad row of an
        image replaced by its feature row; notes that ``reader`` has embedded them."""
        n = embedded.shape[1]
        end = start + n
        pieces, at = [], start
        for span in self.spans:
            lo, hi = max(span.start, start), min(span.end, end)
            if lo >= hi:
                continue
            features = self._features(span)
            if lo > at:
                pieces.append(embedded[:, at - start : lo - start])
            rows = features[lo - span.start : hi - span.start].astype(embedded.dtype)
            pieces.append(rows[None])
            at = hi
        self.readers[reader] = max(self.readers.get(reader, 0), end)
        self._release_passed()
        if not pieces:
            return embedded
        if at < end:
            pieces.append(embedded[:, at - start :])
        return mx.concatenate(pieces, axis=1)

    def _features(self, span: ImageSpan) -> mx.array:
        if span.features is None:
            if span.image is None:
                raise RuntimeError(f"images[{span.index}]: features needed after release")
            span.features = self.encode(span.image)
            span.image = None  # the pixels are not needed again
        return span.features

    def _release_passed(self) -> None:
        done = min(self.readers.values())
        for span in self.spans:
            if span.end <= done and not span.released:
                span.features, span.image, span.released = None, None, True

    def release(self) -> None:
        """Drop every image's pixels and features (the request ended)."""
        for span in self.spans:
            span.features, span.image, span.released = None, None, True

    @property
    def nbytes(self) -> int:
        """Bytes held for the images now: features encoded, pixels not yet."""
        total = 0
        for span in self.spans:
            if span.features is not None:
                total += span.features.nbytes
            pixels = getattr(span.image, "pixels", None)
            if pixels is not None:
                total += pixels.nbytes
        return total

    # ------------------------------------------------------------------ prefix cache
    def key_tokens(self, prompt: Sequence[int]) -> list[int]:
        """The prompt as the prefix cache keys it: each image's pad rows carry the image's
        key (:func:`image_key`), so another image at the same place misses."""
        keys = list(prompt)
        for span in self.spans:
            keys[span.start : span.end] = [span.key] * span.rows
        return keys


def rope_tables(rope, layout: ImageLayout | None, offset: int, length: int, dtype, sections):
    """The RoPE tables of rows ``offset..offset + length - 1`` of a request: plain where the
    rows sit at consecutive equal-channel positions, 3-channel tables inside images."""
    if layout is None:
        return rope.tables(offset, length, dtype)
    first = layout.plain_start(offset, length)
    if first is not None:
        return rope.tables(first, length, dtype)
    return rope.multimodal_tables(layout.rows(offset, length), sections, dtype)
