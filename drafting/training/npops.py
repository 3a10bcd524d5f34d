"""NumPy building blocks of the head's training copy (``nphead``): RMSNorm with its saved
inverse RMS, rotary tables and rotation in MLX's conventions, SwiGLU, the additive mask
value."""

from __future__ import annotations

import numpy as np

NEG = np.float32(-1e9)


def rope_periods(rope) -> tuple[np.ndarray, float]:
    """Per-pair periods (1 / inverse frequency) and the position scale of an MLX RoPE module."""
    return np.array(rope._period_table, dtype=np.float64), float(rope.scale)


def rms_forward(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm output and the per-row inverse RMS (kept for the head's backward pass)."""
    r = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    return x * r * w, r


def rope_table(offset: int, length: int, pos_scale: float, periods: np.ndarray):
    """cos and sin ``[length, dims/2]`` for positions ``offset..offset+length-1``."""
    pos = (np.arange(offset, offset + length, dtype=np.float64) * pos_scale)[:, None]
    theta = pos / periods[None, :]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rope_rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dims: int, traditional: bool):
    """Rotate ``x`` ``[B, H, L, hd]`` (MLX's conventions: halves, or adjacent pairs); ``-sin``
    rotates back (the backward pass)."""
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return np.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
