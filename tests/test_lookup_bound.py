"""The oracle's ceiling on drafting from text already seen (scripts/bench/lookup_bound.py),
which the workload benchmark sets beside each family's measured ratios."""

from __future__ import annotations

import random

import pytest

from drafting.suffix import MAX_DRAFT
from scripts.bench import lookup_bound as lb


def test_a_verbatim_copy_of_the_prompt_is_copyable_from_the_index():
    prompt = list(range(100, 160))
    answer = prompt[10:50]
    rest = [min(MAX_DRAFT, len(answer) - 1 - t) for t in range(len(answer))]
    # The index matches pairs: the prompt's last token then the copy's first was never seen.
    assert lb.index_runs(prompt, answer) == [0, *rest[1:]]
    assert lb.any_runs(prompt, answer) == rest


def test_any_text_holds_at_least_what_the_index_drafts():
    rng = random.Random(7)
    prompt = [rng.randrange(12) for _ in range(300)]
    answer = [rng.randrange(12) for _ in range(120)]
    index, anywhere = lb.index_runs(prompt, answer), lb.any_runs(prompt, answer)
    assert all(a >= i for a, i in zip(anywhere, index, strict=True))
    assert sum(anywhere) > sum(index)  # short random matches: the index's longest is not best


def test_text_never_seen_gives_the_head_alone():
    runs = lb.any_runs([1, 2, 3], [7, 8, 9, 10, 11])
    assert runs == [0] * 5
    assert lb.ceiling(runs, lambda rows: 1.0, head_ratio=1.3) == pytest.approx(1.3)
    assert lb.ceiling(runs, lambda rows: 1.0, head_ratio=0.8) == pytest.approx(1.0)


def test_the_oracle_takes_the_cheapest_way_through_the_answer():
    runs = [3, 0, 0, 0, 0, 0, 0]  # up to 3 drafts after the first token, then nothing
    # Rows cost nothing: a round writes tokens 1..4 (3 drafts and the target's next), then
    # two plain steps: 6 tokens in 3 steps' time.
    assert lb.ceiling(runs, lambda rows: 1.0) == pytest.approx(6 / 3)
    # A round of r rows costs r plain steps: drafting never pays, plain decoding is 1.0.
    assert lb.ceiling(runs, lambda rows: float(rows)) == pytest.approx(1.0)
    # 1 + 0.5 per extra row: all 3 drafts (2.5 for 4 tokens), then 2 plain steps.
    assert lb.ceiling(runs, lambda rows: 1.0 + 0.5 * (rows - 1)) == pytest.approx(6 / 4.5)
    # Two rows free, more dear: one draft (1 for 2 tokens), then 4 plain steps.
    assert lb.ceiling(runs, lambda rows: 1.0 if rows <= 2 else 9.0) == pytest.approx(6 / 5)
