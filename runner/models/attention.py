"""Blocked attention for long feeds on the CPU: prefill chunks at the compute rate.

The composed five-op attention of ``runner.models.llama.Attention`` materialises the whole
``[heads, L, T]`` score matrix and runs MLX's softmax over it. On the CPU that softmax is the
cost of a long prefill: MLX's ``exp`` is a scalar loop with a library call per step, and a
score matrix larger than MLX's buffer cache comes back as fresh pages on every pass. This
kernel computes the same softmax(q k^T) v with four changes:

- **Query blocks by key tiles of fixed shapes.** Queries go in blocks of ``BLOCK_ROWS`` rows
  (all heads of a KV group together, as in the grouped product), keys in tiles of
  ``KEY_TILE`` positions, the last one ending on a ``GRAIN`` boundary: score tiles take a
  few shapes only, so MLX reuses their buffers (and the compiled kernels' traces) from tile
  to tile, block to block and layer to layer, and a tile stays in the last-level cache across
  the passes over it. Keys and values are zero-padded to the grain once per call; padded keys
  are always masked.
- **Causal skipping.** With ``mask="causal"`` a block visits only the tiles up to its last
  row's position; only the (at most two) tiles that cross its diagonal get a mask, a slice of
  one constant. An array mask (sliding windows, a caller's mask) is added tile by tile, with
  no skipping.
- **Scores laid out keys by rows.** ``k_tile @ q_block^T``: the per-row maximum and the
  softmax denominator become column reductions, which MLX runs several times faster than row
  reductions, and the value product runs as ``v_tile^T @ weights`` (dims by rows).
- **A vectorisable exp2.** Scores are in log2 units (``log2(e)`` folded into the query
  scale) and exponentiated as ``2**r * p(f)`` (``r`` the nearest integer, ``p`` a degree-6
  polynomial on ``[-0.5, 0.5]``, the Cephes coefficients MLX's own ``exp`` uses), in two
  ``mx.compile``d elementwise kernels the JIT vectorises: one builds ``2**r`` from exponent
  bits (a bitcast, which MLX cannot fuse, splits the two), one evaluates ``p(f)`` and scales.
  The row maximum is exact (a first pass over the block's tiles), so the weights are the
  softmax's to float32 rounding, as accurate as ``mx.softmax(precise=True)`` against a
  float64 reference (tests/test_prefill.py).

The trade-off: a few MLX ops per tile instead of five per call, which pays only for feeds of
many rows; decode steps and verify rows keep the five-op composition (``serves``).

With the native build (``runner.native.flash_attention``), causal and unmasked feeds without
soft-capping run fused instead: the same softmax per block of query rows with the scores kept
in registers and cache-sized tiles, on every core. The MLX ops above remain for array masks
(sliding windows), soft-capping and builds without the extension.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from runner import native

LOG2E = math.log2(math.e)
BLOCK_ROWS = 128  # query rows per block, per head
KEY_TILE = 512  # key positions per score tile
GRAIN = 128  # a block's last tile ends at its last row rounded up to this (tile widths)
# Feeds of at least this many rows take the blocked kernel; decode steps, verify rows and the
# compiled blocks' feeds (up to 16 rows) keep the five-op composition.
MIN_ROWS = 32

_ROUND = 12582912.0  # 1.5 * 2**23: (x + _ROUND) - _ROUND rounds a float32 to an integer
# 2**f on [-0.5, 0.5] (Cephes; MLX's simd::exp uses the same polynomial after x * log2 e).
_P = (
    1.0,
    6.931472028550421e-1,
    2.402264791363012e-1,
    5.550332471162809e-2,
    9.618437357674640e-3,
    1.339887440266574e-3,
    1.535336188319500e-4,
)
# A masked score, in log2 units: finite (so no inf - inf) and far enough below any real score
# that its exponent clamps to 2**-127 = 0, yet inside int32 for the exponent's conversion.
MASKED = -(2.0**30)
# Query rows per fused call while a cancel hook is set: the hook runs between the calls.
FUSED_PIECE_ROWS = 256


# Called with each query block's (lazy) output but the last while a prefill evaluates its
# chunks piecewise (``runner.decoder``): it evaluates the block and may raise to cancel, so a
# cancel need not wait for the rest of a layer's attention, which grows with the context.
_BETWEEN_BLOCKS: contextvars.ContextVar[Callable[[mx.array], None] | None] = contextvars.ContextVar(
    "between_blocks", default=None
)


@contextlib.contextmanager
def between_blocks(hook: Callable[[mx.array], None]) -> Iterator[None]:
    """Call ``hook`` with every query block's output but each call's last, for the block."""
    token = _BETWEEN_BLOCKS.set(hook)
    try:
        yield
    finally:
        _BETWEEN_BLOCKS.reset(token)


def serves(rows: int, dtype: mx.Dtype, mask: mx.array | str | None) -> bool:
    """Whether ``blocked_attention`` serves a feed of ``rows`` query rows: float32 on the CPU,
    at least ``MIN_ROWS`` rows, and a mask it takes (None, "causal" or a 2-D array)."""
    if rows < MIN_ROWS or dtype != mx.float32 or mx.default_device() != mx.cpu:
        return False
    return mask is None or isinstance(mask, str) or mask.ndim == 2


def exponent_bits(d: mx.array) -> mx.array:
    """The float32 bits of ``2**round(d)`` for ``d <= 0`` (int32): 0 (the float 0.0) from
    -127 down, the integer clamp keeping the loop free of the float ``maximum``'s branch."""
    r = (d + _ROUND) - _ROUND
    return mx.left_shift(mx.maximum(r.astype(mx.int32) + 127, 0), 23)


def scaled_polynomial(d: mx.array, scale: mx.array) -> mx.array:
    """``p(d - round(d)) * scale``, Estrin's scheme (the JIT fuses ops up to a depth of 11)."""
    f = d - ((d + _ROUND) - _ROUND)
    f2 = f * f
    low = (_P[1] * f + _P[0]) + f2 * (_P[3] * f + _P[2])
    high = (_P[5] * f + _P[4]) + f2 * _P[6]
    return (low + (f2 * f2) * high) * scale


# Traced per input shape: tile widths (KEY_TILE / GRAIN of them) times block sizes (full, and
# the partial last block of a feed), a bounded set. Shapeless tracing keeps explicit
# broadcasts that split the fused loops into more passes.
_bits_kernel = mx.compile(exponent_bits)
_poly_kernel = mx.compile(scaled_polynomial)


def exp2_nonpositive(d: mx.array) -> mx.array:
    """``2**d`` for float32 ``MASKED <= d <= 0`` (0 below -127), relative error ~2e-7."""
    return _poly_kernel(d, _bits_kernel(d).view(mx.float32))


@functools.lru_cache(maxsize=4)
def _visibility(key_tile: int, block_rows: int, grain: int, dtype: mx.Dtype) -> mx.array:
    """Additive ``[2 * key_tile + block_rows + grain, block_rows]`` mask, 0 where
    ``i <= r + key_tile``: every tile mask of the kernel is a slice of it (``_diagonal_mask``),
    so one constant serves every layer, forward and request (no memory that comes and goes)."""
    rows = mx.arange(2 * key_tile + block_rows + grain)[:, None]
    visible = rows <= mx.arange(block_rows)[None, :] + key_tile
    return mx.where(visible, mx.array(0.0, dtype), mx.array(MASKED, dtype))


def _diagonal_mask(keys: int, rows: int, delta: int, dtype: mx.Dtype) -> mx.array:
    """Additive ``[keys, rows]`` mask (scores are laid out keys by rows): row ``i`` sees key
    ``c`` when ``c <= i + delta`` (the tile's first key sits ``delta`` positions before the
    block's first row; ``-block_rows - grain < delta < key_tile``)."""
    base = _visibility(KEY_TILE, BLOCK_ROWS, GRAIN, dtype)
    shift = KEY_TILE - delta
    return base[shift : shift + keys, :rows]


def _padded(x: mx.array, length: int) -> mx.array:
    """``x`` ``[B, G, T, D]`` zero-padded to ``length`` positions."""
    batch, groups, keys, dim = x.shape
    if length == keys:
        return x
    return mx.concatenate([x, mx.zeros((batch, groups, length - keys, dim), x.dtype)], axis=2)


@dataclass(frozen=True)
class _Feed:
    """What every query block of one ``blocked_attention`` call shares."""

    batch: int
    groups: int  # KV heads
    per_group: int  # query heads per KV head
    keys: int  # key positions; ``padded`` rounds them up to the grain
    padded: int
    causal: bool
    softcap: float | None
    extra: mx.array | None  # a caller's mask (``_log2_mask``), or None


def blocked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None,
    softcap: float | None = None,
) -> mx.array:
    """softmax(scale * q k^T + mask) v for ``q`` ``[B, heads, L, D]`` and ``k``, ``v``
    ``[B, kv_heads, T, D]`` (grouped-query: heads a multiple of kv_heads), as
    ``Attention._attend`` computes it. ``mask``: None (every key), "causal" (row i at position
    ``T - L + i`` sees keys up to it) or an additive or boolean ``[L, T]`` array;
    ``softcap``: tanh soft-capping of the scores (Gemma 2) ahead of the mask."""
    causal = isinstance(mask, str)
    if softcap is None and (mask is None or causal) and native.attention_available():
        return _fused(q, k, v, scale, causal)
    batch, heads, length, dim = q.shape
    groups, keys = k.shape[1], k.shape[2]
    per_group = heads // groups
    offset = keys - length  # position of the first query row
    padded = -(-keys // GRAIN) * GRAIN
    k, v = _padded(k, padded), _padded(v, padded)
    q = q * (scale * LOG2E if softcap is None else scale)  # log2 units: 2**s for e**s
    q = q.reshape(batch, groups, per_group, length, dim)
    extra = None
    if mask is not None and not causal:
        extra = _log2_mask(mask, length, keys, padded, q.dtype)
    feed = _Feed(batch, groups, per_group, keys, padded, causal, softcap, extra)
    blocks, hook = [], _BETWEEN_BLOCKS.get()
    for start in range(0, length, BLOCK_ROWS):
        rows = min(BLOCK_ROWS, length - start)
        qb = q[:, :, :, start : start + rows].reshape(batch, groups, per_group * rows, dim)
        qt = qb.transpose(0, 1, 3, 2)
        scores, top = _block_scores(feed, k, qt, start, rows, offset + start)
        out = _weighted_values(scores, top, v)
        blocks.append(out.reshape(batch, groups, per_group, rows, dim))
        if hook is not None and start + rows < length:
            hook(blocks[-1])
    out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=3)
    return out.reshape(batch, heads, length, dim)


def _log2_mask(mask: mx.array, length: int, keys: int, padded: int, dtype: mx.Dtype) -> mx.array:
    """A caller's additive or boolean ``[L, T]`` mask in log2 units over the padded keys (the
    padding masked), keys by rows as the score tiles."""
    if mask.dtype == mx.bool_:
        extra = mx.where(mask, mx.array(0.0, dtype), mx.array(MASKED, dtype))
    else:
        extra = mx.maximum(mask.astype(dtype) * LOG2E, MASKED)
    if padded > keys:
        filler = mx.full((length, padded - keys), MASKED, dtype=dtype)
        extra = mx.concatenate([extra, filler], axis=1)
    return extra.T


def _block_scores(
    feed: _Feed, k: mx.array, qt: mx.array, start: int, rows: int, first: int
) -> tuple[list[tuple[int, int, mx.array]], mx.array]:
    """One query block's score tiles ``(lo, width, scores)``, keys by rows and masked, and
    their exact row maximum over every tile. ``qt``: the block's queries, dims by rows;
    ``first``: the position of its first row. A causal block visits the keys up to its last
    row only."""
    end = -(-(first + rows) // GRAIN) * GRAIN if feed.causal else feed.padded
    scores, top = [], None
    for lo in range(0, end, KEY_TILE):
        width = min(KEY_TILE, end - lo)
        s = k[:, :, lo : lo + width] @ qt
        if feed.softcap is not None:
            s = mx.tanh(s / feed.softcap) * (feed.softcap * LOG2E)
        tile_mask = _tile_mask(feed, lo, width, start, rows, first, qt.dtype)
        if tile_mask is not None:
            shape = (feed.batch, feed.groups, width, feed.per_group, rows)
            s = (s.reshape(shape) + tile_mask[:, None]).reshape(feed.batch, feed.groups, width, -1)
        scores.append((lo, width, s))
        tile_max = mx.max(s, axis=-2, keepdims=True)
        top = tile_max if top is None else mx.maximum(top, tile_max)
    return scores, top


def _tile_mask(
    feed: _Feed, lo: int, width: int, start: int, rows: int, first: int, dtype: mx.Dtype
) -> mx.array | None:
    """The additive mask of the key tile ``[lo, lo + width)`` for the block of ``rows`` rows
    from ``start`` (position ``first``), or None where every key of it is visible."""
    if feed.causal:
        if lo + width - 1 > first:  # some key lies past the first row
            return _diagonal_mask(width, rows, first - lo, dtype)
        return None
    if feed.extra is not None:
        return feed.extra[lo : lo + width, start : start + rows]
    if lo + width > feed.keys:  # no mask: only the padding is hidden
        return _diagonal_mask(width, 1, feed.keys - 1 - lo, dtype)
    return None


def _weighted_values(
    scores: list[tuple[int, int, mx.array]], top: mx.array, v: mx.array
) -> mx.array:
    """The block's output, rows by dims: the weights ``2**(s - top)`` tile by tile, their
    products with the values and their sums (the denominator) accumulated across tiles."""
    acc = den = None  # acc: the weighted values, dims by rows
    for lo, width, s in scores:
        e = exp2_nonpositive(s - top)
        part = mx.sum(e, axis=-2, keepdims=True)
        tile_v = v[:, :, lo : lo + width].transpose(0, 1, 3, 2)
        acc = tile_v @ e if acc is None else mx.addmm(acc, tile_v, e)
        den = part if den is None else den + part
    return (acc / den).transpose(0, 1, 3, 2)


def packed_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    mask: mx.array | str | None,
    cache,
    scale: float,
    rows: bool,
    fused: bool,
    threads: int = 1,
) -> mx.array | None:
    """Attention over a ``cache.kv_quantized`` cache's packed rows ``k``, ``v`` without a float
    copy, or None where no kernel reads them (the caller dequantizes). ``rows``: a causal feed
    of a few rows the native row kernel may take (each row alone, as decoding it would, split
    over ``threads``); ``fused``: no soft-capping or ``mx.fast`` kernel, so a long feed with a
    None or "causal" mask takes the native fused kernel, which dequantizes each key tile as it
    reads it."""
    bits, group = cache.bits, cache.group
    if rows and native.row_attention_quantized_available(q.shape[-1]):
        return native.row_attention_quantized(
            q, k, v, scale=scale, bits=bits, group=group, threads=threads
        )
    if (
        fused
        and serves(q.shape[2], q.dtype, mask)
        and (mask is None or isinstance(mask, str))
        and native.flash_attention_quantized_available()
    ):
        return _fused(q, k, v, scale, isinstance(mask, str), (bits, group))
    return None


def _fused(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    causal: bool,
    quantized: tuple[int, int] | None = None,
) -> mx.array:
    """The native fused kernel (over packed rows given ``quantized`` = (bits, group)), in
    pieces of ``FUSED_PIECE_ROWS`` query rows while a cancel hook is set (a causal piece
    takes only the keys up to its last row)."""
    hook, length, keys = _BETWEEN_BLOCKS.get(), q.shape[2], k.shape[2]
    kernel = native.flash_attention
    if quantized is not None:
        bits, group = quantized
        kernel = functools.partial(native.flash_attention_quantized, bits=bits, group=group)
    if hook is None or length <= FUSED_PIECE_ROWS:
        return kernel(q, k, v, scale=scale, causal=causal)
    pieces = []
    for start in range(0, length, FUSED_PIECE_ROWS):
        rows = min(FUSED_PIECE_ROWS, length - start)
        end = keys - length + start + rows if causal else keys
        qp = q[:, :, start : start + rows]
        pieces.append(kernel(qp, k[:, :, :end], v[:, :, :end], scale=scale, causal=causal))
        if start + rows < length:
            hook(pieces[-1])
    return mx.concatenate(pieces, axis=2)


# ----------------------------------------------------------------------------- masks
# Causal feeds of up to this many rows attend row by row (``llama.Attention.attend_cached``).
ROW_BY_ROW = 16


def window_mask(
    offset: int, length: int, window: int, key_start: int = 0, dtype: mx.Dtype = mx.float32
) -> mx.array | None:
    """Additive ``[length, offset + length - key_start]`` mask over the keys of positions
    ``key_start..offset+length-1``: the row at position p sees the keys of ``(p - window, p]``
    (transformers' sliding mask, ``kv_idx > q_idx - sliding_window``). None when every row
    sees every key (one row whose keys start inside its window)."""
    if length == 1 and key_start >= offset - window + 1:
        return None
    rows = mx.arange(offset, offset + length)[:, None]
    keys = mx.arange(key_start, offset + length)[None, :]
    visible = (keys <= rows) & (keys > rows - window)
    return mx.where(visible, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


def causal_mask(offset: int, length: int, dtype: mx.Dtype = mx.float32) -> mx.array | None:
    """Additive ``[length, offset + length]`` mask: row i sees keys up to ``offset + i``.
    None for one row, which sees the whole cache."""
    if length == 1:
        return None
    rows = mx.arange(offset, offset + length)[:, None]
    visible = mx.arange(offset + length)[None, :] <= rows
    return mx.where(visible, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


class FeedLayout:
    """The masks and RoPE tables of one feed (``offset``, ``length`` rows), built once and
    shared by the layers using them: one mask per window, one table per RoPE group. ``attn0``:
    the first layer's attention (whether it takes the fused kernel, its soft-cap); ``mask``:
    None, or a per-sequence mask given by the caller."""

    def __init__(self, attn0, offset: int, length: int, dtype: mx.Dtype, mask) -> None:
        self.offset, self.length, self.dtype, self.mask = offset, length, dtype, mask
        # Soft-capped scores take the composed kernel, so they need the shared array mask.
        fast = attn0.fast and attn0.softcap is None
        self.full = mask
        self.few = mask is None and 1 < length <= ROW_BY_ROW and not fast
        if mask is None and length > 1:
            # The fused kernel takes "causal" (lower-right aligned), and so does the blocked
            # kernel of long feeds (it masks only the key tiles crossing the diagonal); the
            # five-op one adds a mask built once for every layer.
            # A few rows (a verify) attend row by row (Attention.attend_cached): "causal".
            blocked = serves(length, dtype, "causal")
            self.full = (
                "causal" if fast or blocked or self.few else causal_mask(offset, length, dtype)
            )
        self.masks: dict[tuple[int, int], object] = {}
        self.tables: dict[str, tuple] = {}

    def layer_mask(self, layer, cache):
        """The mask of ``layer`` (its ``window``) over ``cache``, before the feed's rows go in."""
        offset, length = self.offset, self.length
        if layer.window is None or (self.few and offset + length <= layer.window):
            # (A window that has not yet slid is causal: a few rows attend row by row.)
            return self.full
        if self.mask is not None:
            raise ValueError("per-sequence masks are not supported with sliding layers")
        start = cache.window_lo(offset)
        key = (layer.window, start)
        if key not in self.masks:
            self.masks[key] = window_mask(offset, length, layer.window, start, self.dtype)
        return self.masks[key]

    def layer_mask_and_rope(self, layer, cache) -> tuple:
        """The mask and RoPE tables of ``layer`` (its ``window``, ``rope_group`` and
        ``self_attn.rope``) over ``cache``."""
        offset, length = self.offset, self.length
        layer_mask = self.layer_mask(layer, cache)
        rope = self.tables.get(layer.rope_group)
        if rope is None:
            rope = self.tables[layer.rope_group] = layer.self_attn.rope.tables(
                offset, length, self.dtype
            )
        return layer_mask, rope
