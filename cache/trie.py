"""A compressed trie over token keys whose nodes hold per-cache snapshots of their edge.

Each node owns the positions ``[start, end)`` spelled by its edge keys and one snapshot per
cache slot covering exactly that range (for a sliding-window cache: the window before ``end``,
possibly empty when it was not kept; see ``cache.window.WindowSnapshot``). The trie knows
nothing of the live caches; the session (``cache/session.py``) decides which path is live and
hands in fresh snapshots.
Memory accounting follows each snapshot's ``on_resize`` hook, so a lazy range that the live
cache copies out later is counted the moment it is copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from cache.kv import KVSnapshot, concat_snapshots
from cache.window import WindowSnapshot

# A full cache's range of the node's positions, or a windowed cache's window at its end.
Snapshot = KVSnapshot | WindowSnapshot
MakeSnapshots = Callable[[int, int], list[Snapshot]]


class Node:
    """One edge of the trie: its keys, the absolute offset where it ends, one snapshot per cache."""

    __slots__ = ("keys", "end", "parent", "children", "snapshots", "last_used", "user")

    def __init__(self, keys: list[int], end: int, parent: Node | None) -> None:
        self.keys = keys
        self.end = end
        self.parent = parent
        self.children: dict[int, Node] = {}  # first key -> child; siblings never share one
        self.snapshots: list[Snapshot] = []
        self.last_used = 0
        self.user = False  # a snapshot at this node's end was asked for: compaction keeps it

    @property
    def start(self) -> int:
        return self.end - len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def __repr__(self) -> str:
        flag = " user" if self.user else ""
        return f"Node([{self.start}, {self.end}){flag}, children={len(self.children)})"


def common_length(edge: list[int], keys: Sequence[int], pos: int, limit: int) -> int:
    """How many leading keys of ``edge`` equal ``keys[pos:limit]``."""
    n = min(len(edge), limit - pos)
    if edge[:n] == keys[pos : pos + n]:
        return n
    i = 0
    while edge[i] == keys[pos + i]:
        i += 1
    return i


class PrefixTrie:
    def __init__(self) -> None:
        self.root = Node([], 0, None)
        self.nbytes = 0  # bytes of copied-out snapshots, kept current by the snapshots' hooks
        self.entries = 0  # nodes other than the root (each holds snapshots)
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ reading
    def match(self, keys: Sequence[int]) -> tuple[list[Node], int]:
        """The path (root first) along the longest stored prefix of ``keys`` and its length.

        The last node of the path may be matched only partly (its end is past the length).
        """
        node, pos, path = self.root, 0, [self.root]
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            common = common_length(child.keys, keys, pos, len(keys))
            path.append(child)
            pos += common
            if common < len(child.keys):
                break
            node = child
        return path, pos

    @staticmethod
    def path_to(node: Node) -> list[Node]:
        """The path from the root to ``node``, root first."""
        path = [node]
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        return path[::-1]

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def recount(self) -> int:
        """Snapshot bytes summed node by node (a check on the running ``nbytes``)."""
        return sum(node.nbytes for node in self.nodes())

    # ------------------------------------------------------------------ snapshots
    def _on_resize(self, delta: int) -> None:
        self.nbytes += delta

    def set_snapshots(self, node: Node, snapshots: list[Snapshot]) -> None:
        """Give ``node`` new snapshots; the old ones are closed. A new snapshot that cannot
        restore (a windowed cache no longer held the window) leaves an old one that can in
        place: both describe the same tokens."""
        old = self._take_snapshots(node)
        if len(old) == len(snapshots):
            for i, (was, new) in enumerate(zip(old, snapshots, strict=True)):
                if not new.restorable and was.restorable and was.end == new.end:
                    new.close()
                    was.start = new.start
                    snapshots[i], old[i] = was, new
        for snap in old:
            snap.close()
        self._attach(node, snapshots)

    def _attach(self, node: Node, snapshots: list[Snapshot]) -> None:
        node.snapshots = snapshots
        for snap in snapshots:
            snap.on_resize = self._on_resize
            self.nbytes += snap.nbytes

    def _take_snapshots(self, node: Node) -> list[Snapshot]:
        """Detach ``node``'s snapshots from the accounting and hand them over."""
        snapshots, node.snapshots = node.snapshots, []
        for snap in snapshots:
            snap.on_resize = None
            self.nbytes -= snap.nbytes
        return snapshots

    def touch(self, node: Node) -> None:
        node.last_used = next(self._clock)

    # ------------------------------------------------------------------ growing
    def add_child(self, parent: Node, keys: list[int], snapshots: list[Snapshot]) -> Node:
        node = Node(keys, parent.end + len(keys), parent)
        parent.children[keys[0]] = node
        self._attach(node, snapshots)
        self.entries += 1
        self.touch(node)
        return node

    def split(self, node: Node, at: int) -> Node:
        """Cut ``node`` at absolute offset ``at``; return the new upper part ``[start, at)``.

        ``node`` keeps the lower part, its children and its ``user`` flag (the flag is about
        its end, which does not move).
        """
        cut = at - node.start
        if not 0 < cut < len(node.keys):
            raise ValueError(f"cannot split {node} at {at}")
        head = Node(node.keys[:cut], at, node.parent)
        head.last_used = node.last_used
        halves = [snap.split(at) for snap in self._take_snapshots(node)]
        self._attach(head, [h for h, _ in halves])
        self._attach(node, [t for _, t in halves])
        node.keys = node.keys[cut:]
        node.parent.children[head.keys[0]] = head
        head.children = {node.keys[0]: node}
        node.parent = head
        self.entries += 1
        return head

    def extend(
        self, frontier: Node, keys: Sequence[int], end: int, live: MakeSnapshots
    ) -> list[Node]:
        """Walk or grow the trie below ``frontier`` along ``keys[frontier.end:end]``.

        The positions walked are live in the caches, so every node on the way gets fresh lazy
        snapshots from ``live(start, end)`` (dropping any copy it held); a partly matching edge
        is split, and what no edge matches becomes one new child (an existing node is never
        extended underneath its snapshots). Returns the nodes walked, the last ending at ``end``.
        """
        node, pos, walked = frontier, frontier.end, []
        while pos < end:
            child = node.children.get(keys[pos])
            if child is None:
                child = self.add_child(node, list(keys[pos:end]), live(pos, end))
                walked.append(child)
                break
            common = common_length(child.keys, keys, pos, end)
            if common < len(child.keys):
                child = self.split(child, pos + common)
            self.set_snapshots(child, live(child.start, child.end))
            walked.append(child)
            node, pos = child, child.end
        return walked

    # ------------------------------------------------------------------ shrinking
    def merge_into_child(self, node: Node) -> Node:
        """Fold a single-child ``node`` into its child; return the child (now starting earlier)."""
        if node is self.root or len(node.children) != 1:
            raise ValueError(f"cannot merge {node}")
        (child,) = node.children.values()
        upper, lower = self._take_snapshots(node), self._take_snapshots(child)
        self._attach(child, [concat_snapshots(u, w) for u, w in zip(upper, lower, strict=True)])
        child.keys = node.keys + child.keys
        child.parent = node.parent
        child.last_used = max(child.last_used, node.last_used)
        node.parent.children[child.keys[0]] = child
        node.children = {}
        self.entries -= 1
        return child

    def remove_leaf(self, node: Node) -> None:
        if node is self.root or node.children:
            raise ValueError(f"cannot remove {node}")
        for snap in self._take_snapshots(node):
            snap.close()
        del node.parent.children[node.keys[0]]
        self.entries -= 1

    def evict(self, budget: int, keep: Sequence[Node]) -> int:
        """Drop or merge nodes until ``nbytes <= budget``; return how many nodes went.

        Candidates are off the ``keep`` path and have at most one child (branch points stay):
        the least recently used first, then the deepest, then the largest. A leaf is removed;
        an interior node folds into its child.
        """
        kept = {id(n) for n in keep}
        gone = 0
        while self.nbytes > budget:
            candidates = [n for n in self.nodes() if len(n.children) <= 1 and id(n) not in kept]
            if not candidates:
                break
            victim = min(candidates, key=lambda n: (n.last_used, -n.end, -n.nbytes))
            if victim.children:
                self.merge_into_child(victim)
            else:
                self.remove_leaf(victim)
            gone += 1
        return gone

    def clear(self) -> None:
        """Forget everything; lazy snapshots stop protecting the live buffers."""
        for node in list(self.nodes()):
            for snap in self._take_snapshots(node):
                snap.close()
        self.root.children = {}
        self.entries = 0
        self.nbytes = 0
