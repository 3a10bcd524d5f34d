"""A cache slot: one set of caches a request decodes into, and its life on the prefix cache.

The engine makes one slot per request it can decode at once (``--parallel``): the target's
layer caches, then the draft cache when the model has a head. ``index`` names the slot to the
prefix cache (``PrefixCache.add_slot``), which restores a request's cached prefix into it
(``begin``) and takes the request's new states back when it ends (``close``). After a failure
mid-forward the slot's caches cannot be trusted: ``invalidate`` resets them and makes the
prefix cache forget everything, since its ranges may live in them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cache.ledger import Outcome
from cache.session import CacheDesyncError, CacheSession, PrefixCache, level_caches

log = logging.getLogger("mtp_runner.cache_slot")


class CacheSlot:
    """The target caches (``caches``), the draft cache (``draft``, or None) and the prefix
    cache that restores into them (set once the engine has made it)."""

    def __init__(self, index: int, caches: list, draft: object | None = None) -> None:
        self.index = index
        self.caches = caches
        self.draft = draft
        self.prefix: PrefixCache | None = None

    @property
    def all(self) -> list:
        return [*self.caches] + ([self.draft] if self.draft is not None else [])

    def begin(self, prompt: Sequence[int], keys: Sequence[int] | None = None) -> CacheSession:
        """Restore the longest cached prefix of ``prompt`` (keyed by ``keys``, see
        ``PrefixCache.begin``) into this slot."""
        return self.prefix.begin(prompt, self.index, keys)

    def close(self, session: CacheSession, outcome: Outcome) -> None:
        """Hand the prefix cache what the request left in the caches: the generated tokens
        they hold and the final sampled one. A discarded draft head stops short of the
        target, so every cache first rests where all of them can (recurrent layers: a
        position they kept, ``cache.session.level_caches``)."""
        tail = list(outcome.fed)
        if outcome.final is not None:
            tail.append(outcome.final)
        level_caches(self.all)
        session.record(tail)
        try:
            session.close()
        except CacheDesyncError:
            log.exception("cache ledgers disagree; dropping the prefix cache")
            self.invalidate()

    def invalidate(self) -> None:
        """The caches start over and the prefix cache forgets everything."""
        self.prefix.clear()
        for c in self.all:
            c.reset()
