"""One request's token ledger, shared by the plain decoding loop and the speculative round driver.

Both write the same ``Ledger`` as they go, so nothing is copied between them when decoding
moves from rounds to plain steps and back. The position is the target caches' own offset,
which every reader takes from the caches (between steps: the prompt plus ``committed``).

- ``emitted``: every generated token handed to the emitter, forced close markers included.
- ``committed``: the generated tokens the target caches hold, in order.

Committed is always a prefix of emitted: a token that ends generation without staying in the
caches (EOS, a token cancelled or cut by the budget before it was fed) is emitted and never
committed, and the caches never run ahead of what the host was told.

``Ledger.judge`` is the one reading of an emitted token: every decoding path (the pipelined
plain loop, the shared forward's rows, the round driver's x and accepted drafts) records the
token with it and acts on the ``Verdict`` it returns (keep the token's state or not, end
generation and why, feed close markers next). The paths differ only in how they act: a
pipelined step has already dispatched the token's forward, a round replays it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class EmitterStep(Protocol):
    """``runner.emit.Step``: what the emitter said about one pushed token."""

    finished: bool
    reason: str | None
    keep: bool
    forced: list[int]


@dataclass(frozen=True)
class Verdict:
    """What one emitted token means for decoding (``Ledger.judge``).

    ``fed`` False: the token's state may not stay in the caches (an EOS); generation ends.
    ``end``: why generation ends at this token ("stop" or "length"), None when it goes on.
    ``forced``: close markers to feed right after the token (think budget); they may come
    with an ``end`` (the budget ran out on the token that fired the think budget)."""

    fed: bool
    end: str | None = None
    forced: tuple[int, ...] = ()


@dataclass
class Ledger:
    emitted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    # Generated tokens the host was sent (``done.eval_tokens``; the budget counts them):
    # not the EOS that ends generation, not close markers the runner forced.
    used: int = 0
    budget: int | None = None  # how many tokens may be used in all (None: unlimited)

    def remaining(self) -> int | None:
        """Tokens the budget still allows (None = unlimited)."""
        return None if self.budget is None else self.budget - self.used

    def judge(self, token: int, step: EmitterStep, *, context_full: bool = False) -> Verdict:
        """Record ``token``, which the emitter answered with ``step``, and say what it means:
        an EOS is never fed; a finished step ends with its reason; a token that spends the
        budget, or fills the context (``context_full``), is the last one ("length")."""
        self.emit(token, step.forced, counted=step.keep)
        if not step.keep:
            return Verdict(fed=False, end=step.reason or "stop")
        if step.finished:
            end = step.reason or "stop"
        elif context_full or (self.budget is not None and self.used >= self.budget):
            end = "length"
        else:
            end = None
        return Verdict(fed=True, end=end, forced=tuple(step.forced))

    def emit(self, token: int, forced: Sequence[int] = (), *, counted: bool = True) -> None:
        """``token`` went to the emitter, which answered with ``forced`` close markers;
        ``counted`` False for an EOS (emitted, never streamed)."""
        self.used += int(counted)
        self.emitted.append(int(token))
        self.emitted.extend(int(t) for t in forced)

    def force(self, tokens: Sequence[int]) -> None:
        """Close markers fed before the first generated token (a zero think budget on a span
        the prompt opened): emitted and held by the caches, never counted."""
        self.emitted.extend(int(t) for t in tokens)
        self.committed.extend(int(t) for t in tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        """``tokens`` (already emitted) now stay in the target caches."""
        self.committed.extend(int(t) for t in tokens)


@dataclass
class Outcome:
    """How generation ended and what the caches hold beyond the prompt."""

    reason: str  # "stop" | "length" | "cancelled" | "error"
    fed: list[int] = field(default_factory=list)  # generated tokens the caches hold, in order
    final: int | None = None  # the token after the last fed one (sampled, never fed)
    error: str | None = None  # why generation failed, when reason == "error"
