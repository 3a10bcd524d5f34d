"""How fast drafting from text already seen could make one answer: the ceiling an oracle sets.

``workloads.py`` reports it beside each family's measured ratios, so a family that stays short
of a target shows whether a better drafter could reach it or the answer itself cannot.

The tokens are plain decoding's. With coupled draws a seeded answer's tokens are the target's
own draws whatever was drafted, so the same ceiling holds greedy and sampled.

- **Copyable run** at position t: how many of the answer's next tokens a lookup draft after
  token t could hold. ``index_runs``: the draft of the runner's own index
  (``drafting.suffix.SuffixIndex``: the longest match of the last tokens, cut where matches
  disagree), counted up to its first wrong token.
  ``any_runs``: the longest run of them found anywhere in the text seen, which is what the
  best possible choice of earlier text could give any lookup drafter.
- **Ceiling** (``ceiling``): an oracle that knows every copyable run drafts exactly that
  far, never a token more, and decodes every other token at the head's rate on the same answer
  (its measured ratio to plain; 1 without a head). A verify round of r rows costs what the
  suffix model's cost line says (``a + s (r - 1)`` plain steps, learned from the engine's own
  rounds). The least time to write the answer is a shortest path over its positions: n
  tokens over that time is the ceiling's ratio to plain. The head's ratio is its average
  over the whole answer, copied spans included, where it drafts best, so the ceiling is
  generous to the head; and no two-branch tree of both drafts can beat the oracle's choice
  of the better one, as it costs at least the rows of the branch the target keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from drafting.suffix import MAX_DRAFT, SuffixIndex
from scripts.bench.common import first_difference

ROWS = MAX_DRAFT + 1  # the most rows a round of the longest draft verifies


def _agreeing(draft: Sequence[int], answer: Sequence[int], start: int) -> int:
    """How many leading tokens of ``draft`` equal ``answer`` from ``start`` on."""
    differ = first_difference(draft, answer[start : start + len(draft)])
    return len(draft) if differ is None else differ


def index_runs(prompt: Sequence[int], answer: Sequence[int], limit: int = MAX_DRAFT) -> list[int]:
    """Per answer position t: how many of the tokens after t the index's draft holds."""
    index = SuffixIndex(prompt)
    runs = []
    for t, token in enumerate(answer):
        draft, _ = index.lookup(token, limit)
        runs.append(_agreeing(draft, answer, t + 1))
        index.extend([token])
    return runs


def any_runs(prompt: Sequence[int], answer: Sequence[int], limit: int = MAX_DRAFT) -> list[int]:
    """Per answer position t: the longest run of the answer's next tokens found anywhere in
    the text seen by then (the prompt and the answer through t; a run reaching the end of
    that text goes on around its period, as the index's loops do), at most ``limit``."""
    text = list(prompt)
    places: dict[int, list[int]] = {}
    for p, token in enumerate(text):
        places.setdefault(token, []).append(p)
    runs = []
    for t, token in enumerate(answer):
        places.setdefault(token, []).append(len(text))
        text.append(token)
        best = 0
        if t + 1 < len(answer):
            for p in places.get(answer[t + 1], ()):
                period = len(text) - p
                draft = text[p : p + limit]
                draft += [draft[i % period] for i in range(len(draft), limit)]
                best = max(best, _agreeing(draft, answer, t + 1))
        runs.append(best)
    return runs


def ceiling(runs: Sequence[int], cost: Callable[[int], float], head_ratio: float = 1.0) -> float:
    """The oracle's ratio to plain decoding (module docstring): ``runs`` per position,
    ``cost(rows)`` a verify round's time in plain steps, ``head_ratio`` the head's rate."""
    # State t: the answer's tokens through t are known (the first comes from the prefill);
    # a plain step writes token t + 1, a round drafting k tokens writes t + 1 .. t + k + 1.
    last = len(runs) - 1
    if last < 1:
        return 1.0
    per_token = 1.0 / max(head_ratio, 1.0)  # where nothing is copied: the head, or plain
    time = [0.0] * len(runs)  # time[t]: the least time from state t to the last token
    for t in range(last - 1, -1, -1):
        best = per_token + time[t + 1]
        for k in range(1, min(runs[t], last - t) + 1):
            best = min(best, cost(k + 1) + time[min(last, t + k + 1)])
        time[t] = best
    return last / time[0]
