"""The cache of a full-attention layer: ``KVCache`` (preallocated buffers, in-place appends,
rewind, lazy snapshots of any range) and its ``KVSnapshot``; ``concat_snapshots`` merges two
adjacent snapshots of any kind. The sliding-window kind lives in ``cache.window``."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import mlx.core as mx

from cache.base import BaseSnapshot, KVBuffers
from cache.window import RotatingKVCache, WindowSnapshot

# Re-exported from cache.window for the importers that still name them here (tests,
# runner.models.llama).
__all__ = ["KVCache", "KVSnapshot", "RotatingKVCache", "WindowSnapshot", "concat_snapshots"]


class KVSnapshot(BaseSnapshot):
    """The keys and values of positions ``[start, end)`` of one cache.

    A snapshot starts *lazy*: it records only the range and its owner cache, holding no array,
    so MLX may still update the live buffer in place. Before an append overwrites any of its
    slots, the owner copies the range out (the snapshot becomes *materialised*). ``on_resize``
    (set by whoever accounts memory) hears every change of ``nbytes``.
    """

    __slots__ = ("start", "end")

    def __init__(self, owner: KVCache, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.owner: KVCache | None = owner
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.on_resize: Callable[[int], None] | None = None

    @property
    def restorable(self) -> bool:
        """A range of a full cache always restores (given the prefix before it)."""
        return True

    @classmethod
    def of_arrays(cls, start: int, end: int, keys: mx.array, values: mx.array) -> KVSnapshot:
        """A materialised snapshot of ``[start, end)`` holding ``keys``/``values`` as given:
        arrays no cache buffer owns (read back from disk by ``cache.disk``), so no copy is
        needed to keep them from changing; a restore writes them into the buffer."""
        snap = cls.__new__(cls)
        snap.start, snap.end, snap.owner, snap.on_resize = start, end, None, None
        snap.keys, snap.values = keys, values
        return snap

    def materialise(self) -> None:
        """Copy the range out of the owner's buffer now (a no-op once materialised)."""
        owner = self.owner
        if owner is None:
            return
        if self.end > self.start:
            keys = mx.contiguous(owner.keys[..., self.start : self.end, :])
            values = mx.contiguous(owner.values[..., self.start : self.end, :])
            # Evaluate now so the copy stops referring to the live buffer before it is updated.
            mx.eval(keys, values)
        else:
            keys = values = None
        self._copied_out(keys, values)

    def split(self, at: int) -> tuple[KVSnapshot, KVSnapshot]:
        """Two snapshots ``[start, at)`` and ``[at, end)``; this one is closed."""
        if not self.start < at < self.end:
            raise ValueError(f"cannot split [{self.start}, {self.end}) at {at}")
        owner = self.owner
        if owner is not None:
            head, tail = owner._lazy_range(self.start, at), owner._lazy_range(at, self.end)
        else:
            cut = at - self.start
            head = _copied(self.start, at, self.keys[..., :cut, :], self.values[..., :cut, :])
            tail = _copied(at, self.end, self.keys[..., cut:, :], self.values[..., cut:, :])
        self.close()
        return head, tail

    def __repr__(self) -> str:
        state = "lazy" if self.lazy else f"{self.nbytes} B"
        return f"KVSnapshot([{self.start}, {self.end}), {state})"


def _copied(start: int, end: int, keys: mx.array, values: mx.array) -> KVSnapshot:
    """A materialised snapshot holding its own contiguous copy of ``keys``/``values``."""
    snap = KVSnapshot.__new__(KVSnapshot)
    snap.start, snap.end, snap.owner, snap.on_resize = start, end, None, None
    snap.keys, snap.values = mx.contiguous(keys), mx.contiguous(values)
    mx.eval(snap.keys, snap.values)
    return snap


def concat_snapshots(head, tail):
    """One snapshot of ``[head.start, tail.end)``; both inputs are closed.

    Two adjacent lazy ranges of the same cache stay lazy (arithmetic only); anything else is
    concatenated into one copy. For a windowed cache the merged node keeps the window at its
    end, which is the tail's (the head's window at the old boundary is dropped).
    """
    if head.end != tail.start:
        raise ValueError(f"[{head.start}, {head.end}) and [{tail.start}, ..) are not adjacent")
    merged = head.merged(tail)
    if merged is not None:
        return merged
    if isinstance(tail, WindowSnapshot):
        head.close()
        tail.start = head.start
        return tail
    if head.owner is not None and head.owner is tail.owner:
        merged = head.owner._lazy_range(head.start, tail.end)
    else:
        head.materialise()
        tail.materialise()
        parts = [s for s in (head, tail) if s.keys is not None]
        keys = mx.concatenate([s.keys for s in parts], axis=2)
        values = mx.concatenate([s.values for s in parts], axis=2)
        merged = _copied(head.start, tail.end, keys, values)
    head.close()
    tail.close()
    return merged


class KVCache(KVBuffers):
    """Keys and values of one attention layer, shaped ``[batch, kv_heads, capacity, head_dim]``.

    Buffers grow in steps of ``step`` positions and appends are slice updates into them, so a
    decode step writes one slot instead of concatenating. Rewinding only moves ``offset``;
    the stale slots are overwritten by the next append, which first copies out every lazy
    snapshot covering the slots it writes. ``BaseCache``'s defaults are this cache's: it
    rewinds to any position up to its offset, has no window and keeps no states.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        # Lazy snapshots of this buffer. Weak, so a dropped snapshot stops costing copies.
        self._lazy: weakref.WeakSet[KVSnapshot] = weakref.WeakSet()
        # Upper bound of the lazy ranges' ends: appends at or past it need no scan.
        self._lazy_end = 0

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        batch, heads, _, k_dim = keys.shape
        v_dim = values.shape[3]
        steps = (needed + self.step - 1) // self.step
        capacity = steps * self.step
        new_k = mx.zeros((batch, heads, capacity, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, capacity, v_dim), values.dtype)
        if self.keys is not None and self.offset > 0:
            # Slots past the offset are not carried: a write that grows the buffer starts at
            # the offset and runs past the old capacity, so it has copied out every lazy
            # range up there already.
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def _protect(self, start: int, end: int) -> None:
        """Copy out every lazy snapshot overlapping ``[start, end)`` before it is written."""
        if start >= self._lazy_end:
            return
        hit = [s for s in self._lazy if s.start < end and start < s.end]
        for snap in hit:
            snap.materialise()
        self._lazy_end = max((s.end for s in self._lazy), default=0)

    def _write(self, start: int, keys: mx.array, values: mx.array) -> int:
        end = start + keys.shape[2]
        self._protect(start, end)
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return end

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``[B, H, L, D]``) at ``offset``; return everything cached."""
        end = self.append(keys, values)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def append(self, keys: mx.array, values: mx.array) -> int:
        """Append ``keys``/``values`` at ``offset``; the new offset. A reader that takes the
        whole buffers and this length (``runner.native.rows_attention``) needs no fetched
        views."""
        self.offset = self._write(self.offset, keys, values)
        return self.offset

    def rewind(self, to: int) -> None:
        """Forget every position at or after ``to`` (an offset move, no copy)."""
        if to < 0 or to > self.offset:
            raise ValueError(f"cannot rewind a cache at offset {self.offset} to {to}")
        self.offset = to

    def keep_rows(self, rows: mx.array) -> None:
        """Keep only the batch rows ``rows`` (int indices, in that order): one gather copy of
        the buffers, for a batch whose finished sequences leave it. Lazy snapshots are copied
        out first, so they keep every row."""
        self._protect(0, self._lazy_end)
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def can_restore(self, snap: KVSnapshot, to: int | None = None) -> bool:
        """Whether ``restore(snap, to)`` may be called now (the prefix before it is in place)."""
        to = snap.end if to is None else to
        return snap.start <= to <= snap.end and self.offset >= snap.start

    def reset(self) -> None:
        """Drop the buffers; lazy snapshots of them are copied out first so they stay valid."""
        self._protect(0, self._lazy_end)
        self.keys = self.values = None
        self.offset = 0

    def snapshot(self, start: int, end: int | None = None) -> KVSnapshot:
        """A lazy snapshot of positions ``[start, end)`` (``end`` defaults to ``offset``)."""
        end = self.offset if end is None else end
        if not 0 <= start <= end <= self.offset:
            raise ValueError(f"cannot snapshot [{start}, {end}) of a cache at offset {self.offset}")
        return self._lazy_range(start, end)

    def _lazy_range(self, start: int, end: int) -> KVSnapshot:
        snap = KVSnapshot(self, start, end)
        if end > start:
            self._lazy.add(snap)
            self._lazy_end = max(self._lazy_end, end)
        else:
            snap.owner = None  # an empty range has nothing to protect
        return snap

    def restore(self, snap: KVSnapshot, to: int | None = None) -> None:
        """Make positions ``[snap.start, to)`` hold the snapshot; ``offset`` becomes ``to``.

        Needs ``offset >= snap.start`` (the prefix before the snapshot is already in place).
        A still-lazy range of this cache is an offset move, forward too, since its slots were
        never overwritten. A copy is written back at ``snap.start``; when it is written whole
        the snapshot turns lazy again, because the live buffer now holds its data.
        """
        to = snap.end if to is None else to
        if not snap.start <= to <= snap.end:
            raise ValueError(f"cannot restore [{snap.start}, {snap.end}) to {to}")
        if self.offset < snap.start:
            raise ValueError(f"cache at offset {self.offset} is behind snapshot [{snap.start}, ..)")
        if snap.owner is self:
            self.offset = to
            return
        if snap.owner is not None:
            raise ValueError("a lazy snapshot can only be restored into the cache it belongs to")
        self.offset = snap.start
        if to > snap.start:
            count = to - snap.start
            self.offset = self._write(
                snap.start, snap.keys[..., :count, :], snap.values[..., :count, :]
            )
        if to == snap.end and snap.keys is not None:
            snap.owner = self
            self._lazy.add(snap)
            self._lazy_end = max(self._lazy_end, snap.end)
            snap._set_copy(None, None)
