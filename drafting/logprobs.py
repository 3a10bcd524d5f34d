"""The target's log-probabilities by sequence slot, for requests that ask for logprobs.

Every forward that decides a token already holds the target's distribution for it: a plain
step's row, and every row of a verify feed (row i holds the distribution of the token at
slot entry + 1 + i, which is the target's own draw, accepted or not). The forwards put their
rows here, keyed by the slot of the token they decide; the emitter takes the entry of each
token as it is emitted. So speculation never has to park for logprobs, and the values are
those of plain decoding for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LogprobEntry:
    """One token's log-probability and the top alternatives at its slot, host values."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class LogprobRows:
    """Entries by slot, from the last forward that decided each slot (a rejected verify row
    is overwritten by the forward that decides the slot next)."""

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n
        self._rows: dict[int, LogprobEntry] = {}

    def put(
        self,
        first_slot: int,
        tokens: Sequence[int],
        chosen: Sequence[float],
        top_ids: Sequence[Sequence[int]],
        top_logprobs: Sequence[Sequence[float]],
    ) -> None:
        """Rows for slots ``first_slot, first_slot + 1, ...`` (host lists, one per row)."""
        for i, token in enumerate(tokens):
            self._rows[first_slot + i] = LogprobEntry(
                int(token), float(chosen[i]), list(top_ids[i]), list(top_logprobs[i])
            )

    def take(self, slot: int, token: int) -> LogprobEntry:
        """The entry of ``token`` emitted at ``slot``; older slots are dropped.

        Raises LookupError when no forward decided that token there: the caller would
        otherwise report another token's probability."""
        entry = self._rows.pop(slot, None)
        for old in [s for s in self._rows if s < slot]:
            del self._rows[old]
        if entry is None or entry.token != int(token):
            found = "nothing" if entry is None else f"token {entry.token}"
            raise LookupError(f"no logprobs for token {token} at slot {slot} ({found} there)")
        return entry

    def __len__(self) -> int:
        return len(self._rows)
