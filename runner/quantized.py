"""Quantized weights as the runner keeps them: every stored format read as affine groups.

Every format the runner reads (MLX affine triples, GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the
K-quants Q4_K/Q5_K/Q6_K) is, exactly, a grid of unsigned integers with one scale and one
bias per group of ``group`` consecutive inputs of an output row:

    w[n, k] = float32(scales[n, k // group] * values[n, k]) + biases[n, k // group]

with ``scales * values`` exact in float32 for every format (11-bit fp16 or bf16 scales, or a
GGUF super-block scale times a 6-bit sub-scale, against at most 8-bit values), so the dense
float32 weight has one rounding, the addition. A reader hands the loader one
:class:`QuantizedTensor` per tensor; the loader unpacks one at a time (``unpack``) into the
native product's quantized panels or, with ``--dequantize``, into float32.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class QuantizedTensor(Protocol):
    """A stored quantized ``[N, K]`` (out, in) weight, unpacked on demand."""

    shape: tuple[int, int]  # [N, K]: output rows, inputs
    group: int  # inputs per scale/bias group (16, 32, 64 or 128)
    bits: int  # the stored width: every value is below 2 ** bits
    kind: str  # the stored type's name, e.g. "Q4_K" or "affine 4-bit" (for messages, status)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in its file."""
        ...

    def unpack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values uint8 [N, K], scales float32 [N, K // group], biases float32 [N, K //
        group])``: the exact affine form above."""
        ...


def affine_dense(values: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """The float32 ``[N, K]`` weight of an unpacked affine tensor: ``scale * value`` (exact),
    then ``+ bias`` (the one rounding), the value every product path computes."""
    n, k = values.shape
    group = k // scales.shape[1]
    q = values.reshape(n, -1, group).astype(np.float32)
    w = q * scales[:, :, None].astype(np.float32)
    w += biases[:, :, None].astype(np.float32)
    return w.reshape(n, k)


def affine_quantize(
    w: np.ndarray, group: int, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine quantization of a float ``[N, K]`` weight in groups of ``group`` inputs (any
    divisor of K, 16 included, where MLX's ``mx.quantize`` takes 32, 64 or 128 only): per
    group the bias is its minimum and the scale its range over ``2 ** bits - 1``, both rounded
    to float16, and each value the nearest level of that float16 grid. Returns ``values``
    uint8 ``[N, K]`` and float32 ``scales``, ``biases`` ``[N, K / group]``, exactly
    representable as quantized panels."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    lo, hi = g.min(-1), g.max(-1)
    levels = (1 << bits) - 1
    scales = ((hi - lo) / levels).astype(np.float16).astype(np.float32)
    biases = lo.astype(np.float16).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0)[..., None]
    q = np.rint((g - biases[..., None]) / safe)
    values = np.clip(q, 0, levels).astype(np.uint8).reshape(n, k)
    return values, scales, biases


def unpack_bits(packed: np.ndarray, k: int, bits: int) -> np.ndarray:
    """The ``uint8 [N, k]`` values of MLX's packing (``uint32 [N, k * bits / 32]``): each row
    one little-endian bit stream, value ``j`` at bits ``[j bits, (j + 1) bits)``."""
    n = packed.shape[0]
    raw = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8).reshape(n, -1)
    if bits == 8:
        return raw[:, :k].copy()
    if bits == 4:
        out = np.empty((n, raw.shape[1] * 2), dtype=np.uint8)
        out[:, 0::2] = raw & 15
        out[:, 1::2] = raw >> 4
        return out[:, :k]
    stream = np.unpackbits(raw, axis=1, bitorder="little")[:, : k * bits]
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return (stream.reshape(n, k, bits).astype(np.uint16) @ weights).astype(np.uint8)


class MlxAffine:
    """An MLX affine triple (``X.weight`` uint32, ``X.scales``, ``X.biases``) as a
    :class:`QuantizedTensor`; the triple stays as loaded until :meth:`unpack`."""

    def __init__(self, packed, scales, biases, group: int, bits: int) -> None:
        self._packed, self._scales, self._biases = packed, scales, biases
        self.group, self.bits = group, bits
        self.shape = (int(scales.shape[0]), int(scales.shape[1]) * group)
        self.kind = f"affine {bits}-bit"

    @property
    def nbytes(self) -> int:
        return int(self._packed.nbytes + self._scales.nbytes + self._biases.nbytes)

    def unpack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import mlx.core as mx

        def f32(a) -> np.ndarray:
            return np.asarray(a.astype(mx.float32))

        values = unpack_bits(np.asarray(self._packed), self.shape[1], self.bits)
        return values, f32(self._scales), f32(self._biases)
