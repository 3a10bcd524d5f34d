"""The per-request session of an assistant drafter: a small separate model that drafts over the
target's own caches (Gemma 4's assistant, ``runner.models.gemma4_assistant``) instead of
keeping a draft KV of its own, behind the same calls ``drafting.mlx_ops.MlxRoundOps`` makes
of a ``drafting.session.DraftSession``, so its drafts go through the same round driver, depth
controller and acceptance as the MTP head's.

Every draft of a round is made at the position of the current token ``x`` (the first slot the
target caches do not hold): step 0 reads ``x`` with the target's hidden at the frontier (the
row that predicted ``x``), step i the draft before it with the assistant's own projected
output, each over the keys and values the target caches hold below that position. So the
session keeps only the frontier: the last committed position and its hidden row. Nothing is
flushed or rewound; the caches it reads are the request's cache slot's, bound when the round
driver is built (``bind``).

Nothing here evaluates: the drafts stay lazy until the round's one host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

from drafting.session import Constrain, Proposal, Sampler


def _ids(tokens: int | Sequence[int] | mx.array) -> mx.array:
    if isinstance(tokens, mx.array):
        return tokens.reshape(-1).astype(mx.int32)
    return mx.array([tokens] if isinstance(tokens, int) else [int(t) for t in tokens], mx.int32)


class AssistantStep(Protocol):
    """One assistant step: the logits ``[1, V]`` of the token after ``token`` (``[1, 1]``) and
    the hidden row ``[1, 1, D]`` the next step reads, for ``token`` at ``position`` with
    ``hidden`` ``[1, 1, D]`` over the target ``caches``."""

    def __call__(
        self, token: mx.array, hidden: mx.array, position: int, caches: list
    ) -> tuple[mx.array, mx.array]: ...


class AssistantSession:
    """One request's assistant drafter: the frontier and the chain of drafts from it."""

    source = "assistant"  # the drafter its rounds count under in ``done.speculation.sources``

    def __init__(self, step: AssistantStep) -> None:
        self.step = step
        self.caches: list | None = None
        self._frontier = 0
        self._frontier_hidden: mx.array | None = None  # [D], target hidden at frontier - 1
        self._discarded = False

    def bind(self, caches: list) -> None:
        """The target caches the drafts read (the request's cache slot)."""
        self.caches = caches

    # -- state, as ``DraftSession`` gives it to the round driver -----------------------------

    @property
    def primed(self) -> bool:
        return self._frontier_hidden is not None

    @property
    def offset(self) -> int:
        """Every committed position is usable: the assistant keeps no pairs of its own."""
        return self._frontier

    @property
    def frontier(self) -> int:
        return self._frontier

    @property
    def pending(self) -> int:
        return 0

    @property
    def discarded(self) -> bool:
        return self._discarded

    # -- reports from the decoder -----------------------------------------------------------

    def committed(self, tokens: Sequence[int] | mx.array, hiddens: mx.array, position: int) -> None:
        """A run the target caches now hold, at ``position``: the frontier moves to its end
        with its last hidden row (a restored prefix before it needs nothing here)."""
        count = _ids(tokens).shape[0]
        rows = hiddens.reshape(-1, hiddens.shape[-1])
        if rows.shape[0] != count:
            raise ValueError(f"{count} tokens but {rows.shape[0]} hidden rows")
        if count and position + count >= self._frontier:
            self._frontier = position + count
            self._frontier_hidden = rows[count - 1]

    def settle(self, next_token: int | mx.array) -> None:
        """Nothing waits for the next token: the assistant keeps no pairs."""

    def close(self) -> None:
        self._frontier_hidden = None
        self.caches = None

    def discard(self) -> None:
        """A failure: no more drafts in this request."""
        self._discarded = True
        self._frontier_hidden = None

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
        """Draft ``k`` tokens after ``current`` (not yet fed, at the frontier), draft i drawn
        for slot ``slot + i`` as ``DraftSession.propose`` draws them; None when the session
        cannot draft (nothing committed, discarded, unbound, or the caches elsewhere than the
        frontier)."""
        caches = self.caches
        if self._discarded or k < 1 or self._frontier_hidden is None or not caches:
            return None
        position = self._frontier
        if caches[0].offset != position:
            return None
        argmax = getattr(sampler, "greedy", False) and not getattr(sampler, "penalises", True)
        token = _ids(current).reshape(1, 1)
        hidden = self._frontier_hidden.reshape(1, 1, -1)
        drafts: list[mx.array] = []
        for step in range(k):
            if step:
                token = drafts[-1].reshape(1, 1)
            logits, hidden = self.step(token, hidden, position, caches)
            allowed = None
            if constrain is not None:
                allowed, only = constrain(step, drafts[-1] if drafts else None)
                if only is not None:
                    drafts.append(mx.array([only], dtype=mx.int32))
                    continue
            if argmax and allowed is None:
                drafts.append(mx.argmax(logits, axis=-1).astype(mx.int32).reshape(1))
                continue
            if allowed is not None:
                logits = mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
            chain = mx.concatenate(drafts) if drafts else mx.zeros((0,), dtype=mx.int32)
            drafts.append(sampler.tokens(logits, chain, slot=slot + step).reshape(1))
        return Proposal(tokens=mx.concatenate(drafts), slot=slot)
