"""The one interface every per-layer cache implements, and what the cache kinds share.

There is one cache per model layer, of one of three kinds:

- ``cache.kv.KVCache``: a full-attention layer's keys and values; rewinds anywhere by moving
  its offset, snapshots any range ``[start, end)``.
- ``cache.window.RotatingKVCache``: a sliding-window layer's, bounded by the window; it can
  resume only where it still holds the window before a position, or from a
  ``WindowSnapshot`` taken there.
- ``cache.recurrent.RecurrentCache``: a Gated DeltaNet layer's conv rows and state; it
  returns only to positions whose state it kept, or to a snapshot's end.

Each kind inherits :class:`BaseCache`, so callers (``cache.session``, the round driver's ops,
the models) use its members directly and never probe a cache with ``getattr``. The defaults
are those of a full KV cache; two class flags say how a kind departs from it:

- ``windowed``: the cache resumes only where it holds a window (or a state). The prefix cache
  brings it to a position by an offset move while ``can_rewind`` says it may, else by
  restoring the snapshot kept at a node's end, and asks it with ``set_pins`` to keep its
  window (state) at the positions where it will want snapshots.
- ``keeps_states``: ``rewind`` reaches only the positions ``rewind_points`` lists; before a
  feed whose prefixes it may return to (a verify feed) the caller names them with ``keep``.

:class:`BaseSnapshot` is what every snapshot (``KVSnapshot``, ``WindowSnapshot``,
``RecurrentSnapshot``) shares: the owner while lazy, the copy once materialised, and its
memory accounting. :class:`KVBuffers` holds the key and value buffers of the two attention
kinds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import mlx.core as mx


class BaseSnapshot:
    """What every snapshot shares: its owner while lazy, the copy once materialised, and the
    memory accounting of that copy (``on_resize`` hears every change of ``nbytes``)."""

    __slots__ = ("owner", "keys", "values", "on_resize", "__weakref__")

    @property
    def lazy(self) -> bool:
        """Still a range of its owner's live buffer (no copy held)."""
        return self.owner is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the copy; 0 while lazy (the data lives in the owner's buffer)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def _set_copy(self, keys: mx.array | None, values: mx.array | None) -> None:
        before = self.nbytes
        self.keys, self.values = keys, values
        if self.on_resize is not None and self.nbytes != before:
            self.on_resize(self.nbytes - before)

    def _copied_out(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Materialised: hold ``keys``/``values`` and stop protecting the owner's slots."""
        owner, self.owner = self.owner, None
        owner._lazy.discard(self)
        self._set_copy(keys, values)

    def merged(self, tail: BaseSnapshot) -> BaseSnapshot | None:
        """This snapshot and the adjacent ``tail`` as one, for a kind whose data another
        process holds (``runner.distributed.remote``); None: ``cache.kv.concat_snapshots``
        merges the data here."""
        return None

    def close(self) -> None:
        """Release the data: a lazy range stops protecting the owner's slots."""
        if self.owner is not None:
            self.owner._lazy.discard(self)
            self.owner = None
        self._set_copy(None, None)
        self.on_resize = None


class BaseCache(ABC):
    """The contract of one layer's cache (module docstring); the defaults are a full KV
    cache's: it rewinds to any position at or below its offset, keeps nothing on request, has
    no window and no pins."""

    offset: int
    """Positions the cache holds: the next append is position ``offset``."""

    windowed: bool = False
    """The cache can resume only where it holds a window (or a state): at a position
    ``can_rewind`` accepts, or at the end of a snapshot it ``can_restore``."""

    keeps_states: bool = False
    """The cache rewinds only to positions whose state it kept (``rewind_points``); ``keep``
    names them before a feed."""

    layer_count: int = 1
    """Layers whose caches this one stands for (the other ranks' recurrent layers of a set,
    ``runner.distributed.remote``, are one cache to rank 0): its share of the prefix cache's
    pin budget counts each."""

    layout: object | None = None
    """The position layout of the request the cache serves now (``runner.images``: a prompt
    with images), which every forward over the cache reads for its rows' RoPE positions and
    embeddings; None: row ``i`` sits at position ``i``. Set for a request's life by its
    stream, on every cache of its slot."""

    @property
    @abstractmethod
    def state(self) -> list[mx.array]:
        """The arrays to evaluate so that pending updates are materialised."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the cache holds (buffer capacity, kept states, pinned copies)."""

    @abstractmethod
    def rewind(self, to: int) -> None:
        """Forget every position at or after ``to`` (``0 <= to <= offset``)."""

    def can_rewind(self, to: int) -> bool:
        """Whether the cache can resume at ``to`` by a rewind; a full cache holds every
        position below its offset."""
        return 0 <= to <= self.offset

    def rewind_points(self) -> Sequence[int]:
        """Every position ``rewind`` accepts, ascending; a cache that does not
        ``keeps_states`` accepts any up to its offset."""
        return range(self.offset + 1)

    def keep(self, positions: Iterable[int]) -> None:
        """Keep the state at each of ``positions`` (absolute) when the next feed passes it,
        so ``rewind`` can return there; a no-op unless the cache ``keeps_states``."""
        return None  # every position below the offset stays held

    @abstractmethod
    def snapshot(self, start: int, end: int | None = None) -> BaseSnapshot:
        """What a trie node spanning ``[start, end)`` keeps of this cache (``end`` defaults to
        the offset): a lazy range, a copy, or, for a windowed cache, the window (state) at
        ``end``, possibly an unrestorable placeholder."""

    @abstractmethod
    def can_restore(self, snap: BaseSnapshot, to: int | None = None) -> bool:
        """Whether ``restore(snap, to)`` may be called now."""

    @abstractmethod
    def restore(self, snap: BaseSnapshot, to: int | None = None) -> None:
        """Make the cache hold the snapshot's positions up to ``to`` (default ``snap.end``);
        ``offset`` becomes ``to``."""

    @abstractmethod
    def reset(self) -> None:
        """Back to an empty cache at offset 0 (snapshots of it stay valid)."""

    def set_pins(self, positions: Iterable[int], budget: int | None = None) -> None:
        """Keep the window (state) at each of ``positions``, most wanted first, once the cache
        passes it, within ``budget`` bytes of copies; replaces earlier pins. A no-op unless
        the cache is ``windowed``."""
        return None  # no window to keep

    def window_lo(self, position: int) -> int:
        """First position whose key a row at ``position`` attends to: 0 without a window."""
        return 0


class KVBuffers(BaseCache):
    """The key and value buffers an attention cache appends into (None until the first)."""

    keys: mx.array | None
    values: mx.array | None

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
