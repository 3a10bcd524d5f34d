"""The cache of a recurrent (Gated DeltaNet) layer: a state, not a sequence of positions.

A linear-attention layer carries two arrays from one position to the next: the last ``K - 1``
rows it fed to its causal convolution (``conv``, ``[B, K - 1, C]``) and the float32 state of
its recurrence (``state``, ``[B, Hv, Dk, Dv]``). Unlike a ``KVCache`` it cannot rewind by
moving an offset: an earlier position is reachable only where its state was kept.

**Kept states.** Every feed keeps the state it started from and the states after any rows it
was asked for (:meth:`RecurrentCache.keep`, one-shot, e.g. every prefix of a verify feed; the
layer computes them in the same forward, ``runner.models.gated_delta``), dropping what the
feed before kept. ``can_rewind(to)`` holds for the current offset, 0 (the zero state) and
those positions; rewinding anywhere else raises, naming what is kept. So an unfed EOS (a
rewind by one row) and a rejected draft suffix are exact, and nothing else pretends to be.

**Prefix cache.** The cache is ``windowed`` and ``keeps_states`` (``cache.base``): it resumes
only at certain positions, as ``RotatingKVCache`` does, and rewinds only to kept ones. Its
trie snapshot of a node is the whole state at the node's end (:class:`RecurrentSnapshot`, a
``WindowSnapshot`` with no window, restorable at ``end`` only), or an empty placeholder where
no state was kept. ``set_pins`` names positions the prefix cache will want snapshots at; when
a feed passes one the layer computes the state there too and the cache keeps a copy, within a
byte budget, the most wanted first. MLX arrays are immutable values, so a kept state or a
snapshot is a reference to arrays no later feed writes: no copy is ever made, and a snapshot
costs its state's bytes from the moment it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mlx.core as mx

from cache.base import BaseCache
from cache.window import WindowSnapshot, claim_pin

# (conv rows, recurrent state); (None, None) is the zero state of position 0.
State = tuple[mx.array | None, mx.array | None]
_ZERO: State = (None, None)


def _bytes(state: State) -> int:
    return sum(a.nbytes for a in state if a is not None)


def make_room(
    pins: dict[int, object | None],
    position: int,
    size: int,
    budget: int | None,
    size_of: Callable[[object], int],
) -> tuple[list[int], bool]:
    """Room for a copy of ``size`` for the pin at ``position`` within ``budget``: the less
    wanted taken pins to give up, least wanted first (``pins`` are most wanted first, a taken
    one holds its copy, ``size_of`` gives its size), and whether the copy fits once they are
    gone (they go even when it does not: each is less wanted than the new copy)."""
    if budget is None:
        return [], True
    rank = {p: i for i, p in enumerate(pins)}
    taken = [p for p, copy in pins.items() if copy is not None]
    used = sum(size_of(pins[p]) for p in taken)
    evicted = []
    for other in sorted(taken, key=lambda p: -rank[p]):
        if used + size <= budget or rank[other] < rank[position]:
            break
        used -= size_of(pins[other])
        evicted.append(other)
    return evicted, used + size <= budget


class RecurrentSnapshot(WindowSnapshot):
    """A recurrent layer's whole state at position ``end`` (for a trie node ``[start, end)``):
    restorable at ``end`` only. ``keys`` holds the conv rows and ``values`` the recurrent
    state (the slots ``WindowSnapshot`` accounts and releases); both None for position 0."""

    __slots__ = ()

    def __init__(self, start: int, end: int, state: State) -> None:
        super().__init__(start, end, end, None)
        self.keys, self.values = state
        self.valid = True

    @property
    def state(self) -> State:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return _bytes(self.state)

    def materialise(self) -> None:
        """Nothing to copy: the arrays are already this snapshot's own."""

    def __repr__(self) -> str:
        state = f"{self.nbytes} B" if self.valid else "closed"
        return f"RecurrentSnapshot([{self.start}, {self.end}), {state})"


class RecurrentCache(BaseCache):
    """The conv rows and recurrent state of one linear-attention layer (module docstring).

    The layer calls :meth:`wanted` before a feed of ``L`` rows (which row counts to return
    states after), then :meth:`update` with the new state and those states.
    """

    windowed = True  # resumes only where a state is held
    keeps_states = True  # rewinds only to the offset, 0 and the positions keep() named

    def __init__(self) -> None:
        self.offset = 0
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        self._kept: dict[int, State] = {}  # rewind targets besides the offset and 0
        self._wanted: set[int] = set()  # keep(): absolute positions, for the next feed only
        self._pins: dict[int, RecurrentSnapshot | None] = {}  # most wanted first
        self._pin_budget: int | None = None
        self._pin_limit: int | None = None

    # ------------------------------------------------------------------ feeding
    @property
    def current(self) -> State:
        return self.conv, self.recurrent

    def keep(self, positions: Iterable[int]) -> None:
        """Keep the state at each of ``positions`` (absolute) when the next feed passes it,
        so that ``rewind`` can return there (e.g. every prefix of a verify feed)."""
        self._wanted.update(int(p) for p in positions)

    def wanted(self, length: int) -> list[int]:
        """Ascending row counts ``r`` (``1 <= r < length``) after which the next feed of
        ``length`` rows must hand back its state: kept positions asked for and pins not yet
        taken. The state after the last row is the new current state anyway."""
        end = self.offset + length
        pins = {p for p, snap in self._pins.items() if snap is None}
        return sorted(p - self.offset for p in self._wanted | pins if self.offset < p < end)

    def update(
        self, conv: mx.array, recurrent: mx.array, length: int, states: dict[int, State]
    ) -> None:
        """Advance by ``length`` rows to the state ``(conv, recurrent)``; ``states`` maps row
        counts (those of :meth:`wanted`) to the states after them."""
        start, end = self.offset, self.offset + length
        kept = {start: self.current}
        for r, state in states.items():
            if start + r in self._wanted:
                kept[start + r] = state
        self._kept = kept
        self._wanted = set()
        self.conv, self.recurrent, self.offset = conv, recurrent, end
        for p in [p for p, snap in self._pins.items() if snap is None and start < p <= end]:
            state = self.current if p == end else states.get(p - start)
            if state is not None:
                self._take_pin(p, state)

    # ------------------------------------------------------------------ rewinding
    def _held(self, to: int) -> State | None:
        if to == self.offset:
            return self.current
        if to == 0:
            return _ZERO
        return self._kept.get(to)

    def rewind_points(self) -> list[int]:
        """Every position ``rewind`` can return to, ascending: 0, the kept ones, the offset."""
        return sorted({0, self.offset, *self._kept})

    def can_rewind(self, to: int) -> bool:
        """Whether the state at ``to`` is held: the offset, 0, or a kept position."""
        return 0 <= to <= self.offset and self._held(to) is not None

    def rewind(self, to: int) -> None:
        """Return to the held state at ``to``; raises ``ValueError`` where none is held (a
        recurrent state cannot be recomputed by moving an offset)."""
        if not 0 <= to <= self.offset:
            raise ValueError(f"cannot rewind a cache at offset {self.offset} to {to}")
        state = self._held(to)
        if state is None:
            raise ValueError(
                f"recurrent cache at offset {self.offset} holds no state at {to} (held: "
                f"{self.rewind_points()}); restore a snapshot taken there, or rewind to a "
                "held position"
            )
        self.conv, self.recurrent = state
        self.offset = to
        self._kept = {p: s for p, s in self._kept.items() if p < to}
        for p in [p for p, snap in self._pins.items() if snap is not None and p > to]:
            self._pins[p].close()  # a state of tokens now forgotten: take it again
            self._pins[p] = None

    def reset(self) -> None:
        """Back to the zero state at offset 0, nothing kept, no pins."""
        self.set_pins(())
        self.conv = self.recurrent = None
        self.offset = 0
        self._kept, self._wanted = {}, set()

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, start: int, end: int | None = None) -> WindowSnapshot:
        """The state at ``end`` (default: the offset) for a trie node ``[start, end)``: a
        pinned copy, a held state, or an empty (unrestorable) placeholder."""
        end, pinned = claim_pin(self._pins, self.offset, start, end)
        if pinned is not None:
            return pinned
        state = self._held(end)
        if state is None:
            return WindowSnapshot.empty(start, end)
        return RecurrentSnapshot(start, end, state)

    def can_restore(self, snap: WindowSnapshot, to: int | None = None) -> bool:
        to = snap.end if to is None else to
        return isinstance(snap, RecurrentSnapshot) and snap.restorable and to == snap.end

    def restore(self, snap: WindowSnapshot, to: int | None = None) -> None:
        """Resume at ``snap.end`` from its state (``to``, when given, must be ``snap.end``)."""
        if not self.can_restore(snap, to):
            raise ValueError(f"cannot restore {snap} to {snap.end if to is None else to}")
        self.conv, self.recurrent = snap.state
        self.offset = snap.end
        self._kept, self._wanted = {}, set()
        for p in [p for p, s in self._pins.items() if s is not None and p > snap.end]:
            self._pins[p].close()
            self._pins[p] = None

    # ------------------------------------------------------------------ pins
    def set_pins(
        self, positions: Iterable[int], budget: int | None = None, limit: int | None = None
    ) -> None:
        """Keep a snapshot of the state at each of ``positions`` (most wanted first) once a
        feed passes it (one held now is taken now), within ``budget`` bytes of copies or
        ``limit`` copies (None: no limit); replaces earlier pins. A count is how another
        process that mirrors the pins (``runner.distributed.remote``) bounds them without
        knowing this layer's state size."""
        for snap in self._pins.values():
            if snap is not None:
                snap.close()
        self._pins = {}
        self._pin_budget, self._pin_limit = budget, limit
        for p in positions:
            p = int(p)
            self._pins[p] = None
            held = self._held(p) if 0 < p <= self.offset else None
            if held is not None:
                self._take_pin(p, held)

    def _take_pin(self, position: int, state: State) -> None:
        """Keep ``state`` for the pin at ``position``, evicting less wanted pinned copies if
        the budget requires; a pin that does not fit is dropped."""
        if self._pin_limit is None:
            size, budget, size_of = _bytes(state), self._pin_budget, lambda s: s.nbytes
        else:  # a count of copies (every state of a layer has the same size)
            size, budget, size_of = 1, self._pin_limit, lambda s: 1
        evicted, fits = make_room(self._pins, position, size, budget, size_of)
        for p in evicted:
            self._pins.pop(p).close()
        if fits:
            self._pins[position] = RecurrentSnapshot(position, position, state)
        else:
            self._pins.pop(position, None)

    # ------------------------------------------------------------------ memory
    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a feed (current and kept states, pinned copies)."""
        arrays = [a for a in self.current if a is not None]
        for state in self._kept.values():
            arrays.extend(a for a in state if a is not None)
        for snap in self._pins.values():
            if snap is not None:
                arrays.extend(a for a in snap.state if a is not None)
        return arrays

    @property
    def nbytes(self) -> int:
        """Bytes of every distinct array the cache holds (current and kept states, pins)."""
        return sum({id(a): a.nbytes for a in self.state}.values())
