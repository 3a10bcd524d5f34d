"""Lossless speculation on sliding-window models: greedy speculative output is token for token
plain greedy output, with prompts and outputs longer than the window (16 in the fixtures),
with and without the prefix cache, for a random head, an echo head and a scripted draft that
is right for a while and then wrong at varying depths.

The heads are built from each target's own family (``runner.models.head_layer``), so these
runs also cover the Gemma and Phi-3 blocks as MTP head layers.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import mlx.core as mx
import pytest

from cache.kv import RotatingKVCache
from drafting.depth import MAX_DRAFT_DEPTH
from drafting.session import DraftSession
from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.loader import load_model
from tests.heads import echo_head, write_head
from tests.test_head import random_head

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
# Phi-3 with a window instead of LongRoPE: a feed-dependent RoPE makes the engine decode
# without speculation (tests/test_engine.py), so the Phi-3 block is covered this way.
PHI3 = "phi3_window"


@pytest.fixture(scope="session")
def phi3_window(tmp_path_factory) -> str:
    import json
    import shutil

    path = tmp_path_factory.mktemp("phi3-window") / PHI3
    shutil.copytree(FIXTURES / "phi3_longrope_old", path)
    config = json.loads((path / "config.json").read_text())
    config.update(rope_scaling=None, sliding_window=16)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def case_path(case: str, phi3: str) -> str:
    return phi3 if case == PHI3 else str(FIXTURES / case)


GREEDY = {"temperature": 0, "repeat_penalty": 1.0}


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(20, 70))] for _ in range(count)]


def run(engine: Engine, tokens: list[int], budget: int) -> tuple[list[int], object]:
    frames: list = []
    request = Completion(id="r", tokens=tokens, options=Options(num_predict=budget, **GREEDY))
    engine.run(engine.prepare(request), frames.append, lambda: False)
    done = frames[-1]
    assert type(done).__name__ == "Done", frames
    return [t for f in frames if type(f).__name__ == "Token" for t in f.tokens], done


@pytest.fixture(scope="module")
def heads(tmp_path_factory, phi3_window):
    """(case, head kind) -> sidecar directory."""
    made = {}
    for case in (
        "mistral_sliding",
        "gemma2_old",
        "gemma2_new",
        "gemma3_text_new",
        "qwen2_sliding_old",
        "qwen2_sliding_new",
        PHI3,
    ):
        loaded = load_model(case_path(case, phi3_window))
        for kind, head in (("random", random_head(loaded, seed=4)), ("echo", echo_head(loaded))):
            directory = str(tmp_path_factory.mktemp(f"{case}-{kind}"))
            made[case, kind] = write_head(directory, loaded, head)
    return made


@pytest.fixture(autouse=True)
def small_steps(monkeypatch):
    """The rotating caches re-lay their buffers every few appends, as in a long context."""
    monkeypatch.setattr(RotatingKVCache, "step", 8)


def engines(case: str, head_dir: str, depth: int, prefix_cache: bool, phi3: str = ""):
    path = case_path(case, phi3)
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    spec = Engine(
        EngineOptions(
            model_path=path, draft_path=head_dir, draft_depth=depth, prefix_cache=prefix_cache
        )
    )
    assert spec.head is not None
    return plain, spec


def requests(seed: int) -> list[list[int]]:
    """Fresh prompts, repeats and follow-ups (the prefix cache restores part of each)."""
    base = prompts(3, seed)
    out = [base[0], base[1], base[0], base[0][:30] + base[2][:20], base[1] + base[2][:10]]
    return out + [base[2]]


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize(
    ("case", "kind", "depth"),
    [
        ("mistral_sliding", "random", 3),
        ("mistral_sliding", "echo", 6),
        ("gemma2_old", "echo", 4),
        ("gemma3_text_new", "random", 2),
        ("qwen2_sliding_old", "echo", 8),
        ("qwen2_sliding_new", "echo", MAX_DRAFT_DEPTH),  # a verify feed as long as the window
        (PHI3, "random", 3),
    ],
)
def test_greedy_speculation_equals_plain_past_the_window(
    heads, phi3_window, case, kind, depth, prefix_cache
):
    plain, spec = engines(case, heads[case, kind], depth, prefix_cache, phi3_window)
    windowed = [c for c in spec.caches if isinstance(c, RotatingKVCache)]
    assert windowed
    rounds = 0
    for i, tokens in enumerate(requests(seed=len(case) + depth)):
        budget = 40 if i % 2 == 0 else 23
        want, want_done = run(plain, tokens, budget)
        got, done = run(spec, tokens, budget)
        assert got == want, (case, i)
        assert done.done_reason == want_done.done_reason
        assert done.eval_tokens == want_done.eval_tokens
        assert spec.draft_cache.offset == spec.caches[0].offset
        assert len(tokens) + len(got) > 16  # past the window
        rounds += done.speculation.rounds
        if prefix_cache and i == 2:
            assert done.prompt_cached_tokens > 0  # a repeat restores from the trie
    assert rounds > 10
    assert all(c.base > 0 for c in windowed)  # the windows slid out of the buffers


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("case", ["mistral_sliding", "gemma2_new", "qwen2_sliding_new"])
def test_scripted_drafts_accept_and_reject_at_every_depth(heads, monkeypatch, case, prefix_cache):
    """Drafts taken from the plain answer, each wrong with some probability: rounds accept
    runs of every length and reject at every position, so the rotating caches are rewound
    by every amount a verify feed allows, across the window boundary."""
    plain, spec = engines(case, heads[case, "random"], 7, prefix_cache)
    script: list[int] = []
    rng = random.Random(17)
    original = DraftSession.propose
    per_depth = [0] * 8

    def scripted(self, current, k, *args, **kwargs):
        proposal = original(self, current, k, *args, **kwargs)
        if proposal is None:
            return None
        start = self.frontier  # the slot of `current`; draft i belongs at start + 1 + i
        drafts = []
        for i in range(k):
            pos = start + 1 + i
            right = script[pos] if pos < len(script) else 5
            drafts.append(right if rng.random() < 0.8 else (right + 1) % 320)
        # Greedy verification reads the drafted tokens only.
        return dataclasses.replace(proposal, tokens=mx.array(drafts, dtype=mx.int32))

    monkeypatch.setattr(DraftSession, "propose", scripted)
    for i, tokens in enumerate(requests(seed=5)):
        want, want_done = run(plain, tokens, 60 if i % 2 else 37)
        script[:] = tokens + want
        got, done = run(spec, tokens, 60 if i % 2 else 37)
        assert got == want, (case, i)
        assert done.eval_tokens == want_done.eval_tokens
        assert spec.draft_cache.offset == spec.caches[0].offset
        for depth, count in enumerate(done.speculation.accepted_per_depth):
            per_depth[depth] += count
    # Rounds ended after every accepted count from 0 to 6 (7 = all accepted, rarer).
    assert all(count > 0 for count in per_depth[:7]), per_depth
