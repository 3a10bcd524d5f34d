"""Rotary position embeddings with the scaling variants real Llama-family configs use."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


class RoPE(nn.Module):
    """``default``, ``linear`` and ``llama3`` scaling, in rotate-half or interleaved form.

    ``traditional=True`` rotates adjacent pairs (GGUF llama weights, whose Q/K rows llama.cpp
    permuted for that form); ``False`` rotates the two halves (Hugging Face layout).
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

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self._freqs is not None:
            return mx.fast.rope(
                x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                offset=offset, freqs=self._freqs,
            )  # fmt: skip
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
            offset=offset,
        )  # fmt: skip


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
