"""The other ranks' caches as one cache among rank 0's, and their snapshots, held where the
layers are.

``RemoteCaches`` stands in, in rank 0's list of caches, for every later rank's layer caches
of one set: its offset is the one they all rest at (each forward, rewind and restore moves
them together). The prefix cache (``cache.session``) drives it through ``cache.base``'s
interface like any full KV cache, and each call that changes the other ranks' caches is a
command to them (``runner.distributed.channel.Op``). A snapshot is kept on each rank for its
own layers (their ``KVSnapshot`` objects, in ``runner.distributed.follower``) under an id
rank 0 numbers; only the id and the positions cross the link. ``RemoteSnapshot`` is rank 0's
handle: splitting, merging and dropping it are commands too.

The trie's byte budget counts copies, and the other ranks' copies are made where a write
overwrites a lazy range (``cache.kv.KVCache._protect``). Those writes are the forwards and
restores rank 0 itself commands, so ``RemoteCaches`` mirrors which ranges are still lazy and
a ``RemoteSnapshot`` counts the other ranks' bytes of its copy (``row_bytes`` a position)
without asking them. A sliding window's snapshot is only restorable where the window was
kept, which rank 0 would have to ask about: the prefix cache is off over such layers.

Where some of the other ranks' layers are a hybrid's recurrent ones, a set is two caches to
rank 0 (``Link.new_set``): a ``RemoteCaches`` for the others and a ``RemoteStates`` for those,
each command naming its part of the set (``Part``). The prefix cache then restores the first
node by node and the second at a node's end, from the states the ranks kept there
(``RemoteState``), as it does one process's caches of both kinds. Every recurrent layer sees
the same commands, so rank 0 mirrors which states they keep, and which pins they hold,
without asking.

A speculative round uses no more of the contract than plain decoding: a verify is one
multi-row forward, its rejected rows one ``rewind`` (the REWIND command). Where the other
ranks' layers are full or sliding-window attention, ``BaseCache``'s defaults hold for the
set as they do for a ``KVCache``: nothing to ``keep``, every position up to the offset a
rewind point, and a round's rewinds stay within what a sliding window keeps
(``drafting.mlx_ops``); ``RemoteStates`` keeps states as recurrent layers do.

``Link`` is rank 0's end of the channel, through which all of these commands and the
forwards go, each bounded by the watchdog.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import mlx.core as mx

from cache.base import BaseCache, BaseSnapshot
from cache.recurrent import make_room
from cache.window import WindowSnapshot
from runner.distributed.channel import DTYPES, Channel, Command, Op, Part
from runner.distributed.watchdog import Watchdog


class RemoteSnapshot(BaseSnapshot):
    """Positions ``[start, end)`` of the other ranks' caches, kept on those ranks under
    ``number``. ``owner``: the ``RemoteCaches`` whose live buffers still hold the range (no
    copy yet), as for a ``KVSnapshot``."""

    __slots__ = ("link", "number", "start", "end", "dropped")

    def __init__(
        self, link: Link, number: int, start: int, end: int, owner: RemoteCaches | None
    ) -> None:
        self.link, self.number = link, number
        self.start, self.end = start, end
        self.keys = self.values = None  # the data is on the other ranks
        self.on_resize = None
        self.dropped = False
        self.owner = owner if end > start else None  # an empty range has nothing to protect
        if self.owner is not None:
            self.owner._lazy.add(self)

    @property
    def restorable(self) -> bool:
        return True  # a full cache's range, given the prefix before it

    @property
    def nbytes(self) -> int:
        """The other ranks' bytes of the copy (0 while lazy, or once dropped)."""
        if self.dropped or self.owner is not None:
            return 0
        return (self.end - self.start) * self.link.row_bytes

    def _resized(self, before: int) -> None:
        if self.on_resize is not None and self.nbytes != before:
            self.on_resize(self.nbytes - before)

    def materialise(self) -> None:
        """The other ranks copy the range out when their buffer is about to be overwritten
        (their ``KVSnapshot`` does it); this marks the copy made, for the accounting."""
        if self.owner is None:
            return
        before = self.nbytes
        self.owner._lazy.discard(self)
        self.owner = None
        self._resized(before)

    def _relive(self, owner: RemoteCaches) -> None:
        """Restored whole into ``owner``: the other ranks' buffers hold it again and their
        snapshot dropped its copy (``KVCache.restore``)."""
        before = self.nbytes
        self.owner = owner
        owner._lazy.add(self)
        self._resized(before)

    def split(self, at: int) -> tuple[RemoteSnapshot, RemoteSnapshot]:
        """``[start, at)`` and ``[at, end)`` under new ids; this one is dropped."""
        if not self.start < at < self.end:
            raise ValueError(f"cannot split [{self.start}, {self.end}) at {at}")
        head, tail = self.link.new_id(), self.link.new_id()
        self.link.command(Command(Op.SPLIT, offset=at, snap=self.number, head=head, tail=tail))
        owner = self.owner
        self._forget()
        return (
            RemoteSnapshot(self.link, head, self.start, at, owner),
            RemoteSnapshot(self.link, tail, at, self.end, owner),
        )

    def merged(self, tail: BaseSnapshot) -> BaseSnapshot | None:
        """This snapshot and the adjacent ``tail`` as one under a new id (two lazy ranges of
        one set's buffers stay lazy, as ``cache.kv.concat_snapshots`` keeps them); both are
        dropped."""
        if not isinstance(tail, RemoteSnapshot):
            raise TypeError(f"cannot merge a snapshot held by the other ranks with {tail!r}")
        number = self.link.new_id()
        command = Command(Op.MERGE, snap=number, head=self.number, tail=tail.number)
        self.link.command(command)
        owner = self.owner if self.owner is not None and self.owner is tail.owner else None
        self._forget()
        tail._forget()
        return RemoteSnapshot(self.link, number, self.start, tail.end, owner)

    def _forget(self) -> None:
        """Stop counting this handle (the other ranks no longer hold its id)."""
        before = self.nbytes
        if self.owner is not None:
            self.owner._lazy.discard(self)
            self.owner = None
        self.dropped = True
        self._resized(before)
        self.on_resize = None

    def close(self) -> None:
        """Release the other ranks' copy; safe to call twice."""
        if not self.dropped:
            self.link.command(Command(Op.DROP, snap=self.number))
        self._forget()

    def __repr__(self) -> str:
        state = "lazy" if self.lazy else f"{self.nbytes} B"
        return f"RemoteSnapshot({self.number}, [{self.start}, {self.end}), {state})"


class RemoteCaches(BaseCache):
    """The other ranks' caches of one set (module docstring); a full KV cache to the prefix
    cache."""

    def __init__(self, link: Link, number: int, part: Part = Part.ALL) -> None:
        self.link = link
        self.number = number
        self.part = part  # which of the set's layers on the other ranks
        self.offset = 0
        # Snapshots whose range the other ranks' buffers still hold (``RemoteSnapshot``).
        self._lazy: weakref.WeakSet[RemoteSnapshot] = weakref.WeakSet()

    @property
    def state(self) -> list[mx.array]:
        return []  # the other ranks evaluate their own

    @property
    def nbytes(self) -> int:
        return 0  # held by the other ranks

    def fed(self, start: int, count: int) -> None:
        """A forward fed ``count`` rows from ``start`` (a set of full caches keeps them all)."""

    def wrote(self, start: int, end: int) -> None:
        """The other ranks write positions ``[start, end)``: the lazy ranges there are copied
        out first (``KVCache._protect``)."""
        for snap in [s for s in self._lazy if s.start < end and start < s.end]:
            snap.materialise()

    def rewind(self, to: int) -> None:
        if not 0 <= to <= self.offset:
            raise ValueError(f"cannot rewind from {self.offset} to {to}")
        if to != self.offset:
            self.link.command(Command(Op.REWIND, self.number, to, part=self.part))
            self.offset = to

    def reset(self) -> None:
        self.link.command(Command(Op.RESET, self.number, part=self.part))
        self.wrote(0, max((s.end for s in self._lazy), default=0))
        self.offset = 0

    def _snapshot_command(self, start: int, end: int | None) -> tuple[int, int]:
        """Tell the other ranks to keep ``[start, end)`` of this part; its end and new id."""
        end = self.offset if end is None else end
        if not 0 <= start <= end <= self.offset:
            raise ValueError(f"cannot snapshot [{start}, {end}) of caches at offset {self.offset}")
        number = self.link.new_id()
        rows = end - start
        self.link.command(
            Command(Op.SNAPSHOT, self.number, rows, start, snap=number, part=self.part)
        )
        return end, number

    def _restore_command(self, snap: RemoteSnapshot | RemoteState, to: int) -> None:
        number, part = snap.number, self.part
        self.link.command(Command(Op.RESTORE, self.number, offset=to, snap=number, part=part))

    def snapshot(self, start: int, end: int | None = None) -> RemoteSnapshot:
        end, number = self._snapshot_command(start, end)
        return RemoteSnapshot(self.link, number, start, end, self)

    def can_restore(self, snap: BaseSnapshot, to: int | None = None) -> bool:
        to = snap.end if to is None else to
        return (
            isinstance(snap, RemoteSnapshot)
            and not snap.dropped
            and snap.start <= to <= snap.end
            and self.offset >= snap.start
        )

    def restore(self, snap: BaseSnapshot, to: int | None = None) -> None:
        """``KVCache.restore`` on every other rank's caches: an offset move for a range their
        buffers still hold, else the copy written back at ``snap.start``."""
        to = snap.end if to is None else to
        if not self.can_restore(snap, to):
            raise ValueError(f"cannot restore {snap!r} to {to} at offset {self.offset}")
        self._restore_command(snap, to)
        if snap.owner is self:
            self.offset = to
            return
        snap.materialise()  # another set's range: the ranks copy it out first
        self.wrote(snap.start, to)
        self.offset = to
        if to == snap.end and to > snap.start:
            snap._relive(self)


INT32_MAX = (1 << 31) - 1  # a header word


class RemoteState(WindowSnapshot):
    """The other ranks' recurrent states at ``end`` for a trie node ``[start, end)``, kept
    there under ``number`` (their ``RecurrentSnapshot`` objects): restorable at ``end`` only,
    and only where rank 0's mirror says they kept one (else they hold empty placeholders,
    released like the rest); ``size``: their bytes."""

    __slots__ = ("link", "number", "size")

    def __init__(
        self, link: Link, number: int, start: int, end: int, size: int, restorable: bool
    ) -> None:
        super().__init__(start, end, end, None)
        self.link, self.number, self.size = link, number, size
        self.valid = restorable

    @property
    def nbytes(self) -> int:
        return self.size if self.valid else 0

    def materialise(self) -> None:
        """Nothing to copy: the states are the other ranks' own arrays."""

    def close(self) -> None:
        """Release the other ranks' states; safe to call twice."""
        if self.number:
            self.link.command(Command(Op.DROP, snap=self.number))
            self.number = 0
        before = self.nbytes
        self.valid = False
        if self.on_resize is not None and before:
            self.on_resize(-before)
        self.on_resize = None

    def __repr__(self) -> str:
        state = f"{self.nbytes} B" if self.valid else "empty"
        return f"RemoteState({self.number}, [{self.start}, {self.end}), {state})"


class RemoteStates(RemoteCaches):
    """The other ranks' recurrent layers of one set (a hybrid's Gated DeltaNet layers,
    ``cache.recurrent``), beside a ``RemoteCaches`` for their other layers: those return only
    to the positions whose state they kept, so this cache ``keeps_states`` and is
    ``windowed`` to the prefix cache. Every rank's recurrent layers see the same commands,
    so rank 0 mirrors without asking what ``RecurrentCache`` does on each: a feed keeps the
    state it started from and the positions ``keep`` named (``Op.KEEP``) that it passed,
    dropping what the feed before kept; a rewind keeps the kept positions below it; the
    prefix cache's pins (``Op.PINS``) are taken when a feed passes them or at once where a
    state is held, each layer keeping at most ``limit`` copies, the most wanted first (one
    count for every layer: their states have one size), and a snapshot claims the pin at its
    end or the state held there. A mirror that disagreed with a rank would meet a restore
    that rank refuses, which stops it (``runner.distributed.follower.OutOfStep``), never a
    wrong state."""

    windowed = True
    keeps_states = True

    def __init__(self, link: Link, number: int) -> None:
        super().__init__(link, number, Part.STATES)
        self.layer_count = link.state_layers
        self._kept: set[int] = set()
        self._wanted: set[int] = set()
        self._pins: dict[int, bool | None] = {}  # most wanted first; True: a copy is kept
        self._pin_limit: int | None = None

    def keep(self, positions) -> None:
        wanted = sorted({int(p) for p in positions} - self._wanted)
        runs: list[list[int]] = []
        for p in wanted:  # one command per run of consecutive positions
            if runs and p == runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([p, p + 1])
        for start, end in runs:
            command = Command(Op.KEEP, self.number, end - start, start, part=self.part)
            self.link.command(command)
        self._wanted.update(wanted)

    def fed(self, start: int, count: int) -> None:
        end = start + count
        self._kept = {start} | {p for p in self._wanted if start < p < end}
        self._wanted = set()
        for p in [p for p, taken in self._pins.items() if not taken and start < p <= end]:
            self._take_pin(p)

    def _held(self, to: int) -> bool:
        return to in (0, self.offset) or to in self._kept

    def rewind_points(self) -> list[int]:
        return sorted({0, self.offset, *self._kept})

    def can_rewind(self, to: int) -> bool:
        return 0 <= to <= self.offset and self._held(to)

    def rewind(self, to: int) -> None:
        if not self.can_rewind(to):
            raise ValueError(
                f"the other ranks' recurrent layers at {self.offset} hold no state at {to} "
                f"(held: {self.rewind_points()})"
            )
        super().rewind(to)
        self._kept = {p for p in self._kept if p < to}
        self._forget_pins_above(to)

    def reset(self) -> None:
        super().reset()
        self._kept, self._wanted = set(), set()
        self._pins, self._pin_limit = {}, None

    def _forget_pins_above(self, to: int) -> None:
        """Copies of states past ``to`` are of tokens now forgotten: taken again when fed."""
        for p in [p for p, taken in self._pins.items() if taken and p > to]:
            self._pins[p] = None

    # ------------------------------------------------------------------ the prefix cache
    def set_pins(self, positions, budget: int | None = None) -> None:
        """``RecurrentCache.set_pins`` on every other rank's recurrent layers, ``budget``
        (this cache's share: ``layer_count`` layers' worth) as a count of copies a layer."""
        order = list(dict.fromkeys(int(p) for p in positions))
        if not order and not self._pins:
            return  # nothing pinned on the ranks either (a request without a prefix cache)
        size = self.link.state_bytes
        limit = None if budget is None or not size else min(budget // size, INT32_MAX)
        most = -1 if limit is None else limit
        self.link.pins(Command(Op.PINS, self.number, len(order), most, part=self.part), order)
        self._pins, self._pin_limit = {}, limit
        for p in order:
            self._pins[p] = None
            if 0 < p <= self.offset and self._held(p):
                self._take_pin(p)

    def _take_pin(self, position: int) -> None:
        evicted, fits = make_room(self._pins, position, 1, self._pin_limit, lambda _: 1)
        for p in evicted:
            del self._pins[p]
        if fits:
            self._pins[position] = True
        else:
            self._pins.pop(position, None)

    def snapshot(self, start: int, end: int | None = None) -> RemoteState:
        """The other ranks' states at ``end`` for a node ``[start, end)``: a pinned copy or
        a held state, else an empty placeholder (``RecurrentCache.snapshot`` on each)."""
        end = self.offset if end is None else end
        restorable = 0 <= end <= self.offset and (bool(self._pins.get(end)) or self._held(end))
        end, number = self._snapshot_command(start, end)
        self._pins.pop(end, None)  # claimed, or not kept there: the ranks drop it too
        size = self.link.state_bytes if end > 0 else 0
        return RemoteState(self.link, number, start, end, size, restorable)

    def can_restore(self, snap: BaseSnapshot, to: int | None = None) -> bool:
        to = snap.end if to is None else to
        return isinstance(snap, RemoteState) and snap.restorable and to == snap.end

    def restore(self, snap: BaseSnapshot, to: int | None = None) -> None:
        """Resume at ``snap.end`` from the states the other ranks kept there."""
        if not self.can_restore(snap, to):
            raise ValueError(f"cannot restore {snap!r} to {snap.end if to is None else to}")
        self._restore_command(snap, snap.end)
        self.offset = snap.end
        self._kept, self._wanted = set(), set()
        self._forget_pins_above(snap.end)


class Link:
    """Rank 0's end of the channel: every command it sends, each within the watchdog's
    bound."""

    def __init__(
        self,
        channel: Channel,
        watchdog: Watchdog,
        row_bytes: int = 0,
        state_layers: int = 0,
        state_bytes: int = 0,
    ) -> None:
        self.channel = channel
        self.watchdog = watchdog
        self.row_bytes = row_bytes  # the other ranks' cache bytes a position (the accounting)
        # The other ranks' recurrent layers (a set is then a RemoteCaches and a RemoteStates)
        # and the bytes of their states at one position (the accounting).
        self.state_layers = state_layers
        self.state_bytes = state_bytes
        self.sets = 0  # cache sets made so far (their numbers)
        self.snapshots = 0  # snapshot ids given so far

    @property
    def parts(self) -> int:
        """Caches a set is to rank 0 (``new_set``)."""
        return 2 if self.state_layers else 1

    def forward(self, rows: mx.array, parts: Sequence[RemoteCaches]) -> mx.array:
        """The other ranks' layers over ``rows`` ``[1, L, D]`` after the caches of one set
        (its ``parts``): the last rank's output rows."""
        count = rows.shape[1]
        at, layout = parts[0].offset, parts[0].layout
        op = Op.FORWARD if layout is None else Op.FORWARD_PLACED
        command = Command(op, parts[0].number, count, at, DTYPES.index(rows.dtype))
        # Rank 0's own layers first: a failure there leaves the other ranks untouched, while
        # one after the header went out would leave them waiting for rows.
        mx.eval(rows)
        _write(parts, count)
        with self.watchdog.exchange("a forward"):
            self.channel.send_command(command)
            if layout is not None:  # the rows' positions: the other ranks rotate by them
                self.channel.send_table(layout.rows(at, count).tolist())
            self.channel.send_rows(rows)
            back = self.channel.recv_rows(count, rows.dtype)
        _feed(parts, count)
        return back

    def forward_rows(self, rows: mx.array, sets: list[Sequence[RemoteCaches]]) -> mx.array:
        """A shared forward's rows ``[1, R, D]`` through the other ranks' layers, row i after
        ``sets[i]`` (a set's parts): the last rank's output rows."""
        count = rows.shape[1]
        numbers = [parts[0].number for parts in sets]
        if count != len(sets) or len(set(numbers)) != count:
            raise ValueError(f"{count} rows for the sets {numbers}")
        table = [numbers, [parts[0].offset for parts in sets]]
        command = Command(Op.FORWARD_ROWS, rows=count, dtype=DTYPES.index(rows.dtype))
        mx.eval(rows)  # rank 0's own layers first, as for ``forward``
        for parts in sets:
            _write(parts, 1)
        with self.watchdog.exchange("a shared forward"):
            self.channel.send_command(command)
            self.channel.send_table(table)
            self.channel.send_rows(rows)
            back = self.channel.recv_rows(count, rows.dtype)
        for parts in sets:
            _feed(parts, 1)
        return back

    def pins(self, command: Command, positions: list[int]) -> None:
        """A PINS command and its positions (none follow an empty list)."""
        with self.watchdog.exchange("pins"):
            self.channel.send_command(command)
            if positions:
                self.channel.send_table([positions])

    def command(self, command: Command) -> None:
        with self.watchdog.exchange(command.op.name.lower()):
            self.channel.send_command(command)

    def new_set(self) -> list[RemoteCaches]:
        """The other ranks' caches of a new set: one full cache, or, where some of their
        layers are recurrent, their other layers and those (``RemoteStates``)."""
        self.sets += 1
        if not self.state_layers:
            return [RemoteCaches(self, self.sets)]
        return [RemoteCaches(self, self.sets, Part.FULL), RemoteStates(self, self.sets)]

    def new_id(self) -> int:
        """A snapshot id no other snapshot has had (the ranks key their snapshots by it)."""
        self.snapshots += 1
        return self.snapshots


def _write(parts: Sequence[RemoteCaches], count: int) -> None:
    """A feed of ``count`` rows is about to write each part's next positions."""
    for part in parts:
        part.wrote(part.offset, part.offset + count)


def _feed(parts: Sequence[RemoteCaches], count: int) -> None:
    """A feed of ``count`` rows went through every part of a set."""
    for part in parts:
        part.fed(part.offset, count)
        part.offset += count
