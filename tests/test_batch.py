"""Continuous batching (``runner.batch``): several completions decoding in shared forwards
give each exactly what it gives alone; cancels, failures and the prefix cache per stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protocol.frames import Done, Error, Token
from protocol.requests import Completion, Options
from runner.batch import Scheduler
from runner.engine import Engine, EngineOptions
from runner.prefill import prefill

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "Tell me about cats.",
    "What is 2+2? Explain.",
    "Write a haiku about rain.",
    "List three colors.",
    "Why is the sky blue?",
    "Name a fruit and describe it.",
    "Describe Paris in two sentences.",
    "What is Python used for?",
]


def request(rid: str, question: str, **options) -> Completion:
    options.setdefault("temperature", 0.0)
    return Completion(id=rid, prompt=CHAT.format(question), options=Options(**options))


class Collector:
    """Frames of one completion, as the server's emit receives them."""

    def __init__(self, fail_on_token: int | None = None) -> None:
        self.frames: list = []
        self.fail_on_token = fail_on_token

    def __call__(self, frame) -> None:
        if isinstance(frame, Token) and self.fail_on_token is not None:
            if sum(isinstance(f, Token) for f in self.frames) + 1 == self.fail_on_token:
                raise RuntimeError("host-side fault on a token frame")
        self.frames.append(frame)

    @property
    def ids(self) -> list[int]:
        return [t for f in self.frames if isinstance(f, Token) for t in f.tokens]

    @property
    def done(self) -> Done | None:
        done = [f for f in self.frames if isinstance(f, Done)]
        assert len(done) <= 1, "more than one done frame"
        return done[0] if done else None


def alone(engine: Engine, req: Completion) -> Collector:
    out = Collector()
    engine.run(engine.prepare(req), out, lambda: False)
    return out


def together(engine: Engine, reqs, cancel_after=None, fail=None, max_steps=100_000):
    """Admit every request at once (the first ``engine.parallel``, the rest as slots free
    up, in order) and step until all are done. ``cancel_after``: {id: tokens} cancels a
    stream once it streamed that many; ``fail``: {id: n} makes its n-th token frame raise."""
    scheduler = Scheduler(engine)
    outs = {r.id: Collector((fail or {}).get(r.id)) for r in reqs}
    flags = {r.id: False for r in reqs}
    queue = list(reqs)
    active = 0
    steps = 0
    while queue or active:
        while queue and scheduler.room:
            r = queue.pop(0)
            scheduler.admit(engine.prepare(r), outs[r.id], lambda rid=r.id: flags[rid])
            active += 1
        active -= len(scheduler.step())
        for rid, n in (cancel_after or {}).items():
            if len(outs[rid].ids) >= n:
                flags[rid] = True
        steps += 1
        assert steps < max_steps
    return outs, scheduler


def equal_alone(engine: Engine, reqs) -> tuple[dict, Scheduler]:
    """Run ``reqs`` together (``together``) after each alone, and check that every one's
    tokens and ending equal its own alone; the together run's outputs and scheduler."""
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0
    for r in reqs:
        assert outs[r.id].ids == solo[r.id].ids, r.id
        assert outs[r.id].done.done_reason == solo[r.id].done.done_reason, r.id
    return outs, scheduler


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(EngineOptions(model_path=default_model, parallel=4))


def test_a_shared_forward_row_equals_a_forward_of_its_own(engine):
    """Model.hidden_rows: each row's hidden has the bits of a one-row forward after its own
    prompt, whatever else is in the batch."""
    model = engine.model
    prompts = [engine.tokenize(CHAT.format(q)) for q in QUESTIONS[:5]]
    solo, caches = [], []
    for p in prompts:
        c = model.make_caches()
        prefill(model, c, p[:-1], 0)
        h = model.hidden(mx.array([[p[-1]]]), c)
        solo.append(np.array(h[0, 0]))
        c2 = model.make_caches()
        prefill(model, c2, p[:-1], 0)
        caches.append(c2)
    rows = model.hidden_rows(mx.array([p[-1] for p in prompts]), caches)
    for i, p in enumerate(prompts):
        assert np.array_equal(np.array(rows[i]), solo[i])
        assert all(c.offset == len(p) for c in caches[i])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_eight_requests_at_once_give_what_each_gives_alone(engine, sampled):
    extra = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7} if sampled else {}
    reqs = [
        request(f"r{i}", q, num_predict=6 + 5 * i, repeat_penalty=1.0, **extra)
        for i, q in enumerate(QUESTIONS)
    ]
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0
    for r in reqs:
        assert outs[r.id].ids == solo[r.id].ids, r.id
        assert outs[r.id].done.done_reason == solo[r.id].done.done_reason
    # Alone, a request speculates with the shipped head: the done frames say rounds ran.
    assert any(out.done.speculation.rounds for out in solo.values())


def test_cancelling_one_stream_leaves_the_others_unchanged(engine):
    reqs = [request(f"c{i}", q, num_predict=24) for i, q in enumerate(QUESTIONS[:4])]
    expected = {r.id: alone(engine, r).ids for r in reqs}
    outs, _ = together(engine, reqs, cancel_after={"c1": 3})
    assert outs["c1"].done.done_reason == "cancelled"
    assert outs["c1"].ids == expected["c1"][: len(outs["c1"].ids)]
    assert len(outs["c1"].ids) < len(expected["c1"])
    for rid in ("c0", "c2", "c3"):
        assert outs[rid].ids == expected[rid]


def test_a_stream_that_fails_does_not_disturb_the_others(engine):
    reqs = [request(f"f{i}", q, num_predict=20) for i, q in enumerate(QUESTIONS[:4])]
    expected = {r.id: alone(engine, r).ids for r in reqs}
    outs, _ = together(engine, reqs, fail={"f2": 3})
    failed = outs["f2"]
    assert failed.done.done_reason == "error"
    assert any(isinstance(f, Error) for f in failed.frames)
    for rid in ("f0", "f1", "f3"):
        assert outs[rid].ids == expected[rid]
    # and the engine serves on, with the same answers
    assert alone(engine, reqs[2]).ids == expected["f2"]


def test_interleaved_multi_turn_chats_keep_their_prefix_hits(engine):
    """Two chats, their turns submitted together: every second turn restores its own
    history from the prefix cache, though the other chat decoded in between."""
    history = {"a": CHAT.format("Tell me a fact about owls."), "b": CHAT.format("Name a river.")}
    held = {"a": 0, "b": 0}  # what the previous turn left in the cache: prompt + answer
    for turn in range(3):
        reqs = [
            Completion(
                id=f"{k}{turn}", prompt=history[k], options=Options(temperature=0, num_predict=12)
            )
            for k in history
        ]
        outs, _ = together(engine, reqs)
        for k in history:
            out = outs[f"{k}{turn}"]
            # all of it, but the last position (pair keys: a slot is keyed by its successor)
            if turn:
                assert out.done.prompt_cached_tokens == held[k] - 1, (k, turn)
            held[k] = len(engine.tokenize(history[k])) + len(out.ids)
            text = engine.detokenize(out.ids)
            history[k] += text + "<|im_end|>\n<|im_start|>user\nAnd more?<|im_end|>\n"
            history[k] += "<|im_start|>assistant\n"


def test_tiny_models_of_each_batched_family_match_alone(checkpoint_factory):
    """qwen3 (q/k norms) and qwen2 (q/k/v biases) through the scheduler: the same greedy
    tokens as alone, and the rows of a shared forward equal one-row forwards."""
    for family in ("qwen3", "qwen2"):
        engine = Engine(EngineOptions(model_path=checkpoint_factory(family), parallel=3))
        assert engine.parallel == 3
        reqs = [
            Completion(
                id=f"{family}{i}",
                tokens=[5 + i, 17, 33 + 3 * i],
                options=Options(temperature=0, num_predict=10 + i),
            )
            for i in range(5)
        ]
        expected = {r.id: alone(engine, r).ids for r in reqs}
        outs, scheduler = together(engine, reqs)
        assert scheduler.shared_steps > 0
        for r in reqs:
            assert outs[r.id].ids == expected[r.id]


def test_think_budgets_close_the_span_in_shared_forwards_as_alone(engine):
    """A think budget forces the close marker in the middle of a stream: with others decoding,
    the stream feeds it in forwards of its own and continues exactly as alone."""
    reqs = [
        Completion(
            id=f"t{i}",
            prompt=CHAT.format(q) + "<think>\n",
            think_budget=2 + 3 * i,
            options=Options(temperature=0, num_predict=20 + i),
        )
        for i, q in enumerate(QUESTIONS[:4])
    ]
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0
    closed = [r.id for r in reqs if "</think>" in engine.detokenize(solo[r.id].ids)]
    assert len(closed) >= 2  # the budget forced the marker mid-stream
    for r in reqs:
        assert outs[r.id].ids == solo[r.id].ids, r.id


def test_logprobs_and_stop_strings_in_shared_forwards_equal_alone(engine):
    """Plain decoding alone (a verify row's logits may differ from a plain row's in the last
    bits; the tokens never do): a shared forward's rows give the same logprobs, bit for bit."""
    reqs = [
        Completion(
            id=f"l{i}",
            prompt=CHAT.format(q),
            logprobs=True,
            top_logprobs=3,
            speculative=False,
            options=Options(temperature=0, num_predict=16, stop=[".", "\n"] if i % 2 else None),
        )
        for i, q in enumerate(QUESTIONS[:3])
    ]
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, _ = together(engine, reqs)
    for r in reqs:
        got = [f for f in outs[r.id].frames if isinstance(f, Token)]
        want = [f for f in solo[r.id].frames if isinstance(f, Token)]
        assert [f.content for f in got] == [f.content for f in want]
        assert [f.logprobs for f in got] == [f.logprobs for f in want]
        assert outs[r.id].done.done_reason == solo[r.id].done.done_reason


def test_constrained_streams_in_shared_forwards_equal_alone(engine):
    """``format`` requests decode in shared forwards through their own matchers (a mask per
    row) and give what they give alone; alone they speculate under the constraint."""
    import json

    from tests.test_format import SCHEMAS

    reqs = []
    for i, (topic, schema) in enumerate(SCHEMAS[:3]):
        ask = f"Reply with JSON only matching this JSON Schema: {json.dumps(schema)}. Give {topic}."
        reqs.append(
            Completion(
                id=f"j{i}",
                messages=[{"role": "user", "content": ask}],
                format=schema,
                options=Options(temperature=0.0 if i % 2 == 0 else 0.7, seed=3, num_predict=80),
            )
        )
    reqs.append(request("free", QUESTIONS[0], num_predict=30))
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0
    for r in reqs:
        assert outs[r.id].ids == solo[r.id].ids, r.id
        if r.format is not None:
            json.loads(engine.detokenize(outs[r.id].ids))


def test_a_failure_outside_the_streams_ends_them_all_and_the_engine_serves_on(engine):
    reqs = [request(f"x{i}", q, num_predict=30) for i, q in enumerate(QUESTIONS[:3])]
    expected = alone(engine, reqs[0]).ids
    scheduler = Scheduler(engine)
    outs = {r.id: Collector() for r in reqs}
    for r in reqs:
        scheduler.admit(engine.prepare(r), outs[r.id], lambda: False)
    for _ in range(6):
        scheduler.step()
    ended = scheduler.fail_all(RuntimeError("scheduler bug"))
    assert {s.req.id for s in ended} == {r.id for r in reqs} and not scheduler.active
    assert scheduler.room == engine.parallel
    for r in reqs:
        frames = outs[r.id].frames
        assert outs[r.id].done.done_reason == "error"
        assert any(isinstance(f, Error) for f in frames)
    assert alone(engine, reqs[0]).ids == expected


def test_a_prompt_waiting_for_its_turn_sees_its_cancel_at_once(engine):
    """Behind a long prompt that prefills a chunk a step, a waiting request's cancel ends it
    at the next step, with a cancelled done, and leaves the long prompt's answer unchanged."""
    long_prompt = CHAT.format(" ".join(QUESTIONS * 12))
    first = Completion(id="long", prompt=long_prompt, options=Options(temperature=0, num_predict=4))
    expected = alone(engine, first).ids
    engine.prefix.clear()
    scheduler = Scheduler(engine)
    outs = {"long": Collector(), "w": Collector()}
    flags = {"w": False}
    scheduler.admit(engine.prepare(first), outs["long"], lambda: False)
    scheduler.admit(engine.prepare(request("w", QUESTIONS[1])), outs["w"], lambda: flags["w"])
    scheduler.step()  # the long prompt's first chunk
    flags["w"] = True
    ended = scheduler.step()
    assert [s.req.id for s in ended] == ["w"] and outs["w"].done.done_reason == "cancelled"
    while scheduler.active:
        scheduler.step()
    assert outs["long"].ids == expected
