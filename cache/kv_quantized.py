"""A full-attention layer's cache with its keys and values stored quantized (``--kv-bits``).

Each appended row of ``D`` floats is quantized once, on append, as mlx-lm's quantized cache
does it (``mx.quantize``: affine per group of ``group`` values, ``x ~ scale * q + bias`` with
``q`` an unsigned ``bits``-bit integer and a float32 scale and bias per group), and the three
parts are packed into one uint32 row of ``words(D, bits, group)`` words:

    [ D * bits / 32 words of packed q | D / group scales | D / group biases ]

(the scales and biases are float32 bits). A packed row is one array row, so ``KVCache``'s
machinery runs unchanged on the packed buffers: in-place appends, rewinds that only move the
offset (rows are only appended and truncated, so a speculative rewind is exact), lazy
snapshots that copy packed rows out (prefix snapshots stay quantized), restores that write
them back, ``keep_rows`` gathers and the disk tier, which stores the uint32 arrays as they are.

Readers: ``runner.native.row_attention_quantized`` attends over the packed rows directly
(decode steps and verify rows); every other reader takes ``dequantize``'s float rows.
"""

from __future__ import annotations

import mlx.core as mx

from cache.kv import KVCache

BITS = (4, 8)
GROUPS = (32, 64, 128)


def words(dim: int, bits: int, group: int) -> int:
    """uint32 words of one packed row of ``dim`` values."""
    return dim * bits // 32 + 2 * (dim // group)


def check(dim: int, bits: int, group: int) -> None:
    """Refuse a layout ``mx.quantize`` cannot give (ValueError)."""
    if bits not in BITS:
        raise ValueError(f"--kv-bits must be one of {BITS}, not {bits}")
    if group not in GROUPS:
        raise ValueError(f"--kv-group must be one of {GROUPS}, not {group}")
    if dim % group:
        raise ValueError(f"a head dimension of {dim} is not a multiple of --kv-group {group}")


def pack(x: mx.array, bits: int, group: int) -> mx.array:
    """Float rows ``[..., D]`` quantized and packed into uint32 rows ``[..., words]``."""
    check(x.shape[-1], bits, group)
    q, scales, biases = mx.quantize(x.astype(mx.float32), group_size=group, bits=bits)
    return mx.concatenate([q, scales.view(mx.uint32), biases.view(mx.uint32)], axis=-1)


def unpack(packed: mx.array, dim: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """The packed rows' ``(q, scales, biases)`` as ``mx.quantize`` gives them."""
    width = dim * bits // 32
    groups = (packed.shape[-1] - width) // 2
    q = packed[..., :width]
    scales = packed[..., width : width + groups].view(mx.float32)
    biases = packed[..., width + groups :].view(mx.float32)
    return q, scales, biases


def dequantize(packed: mx.array, dim: int, bits: int, group: int) -> mx.array:
    """Float32 rows ``[..., D]`` of packed rows: ``scale * q + bias`` per group."""
    q, scales, biases = unpack(packed, dim, bits)
    return mx.dequantize(q, scales, biases, group_size=group, bits=bits)


class QuantizedKVCache(KVCache):
    """A ``KVCache`` whose buffers hold packed quantized rows (``[B, kv_heads, capacity,
    words]``, uint32); ``update_and_fetch`` takes float rows and returns the packed prefix.

    ``dim`` (the head dimension) is learnt from the first append; a snapshot's packed rows
    restore into any cache of the same ``bits`` and ``group``."""

    quantized = True

    def __init__(self, bits: int, group: int) -> None:
        super().__init__()
        check(group, bits, group)  # the bits and the group (any head dim is checked on append)
        self.bits, self.group = bits, group
        self.k_dim: int | None = None
        self.v_dim: int | None = None
        self.dtype = mx.float32  # the appended rows' (dequantize gives it back)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize ``keys``/``values`` (float ``[B, H, L, D]``), append them at ``offset``,
        return every packed row cached (``[B, H, offset, words]``)."""
        self.k_dim, self.v_dim, self.dtype = keys.shape[-1], values.shape[-1], keys.dtype
        return super().update_and_fetch(
            pack(keys, self.bits, self.group), pack(values, self.bits, self.group)
        )

    def _dims(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        if self.k_dim is not None:
            return self.k_dim, self.v_dim
        # Restored rows only (no append yet): the dims follow from the packed widths.
        per = self.bits / 32 + 2 / self.group
        return round(keys.shape[-1] / per), round(values.shape[-1] / per)

    def dequantize(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values of packed rows (what ``update_and_fetch`` returned) in the appended
        rows' dtype."""
        k_dim, v_dim = self._dims(keys, values)
        return (
            dequantize(keys, k_dim, self.bits, self.group).astype(self.dtype),
            dequantize(values, v_dim, self.bits, self.group).astype(self.dtype),
        )

    def float_state(self) -> tuple[mx.array, mx.array] | None:
        """The cached positions as float32 keys and values (tests, measurements)."""
        if self.keys is None or self.offset == 0:
            return None
        return self.dequantize(self.keys[..., : self.offset, :], self.values[..., : self.offset, :])


def quantize_caches(caches: list, bits: int | None, group: int) -> list:
    """``caches`` with every plain ``KVCache`` (a full-attention layer) replaced by a
    ``QuantizedKVCache``; sliding-window and recurrent caches keep their own states."""
    if not bits:
        return caches
    return [QuantizedKVCache(bits, group) if type(c) is KVCache else c for c in caches]
