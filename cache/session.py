"""The prefix cache as a request sees it: restore the longest cached prefix, record, page out.

One path of the trie is *live*: its positions are what the cache buffers hold, and its
snapshots are lazy ranges of those buffers. ``begin`` switches the live caches to the best
match (a rewind when it is on the live path, snapshot restores otherwise); ``close`` indexes
what the caches hold after the request and enforces the byte budget.

Sliding-window caches (``RotatingKVCache``: ``windowed``, in ``cache.base``'s interface) hold
only the window before their offset, so their snapshot of a node is the window at the node's
end (``WindowSnapshot``): such a cache can resume at a node end whose window was kept, or by an
offset move while it still holds the window. ``begin`` restores the deepest point at or below
the match that every cache can reach (``cached`` reports it) and pins, in the windowed caches,
the positions where ``close`` will want windows (the snapshot points, where the prompt leaves
the trie, the matched node ends past the restore point), so they are kept when prefill passes
them.

Recurrent layers (``cache.recurrent``) are windowed caches whose "window" is their whole state,
so with any windowed cache a session also wants node boundaries where the next request is
likely to resume, since a state exists only where one was kept: the prompt's end (a regenerated
answer, or a next turn whose history differs from the answer, e.g. a stripped reasoning span),
the point the session itself resumed from (the previous answer's end: an edited last message
goes back there) and, as for every model, the end of the answer (where ``close`` indexes the
caches; the next chat turn resumes there) and every ``snapshot_interval`` tokens of a long
prefill. Their copies count against the byte budget like any other: off the live path whole
nodes go first (``PrefixTrie.evict``), then the windowed copies of the live path itself, least
recently used first (the live path's full-cache ranges cost nothing, its windowed copies do).

With a disk tier (``cache.disk``), ``begin`` first grafts onto the trie what the disk spells of
the prompt past the trie's own match (materialised nodes, restored like any paged-out ones),
and ``close`` hands the disk what the caches hold past what it has.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache.base import BaseCache, BaseSnapshot
from cache.trie import Node, PrefixTrie
from cache.window import WindowSnapshot

if TYPE_CHECKING:
    from cache.disk import DiskCache

log = logging.getLogger("mtp_runner.prefix_cache")

SNAPSHOT_INTERVAL = 2048
# A snapshot this many tokens before the prompt end lets a regenerated last turn (whose final
# template tokens differ) restore almost everything.
PRE_TURN = 4


class CacheDesyncError(RuntimeError):
    """The caches do not hold what the session recorded: a bug in the caller."""


def trie_keys(tokens: Sequence[int], pair: bool) -> list[int]:
    """The trie key of each position: the token, or with ``pair`` the pair (token, next token).

    A draft KV slot S depends on token S+1, so pair keys make every match a valid restore
    point for it: matching k keys verifies k+1 tokens. The last token has no pair key yet.
    ``tokens`` are Python ints below 2**32.
    """
    if not pair:
        return list(tokens)
    return [(a << 32) | b for a, b in zip(tokens, tokens[1:], strict=False)]


def level_caches(caches: Sequence[BaseCache]) -> int:
    """Rest every cache at one offset and return it: the lowest offset, or, where a layer that
    ``keeps_states`` (``cache.recurrent``: ``rewind_points``) holds no state there, the
    deepest position at or below it that every such layer holds (0 at worst). A discarded
    draft head leaves its cache below the target's this way."""
    low = min((c.offset for c in caches), default=0)
    exact = [c for c in caches if c.keeps_states]
    if exact and not all(c.can_rewind(low) for c in exact):
        held = [{p for p in c.rewind_points() if p <= low} for c in exact]
        low = max(set.intersection(*held) | {0})
    for c in caches:
        c.rewind(low)
    return low


class _Slot:
    """One set of live caches (a concurrent sequence's): the trie path its buffers hold, root
    first, and the session open on it."""

    __slots__ = ("caches", "live", "open")

    def __init__(self, caches: list, root: Node) -> None:
        self.caches = list(caches)
        self.live: list[Node] = [root]
        self.open: CacheSession | None = None


class CacheSession:
    """One request's view of the prefix cache; see ``PrefixCache.begin``."""

    def __init__(
        self,
        owner: PrefixCache,
        prompt: list[int],
        cached: int,
        points: list[int],
        boundaries: Sequence[int] = (),
        slot: _Slot | None = None,
        keys: list[int] | None = None,
        from_disk: int = 0,
    ) -> None:
        self._owner = owner
        self._slot = slot
        self.prompt = prompt
        # What the trie keys the prompt by: its ids, or with images each image row's key.
        self.keys = prompt if keys is None else keys
        self.cached = cached  # prompt tokens restored from the cache
        self.from_disk = from_disk  # of those, read from the disk tier for this request
        self.remaining = prompt[cached:]  # still to evaluate; the last one seeds decoding
        self._points = points
        # Where ``close`` keeps node boundaries: the points, and resume points outside them.
        self.boundaries = sorted({*points, *boundaries})
        self.recorded: list[int] = []
        self.closed = False

    def snapshot_points(self) -> list[int]:
        """Ascending absolute offsets past ``cached`` where prefill chunks should end."""
        return list(self._points)

    def record(self, tokens: Sequence[int]) -> None:
        """Generated ids in order, including a final sampled-but-unfed one."""
        self.recorded.extend(map(int, tokens))

    def close(self) -> None:
        """Index what the caches hold and enforce the budget; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._owner._close(self)


class PrefixCache:
    """A trie of token prefixes over the given cache slots, with a budget for paged-out bytes.

    ``caches`` lists every cache slot the model uses (target layers, then draft-head layers);
    they rest at one offset between requests and are touched only through sessions.

    Concurrent sequences each get a set of caches of the same structure (``add_slot``; the
    first is ``caches``). Every set has its own live path; a node a set indexed is a lazy
    range of that set's buffers, and another set restoring it copies the range out first. A
    node on any set's live path is never evicted or folded, since that set extends the trie
    from it.
    """

    def __init__(
        self,
        caches: list[BaseCache],
        budget_bytes: int,
        *,
        pair_keys: bool = False,
        enabled: bool = True,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
        disk: DiskCache | None = None,
    ) -> None:
        if snapshot_interval < 1:
            raise ValueError("snapshot_interval must be positive")
        self.budget_bytes = budget_bytes
        self.pair_keys = pair_keys
        self.enabled = enabled
        self.snapshot_interval = snapshot_interval
        self.trie = PrefixTrie()
        self.slots: list[_Slot] = [_Slot(caches, self.trie.root)]
        self.disk = disk  # the disk tier, or None

    @property
    def caches(self) -> list:
        """The first set's caches."""
        return self.slots[0].caches

    def add_slot(self, caches: list) -> int:
        """Another set of live caches, shaped as the first; returns its index for ``begin``."""
        if len(caches) != len(self.caches) or any(
            type(a) is not type(b) for a, b in zip(caches, self.caches, strict=True)
        ):
            raise ValueError("a cache slot must have the caches of the first, in order")
        self.slots.append(_Slot(caches, self.trie.root))
        return len(self.slots) - 1

    def _kept(self) -> list[Node]:
        """Every set's live path: never evicted, never folded."""
        return [n for slot in self.slots for n in slot.live]

    @property
    def entries(self) -> int:
        """Nodes holding snapshots."""
        return self.trie.entries

    @property
    def nbytes(self) -> int:
        """Bytes of paged-out (copied) snapshots; the live buffers are not counted."""
        return self.trie.nbytes

    def set_pair_keys(self, on: bool) -> None:
        """Switch the key scheme; stored prefixes under the other scheme are dropped."""
        if on != self.pair_keys:
            self.pair_keys = on
            self.clear()

    def clear(self) -> None:
        """Forget every stored prefix (call before resetting the caches to skip copy-outs)."""
        self.trie.clear()
        for slot in self.slots:
            self._unpin(slot)
            slot.live = [self.trie.root]

    # ------------------------------------------------------------------ begin
    def begin(
        self, tokens: Sequence[int], slot: int = 0, keys: Sequence[int] | None = None
    ) -> CacheSession:
        """Restore the longest cached prefix of ``tokens``; at least one token is left to run.

        ``keys`` (as long as ``tokens``) replaces the ids as the trie sees them: a row whose
        state depends on more than its id (an image's row: its features) is keyed by what it
        depends on, a value outside the vocabulary (``runner.images.image_key``).

        With sliding-window caches the restore point is the deepest one at or below the match
        where every cache can resume (a full cache anywhere; a windowed one where it still
        holds the window, or at a node end whose window was kept); ``cached`` says where.
        A session left open by the previous request of the same ``slot`` (``add_slot``) is
        abandoned (its close does nothing).
        """
        prompt = list(map(int, tokens))
        if not prompt:
            raise ValueError("cannot begin a cache session for an empty prompt")
        keyed = prompt if keys is None else list(map(int, keys))
        if len(keyed) != len(prompt):
            raise ValueError(f"{len(keyed)} keys for a prompt of {len(prompt)} tokens")
        at = self.slots[slot]
        if at.open is not None:
            at.open.closed = True
        self._level(at)
        from_disk = 0
        if self.enabled:
            search = trie_keys(keyed, self.pair_keys)
            lo, hi = self._from_disk(search, len(prompt) - 1)
            path, matched = self.trie.match(search)
            cached = self._switch(at, path, min(matched, len(prompt) - 1))
            from_disk = max(0, min(cached, hi) - lo)
            resume = self._resume_points(at, len(prompt), cached)
            points = self._points(len(prompt), cached, resume)
            self._pin(at, path, points, cached, matched, len(prompt), resume)
        else:
            for c in at.caches:
                c.rewind(0)
            at.live = [self.trie.root]
            cached, points, resume = 0, [], []
        at.open = CacheSession(
            self, prompt, cached, points, resume, slot=at, keys=keyed, from_disk=from_disk
        )
        return at.open

    def _on_disk(self) -> bool:
        return self.disk is not None and self.disk.pair_keys == self.pair_keys

    def _from_disk(self, keys: list[int], limit: int) -> tuple[int, int]:
        """Graft what the disk tier has of ``keys[:limit]`` past the trie's match; returns the
        grafted range (empty: none). A node split on the way is put back on the live paths."""
        if not self._on_disk():
            return 0, 0
        try:
            lo, hi = self.disk.graft(self.trie, keys, min(limit, len(keys)))
        except Exception:  # the disk is an optimisation: never fail a request over it
            log.exception("disk cache: restore failed; serving from memory")
            lo = hi = 0
        for slot in self.slots:
            slot.live = self.trie.path_to(slot.live[-1])
        return lo, hi

    @staticmethod
    def _level(at: _Slot) -> None:
        """Rest every cache at the lowest offset and trim the live path to what they hold."""
        low = level_caches(at.caches)
        at.live = [n for n in at.live if n.end <= low]

    def _switch(self, at: _Slot, path: list[Node], matched: int) -> int:
        """Make the caches hold the first ``t`` positions of ``path``, ``t`` the deepest point
        at or below ``matched`` that every cache can reach; return ``t``."""
        common = 0
        for live, node in zip(at.live, path, strict=False):
            if live is not node:
                break
            common += 1
        keep = min(path[common - 1].end, matched)  # what the live buffers hold of the path
        ends = {n.end: n for n in path if n.end <= matched}
        target = 0
        for t in sorted({matched, keep, *ends}, reverse=True):
            if all(self._reaches(i, c, t, keep, ends) for i, c in enumerate(at.caches)):
                target = t
                break
        held = min(target, keep)
        for i, c in enumerate(at.caches):
            if not c.windowed:
                c.rewind(held)
            elif c.can_rewind(target) and target <= keep:
                c.rewind(target)
            else:
                c.restore(ends[target].snapshots[i])
        at.live = [n for n in path[:common] if n.end <= held]
        for node in path[common:]:
            end = min(node.end, target)
            if end <= node.start:
                break
            for c, snap in zip(at.caches, node.snapshots, strict=True):
                if not c.windowed:
                    if snap.owner is not None and snap.owner is not c:
                        snap.materialise()  # another set's live range: copied out first
                    c.restore(snap, end)
            if end == node.end:
                at.live.append(node)
        self.trie.touch(at.live[-1])
        return target

    @staticmethod
    def _reaches(i: int, cache, t: int, keep: int, ends: dict[int, Node]) -> bool:
        """Whether cache slot ``i`` can be brought to ``t``: a full cache anywhere on the path
        (rewind, then the nodes' ranges); a windowed one by an offset move while it holds the
        window before ``t``, or from the window kept at a node ending at ``t``."""
        if not cache.windowed:
            return True
        if t <= keep and cache.can_rewind(t):
            return True
        node = ends.get(t)
        return node is not None and node.snapshots and cache.can_restore(node.snapshots[i])

    def _pin(
        self,
        at: _Slot,
        path: list[Node],
        points: list[int],
        cached: int,
        matched: int,
        length: int,
        resume: Sequence[int] = (),
    ):
        """Ask windowed caches to keep their window where ``close`` may put node boundaries:
        the snapshot points, where the prompt leaves the trie (a split) and the ends of the
        matched nodes past the restore point (their windows get refreshed).

        A kept window becomes a copy of every windowed layer's window once prefill moves past
        it, so each windowed cache keeps its copies within its share of the byte budget, the
        most wanted first: the resume points (the prompt's end, where this session resumed),
        the pre-turn point and the split (regenerated turns and branches), then the others,
        deepest first."""
        windowed = [c for c in at.caches if c.windowed]
        if not windowed:
            return
        pre_turn = length - PRE_TURN - (1 if self.pair_keys else 0)
        held = {n.end for n in at.live}  # a node already keeps the window there
        first = [
            p
            for p in (*resume, pre_turn, matched)
            if 0 < p <= length and p not in held and (cached < p < length or p in resume)
        ]
        rest = set(points) | {n.end for n in path if cached < n.end <= matched}
        order = list(dict.fromkeys([*first, *sorted(rest - set(first), reverse=True)]))
        share = self.budget_bytes // sum(c.layer_count for c in windowed)
        for c in windowed:
            c.set_pins(order, budget=share * c.layer_count)

    @staticmethod
    def _unpin(at: _Slot) -> None:
        for c in at.caches:
            if c.windowed:
                c.set_pins(())

    def _points(self, length: int, cached: int, resume: Sequence[int] = ()) -> list[int]:
        shift = 1 if self.pair_keys else 0
        wanted = set(range(self.snapshot_interval, length, self.snapshot_interval))
        wanted.add(length - PRE_TURN)
        points = {p - shift for p in wanted if cached < p - shift < length}
        return sorted(points | {p for p in resume if cached < p < length})

    def _resume_points(self, at: _Slot, length: int, cached: int) -> list[int]:
        """With windowed caches, the boundaries a later request may resume at besides the
        snapshot points (module docstring), most wanted first: the prompt's end (as its last
        key spells it: one short with pair keys; the restore point of a repeated prompt is
        one short of its end as well) and where this session resumed."""
        if not any(c.windowed for c in at.caches):
            return []
        ends = [length - (1 if self.pair_keys else 0), length - 1, cached]
        return [p for p in dict.fromkeys(ends) if 0 < p <= length]

    # ------------------------------------------------------------------ close
    def _close(self, session: CacheSession) -> None:
        at = session._slot
        if at is None or session is not at.open:
            return
        at.open = None
        try:
            self._check_and_index(at, session)
        finally:
            self._unpin(at)

    def _check_and_index(self, at: _Slot, session: CacheSession) -> None:
        offsets = [c.offset for c in at.caches]
        low = min(offsets, default=0)
        stored = session.keys + session.recorded
        at.live = [n for n in at.live if n.end <= low]
        if offsets and max(offsets) != low:
            raise CacheDesyncError(f"cache slots rest at different offsets: {sorted(set(offsets))}")
        if low > len(stored):
            raise CacheDesyncError(
                f"caches hold {low} positions but only {len(stored)} tokens were recorded"
            )
        if self.enabled:
            self._index(at, session, stored, low)

    def _index(self, at: _Slot, session: CacheSession, stored: list[int], low: int) -> None:
        keys = trie_keys(stored, self.pair_keys)
        indexed = min(low, len(keys))
        at.live = [n for n in at.live if n.end <= indexed]
        # Node boundaries at the requested points the caches passed, then the end.
        wanted = set(session.boundaries)
        for node in at.live[1:]:
            node.user = node.user or node.end in wanted  # e.g. where this session resumed
        stops = sorted({p for p in wanted if at.live[-1].end < p <= indexed})

        def snapshots(start: int, end: int) -> list[BaseSnapshot]:
            return [c.snapshot(start, end) for c in at.caches]

        for stop in [*stops, indexed]:
            if stop > at.live[-1].end:
                at.live += self.trie.extend(at.live[-1], keys, stop, snapshots)
            if stop in stops:
                at.live[-1].user = True
        windowed = [i for i, c in enumerate(at.caches) if c.windowed]
        for node in at.live[1:] if windowed else ():
            if not any(node.snapshots[i].restorable for i in windowed):
                node.user = False  # no window was kept there: compaction may fold it
        self._compact(at)
        self.trie.touch(at.live[-1])
        self.trie.evict(self.budget_bytes, self._kept())
        self._evict_live_windows(at)
        if self._on_disk():
            try:
                self.disk.record(at.caches, at.live, keys, indexed)
            except Exception:
                log.exception("disk cache: recording failed; the prefix stays in memory only")

    def _evict_live_windows(self, at: _Slot) -> None:
        """Over budget with only the live path left: release the windowed copies its nodes
        hold (a recurrent state, a copied-out window), least recently used first, then the
        shallowest; such a node can then be resumed by offset moves only (full caches) and
        compaction may fold it."""
        nodes = sorted(at.live[1:], key=lambda n: (n.last_used, n.end))
        for node in nodes:
            if self.trie.nbytes <= self.budget_bytes:
                return
            windows = [s for s in node.snapshots if isinstance(s, WindowSnapshot) and s.nbytes]
            for snap in windows:
                snap.close()  # its on_resize hook takes the bytes off the trie's count
            if windows:
                node.user = False

    def _compact(self, at: _Slot) -> None:
        """Fold plain (non-user) single-child nodes of the live path into their child (not
        those another set's live path holds)."""
        others = {id(n) for slot in self.slots if slot is not at for n in slot.live}

        def folds(node: Node) -> bool:
            return not node.user and len(node.children) == 1 and id(node) not in others

        path = [at.live[0]]
        for i, node in enumerate(at.live[1:], start=1):
            last = i == len(at.live) - 1
            if not last and folds(node):
                continue  # folded into the next node below
            path.append(node)
        # Merge bottom-up so each merge sees its child already in place.
        for node in reversed(at.live[1:-1]):
            if folds(node):
                self.trie.merge_into_child(node)
        at.live = path
