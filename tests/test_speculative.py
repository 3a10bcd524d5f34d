"""Speculative decoding on a real small model with a real (random) head: lossless.

The head drafts the token it is given, so it is right exactly when the target repeats itself,
which random tiny models do a lot: rounds see full acceptance, rejection at every depth and
EOS inside accepted runs.
"""

from __future__ import annotations

import pytest

from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.loader import load_model
from tests.heads import echo_head, write_head

PROMPTS = [
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def add(a, b):\n    return",
]
BUDGETS = [1, 2, 7, 16, 31]
DEPTHS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model_and_head(tiny_checkpoint, tmp_path_factory):
    loaded = load_model(tiny_checkpoint)
    head_dir = write_head(str(tmp_path_factory.mktemp("echo-head")), loaded, echo_head(loaded))
    return tiny_checkpoint, head_dir


def run(engine: Engine, prompt: str, **options) -> tuple[list[int], object, int]:
    frames: list = []
    extra = {k: options.pop(k) for k in ("speculative", "logprobs", "think_budget") if k in options}
    request = Completion(id="r", prompt=prompt, options=Options(**options), **extra)
    engine.run(engine.prepare(request), frames.append, lambda: False)
    tokens = [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]
    done = frames[-1]
    assert type(done).__name__ == "Done", frames[-1]
    return tokens, done, engine.caches[0].offset


GREEDY = {"temperature": 0, "repeat_penalty": 1.0}
# Penalised greedy drafts go through the sampler; unpenalised ones take the head's argmax.
PENALISED = {"temperature": 0, "repeat_penalty": 1.3, "repeat_last_n": 8}


@pytest.mark.parametrize("sampling", [GREEDY, PENALISED], ids=["greedy", "penalised"])
def test_greedy_speculation_equals_plain_for_every_depth_and_budget(model_and_head, sampling):
    path, head_dir = model_and_head
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    engines = {
        k: Engine(
            EngineOptions(model_path=path, draft_path=head_dir, draft_depth=k, prefix_cache=False)
        )
        for k in DEPTHS
    }
    accepted = 0
    for prompt in PROMPTS:
        for budget in BUDGETS:
            want, want_done, want_offset = run(plain, prompt, num_predict=budget, **sampling)
            for k, engine in engines.items():
                got, done, offset = run(engine, prompt, num_predict=budget, **sampling)
                assert got == want, (prompt, budget, k)
                assert done.done_reason == want_done.done_reason
                assert done.eval_tokens == want_done.eval_tokens
                # Caches hold the prompt and the fed tokens; the draft cache rests level.
                assert offset == want_offset, (prompt, budget, k)
                assert engine.draft_cache.offset == engine.caches[0].offset
                accepted += done.speculation.accepted
    assert accepted > 20  # the runs really exercised accepted drafts


def test_speculation_off_and_logprobs_park_but_keep_the_draft_cache(model_and_head):
    path, head_dir = model_and_head
    engine = Engine(EngineOptions(model_path=path, draft_path=head_dir, draft_depth=3))
    _, done, _ = run(engine, PROMPTS[0], num_predict=12, speculative=False, **GREEDY)
    assert done.speculation.rounds == 0 and done.speculation.drafted == 0
    assert engine.draft_cache.offset == engine.caches[0].offset
    _, done, _ = run(engine, PROMPTS[1], num_predict=12, logprobs=True, **GREEDY)
    assert done.speculation.rounds == 0
    assert engine.draft_cache.offset == engine.caches[0].offset


def test_prefix_cache_with_a_draft_head_is_lossless(model_and_head):
    """Pair keys: every restore point is valid for the draft cache too, so cached speculative
    runs equal uncached plain runs, and every cache rests level after each request."""
    import random

    path, head_dir = model_and_head
    cached = Engine(EngineOptions(model_path=path, draft_path=head_dir, draft_depth=3))
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    rng = random.Random(11)
    base = [PROMPTS[i % 3] for i in range(30)]
    hits = 0
    for i, prompt in enumerate(base):
        if i % 4 == 1:
            prompt = prompt + " more"
        elif i % 4 == 2:
            prompt = prompt[: rng.randrange(5, len(prompt))]
        budget = rng.choice([1, 3, 9])
        want, _, _ = run(plain, prompt, num_predict=budget, **GREEDY)
        got, done, _ = run(cached, prompt, num_predict=budget, **GREEDY)
        assert got == want, (i, prompt)
        assert cached.draft_cache.offset == cached.caches[0].offset
        hits += done.prompt_cached_tokens > 0
    assert hits > 10
    assert cached.prefix.entries > 0


def test_forced_think_close_is_identical_with_speculation(model_and_head):
    path, head_dir = model_and_head
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    spec = Engine(EngineOptions(model_path=path, draft_path=head_dir, draft_depth=3))
    prompt = PROMPTS[0] + "<think>"
    for budget in (0, 2, 5):
        want, want_done, _ = run(plain, prompt, num_predict=14, think_budget=budget, **GREEDY)
        got, done, _ = run(spec, prompt, num_predict=14, think_budget=budget, **GREEDY)
        assert got == want and done.eval_tokens == want_done.eval_tokens, budget
        assert spec.draft_cache.offset == spec.caches[0].offset
