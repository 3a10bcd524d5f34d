"""Speculation inside shared forwards (``runner.batch``): a stream whose text was seen before
feeds its token with the suffix drafter's draft in the forward it shares with other streams,
each sequence's rows attending over its own cache (``Model.hidden_rows`` with counts). Every
stream still gives exactly what it gives alone; a round that fails, or a cancel, ends its own
stream only; and the drafts' length follows what a row costs the shared step."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from drafting.seam import HostError, TargetError
from drafting.suffix import SuffixModel
from protocol.frames import Error, Token
from protocol.requests import Completion
from runner.batch import ROW_COST_PRIOR, Scheduler, SharedCost
from runner.engine import Engine, EngineOptions
from runner.prefill import prefill
from tests.test_batch import CHAT, QUESTIONS, Collector, alone, equal_alone, request, together

# Prompts whose answers copy them: their streams draft from the prompt in shared forwards.
PASSAGES = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def area(width, height):\n    return width * height\n\nprint(area(3, 4))",
    "Rain fell on the quiet harbour while the fishing boats waited for the morning tide.",
    "Alice has three apples, Bob has four pears and Carol has five plums in her basket.",
]


def copying(rid: str, i: int, **options) -> Completion:
    """A request whose answer copies a passage of its prompt (no repeat penalty)."""
    text = f"Repeat this text exactly, twice: {PASSAGES[i % len(PASSAGES)]}"
    return request(rid, text, **{"repeat_penalty": 1.0, **options})


def chatting(rid: str, i: int, **options) -> Completion:
    return request(rid, QUESTIONS[i], **{"repeat_penalty": 1.0, **options})


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(EngineOptions(model_path=default_model, parallel=8))


@pytest.fixture(scope="module")
def four(default_model):
    return Engine(EngineOptions(model_path=default_model, parallel=4))


@pytest.fixture
def drafts_pay(monkeypatch):
    """Rows taken as nearly free: a stream drafts whenever the index continues its text, so
    whether rounds run in the shared forwards does not hang on the step times a loaded
    machine measures (``SharedCost``; its own tests are below)."""
    monkeypatch.setattr(SharedCost, "row_cost", lambda self, streams: 0.01)


def suffix_drafted(out: Collector) -> int:
    sources = out.done.speculation.sources or {}
    return sources["suffix"].drafted if "suffix" in sources else 0


def test_ragged_rows_equal_each_sequence_fed_alone(engine):
    """``hidden_rows`` with 1, 3, 8 and 2 rows for four sequences: each sequence's rows have
    the bits of a causal forward of its own rows after its own cache, and each cache holds
    its own rows after."""
    model = engine.model
    prompts = [engine.tokenize(CHAT.format(q)) for q in QUESTIONS[:4]]
    counts = [1, 3, 8, 2]
    fed = [[(31 * i + 7 * j) % 900 + 20 for j in range(n)] for i, n in enumerate(counts)]
    solo, caches = [], []
    for prompt, tokens in zip(prompts, fed, strict=True):
        own = model.make_caches()
        prefill(model, own, prompt, 0)
        mask = "causal" if len(tokens) > 1 else None
        solo.append(np.array(model.hidden(mx.array([tokens]), own, mask=mask)[0]))
        shared = model.make_caches()
        prefill(model, shared, prompt, 0)
        caches.append(shared)
    rows = model.hidden_rows(mx.array(sum(fed, [])), caches, counts)
    start = 0
    for i, n in enumerate(counts):
        assert np.array_equal(np.array(rows[start : start + n]), solo[i]), i
        assert all(c.offset == len(prompts[i]) + n for c in caches[i])
        start += n
    with pytest.raises(ValueError, match="rows for 4 cache lists"):
        model.hidden_rows(mx.array(sum(fed, [])), caches, [1, 3, 8, 1])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_eight_streams_speculating_in_shared_forwards_equal_alone(engine, sampled, drafts_pay):
    """Four copying and four chatting streams at once: the copying ones verify suffix drafts
    inside the shared forwards (and with the head's drafts when they end up alone), and
    every stream's tokens and ending equal its own alone."""
    extra = {"temperature": 0.8, "top_k": 40, "seed": 11} if sampled else {}
    reqs = [copying(f"c{i}", i, num_predict=48 + 5 * i, **extra) for i in range(4)]
    reqs += [chatting(f"q{i}", i, num_predict=30 + 7 * i, **extra) for i in range(4)]
    outs, scheduler = equal_alone(engine, reqs)
    assert scheduler.shared_rounds > 0
    assert sum(suffix_drafted(outs[f"c{i}"]) for i in range(4)) > 0


def test_without_speculation_shared_forwards_feed_one_row_a_stream(engine):
    """``speculative: false`` requests never draft, in shared forwards either."""
    reqs = [copying(f"n{i}", i, num_predict=40) for i in range(3)]
    for r in reqs:
        r.speculative = False
    solo = {r.id: alone(engine, r).ids for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0 and scheduler.shared_rounds == 0
    assert all(outs[r.id].ids == solo[r.id] for r in reqs)


def test_shared_draft_rows_zero_keeps_drafts_to_streams_alone(engine, monkeypatch, drafts_pay):
    """``--shared-draft-rows 0``: shared forwards feed one row a stream (the same requests
    draft there otherwise), and every stream gives what it gives alone."""
    reqs = [copying(f"o{i}", i, num_predict=30 + 10 * i) for i in range(3)]
    solo = {r.id: alone(engine, r).ids for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_rounds > 0
    monkeypatch.setattr(engine, "shared_draft_rows", 0)
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0 and scheduler.shared_rounds == 0
    assert all(outs[r.id].ids == solo[r.id] for r in reqs)


def test_logprobs_and_stop_strings_of_shared_rounds_match_alone(engine, drafts_pay):
    """Copying streams asking for logprobs, one with a stop string: the same text and tokens
    as alone, a logprob entry for every token, each the one alone gives it up to the last
    bits (a verify row's logits may differ from a plain row's there; alone and shared, the
    rounds fall at other positions)."""
    reqs = [copying(f"p{i}", i, num_predict=40, stop=["dog"] if i == 0 else None) for i in range(3)]
    for r in reqs:
        r.logprobs, r.top_logprobs = True, 2
    solo = {r.id: alone(engine, r) for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_rounds > 0
    for r in reqs:
        got = [f for f in outs[r.id].frames if isinstance(f, Token)]
        want = [f for f in solo[r.id].frames if isinstance(f, Token)]
        assert [f.content for f in got] == [f.content for f in want], r.id
        entries = [e for f in got for e in f.logprobs]
        expected = [e for f in want for e in f.logprobs]
        assert [e.id for e in entries] == [e.id for e in expected] == outs[r.id].ids
        for e, x in zip(entries, expected, strict=True):
            assert e.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert len(e.top_logprobs) == len(x.top_logprobs) == 2
        assert outs[r.id].done.done_reason == solo[r.id].done.done_reason


def run_with_failing_round(engine, reqs, victim: str, error: Exception):
    """The scheduler over ``reqs``; the victim's first verification inside a shared forward
    raises ``error`` (once its stream has decoded a few steps)."""
    scheduler = Scheduler(engine)
    outs = {r.id: Collector() for r in reqs}
    for r in reqs:
        scheduler.admit(engine.prepare(r), outs[r.id], lambda: False)
    armed = False
    fired = []
    while scheduler.active:
        stream = next((s for s in scheduler.streams if s.req.id == victim), None)
        if not armed and stream is not None and stream.decode is not None:
            ops = stream.decode.drafter.ops
            verify_rows = ops.verify_rows

            def failing(current, proposal, entry, hidden, logits=None, verify_rows=verify_rows):
                if logits is not None and not fired:  # a shared forward's rows
                    fired.append(entry)
                    raise error
                return verify_rows(current, proposal, entry, hidden, logits)

            ops.verify_rows = failing
            armed = True
        scheduler.step()
    return outs, fired


@pytest.mark.parametrize(
    "error", [HostError("host fault in a shared round"), TargetError("target fault")]
)
def test_a_shared_round_that_fails_ends_its_own_stream_only(engine, error, drafts_pay):
    """A host failure after the shared forward (VERIFY_HOST, no salvage) ends the stream
    with an error, its caches rewound to the committed prefix; a target failure ends it and
    resets its slot. The other streams' tokens are unchanged, and the engine serves the
    victim's request again exactly as before."""
    reqs = [copying(f"v{i}", i, num_predict=60) for i in range(3)]
    reqs.append(chatting("v3", 0, num_predict=60))
    expected = {r.id: alone(engine, r).ids for r in reqs}
    outs, fired = run_with_failing_round(engine, reqs, "v0", error)
    assert fired, "the victim never verified inside a shared forward"
    victim = outs["v0"]
    assert victim.done.done_reason == "error"
    assert any(isinstance(f, Error) for f in victim.frames)
    assert victim.ids == expected["v0"][: len(victim.ids)]
    for rid in ("v1", "v2", "v3"):
        assert outs[rid].ids == expected[rid], rid
    assert alone(engine, reqs[0]).ids == expected["v0"]


def test_cancelling_a_speculating_stream_leaves_the_others_unchanged(engine, drafts_pay):
    reqs = [copying(f"k{i}", i, num_predict=50) for i in range(4)]
    expected = {r.id: alone(engine, r).ids for r in reqs}
    outs, scheduler = together(engine, reqs, cancel_after={"k0": 12})
    assert scheduler.shared_rounds > 0
    cancelled = outs["k0"]
    assert cancelled.done.done_reason == "cancelled"
    assert 12 <= len(cancelled.ids) < len(expected["k0"])
    assert cancelled.ids == expected["k0"][: len(cancelled.ids)]
    for rid in ("k1", "k2", "k3"):
        assert outs[rid].ids == expected[rid], rid


@pytest.mark.parametrize("seed", [3, 8])
def test_random_mixes_of_speculating_streams_equal_alone(four, seed, drafts_pay):
    """Fuzz: seven requests through four slots (copying or chatting, greedy or seeded,
    budgets, stop strings, a cancel), four speculating streams at a time: every finished
    stream equals alone, a cancelled one is a prefix of it."""
    rng = random.Random(seed)
    reqs, cancels = [], {}
    for i in range(7):
        options = {"num_predict": rng.randint(6, 60)}
        if rng.random() < 0.5:
            options.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 999))
        if rng.random() < 0.3:
            options["stop"] = [rng.choice([".", ",", "\n\n", "dog"])]
        make = copying if rng.random() < 0.6 else chatting
        reqs.append(make(f"z{i}", rng.randrange(4), **options))
        if rng.random() < 0.2:
            cancels[f"z{i}"] = rng.randint(2, 10)
    solo = {r.id: alone(four, r) for r in reqs}
    outs, scheduler = together(four, reqs, cancel_after=cancels)
    assert scheduler.shared_steps > 0
    for r in reqs:
        got, want = outs[r.id], solo[r.id]
        if got.done.done_reason == "cancelled":
            assert got.ids == want.ids[: len(got.ids)], r.id
        else:
            assert got.ids == want.ids, r.id
            assert got.done.done_reason == want.done.done_reason, r.id


# ---------------------------------------------------------------------------- the costs


def test_shared_cost_learns_what_a_row_costs_the_step():
    cost = SharedCost()
    assert cost.row_cost(4) == ROW_COST_PRIOR  # no step timed yet
    cost.observe(4, 4, 0.010)
    assert cost.row_cost(4) == pytest.approx(ROW_COST_PRIOR)  # the prior, scaled to the step
    for _ in range(200):  # rows that cost 2 ms each: 4 of a 10 ms step's tokens per ms
        cost.observe(4, 4, 0.010)
        cost.observe(4, 9, 0.020)
    assert cost.row_cost(4) == pytest.approx(0.002 * 4 / 0.010, rel=0.05)
    assert cost.row_cost(2) == ROW_COST_PRIOR  # another width's step is not known yet
    cost.observe(4, 4, 10.0)  # one stall moves the plain step by at most COST_CLAMP / 10
    assert cost.step[4] < 0.0106


def test_shared_length_takes_the_draft_whose_extra_tokens_beat_its_rows():
    model = SuffixModel()
    bucket = 4  # the longest matches: the priors expect most of their drafts to pass
    long = model.shared_length(bucket, 15, 0.1)
    short = model.shared_length(bucket, 15, 0.6)
    assert long == 15 and 0 < short < long
    assert model.shared_length(bucket, 15, 1.0) == 0  # no draft commits a token a row
    assert model.shared_length(bucket, 3, 0.1) == 3  # at most what is available
    for _ in range(40):  # drafts from this bucket are always refused
        model.observe(bucket, 4, 0)
    assert model.shared_length(bucket, 15, 0.3) == 0
