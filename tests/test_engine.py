"""The engine end to end on a small real model: options, seeds, budgets, the prefix cache."""

from __future__ import annotations

import random

import pytest

from protocol.frames import Done, Token
from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions, RequestError

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}


def complete(engine: Engine, prompt=None, tokens=None, **kwargs):
    """Run one completion; return (generated ids, text, done frame, token frames)."""
    fields = ("logprobs", "top_logprobs", "speculative", "think_budget")
    top = {k: kwargs.pop(k) for k in fields if k in kwargs}
    request = Completion(id="r", prompt=prompt, tokens=tokens, options=Options(**kwargs), **top)
    frames: list = []
    engine.run(engine.prepare(request), frames.append, lambda: False)
    done = frames[-1]
    assert isinstance(done, Done)
    token_frames = [f for f in frames if isinstance(f, Token)]
    ids = [t for f in token_frames for t in f.tokens]
    return ids, "".join(f.content for f in token_frames), done, token_frames


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine(EngineOptions(model_path=tiny_checkpoint))


def test_seeded_sampling_is_reproducible_whatever_ran_before(engine):
    opts = {"temperature": 1.2, "top_k": 0, "top_p": 1.0, "seed": 1234, "num_predict": 24}
    first = complete(engine, CHAT.format("tell me a story"), **opts)[0]
    complete(engine, CHAT.format("something else"), temperature=1.0, num_predict=9)
    complete(engine, CHAT.format("and more"), temperature=0.7, seed=5, num_predict=5)
    again = complete(engine, CHAT.format("tell me a story"), **opts)[0]
    assert first == again and len(first) == 24
    other_seed = complete(engine, CHAT.format("tell me a story"), **{**opts, "seed": 99})[0]
    assert other_seed != first


def test_unseeded_sampling_differs(engine):
    opts = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "num_predict": 24}
    runs = {tuple(complete(engine, CHAT.format("hello"), **opts)[0]) for _ in range(3)}
    assert len(runs) > 1


def test_top_k_one_equals_greedy(engine):
    greedy = complete(engine, CHAT.format("count"), temperature=0, num_predict=16)[0]
    top1 = complete(engine, CHAT.format("count"), temperature=0.9, top_k=1, num_predict=16)[0]
    assert top1 == greedy


@pytest.mark.parametrize("budget", [1, 7])
def test_num_predict_is_exact(engine, budget):
    ids, _, done, _ = complete(engine, CHAT.format("go"), num_predict=budget, **GREEDY)
    assert done.done_reason == "length" and done.eval_tokens == budget
    assert len(ids) <= budget


def test_num_predict_zero_runs_to_the_end_of_the_context(checkpoint_factory):
    path = checkpoint_factory("llama", max_position_embeddings=48)
    small = Engine(EngineOptions(model_path=path))
    prompt = small.tokenize(CHAT.format("hi"))
    ids, _, done, _ = complete(small, CHAT.format("hi"), num_predict=0, **GREEDY)
    if done.done_reason == "length":
        assert done.eval_tokens == 48 - len(prompt)
    else:  # the random model produced EOS first
        assert done.done_reason == "stop" and done.eval_tokens < 48 - len(prompt)


def test_context_overflow_is_refused_before_running(checkpoint_factory):
    path = checkpoint_factory("llama", max_position_embeddings=48)
    small = Engine(EngineOptions(model_path=path))
    with pytest.raises(RequestError) as info:
        small.prepare(Completion(id="x", tokens=[5] * 48))
    assert info.value.code == "context_overflow" and "48" in info.value.message


def test_logprobs_are_reported_per_token(engine):
    ids, _, done, frames = complete(
        engine, CHAT.format("hi"), num_predict=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    entries = [e for f in frames for e in (f.logprobs or []) if e is not None]
    assert [e.id for e in entries] == ids
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        # Greedy without penalties picks the most likely token.
        assert e.id == e.top_logprobs[0].id and e.logprob == pytest.approx(
            e.top_logprobs[0].logprob
        )


def top_logprobs(frames) -> list[tuple[int, float]]:
    return [
        (t.id, t.logprob) for f in frames for e in f.logprobs or [] if e for t in e.top_logprobs
    ]


def test_prefix_cache_never_changes_outputs(tiny_checkpoint):
    """Random request sequences: shared prefixes, branches, regenerated turns, repeats."""
    cached = Engine(EngineOptions(model_path=tiny_checkpoint, cache_bytes=64 * 1024))
    fresh = Engine(EngineOptions(model_path=tiny_checkpoint, prefix_cache=False))
    rng = random.Random(7)
    vocab = cached.info.vocab_size
    history: list[list[int]] = []
    hits = 0
    for _ in range(40):
        kind = rng.random()
        if history and kind < 0.3:  # continue an earlier prompt
            base = rng.choice(history)
            prompt = base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        elif history and kind < 0.5:  # branch inside an earlier prompt
            base = rng.choice(history)
            prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(3, vocab)]
        elif history and kind < 0.65:  # exact repeat
            prompt = list(rng.choice(history))
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))]
        history.append(prompt)
        opts = {"num_predict": rng.randrange(1, 8), "logprobs": True, "top_logprobs": 4}
        a_ids, _, a_done, a_frames = complete(cached, tokens=prompt, **opts, **GREEDY)
        b_ids, _, _, b_frames = complete(fresh, tokens=prompt, **opts, **GREEDY)
        assert a_ids == b_ids
        a_lp, b_lp = top_logprobs(a_frames), top_logprobs(b_frames)
        assert [i for i, _ in a_lp] == [i for i, _ in b_lp]
        assert [v for _, v in a_lp] == pytest.approx([v for _, v in b_lp], abs=1e-4)
        hits += a_done.prompt_cached_tokens > 0
    assert hits >= 10


def test_follow_up_turn_reuses_the_previous_prompt_and_answer(engine):
    first = engine.tokenize(CHAT.format("what is the capital of France?"))
    ids, _, done, _ = complete(engine, tokens=first, num_predict=12, **GREEDY)
    eos = next(iter(engine.tokenizer.eos_ids))
    follow = first + ids + [eos] + engine.tokenize("\n" + CHAT.format("and of Italy?"))
    _, _, done2, _ = complete(engine, tokens=follow, num_predict=4, **GREEDY)
    assert done2.prompt_cached_tokens >= len(first) + len(ids) - 1
    assert done2.prompt_tokens == len(follow)


def test_cancel_between_prefill_chunks_keeps_what_was_done(tiny_checkpoint):
    small_chunks = Engine(EngineOptions(model_path=tiny_checkpoint, prefill_chunk=8))
    prompt = [(i * 37) % 300 + 5 for i in range(60)]
    calls = {"n": 0}

    def cancel_after_three_chunks() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    frames: list = []
    request = Completion(id="c", tokens=prompt, options=Options(num_predict=4, **GREEDY))
    small_chunks.run(small_chunks.prepare(request), frames.append, cancel_after_three_chunks)
    assert frames[-1].done_reason == "cancelled" and frames[-1].eval_tokens == 0
    _, _, done, _ = complete(small_chunks, tokens=prompt, num_predict=4, **GREEDY)
    assert done.prompt_cached_tokens >= 24  # the retry resumes where the cancel stopped


def test_think_budget_closes_the_span_and_feeds_the_marker(engine):
    prompt = CHAT.format("think first") + "<think>"
    close = engine.tokenize("</think>")
    ids, text, done, _ = complete(engine, prompt, num_predict=12, think_budget=3, **GREEDY)
    # Three content tokens inside the span, then the runner's own close marker.
    assert ids[3 : 3 + len(close)] == close
    assert text.count("</think>") == 1
    # The marker is fed: the caches hold prompt + generated tokens, marker included.
    fed = len(engine.tokenize(prompt)) + len(ids)
    assert engine.caches[0].offset in (fed - 1, fed)
    assert done.eval_tokens == len(ids) - len(close)


def test_a_feed_dependent_rope_runs_whole_prompts_without_cache_or_speculation():
    """Dynamic RoPE picks its rotation per forward (as transformers does): the engine feeds
    every prompt in one forward and decodes one token per forward, so a restored prefix or a
    verify feed cannot rotate differently from the reference."""
    import os

    path = os.path.join(
        os.path.dirname(__file__), "fixtures", "reference", "llama_rope_dynamic_new"
    )
    engine = Engine(EngineOptions(model_path=path, prefill_chunk=8))
    assert engine.feed_dependent and not engine.info.mtp and "RoPE" in engine.info.mtp_detail
    assert not engine.prefix.enabled and engine.chunk == engine.info.context_length
    first = complete(engine, tokens=list(range(3, 40)), num_predict=6, **GREEDY)
    again = complete(engine, tokens=list(range(3, 40)), num_predict=6, **GREEDY)
    assert first[0] == again[0] and again[2].prompt_cached_tokens == 0


def test_release_memory_gives_freed_buffers_back_to_the_system():
    """MLX's cache cleared is not enough: freed heap blocks between live ones stay resident
    until the heap is trimmed (the pattern a long prompt's transient buffers leave)."""
    import mlx.core as mx

    from runner import device

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

    transient, live = [], []
    for i in range(2000):
        transient.append(mx.full((16 << 10,), float(i)))  # 64 KiB each, below mmap's threshold
        live.append(mx.full((16,), float(i)))
        mx.eval(transient[-1], live[-1])
    del transient
    mx.clear_cache()
    cleared = rss()
    device.release_memory()
    assert cleared - rss() > 64 << 20
    del live
