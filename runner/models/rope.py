"""Rotary position embeddings with the scaling variants real Llama-family configs use."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.models.rope_config import rope_spec


class RoPE(nn.Module):
    """Every RoPE variant transformers implements for these families, each as its
    ``ROPE_INIT_FUNCTIONS`` computes it (``tests/test_rope_tables.py`` compares them):

    - ``default``, ``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1's
      wavelength bands), ``yarn`` (NTK-by-parts frequencies and an attention factor on cos and
      sin) and GGUF's ``freq_factors`` (per-pair divisors): fixed frequencies;
    - ``dynamic`` (NTK): the base grows with the length a forward ends at, ``max(end,
      max_position_embeddings)``, recomputed for every forward; cached keys keep the rotation
      they were stored with (transformers does the same);
    - ``longrope`` (Phi-3): the short factors for a forward that ends at or below
      ``original_max_position_embeddings``, the long ones past it (the whole forward, cached
      keys unchanged), times its attention factor.

    The last two depend on how a sequence was fed (``depends_on_feed``): one forward over a
    long prompt and the same prompt in chunks rotate differently, exactly as in transformers.

    ``scaling`` is a RoPE dict in any layout (``runner.models.rope_config.rope_spec`` reads it;
    already-resolved dicts pass unchanged); ``max_position_embeddings`` is the model's context,
    which dynamic, yarn and longrope defaults read. ``dims`` are the rotated dimensions, the
    first ``dims`` of a ``head_dim``-wide head (partial rotary; the rest pass unchanged).

    ``traditional=True`` rotates adjacent pairs (GGUF llama weights, whose Q/K rows llama.cpp
    permuted for that form); ``False`` rotates the two halves (Hugging Face layout).

    Two kernels compute the same rotation (``fast``, set by ``runner.device``): the composed
    one builds cos/sin tables once per forward and applies them with one small matmul (on the
    CPU ``mx.fast.rope`` falls back to many small ops per call); ``mx.fast.rope`` is fused on a
    GPU. Either way :meth:`tables` gives what :meth:`apply` needs for one forward.
    """

    def __init__(
        self,
        dims: int,
        base: float = 10000.0,
        traditional: bool = False,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim or dims
        if max_position_embeddings is None:
            max_position_embeddings = (scaling or {}).get("max_position_embeddings", 0)
        spec = rope_spec(
            scaling,
            head_dim=dims,
            max_position_embeddings=max_position_embeddings,
            theta=base,
            where="rope_scaling",
        )
        self.dims = dims
        self.traditional = traditional
        self.base = spec.theta
        self.kind = spec.rope_type
        self.scaling = spec.scaling
        params = spec.scaling or {}
        self.scale = 1.0 / params["factor"] if self.kind == "linear" else 1.0
        self.attention_factor = float(params.get("attention_factor", 1.0))
        self.max_position_embeddings = int(max_position_embeddings)
        periods = self._periods(None)
        self._period_table = mx.array(periods)
        # mx.fast.rope takes the periods ("freqs") where a base and a position scale do not say.
        self._freqs = None if self.kind in ("default", "linear") else self._period_table
        self._rotation = rotation_matrix(dims, traditional, self.head_dim)
        self.fast = False

    @property
    def depends_on_feed(self) -> bool:
        """Whether a forward's rotation depends on where it ends (dynamic, longrope)."""
        return self.kind in ("dynamic", "longrope")

    def _periods(self, end: int | None) -> np.ndarray:
        """Per-pair periods (1 / inverse frequency) of a forward ending at ``end`` (None: at
        initialisation, as transformers first computes them), float32."""
        d, p = self.dims, self.scaling or {}
        exps = np.arange(0, d, 2, dtype=np.float64) / d
        if self.kind in ("default", "linear"):
            periods = self.base**exps
        elif self.kind == "dynamic":
            factor, context = p["factor"], p["max_position_embeddings"]
            length = max(end or 0, context)
            base = self.base * ((factor * length / context) - (factor - 1)) ** (d / (d - 2))
            periods = base**exps
        elif self.kind == "longrope":
            long = end is not None and end > p["original_max_position_embeddings"]
            ext = np.array(p["long_factor" if long else "short_factor"], dtype=np.float64)
            periods = ext * self.base**exps
        elif self.kind == "llama3":
            periods = llama3_periods(d, self.base, p)
        elif self.kind == "yarn":
            periods = yarn_periods(d, self.base, p)
        elif self.kind == "freq_factors":
            periods = self.base**exps * np.array(p["factors"], dtype=np.float64)
        else:  # rope_spec refuses every other type
            raise ValueError(f"unsupported rope type {self.kind!r}")
        return periods.astype(np.float32)

    def periods(self, offset: int, length: int) -> mx.array:
        """The periods of a forward over positions ``offset..offset+length-1``."""
        if not self.depends_on_feed:
            return self._period_table
        return mx.array(self._periods(offset + length))

    def inv_freq(self, offset: int, length: int) -> np.ndarray:
        """What transformers calls ``inv_freq`` for that forward (the position scale over the
        periods), float64; with :attr:`attention_factor`, everything the rotation uses."""
        return self.scale / np.array(self.periods(offset, length), dtype=np.float64)

    def tables(self, offset: int, length: int, dtype: mx.Dtype = mx.float32) -> RopeTables:
        """What :meth:`apply` needs for positions ``offset..offset+length-1``: composed, cos and
        sin ``[length, head_dim]`` (the attention factor folded in) and the rotation in the
        activations' dtype (one forward computes them once for every layer); fast, the offset as
        an array (so compiled blocks do not retrace per position) and, for a variant whose
        frequencies change per forward, that forward's periods."""
        if self.fast:
            offset_array = mx.array(offset, dtype=mx.int32)
            if self.depends_on_feed:
                return (offset_array, self.periods(offset, length))
            return (offset_array,)
        return self.composed_tables(offset, length, dtype)

    def composed_tables(self, offset: int, length: int, dtype: mx.Dtype = mx.float32) -> RopeTables:
        """:meth:`tables` in the composed form whatever ``fast`` says (a forward shared by
        several sequences concatenates each sequence's)."""
        positions = mx.arange(offset, offset + length, dtype=mx.float32)
        return self._composed(positions, self.periods(offset, length), dtype)

    def row_tables(self, positions: list[int], dtype: mx.Dtype = mx.float32) -> RopeTables:
        """Composed tables for rows at arbitrary ``positions`` (a batched decode step, one row
        per sequence), in either mode: row i gets exactly the values the composed
        :meth:`tables` give for one row at ``positions[i]`` (with ``fast`` on, as on a GPU, a
        lone forward rotates through ``mx.fast.rope`` instead, equal up to rounding). Not for
        a variant whose periods depend on the feed."""
        if self.depends_on_feed:
            raise ValueError(f"{self.kind} RoPE depends on the feed: no per-row tables")
        return self._composed(mx.array(positions, dtype=mx.float32), self._period_table, dtype)

    def multimodal_tables(
        self, positions: np.ndarray, sections: Sequence[int], dtype: mx.Dtype = mx.float32
    ) -> RopeTables:
        """Composed tables for rows at 3-channel positions ``[3, length]`` (temporal, height,
        width: an image's rows in a multimodal prompt). Frequency ``j`` reads one channel,
        interleaved over the first ``3 * sections[c]`` frequencies (:func:`mrope_channels`).
        A row whose three channels are equal gets exactly the 1-D tables of its position.
        Not for a variant whose periods depend on the feed."""
        if self.depends_on_feed:
            raise ValueError(f"{self.kind} RoPE depends on the feed: no multimodal tables")
        channels = mrope_channels(self.dims // 2, sections)
        pos = mx.array(np.asarray(positions, dtype=np.float32)) * self.scale
        angles = mx.take(pos, mx.array(channels), axis=0).T / self._period_table[None, :]
        return self._from_angles(angles, dtype)

    def _composed(self, positions: mx.array, periods: mx.array, dtype: mx.Dtype) -> RopeTables:
        pos = positions * self.scale
        return self._from_angles(pos[:, None] / periods[None, :], dtype)

    def _from_angles(self, angles: mx.array, dtype: mx.Dtype) -> RopeTables:
        """cos, sin ``[length, head_dim]`` of per-pair ``angles`` ``[length, dims / 2]``."""
        length = angles.shape[0]
        if self.traditional:
            angles = mx.repeat(angles, 2, axis=1)
        else:
            angles = mx.concatenate([angles, angles], axis=1)
        cos, sin = mx.cos(angles), mx.sin(angles)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        rest = self.head_dim - self.dims
        if rest:  # partial rotary: the other dims pass unchanged
            cos = mx.concatenate([cos, mx.ones((length, rest))], axis=1)
            sin = mx.concatenate([sin, mx.zeros((length, rest))], axis=1)
        rotation = self._rotation if dtype == mx.float32 else self._rotation.astype(dtype)
        return cos.astype(dtype), sin.astype(dtype), rotation

    def apply(self, x: mx.array, tables: RopeTables) -> mx.array:
        """Rotate ``x`` ``[..., length, head_dim]`` by ``tables``: composed, ``x cos + rot(x)
        sin`` with ``rot`` a constant signed permutation (one small matmul)."""
        if len(tables) == 3:
            cos, sin, rotation = tables
            return x * cos + (x @ rotation) * sin
        freqs = tables[1] if len(tables) == 2 else self._freqs
        partial = self.attention_factor != 1.0 and self.dims != x.shape[-1]
        rotated = x[..., : self.dims] if partial else x
        out = mx.fast.rope(
            rotated,
            self.dims,
            traditional=self.traditional,
            base=None if freqs is not None else self.base,
            scale=self.scale,
            offset=tables[0],
            freqs=freqs,
        )
        if self.attention_factor == 1.0:
            return out
        out = out * self.attention_factor
        if partial:
            out = mx.concatenate([out, x[..., self.dims :]], axis=-1)
        return out

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return self.apply(x, self.tables(offset, x.shape[-2], x.dtype))


# Composed: (cos, sin, rotation); fast: (offset,) or (offset, periods).
RopeTables = tuple[mx.array, ...]


def mrope_channels(pairs: int, sections: Sequence[int]) -> np.ndarray:
    """The position channel (0 temporal, 1 height, 2 width) each of ``pairs`` frequencies
    reads in interleaved multimodal RoPE: height where ``j % 3 == 1`` and ``j < 3 *
    sections[1]``, width where ``j % 3 == 2`` and ``j < 3 * sections[2]``, temporal for the
    rest (so frequencies past the sections read the temporal channel)."""
    j = np.arange(pairs)
    channels = np.zeros(pairs, dtype=np.int32)
    channels[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    channels[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return channels


def rotation_matrix(dims: int, traditional: bool, width: int | None = None) -> mx.array:
    """``R`` with ``x @ R`` = rotate-half(x) (``[-x2, x1]``) or, traditional, each adjacent
    pair ``(a, b)`` -> ``(-b, a)``, over the first ``dims`` of ``width`` features (zero past
    them: those features are not rotated)."""
    rot = np.zeros((width or dims, width or dims), dtype=np.float32)
    if traditional:
        for i in range(0, dims, 2):
            rot[i + 1, i], rot[i, i + 1] = -1.0, 1.0
    else:
        half = dims // 2
        for i in range(half):
            rot[i + half, i], rot[i, i + half] = -1.0, 1.0
    return mx.array(rot)


def llama3_periods(dims: int, base: float, p: dict) -> np.ndarray:
    """Llama 3.1's wavelength-dependent frequency stretch, as periods (float64)."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    inv = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return 1.0 / np.where(medium, smoothed, scaled)


def yarn_periods(dims: int, base: float, p: dict) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies (transformers'
    ``_compute_yarn_parameters``), as periods (float64)."""
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singularity
    pos_freqs = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolation share
    return 1.0 / (interpolation * (1 - keep) + extrapolation * keep)
