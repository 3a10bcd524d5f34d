"""One request's token ledger, shared by the plain decoding loop and the speculative round driver.

Both write the same ``Ledger`` as they go, so nothing is copied between them when decoding
moves from rounds to plain steps and back. The position is the target caches' own offset,
which every reader takes from the caches (between steps: the prompt plus ``committed``).

- ``emitted``: every generated token handed to the emitter, forced close markers included.
- ``committed``: the generated tokens the target caches hold, in order.

Committed is always a prefix of emitted: a token that ends generation without staying in the
caches (EOS, a token cancelled or cut by the budget before it was fed) is emitted and never
committed, and the caches never run ahead of what the host was told.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Ledger:
    emitted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    # Generated tokens the host was sent (``done.eval_tokens``; the budget counts them):
    # not the EOS that ends generation, not close markers the runner forced.
    used: int = 0

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
