"""The per-request MTP draft session: pairs, the pending flush, settle and propose.

Draft KV slot S holds the pair (embedding of token S+1, target hidden at S), so a pair
completes only when the token after S is known. Completed pairs wait in a pending list and
reach the head in ONE batched forward (at the committed draft offset) when ``flush_at`` are
pending, at ``settle``, when a round proposes, or at ``close``. Drafting writes speculative
entries above the committed offset; the next flush rewinds them and writes the verified
pairs from target hiddens, so the head's own hiddens never enter the committed draft KV.

Behind a verify feed of its drafts the session can write ahead the pairs the feed may commit
(``prepare``): candidates above the committed offset, adopted as verified by the reports whose
tokens they drew, dropped (the cache rewound to the offset) by any other report, a flush,
``close`` or ``discard``.

Nothing here waits on the stream: the caller evaluates drafts together with verification
(one host sync per round). The session tracks two offsets:

    frontier   the slot after the last token reported through ``committed``
    offset     draft KV slots holding verified pairs; offset + pending <= frontier
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from cache.kv import KVCache

# Pending pairs that trigger a flush. A batched head forward costs less per pair as the batch
# grows until the attention over the batch dominates (around a hundred pairs on the default
# model's head): a larger cap buys nothing, while a 256-pair flush stays within about one
# target decode step and bounds the target hiddens held alive by pending pairs.
FLUSH_AT = 256


class Sampler(Protocol):
    """What ``propose`` needs from ``runner.sampler.Sampler`` (see docs/INTERNALS.md): the
    request's draw of the token at a slot (``drafting.accept``: the head drafts with the same
    noise the target draws with). For a head with a draft vocabulary of distinct ids the
    logits are that vocabulary's, described by ``columns`` (``drafting.columns.Columns``; not
    passed otherwise), greedy draws included."""

    def tokens(self, logits: mx.array, chain: Any, *, slot: int, **columns: Any) -> mx.array: ...


class Head(Protocol):
    """What the session needs from ``drafting.head.MTPHead``."""

    feature_width: int  # the width of the target rows it reads

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: Any) -> mx.array: ...

    def draft_logits(self, y: mx.array, unembed: Callable[[mx.array], mx.array]) -> mx.array: ...


# constrain(step, previous draft or None) -> (allowed tokens bool [V] or None, forced token or None)
Constrain = Callable[[int, "mx.array | None"], "tuple[mx.array | None, int | None]"]


@dataclass
class _Candidates:
    """Head outputs written ahead for the pairs a verify feed may commit (``prepare``): output
    row j is the pair at slot ``slot + j`` of the feed's target row ``first + j`` with the
    target's draw there, ``draws[first + j]``. Their draft KV entries lie above the committed
    offset until a report adopts them."""

    slot: int
    outputs: mx.array  # [1, n, D]
    draws: mx.array  # the feed's draws, as the feed evaluates them (read after its sync)
    current: int  # the feed's first token, which completed the pair below ``slot``
    first: int = 0
    _host: list[int] | None = None

    def tokens(self) -> list[int]:
        """The candidates' tokens, from the feed's evaluated draws (no graph is waited on)."""
        if self._host is None:
            self._host = [int(t) for t in self.draws.tolist()]
        return self._host[self.first :]

    def after(self, taken: int) -> _Candidates | None:
        """The candidates left once the first ``taken`` became verified pairs."""
        if taken == 0:
            return self
        if taken >= self.outputs.shape[1]:
            return None
        left = _Candidates(
            self.slot + taken,
            self.outputs[:, taken:],
            self.draws,
            self.tokens()[taken - 1],  # the last adopted pair's token
            self.first + taken,
        )
        left._host = self._host
        return left


@dataclass
class Proposal:
    """k drafted tokens (lazy), for slots ``slot .. slot + k - 1``."""

    tokens: mx.array  # [k] int32
    slot: int


def _as_ids(tokens: int | Sequence[int] | mx.array) -> mx.array:
    if isinstance(tokens, int):
        return mx.array([tokens], dtype=mx.int32)
    if isinstance(tokens, mx.array):
        return tokens.reshape(-1).astype(mx.int32)
    return mx.array([int(t) for t in tokens], dtype=mx.int32)


class DraftSession:
    """One request's view of the draft head and its KV cache (opened before prefill).

    Opens at the draft cache's current offset (a restored prefix): those pairs are trusted
    and reports that overlap them are skipped.
    """

    source = "head"  # the drafter its rounds count under in ``done.speculation.sources``

    def __init__(
        self,
        head: Head,
        cache: KVCache,
        unembed: Callable[[mx.array], mx.array],
        *,
        flush_at: int = FLUSH_AT,
    ) -> None:
        if flush_at < 1:
            raise ValueError(f"flush_at must be >= 1, got {flush_at}")
        self.head = head
        self.cache = cache
        self.unembed = unembed
        self.flush_at = flush_at
        self._offset = cache.offset
        self._frontier = cache.offset
        self._frontier_hidden: mx.array | None = None  # [D], target hidden at frontier - 1
        self._pending_tokens: list[mx.array] = []
        self._pending_hiddens: list[mx.array] = []
        self._pending = 0
        # Last output row of the last flush and the slot it was written at: when that slot
        # is frontier - 1 the row already predicts the token after the current one.
        self._held: mx.array | None = None
        self._held_slot = -1
        self._candidates: _Candidates | None = None
        self._discarded = False

    # -- state, for the round driver and tests --------------------------------------------

    @property
    def primed(self) -> bool:
        """Something was committed in this session, so a frontier hidden exists."""
        return self._frontier_hidden is not None

    @property
    def offset(self) -> int:
        """Draft KV slots holding verified pairs."""
        return self._offset

    @property
    def frontier(self) -> int:
        return self._frontier

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def discarded(self) -> bool:
        return self._discarded

    # -- reports from the decoder -----------------------------------------------------------

    def committed(self, tokens: Sequence[int] | mx.array, hiddens: mx.array, position: int) -> None:
        """Report a run the target caches now hold: ``tokens`` at slots ``position..``, with
        ``hiddens`` (``[L, D]`` or ``[1, L, D]``) the target's hiddens of those tokens.

        Token i completes the pair of slot position + i - 1 (token 0 with the frontier
        hidden); pairs already written or pending are skipped. Reporting past the frontier
        leaves slots unreported: a gap, which is a caller bug.
        """
        ids = _as_ids(tokens)
        count = ids.shape[0]
        rows = hiddens.reshape(-1, hiddens.shape[-1])
        if rows.shape[0] != count:
            raise ValueError(f"{count} tokens but {rows.shape[0]} hidden rows")
        if rows.shape[-1] != self.head.feature_width:  # a fused head's rows carry its streams
            raise ValueError(
                f"target rows of width {rows.shape[-1]}; the head reads {self.head.feature_width}"
            )
        if count == 0:
            return
        if position > self._frontier or position < 0:
            raise ValueError(
                f"pair gap: run at slot {position} but slots up to {self._frontier} reported"
            )
        end = position + count
        if not self._discarded:
            self._adopt_run(tokens, position, count)
            # Index in the run of the first token whose pair is neither written nor pending.
            first = self._offset + self._pending + 1 - position
            if first == 0 and self._frontier_hidden is None:
                raise ValueError(f"pair gap: no target hidden for slot {position - 1}")
            if first < count:
                lookahead = ids[first:]
                paired = rows[max(first - 1, 0) : count - 1]
                if first == 0:
                    paired = mx.concatenate([self._frontier_hidden[None], paired])
                self._queue(lookahead, paired)
        if end >= self._frontier:
            self._frontier = end
            self._frontier_hidden = rows[count - 1]
        if self._pending >= self.flush_at:
            self._flush(background=True)

    def settle(self, next_token: int | mx.array) -> None:
        """Complete the frontier pair with the token that follows the frontier, then flush."""
        if not self._discarded:
            self._settle(next_token, background=True)

    def close(self) -> None:
        """Flush what is pending. After ``settle(final token)`` the draft cache rests at the
        target's offset."""
        if not self._discarded:
            self.forget_prepared()
            self._flush(background=True)
        self._held = None
        self._frontier_hidden = None

    def discard(self) -> None:
        """Head failure: no more head calls in this request. Pending pairs are dropped and
        speculative entries rewound; the draft cache keeps only the pairs flushed before,
        so it rests below the target and must not be trusted as a restore point."""
        self._discarded = True
        self._pending_tokens.clear()
        self._pending_hiddens.clear()
        self._pending = 0
        self._held = None
        self._frontier_hidden = None
        self._candidates = None
        if self.cache.offset > self._offset:
            self.cache.rewind(self._offset)

    # -- drafting ---------------------------------------------------------------------------

    def propose(
        self,
        current: int | mx.array,
        k: int,
        sampler: Sampler,
        *,
        slot: int,
        constrain: Constrain | None = None,
    ) -> Proposal | None:
        """Draft ``k`` tokens after ``current`` (the emitted, not yet forwarded token); draft i
        (from 0) is drawn for cache slot ``slot + i``.

        None when the session cannot draft (nothing committed yet, discarded, k < 1): the
        caller decodes plainly. Settling with ``current`` flushes the pending pairs; that
        flush's last row is the first draft step. Step i feeds draft i-1 with the head's own
        previous output, writing speculative draft KV entries above the committed offset.
        ``constrain(i, previous_draft)`` (constrained output) gives step i's allowed tokens
        (bool ``[V]``, None: any) and the one token a grammar forces there, drafted as it is.
        """
        if self._discarded or k < 1 or self._frontier_hidden is None:
            return None
        self._settle(current, background=False)
        self.forget_prepared()  # and the last proposal's speculative entries
        if self._held is None or self._held_slot != self._frontier - 1:
            return None
        y = self._held
        columns = getattr(self.head, "draft_columns", None)
        drafts: list[mx.array] = []
        for step in range(k):
            if step:
                y = self.head(drafts[-1].reshape(1, 1), y, self.cache)
            allowed = None
            if constrain is not None:
                allowed, only = constrain(step, drafts[-1] if drafts else None)
                if only is not None:
                    drafts.append(mx.array([only], dtype=mx.int32))
                    continue
            chain = mx.concatenate(drafts) if drafts else mx.zeros((0,), dtype=mx.int32)
            if columns is None:
                logits = self.head.draft_logits(y[0, -1:], self.unembed)
                drawn = {}
            else:  # drawn from the draft vocabulary's own logits, no full-vocabulary row
                logits = self.head.logits(y[0, -1:], self.unembed)
                allowed = None if allowed is None else allowed[self.head.draft_vocab_ids]
                drawn = {"columns": columns}
            if allowed is not None:
                logits = mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
            drafts.append(sampler.tokens(logits, chain, slot=slot + step, **drawn).reshape(1))
        return Proposal(tokens=mx.concatenate(drafts), slot=slot)

    # -- internals --------------------------------------------------------------------------

    def _settle(self, next_token: int | mx.array, background: bool) -> None:
        if self._frontier_hidden is not None and self._offset + self._pending == self._frontier - 1:
            if self._adopt_frontier(next_token):
                return
            self._queue(_as_ids(next_token), self._frontier_hidden[None])
        self._flush(background)

    # -- pairs written ahead of a verify feed's sync ----------------------------------------

    def prepare(self, current: int, rows: mx.array, draws: mx.array, position: int) -> bool:
        """A verify feed of ``current`` and the drafts just proposed, at target ``position``,
        was dispatched, with target rows ``rows`` ``[n, W]`` and the target's draws ``draws``
        ``[n]`` (lazy): write the pairs it may commit in one head forward now, behind the
        feed on the stream.

        Row j pairs the feed's row j with the draw at the next slot; when j drafts are
        accepted, draft i equals draw i - 1 for every i <= j, so rows 0..j are exactly the
        pairs the round commits and the frontier pair after it, whatever j turns out to be.
        The host builds this forward while the feed computes, and after the sync the next
        draft needs only its logits: the head's graph building and its forward leave the gap
        between two feeds. Rows past the acceptance are computed for nothing, and a report
        that does not match them drops them (``_adopt_run``, ``_adopt_frontier``). False when
        the session is not where ``propose`` leaves it (every pair up to ``position`` written,
        none pending): nothing is written."""
        if (
            self._discarded
            or self._frontier != position
            or self._offset != position
            or self._pending
            or self.cache.offset < self._offset
        ):
            return False
        self.forget_prepared()  # and the proposal's speculative entries
        y = self.head(
            draws.reshape(1, -1).astype(mx.int32), rows.reshape(1, -1, rows.shape[-1]), self.cache
        )
        self._candidates = _Candidates(position, y, draws, current=int(current))
        mx.async_eval(y, self.cache.state)
        return True

    def _adopt_run(self, tokens, position: int, count: int) -> None:
        """A run reported at ``position``: the candidates of the slots its tokens complete
        become verified pairs when their draws are those tokens (all but the frontier pair,
        which waits for the token after the run). Any other report drops them."""
        c = self._candidates
        if c is None:
            return
        if (
            isinstance(tokens, mx.array)
            or position != c.slot
            or self._offset != c.slot
            or self._pending
            or count - 1 > c.outputs.shape[1]
            or int(tokens[0]) != c.current
        ):
            self.forget_prepared()
            return
        taken = count - 1  # token 0 completed the pair below c.slot already
        if [int(t) for t in tokens[1:]] != c.tokens()[:taken]:
            self.forget_prepared()
            return
        self._offset += taken
        self._candidates = c.after(taken)

    def _adopt_frontier(self, next_token: int | mx.array) -> bool:
        """The frontier pair completed by ``next_token``: its candidate's output becomes the
        held row (the first draft step) when the candidate drew that token."""
        c = self._candidates
        if c is None:
            return False
        if (
            isinstance(next_token, mx.array)
            or self._pending
            or c.slot != self._offset
            or c.slot != self._frontier - 1
            or c.tokens()[0] != int(next_token)
        ):
            self.forget_prepared()
            return False
        self._offset += 1
        self._held = c.outputs[:, :1]
        self._held_slot = c.slot
        self.forget_prepared()  # the entries past it were drawn for other outcomes
        return True

    def forget_prepared(self) -> None:
        """No candidates any more, and no draft KV entry above the committed offset: a
        proposal's chain, candidates, what a ``prepare`` that failed part-way wrote."""
        self._candidates = None
        if self.cache.offset > self._offset:
            self.cache.rewind(self._offset)

    def _queue(self, tokens: mx.array, hiddens: mx.array) -> None:
        self._pending_tokens.append(tokens)
        self._pending_hiddens.append(hiddens)
        self._pending += tokens.shape[0]

    def _flush(self, background: bool) -> None:
        """One head forward over every pending pair at the committed offset."""
        if not self._pending:
            return
        self._candidates = None  # their entries are overwritten below
        if self.cache.offset > self._offset:
            self.cache.rewind(self._offset)  # drop speculative entries
        elif self.cache.offset < self._offset:
            raise RuntimeError(
                f"draft cache at {self.cache.offset} fell below the session's {self._offset}"
            )
        tokens = mx.concatenate(self._pending_tokens)
        hiddens = mx.concatenate(self._pending_hiddens)
        count = self._pending
        self._pending_tokens.clear()
        self._pending_hiddens.clear()
        self._pending = 0
        y = self.head(tokens[None], hiddens[None], self.cache)
        self._held = y[:, -1:, :]
        self._held_slot = self._offset + count - 1
        self._offset += count
        if background:
            # Materialise the draft KV now so a session that rarely drafts does not keep the
            # target hiddens (and the graph behind them) alive until close.
            mx.async_eval(self.cache.state)
