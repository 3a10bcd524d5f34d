"""Per-layer attention KV cache: preallocated buffers, in-place appends, rewind by offset."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one attention layer, shaped ``[batch, kv_heads, capacity, head_dim]``.

    Buffers grow in steps of ``step`` positions and appends are slice updates into them, so a
    decode step writes one slot instead of concatenating. Rewinding only moves ``offset``;
    the stale slots are overwritten by the next append.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        batch, heads, _, k_dim = keys.shape
        v_dim = values.shape[3]
        steps = (needed + self.step - 1) // self.step
        capacity = steps * self.step
        new_k = mx.zeros((batch, heads, capacity, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, capacity, v_dim), values.dtype)
        if self.keys is not None and self.offset > 0:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``[B, H, L, D]``) at ``offset``; return everything cached."""
        start = self.offset
        end = start + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def rewind(self, to: int) -> None:
        """Forget every position at or after ``to`` (an offset move, no copy)."""
        if to < 0 or to > self.offset:
            raise ValueError(f"cannot rewind a cache at offset {self.offset} to {to}")
        self.offset = to

    def reset(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate so that pending appends are materialised."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not just the used prefix)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
