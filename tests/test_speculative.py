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


REQUEST_FIELDS = ("speculative", "logprobs", "top_logprobs", "think_budget")


def run_frames(engine: Engine, prompt: str, **options) -> list:
    frames: list = []
    extra = {k: options.pop(k) for k in REQUEST_FIELDS if k in options}
    request = Completion(id="r", prompt=prompt, options=Options(**options), **extra)
    engine.run(engine.prepare(request), frames.append, lambda: False)
    assert type(frames[-1]).__name__ == "Done", frames[-1]
    return frames


def run(engine: Engine, prompt: str, **options) -> tuple[list[int], object, int]:
    frames = run_frames(engine, prompt, **options)
    tokens = [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]
    return tokens, frames[-1], engine.caches[0].offset


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


def test_speculation_off_parks_but_keeps_the_draft_cache(model_and_head):
    path, head_dir = model_and_head
    engine = Engine(EngineOptions(model_path=path, draft_path=head_dir, draft_depth=3))
    _, done, _ = run(engine, PROMPTS[0], num_predict=12, speculative=False, **GREEDY)
    assert done.speculation.rounds == 0 and done.speculation.drafted == 0
    assert engine.draft_cache.offset == engine.caches[0].offset


def logprob_entries(frames) -> list:
    return [e for f in frames if type(f).__name__ == "Token" for e in (f.logprobs or [])]


SEEDED = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 7, "repeat_penalty": 1.0}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_come_from_the_verify_rows_and_equal_plain_decoding(model_and_head, sampling):
    """Speculation no longer parks for logprobs: every accepted draft, bonus and correction
    gets the entry of the verify row that decided it, equal to plain decoding's."""
    path, head_dir = model_and_head
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    tok = plain.tokenizer
    rounds = 0
    for depth in (1, 2, 4):
        spec = Engine(
            EngineOptions(
                model_path=path, draft_path=head_dir, draft_depth=depth, prefix_cache=False
            )
        )
        for prompt in PROMPTS:
            for budget in (1, 7, 20):
                kw = dict(num_predict=budget, logprobs=True, top_logprobs=3, **sampling)
                want = run_frames(plain, prompt, **kw)
                got = run_frames(spec, prompt, **kw)
                rounds += got[-1].speculation.rounds
                ids = [t for f in got if type(f).__name__ == "Token" for t in f.tokens]
                a, b = logprob_entries(want), logprob_entries(got)
                assert [e.id for e in b] == ids == [e.id for e in a], (depth, prompt, budget)
                for x, y in zip(a, b, strict=True):
                    assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
                    assert [t.id for t in y.top_logprobs] == [t.id for t in x.top_logprobs]
                    assert [t.logprob for t in y.top_logprobs] == pytest.approx(
                        [t.logprob for t in x.top_logprobs], abs=1e-5
                    )
                    assert bytes(y.bytes) == tok.token_bytes(y.id)
                    assert all(bytes(t.bytes) == tok.token_bytes(t.id) for t in y.top_logprobs)
                assert spec.draft_cache.offset == spec.caches[0].offset
    assert rounds > 20  # the requests really ran speculative rounds


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
