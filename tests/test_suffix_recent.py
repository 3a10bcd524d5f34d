"""The suffix drafter's index of recent outputs (``drafting.suffix.RecentOutputs``): lookups
of one text's context in another against a brute-force search, separators that no draft
crosses, the bound and its oldest-out order, the drafter choosing the longer of its two
matches, and a real engine whose second request drafts from the first one's answer without
changing a token."""

from __future__ import annotations

import random

import pytest

from drafting.suffix import (
    CANDIDATES,
    MAX_MATCH,
    RECENT_MIN,
    RECENT_PROMPT,
    RECENT_TOKENS,
    SEPARATOR,
    RecentOutputs,
    SuffixDrafter,
    SuffixIndex,
    SuffixModel,
)
from runner.cli import build_parser
from runner.engine import Engine, EngineOptions
from tests.test_engine import complete
from tests.test_suffix import longest_match


def brute_force(text: list[int], context: list[int], limit: int) -> tuple[list[int], int]:
    """The context lookup by exhaustive search: the newest CANDIDATES positions of ``text``
    that follow the context's last pair, the longest backward match (newest on ties), its
    continuation up to a separator, cut where an equally long rival continues differently."""
    places = [p for p in range(2, len(text)) if text[p - 2 : p] == context[-2:]][-CANDIDATES:]
    if len(context) < 2 or not places:
        return [], 0

    def match(p: int) -> int:
        m = 2
        while (m < MAX_MATCH and m <= len(context) - 1 and p - 1 - m >= 0) and text[
            p - 1 - m
        ] == context[-1 - m]:
            m += 1
        return m

    def continuation(p: int, count: int) -> list[int]:
        out = []
        for token in text[p : p + count]:
            if token == SEPARATOR:
                break
            out.append(token)
        return out

    return longest_match([(match(p), p) for p in places], continuation, limit)


@pytest.mark.parametrize("alphabet", [3, 6, 30])
def test_a_context_lookup_is_the_brute_force_search(alphabet):
    rng = random.Random(alphabet)
    for case in range(40):
        outputs = [
            [rng.randrange(alphabet) for _ in range(rng.randrange(2, 40))]
            for _ in range(rng.randrange(1, 5))
        ]
        text = [t for output in outputs for t in (SEPARATOR, *output)]
        index = SuffixIndex(text)
        # A context that copies part of one output, or random tokens.
        source = rng.choice(outputs)
        cut = rng.randrange(1, len(source) + 1)
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 4))] + source[:cut]
        if rng.random() < 0.3:
            context = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 12))]
        limit = rng.randrange(1, 16)
        assert index.lookup_context(context, limit) == brute_force(text, context, limit), case


def test_a_draft_from_recent_outputs_stops_at_the_next_output():
    recent = RecentOutputs(1000)
    recent.add([1, 2, 3, 4, 5, 6, 7, 8])
    recent.add([9, 9, 9, 9, 9, 9, 9, 9])
    assert recent.lookup([0, 5, 6], 10) == ([7, 8], 2)  # the separator ends it
    assert recent.lookup([1, 2, 3], 3) == ([4, 5, 6], 3)
    assert recent.lookup([4, 1], 5) == ([], 0)  # the pair never occurred


def test_a_retried_prompt_drafts_its_answer_from_the_first_token():
    recent = RecentOutputs(1000)
    prompt = list(range(100, 140))
    recent.add(list(range(10, 30)), prompt)
    # The prompt's tail is indexed before the answer: its last pair continues into it.
    draft, match = recent.lookup(prompt, 8)
    assert draft == list(range(10, 18)) and match == RECENT_PROMPT
    assert recent.tokens == RECENT_PROMPT + 20


def test_recent_outputs_are_bounded_and_the_oldest_go_first():
    recent = RecentOutputs(100)
    outputs = [[1000 * i + j for j in range(30)] for i in range(6)]
    for output in outputs:
        recent.add(output)
        assert recent.tokens <= 100
    # Past the bound the oldest went until half was left; the newest outputs are found.
    assert recent.lookup(outputs[-1][:3], 4) == (outputs[-1][3:7], 3)
    assert recent.lookup(outputs[0][:3], 4) == ([], 0)
    assert recent.lookup(outputs[1][:3], 4) == ([], 0)
    recent.add([7] * (RECENT_MIN - 1))  # too short to be worth a lookup
    assert recent.lookup([7, 7], 4) == ([], 0)
    off = RecentOutputs(0)
    off.add(outputs[0])
    assert off.tokens == 0 and off.lookup(outputs[0][:3], 4) == ([], 0)
    # At most what one index holds without restarting; the command line says so by name.
    with pytest.raises(ValueError, match="recent outputs"):
        RecentOutputs(RECENT_TOKENS + 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--recent-outputs", str(RECENT_TOKENS + 1)])
    assert build_parser().parse_args([]).recent_outputs == 0  # off unless asked for


def test_the_drafter_takes_the_longer_of_its_own_and_the_recent_match():
    model = SuffixModel(recent_tokens=1000)
    model.recent.add([50, 51, 52, 53, 54, 55, 56, 57, 58, 59])
    # The request's own text has the pair (52, 53) once, after a shorter match.
    drafter = SuffixDrafter(model, [9, 52, 53, 70, 71, 1, 2, 50, 51, 52], lambda: [], fixed=4)
    draft, _ = drafter.draft(53, 4)
    assert draft.tokens == [54, 55, 56, 57]  # 50 51 52 53 matches 4 tokens of the output
    own = SuffixDrafter(model, [1, 52, 53, 70, 71, 72, 9, 52], lambda: [], fixed=4)
    draft, _ = own.draft(53, 4)
    assert draft.tokens == [70, 71, 72, 9]  # 9 52 53 is no longer a match than 51 52 53


CHAT = (
    "<|im_start|>user\nWrite four short lines about a lighthouse keeper and the sea."
    "<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def engines(default_model) -> dict[int, Engine]:
    # The suffix drafter alone at a fixed length: it drafts whenever it has a continuation.
    options = {"model_path": default_model, "draft_depth": 4, "draft_sources": ("suffix",)}
    return {n: Engine(EngineOptions(**options, recent_outputs=n)) for n in (0, 4096)}


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"]
)
def test_a_retried_request_drafts_its_earlier_answer_losslessly(engines, sampling):
    accepted, length = {}, 0
    for recent, engine in engines.items():
        first = complete(engine, CHAT, speculative=False, num_predict=48, **sampling)
        again = complete(engine, CHAT, num_predict=48, **sampling)
        assert again[0] == first[0], recent  # the same request: the same tokens
        counts = again[2].speculation.sources.get("suffix")
        accepted[recent] = counts.accepted if counts is not None else 0
        length = len(first[0])
    # Only an earlier output holds this answer: most of it comes from accepted drafts (four
    # in every round of five tokens at best), from the first token on (the warm round).
    assert length >= 24 and accepted[4096] >= 0.7 * length, (accepted, length)
    assert accepted[4096] > accepted[0] + length // 2, accepted
    state = {n: e.status()["speculation"]["suffix"]["recent_tokens"] for n, e in engines.items()}
    assert state[0] == 0 and state[4096] > 0, state
