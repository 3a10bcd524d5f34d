"""The cache of a sliding-window attention layer: ``RotatingKVCache``, bounded by its window,
and ``WindowSnapshot``, the window before a position (what the prefix cache keeps of such a
layer at a node's end); ``claim_pin`` is shared with ``cache.recurrent``."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import mlx.core as mx

from cache.base import BaseSnapshot, KVBuffers


def claim_pin(pins: dict, offset: int, start: int, end: int | None) -> tuple[int, object]:
    """For a windowed cache's ``snapshot(start, end)``: ``end`` (default ``offset``) checked
    against the cache, and the restorable snapshot pinned there, taken out of ``pins`` and
    made to start at ``start`` (None when there is none)."""
    end = offset if end is None else end
    if not 0 <= start <= end <= offset:
        raise ValueError(f"cannot snapshot [{start}, {end}) of a cache at offset {offset}")
    pinned = pins.pop(end, None)
    if pinned is None or not pinned.restorable:
        return end, None
    pinned.start = start
    return end, pinned


class WindowSnapshot(BaseSnapshot):
    """What a sliding-window cache needs to resume at position ``end``: the keys and values of
    the window before it, positions ``[lo, end)`` with ``lo = max(0, end - window + 1)``.

    It belongs to a trie node spanning ``[start, end)`` but holds only the window before
    ``end``, so a windowed cache can be restored from it at ``end`` and nowhere else. Like a
    ``KVSnapshot`` it starts *lazy* (a range of its owner's buffer, copied out before the owner
    drops or overwrites any of it) or is a copy; unlike one it may also be *empty*: made where
    the owner no longer held the window, it cannot restore anything (``restorable`` is False)
    and a prefix match has to stop at an earlier node.
    """

    __slots__ = ("start", "end", "lo", "valid")

    def __init__(self, start: int, end: int, lo: int, owner: RotatingKVCache | None) -> None:
        self.start, self.end, self.lo = start, end, lo
        self.owner = owner
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.valid = owner is not None or lo == end  # an empty window needs no data
        self.on_resize: Callable[[int], None] | None = None

    @classmethod
    def empty(cls, start: int, end: int) -> WindowSnapshot:
        """A placeholder for a node whose window was not kept: never restorable."""
        snap = cls(start, end, end, None)
        snap.valid = False
        return snap

    @classmethod
    def of_arrays(
        cls, start: int, end: int, lo: int, keys: mx.array | None, values: mx.array | None
    ) -> WindowSnapshot:
        """A restorable window ``[lo, end)`` held in ``keys``/``values`` (None for an empty
        window): arrays no cache buffer owns, read back from disk by ``cache.disk``."""
        snap = cls(start, end, lo, None)
        if end > lo:
            snap.keys, snap.values = keys, values
        snap.valid = True
        return snap

    @property
    def restorable(self) -> bool:
        return self.valid

    def arrays(self) -> tuple[mx.array | None, mx.array | None]:
        """The window's keys and values (for a recurrent snapshot its conv rows and state) as
        they are now, a view of the owner's buffer while lazy; the snapshot is left as it is.
        None, None for an empty window."""
        owner = self.owner
        if owner is None or self.end <= self.lo:
            return self.keys, self.values
        a, b = self.lo - owner.base, self.end - owner.base
        return owner.keys[..., a:b, :], owner.values[..., a:b, :]

    def materialise(self) -> None:
        """Copy the window out of the owner's buffer now (a no-op unless lazy)."""
        owner = self.owner
        if owner is None:
            return
        keys = values = None
        if self.end > self.lo:
            a, b = self.lo - owner.base, self.end - owner.base
            keys = mx.contiguous(owner.keys[..., a:b, :])
            values = mx.contiguous(owner.values[..., a:b, :])
            mx.eval(keys, values)  # stop referring to the live buffer before it changes
        self._copied_out(keys, values)

    def close(self) -> None:
        super().close()
        self.valid = False

    def split(self, at: int) -> tuple[WindowSnapshot, WindowSnapshot]:
        """``[start, at)`` and ``[at, end)``: the lower part has no window of its own (an empty
        placeholder; the prefix cache hands the node fresh snapshots where it can), the upper
        part is this snapshot, which keeps the window at ``end``."""
        if not self.start < at < self.end:
            raise ValueError(f"cannot split [{self.start}, {self.end}) at {at}")
        head = WindowSnapshot.empty(self.start, at)
        self.start = at
        return head, self

    def __repr__(self) -> str:
        if not self.valid:
            state = "empty"
        else:
            state = "lazy" if self.lazy else f"{self.nbytes} B"
        window = f"window [{self.lo}, {self.end})"
        return f"WindowSnapshot([{self.start}, {self.end}), {window}, {state})"


class RotatingKVCache(KVBuffers):
    """Keys and values of one sliding-window attention layer, bounded by the window.

    A row at position ``p`` attends to the keys of positions ``(p - window, p]``, the
    transformers mask (``kv_idx > q_idx - sliding_window``) for Mistral, Qwen2, Phi-3 and the
    Gemmas alike. ``update_and_fetch`` appends ``L`` rows at ``offset`` and returns the keys of
    positions ``[max(0, offset - window + 1), offset + L)``, in order: the caller masks each row
    to its own window (``runner.models.attention.window_mask``). A chunk longer than the window is
    therefore handled like transformers does, attention over the whole chunk's keys, of which
    only the last ones are kept.

    The buffer holds a contiguous run of positions starting at ``base``; once it is full the
    next append moves the newest ``window - 1 + slack`` positions to the front of a fresh
    buffer (one copy every ``headroom`` appends or more), so the memory stays bounded by the
    window plus ``slack``, ``headroom`` and the longest feed, whatever the context length.

    **Speculation: slack, not copies.** Positions are dropped only when an append needs room,
    never by a rewind, and that append keeps the ``window - 1 + slack`` positions before it in
    the fresh buffer, whose size fits the whole feed. So after a verify feed of
    ``[x, d1..dk]``, at any depth, a rewind to any accepted count (or to the entry, on a
    failure) finds every slot it needs: rewinding is an offset move, exact, with nothing to
    copy or undo; the next append overwrites the rejected slots. The fixed ``slack`` (16, more
    than max draft depth + 1 for any usual depth) covers rewinds reaching a little below the
    last feed; ``can_rewind`` says whether one does. Copying the slots each feed overwrites
    would cost a copy per round and a restore per rewind; the slack costs ``slack`` slots once.

    **Prefix cache.** A windowed cache can resume at position ``t`` only while it holds the
    window before ``t`` (``can_rewind``), or from a ``WindowSnapshot`` taken at ``t``.
    ``snapshot(start, end)`` gives a lazy snapshot of the window before ``end`` when the buffer
    still holds it, else an empty (unrestorable) one. Positions the prefix cache will want
    a window at (``set_pins``) are kept when passed: before the window of a passed pin is
    dropped it is copied out (within a byte budget, the most wanted first), and ``snapshot``
    hands that copy over.
    """

    step = 256
    windowed = True

    def __init__(self, window: int, slack: int = 16) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.slack = slack
        self.headroom = max(self.step // 2, window // 8)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.base = 0  # position of buffer slot 0
        # Lowest position from which [valid_lo, offset) are this branch's keys (>= base).
        self.valid_lo = 0
        self._lazy: weakref.WeakSet[WindowSnapshot] = weakref.WeakSet()
        self._pins: dict[int, WindowSnapshot | None] = {}  # most wanted first
        self._pin_budget: int | None = None

    # ------------------------------------------------------------------ positions
    def window_lo(self, position: int) -> int:
        """First position whose key a row at ``position`` attends to."""
        return max(0, position - self.window + 1)

    def holds(self, position: int) -> bool:
        """The cache could resume at ``position`` (at or below the offset) by an offset move."""
        if not 0 <= position <= self.offset:
            return False
        return position == 0 or self.window_lo(position) >= self.valid_lo

    def can_rewind(self, to: int) -> bool:
        """Whether the cache still holds the window before ``to`` (see ``holds``)."""
        return self.holds(to)

    # ------------------------------------------------------------------ appends
    def _capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _relayout(self, keys: mx.array, values: mx.array, keep_lo: int, needed: int) -> None:
        """A fresh buffer holding positions ``[keep_lo, offset)`` at its front, with room for
        ``needed`` slots in all; windows of pins and lazy snapshots it drops are copied out."""
        offset = self.offset
        dropped = [s for s in self._lazy if s.lo < keep_lo or s.end > offset]
        pinned = {id(s) for s in self._pins.values() if s is not None}
        self._keep_pins([s for s in dropped if id(s) in pinned])
        for snap in dropped:
            snap.materialise()
        steps = (needed + self.headroom + self.step - 1) // self.step
        batch, heads, _, k_dim = keys.shape
        new_k = mx.zeros((batch, heads, steps * self.step, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, steps * self.step, values.shape[3]), values.dtype)
        kept = offset - keep_lo
        if kept > 0:
            a = keep_lo - self.base
            new_k[..., :kept, :] = self.keys[..., a : a + kept, :]
            new_v[..., :kept, :] = self.values[..., a : a + kept, :]
        self.keys, self.values = new_k, new_v
        self.base = keep_lo
        self.valid_lo = max(self.valid_lo, keep_lo)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``[B, H, L, D]``) at ``offset``; return the keys and values
        of positions ``[window_lo(offset), offset + L)``."""
        offset, length = self.offset, keys.shape[2]
        first = self.window_lo(offset)
        if offset > 0 and first < self.valid_lo:
            raise RuntimeError(
                f"sliding-window cache at offset {offset} needs positions from {first} but "
                f"holds them from {self.valid_lo} only (rewound past its window)"
            )
        end = offset + length
        # Lazy windows overlapping the slots about to be written are copied out first.
        for snap in [s for s in self._lazy if s.lo < end and offset < s.end]:
            snap.materialise()
        slot = offset - self.base
        if self.keys is None or slot < 0 or slot + length > self._capacity():
            keep_lo = min(offset, max(self.valid_lo, offset - (self.window - 1) - self.slack))
            self._relayout(keys, values, keep_lo, offset - keep_lo + length)
            slot = offset - self.base
        self.keys[..., slot : slot + length, :] = keys
        self.values[..., slot : slot + length, :] = values
        self.offset = end
        for pin in [p for p, s in self._pins.items() if s is None and offset < p <= end]:
            self._pins[pin] = self._lazy_window(pin, pin)
        a = first - self.base
        return self.keys[..., a : slot + length, :], self.values[..., a : slot + length, :]

    def rewind(self, to: int) -> None:
        """Forget every position at or after ``to`` (an offset move). Rewinding further back
        than the cache holds windows for is allowed (the engine levels caches that way), but
        then the cache cannot take an append until it is restored or rewound to 0."""
        if to < 0 or to > self.offset:
            raise ValueError(f"cannot rewind a cache at offset {self.offset} to {to}")
        self.offset = to
        self.valid_lo = min(self.valid_lo, to)
        for pin in [p for p, s in self._pins.items() if s is not None and p > to]:
            self._pins[pin].close()  # kept for tokens that are now forgotten: take it again
            self._pins[pin] = None

    def reset(self) -> None:
        """Drop the buffers; lazy snapshots are copied out first so they stay valid."""
        self.set_pins(())
        for snap in list(self._lazy):
            snap.materialise()
        self.keys = self.values = None
        self.offset = self.base = self.valid_lo = 0

    # ------------------------------------------------------------------ snapshots
    def _lazy_window(self, start: int, end: int) -> WindowSnapshot:
        snap = WindowSnapshot(start, end, self.window_lo(end), self)
        if snap.lo == end:
            snap.owner = None  # an empty window: nothing to protect
        else:
            self._lazy.add(snap)
        return snap

    def set_pins(self, positions, budget: int | None = None) -> None:
        """Keep the window at each of ``positions`` (most wanted first) once the cache passes
        it (a position at or below the offset whose window is held is kept now); replaces
        earlier pins. A kept window costs nothing while the buffer still holds it; copies of
        the windows it drops stay within ``budget`` bytes, the least wanted giving way."""
        for snap in self._pins.values():
            if snap is not None:
                snap.close()
        self._pins = {}
        self._pin_budget = budget
        for p in positions:
            self._pins[p] = self._lazy_window(p, p) if 0 < p and self.holds(p) else None

    def _keep_pins(self, leaving: list[WindowSnapshot]) -> None:
        """Pinned windows about to leave the buffer: copy out those the budget allows (most
        wanted first, evicting copies of less wanted ones), forget the rest."""
        if self._pin_budget is None:
            return
        rank = {p: i for i, p in enumerate(self._pins)}
        for snap in sorted(leaving, key=lambda s: rank[s.end]):
            size = self.window_nbytes * (snap.end - snap.lo) // max(self.window - 1, 1)
            copies = [s for s in self._pins.values() if s is not None and not s.lazy]
            for other in sorted(copies, key=lambda s: -rank[s.end]):
                if sum(s.nbytes for s in copies) + size <= self._pin_budget:
                    break
                if rank[other.end] < rank[snap.end]:
                    break
                copies.remove(other)
                self._drop_pin(other.end)
            if sum(s.nbytes for s in copies) + size > self._pin_budget:
                self._drop_pin(snap.end)
            else:
                snap.materialise()

    def _drop_pin(self, position: int) -> None:
        snap = self._pins.pop(position)
        if snap is not None:
            snap.close()

    def snapshot(self, start: int, end: int | None = None) -> WindowSnapshot:
        """The window before ``end`` for a trie node ``[start, end)``: a pinned copy, a lazy
        range of the buffer, or an empty snapshot when the window is gone."""
        end, pinned = claim_pin(self._pins, self.offset, start, end)
        if pinned is not None:
            return pinned
        if self.holds(end):
            return self._lazy_window(start, end)
        return WindowSnapshot.empty(start, end)

    def can_restore(self, snap: WindowSnapshot, to: int | None = None) -> bool:
        to = snap.end if to is None else to
        return to == snap.end and snap.restorable and snap.owner in (None, self)

    def restore(self, snap: WindowSnapshot, to: int | None = None) -> None:
        """Resume at ``snap.end`` from its window (``to``, when given, must be ``snap.end``). A
        lazy range of this cache is an offset move; a copy becomes the front of a fresh buffer
        and the snapshot turns lazy again, since the buffer now holds its data."""
        if not self.can_restore(snap, to):
            raise ValueError(f"cannot restore {snap} to {snap.end if to is None else to}")
        if snap.owner is self:
            self.offset = snap.end
            self.valid_lo = snap.lo
            return
        for other in list(self._lazy):
            other.materialise()  # their buffer is replaced
        count = snap.end - snap.lo
        self.offset = self.base = self.valid_lo = snap.lo
        if count == 0:
            self.offset = snap.end
            self.base = self.valid_lo = snap.end
            return
        self._relayout(snap.keys, snap.values, snap.lo, count)
        self.keys[..., :count, :] = snap.keys
        self.values[..., :count, :] = snap.values
        self.offset = snap.end
        snap.owner = self
        self._lazy.add(snap)
        snap._set_copy(None, None)

    # ------------------------------------------------------------------ memory
    @property
    def window_nbytes(self) -> int | None:
        """Bytes of one copied-out window (None until the buffer tells the row size)."""
        if self.keys is None:
            return None
        per_slot = (self.keys.nbytes + self.values.nbytes) // self.keys.shape[2]
        return per_slot * (self.window - 1)
