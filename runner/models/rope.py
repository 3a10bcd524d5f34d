"""Rotary position embeddings with the scaling variants real Llama-family configs use."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class RoPE(nn.Module):
    """``default``, ``linear`` and ``llama3`` scaling, in rotate-half or interleaved form.

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
    ) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base
        self.scale = 1.0
        self._freqs = None
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self._freqs = llama3_freqs(dims, base, scaling)
        elif kind == "freq_factors":
            # GGUF stores llama3-style scaling as per-pair divisors of the frequency.
            factors = list(scaling["factors"])
            periods = [base ** (i / dims) * factors[i // 2] for i in range(0, dims, 2)]
            self._freqs = mx.array(periods, dtype=mx.float32)
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
        if self._freqs is not None:
            self._period_table = self._freqs
        else:
            exps = np.arange(0, dims, 2, dtype=np.float64) / dims
            self._period_table = mx.array((base**exps).astype(np.float32))
        self._rotation = rotation_matrix(dims, traditional)
        self.fast = False

    def tables(self, offset: int, length: int, dtype: mx.Dtype = mx.float32) -> RopeTables:
        """What :meth:`apply` needs for positions ``offset..offset+length-1``: composed, cos and
        sin ``[length, dims]`` and the rotation in the activations' dtype (one forward computes
        them once for every layer); fast, the offset as an array (so compiled blocks do not
        retrace per position)."""
        if self.fast:
            return (mx.array(offset, dtype=mx.int32),)
        pos = mx.arange(offset, offset + length, dtype=mx.float32) * self.scale
        angles = pos[:, None] / self._period_table[None, :]
        if self.traditional:
            angles = mx.repeat(angles, 2, axis=1)
        else:
            angles = mx.concatenate([angles, angles], axis=1)
        rotation = self._rotation if dtype == mx.float32 else self._rotation.astype(dtype)
        return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype), rotation

    def apply(self, x: mx.array, tables: RopeTables) -> mx.array:
        """Rotate ``x`` ``[..., length, dims]`` by ``tables``: composed, ``x cos + rot(x) sin``
        with ``rot`` a constant signed permutation (one small matmul)."""
        if len(tables) == 1:
            freqs = self._freqs
            return mx.fast.rope(
                x, self.dims, traditional=self.traditional,
                base=None if freqs is not None else self.base, scale=self.scale,
                offset=tables[0], freqs=freqs,
            )  # fmt: skip
        cos, sin, rotation = tables
        return x * cos + (x @ rotation) * sin

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return self.apply(x, self.tables(offset, x.shape[-2], x.dtype))


# Composed: (cos, sin, rotation); fast: (offset,).
RopeTables = tuple[mx.array, ...]


def rotation_matrix(dims: int, traditional: bool) -> mx.array:
    """``R`` with ``x @ R`` = rotate-half(x) (``[-x2, x1]``) or, traditional, each adjacent
    pair ``(a, b)`` -> ``(-b, a)``."""
    rot = np.zeros((dims, dims), dtype=np.float32)
    if traditional:
        for i in range(0, dims, 2):
            rot[i + 1, i], rot[i, i + 1] = -1.0, 1.0
    else:
        half = dims // 2
        for i in range(half):
            rot[i + half, i], rot[i, i + half] = -1.0, 1.0
    return mx.array(rot)


def llama3_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    """Llama 3.1's wavelength-dependent frequency stretch (returned as periods for mx.fast.rope)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    periods = []
    for i in range(0, dims, 2):
        period = base ** (i / dims)  # 1 / inverse frequency
        wavelen = 2 * math.pi * period
        if wavelen < high_wavelen:
            periods.append(period)
        elif wavelen > low_wavelen:
            periods.append(period * factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            periods.append(period / ((1 - smooth) / factor + smooth))
    return mx.array(periods, dtype=mx.float32)
