"""The suffix drafter (``drafting.suffix``): its index against a brute-force search, its
acceptance and cost model, its rounds on the round driver's fake seam (no head step, the head
still following every committed token, output equal to plain decoding greedy and seeded), and
on real models through the engine: the default model with its head and a model with none."""

from __future__ import annotations

import random

import pytest

import drafting.suffix as suffix_module
from drafting.depth import FixedDepth
from drafting.rounds import RoundDriver, RoundError
from drafting.suffix import (
    BUCKETS,
    CANDIDATES,
    MAX_MATCH,
    SuffixDrafter,
    SuffixIndex,
    SuffixModel,
    bucket_of,
)
from runner.engine import Engine, EngineOptions
from tests.fakes import (
    FakeOps,
    ScriptedEmitter,
    check_state,
    hash_token,
    run_rounds,
    seeded_sampler,
    spread,
)
from tests.test_engine import complete

# --- the index


def brute_force(seq: list[int], current: int, limit: int) -> tuple[list[int], int]:
    """The lookup by exhaustive search: the newest CANDIDATES earlier occurrences of the last
    pair, the longest backward match (newest on ties), its continuation through seq + [current]
    and on around the period, cut where an equally long rival continues differently."""
    full = [*seq, current]
    n = len(seq)
    places = [p for p in range(2, n + 1) if p <= n - 1 and full[p - 2 : p] == full[n - 1 : n + 1]]
    places = places[-CANDIDATES:]
    if not places:
        return [], 0

    def match(p: int) -> int:
        m = 0
        while m < MAX_MATCH and p - 1 - m >= 0 and full[p - 1 - m] == full[n - m]:
            m += 1
        return m

    def continuation(p: int, count: int) -> list[int]:
        out: list[int] = []
        for i in range(count):
            out.append(full[p + i] if p + i <= n else out[i - (n + 1 - p)])
        return out

    return longest_match([(match(p), p) for p in places], continuation, limit)


def longest_match(scored: list[tuple[int, int]], continuation, limit: int) -> tuple[list[int], int]:
    """The draft of the longest ``(match, position)`` (the newest on ties), cut where an
    equally long rival's ``continuation(position, count)`` differs."""
    best_match, best = max(scored)
    draft = continuation(best, limit)
    for m, p in scored:
        if m == best_match and p != best:
            other = continuation(p, len(draft))
            pairs = enumerate(zip(other, draft[: len(other)], strict=True))
            same = next((i for i, (a, b) in pairs if a != b), len(other))
            draft = draft[: max(same, 1)]
    return draft, best_match


@pytest.mark.parametrize("alphabet", [3, 5, 40])
def test_lookup_is_the_brute_force_search(alphabet):
    rng = random.Random(alphabet)
    for case in range(30):
        length = rng.randrange(2, 160)
        if alphabet == 40:  # long copies: a text with a passage repeated and edited
            base = [rng.randrange(alphabet) for _ in range(length // 2 + 2)]
            seq = base + [t if rng.random() > 0.05 else rng.randrange(alphabet) for t in base]
        else:
            seq = [rng.randrange(alphabet) for _ in range(length)]
        index = SuffixIndex()
        for i, token in enumerate(seq):
            limit = rng.randrange(1, 16)
            want = brute_force(seq[:i], token, limit)
            assert index.lookup(token, limit) == want, (case, i)
            index.extend([token])


def test_extending_token_by_token_equals_one_extend():
    rng = random.Random(7)
    seq = [rng.randrange(6) for _ in range(300)]
    one = SuffixIndex(seq)
    many = SuffixIndex()
    for token in seq:
        many.extend([token])
    for current in range(6):
        assert one.lookup(current, 12) == many.lookup(current, 12)


def test_a_loop_continues_around_its_period():
    index = SuffixIndex([9, 1, 2, 3, 1, 2])
    draft, match = index.lookup(3, 8)
    assert draft == [1, 2, 3, 1, 2, 3, 1, 2] and match == 3
    assert index.lookup(7, 8) == ([], 0)  # the pair (2, 7) never occurred


def test_the_prediction_for_the_last_token_looks_up_one_position_back():
    index = SuffixIndex([5, 6, 7, 8, 0, 5, 6, 7])
    assert index.lookup(7, 3, n=7) == ([8, 0, 5], 3)


def test_the_index_restarts_from_its_newest_half(monkeypatch):
    monkeypatch.setattr(suffix_module, "MAX_INDEXED", 64)
    rng = random.Random(3)
    seq = [rng.randrange(50) for _ in range(200)]
    index = SuffixIndex(seq)
    assert len(index) == 200 and index.tokens == seq[-32:]
    fresh = SuffixIndex(seq[-32:])
    for current in range(50):
        assert index.lookup(current, 5) == fresh.lookup(current, 5)
    # The drafter's sync goes on from the count of tokens seen, not the ones kept.
    drafter = SuffixDrafter(SuffixModel(), seq, lambda: [1, 2])
    drafter.index = index
    drafter.sync()
    assert index.tokens[-2:] == [1, 2] and len(index) == 202


# --- the model


def test_acceptance_moves_the_chosen_length():
    model = SuffixModel()
    bucket = bucket_of(10)
    start, _ = model.best_length(bucket, 15)
    for _ in range(40):
        model.observe(bucket, 12, 12)  # every draft accepted
    longer, rate = model.best_length(bucket, 15)
    assert longer > start and rate > 2.0
    for _ in range(60):
        model.observe(bucket, 6, 0)  # first drafts rejected
    assert model.best_length(bucket, 15)[0] < longer
    assert model.expected(bucket, 4) < 1.5


def test_early_misses_cannot_shut_out_the_longest_matches():
    """Two rejected drafts in the longest-match bucket before any other verdict would price
    its drafts below plain decoding for good (it never drafts again, so never learns); a
    bucket's rates are never below a shorter match's."""
    model = SuffixModel()
    top, below = len(BUCKETS) - 1, len(BUCKETS) - 2
    for _ in range(2):
        model.observe(top, 8, 0)
    assert model.best_length(top, 15)[0] == 0  # nothing else known: its own estimate
    for _ in range(40):
        model.observe(below, 12, 12)
    shorter, rate = model.best_length(below, 15)
    assert model.best_length(top, 15) == (shorter, rate) and shorter >= 8
    for _ in range(40):
        model.observe(below, 6, 0)  # a shorter match going bad lowers the longer one too
    assert model.best_length(top, 15)[0] < shorter


def test_costs_are_a_line_fitted_to_the_rounds_timed():
    model = SuffixModel()
    prior = suffix_module.ROW_BASE + 4 * suffix_module.ROW_SLOPE
    assert model.relative_cost(5) == pytest.approx(prior)
    model.verify_round(3, 0.5)  # no plain step timed yet: nothing to compare with
    assert model.relative_cost(5) == pytest.approx(prior)
    model.plain_step(0.010)
    for _ in range(40):  # rounds of 3 and 9 rows on the line 1.5 + 0.25 (r - 1)
        model.verify_round(3, 0.020)
        model.verify_round(9, 0.035)
    base, slope = model.cost_line()
    assert base == pytest.approx(1.5, abs=0.05) and slope == pytest.approx(0.25, abs=0.02)
    assert model.relative_cost(6) == pytest.approx(1.5 + 5 * 0.25, abs=0.1)
    # A round of one length moves the estimate at every length (old samples fade).
    before = [model.relative_cost(r) for r in (3, 5)]
    for _ in range(40):
        model.verify_round(5, 0.015)
    assert model.relative_cost(3) < before[0] - 0.2 and model.relative_cost(5) < before[1]
    # Costly rows shorten the draft for the same acceptance.
    cheap = SuffixModel()
    for m in (model, cheap):
        for _ in range(30):
            m.observe(len(BUCKETS) - 1, 10, 7)
    cheap.plain_step(0.010)
    for rows in range(2, 17):
        cheap.verify_round(rows, 0.010 * (1 + 0.05 * (rows - 1)))
    costly = SuffixModel()
    for _ in range(30):
        costly.observe(len(BUCKETS) - 1, 10, 7)
    costly.plain_step(0.010)
    for rows in range(2, 17):
        costly.verify_round(rows, 0.010 * (1.2 + 0.9 * (rows - 1)))
    assert cheap.best_length(len(BUCKETS) - 1, 15)[0] > costly.best_length(len(BUCKETS) - 1, 15)[0]


def test_the_round_clock_times_plain_steps_and_suffix_rounds():
    now = [0.0]
    model = SuffixModel()
    drafter = SuffixDrafter(model, [], lambda: [], clock=lambda: now[0])
    # A "plain" mark comes as a plain step ends, a round's as the round starts.
    for kind, rows, seconds in [
        ("plain", 1, 0.01),
        ("plain", 1, 0.01),  # plain to plain: one plain step
        ("plain", 1, 0.03),
        ("suffix", 5, 0.04),  # plain to a round: not a step (the gap before the round)
        ("suffix", 5, 0.02),  # round to round: the first round's cost
        ("plain", 1, 0.0),  # round to plain: a round and the pipeline's refill, not a sample
    ]:
        drafter.started(kind, rows)
        now[0] += seconds
    assert model.plain_seconds == pytest.approx(0.01)
    assert model.state()["rounds_timed"] == 1  # the one round to round span: 4 plain steps


# --- rounds on the fake seam

V = 16
PROMPT = [3, 7, 1, 9, 4, 11, 5, 7, 1, 9]
X = 6


def copying_target(pattern: list[int], noise: int):
    """A target that writes ``pattern`` over and over, with a hashed token every ``noise``
    positions (so drafts from the text are mostly, not always, right)."""

    def token(seq) -> int:
        if noise and len(seq) % noise == noise - 1:
            return hash_token(seq, V)
        return pattern[len(seq) % len(pattern)]

    return token


def drive(
    *, head: bool, suffix: bool, depth: int, budget: int, target, sampler=None, probs=None, first=X
):
    ops = FakeOps(PROMPT, vocab=V, head=head, target=target, sampler=sampler, **(probs or {}))
    emitter = ScriptedEmitter(eos=())
    source = None
    if suffix:
        source = SuffixDrafter(SuffixModel(), PROMPT, lambda: driver.committed, fixed=depth or None)
    driver = RoundDriver(
        ops, emitter.push, lambda: False, depth=FixedDepth(depth), budget=budget, suffix=source
    )
    end = run_rounds(driver, first)
    return ops, driver, end


def test_a_suffix_round_feeds_the_draft_without_a_head_step():
    target = copying_target([X, 1, 9, 4, 11, 5, 7], noise=0)
    ops, driver, _ = drive(head=True, suffix=True, depth=4, budget=20, target=target)
    fixed = ops.events("fixed_proposal")
    assert fixed, "the suffix drafter never drafted"
    assert driver.stats.sources["suffix"]["accepted"] > 0
    # A round that took a suffix draft fed it right after x, with no head step between.
    log = ops.ops_log()
    for i, entry in enumerate(log):
        if entry[0] == "fixed_proposal":
            verify = next(e for e in log[i:] if e[0] == "verify")
            assert verify[1][1:] == entry[1]
            assert all(e[0] != "head_step" for e in log[i : log.index(verify, i)])
    check_state(ops, driver)  # the head's pairs cover every committed token


@pytest.mark.parametrize("head", [True, False], ids=["head", "no-head"])
def test_greedy_rounds_with_suffix_drafts_equal_plain_greedy(head):
    for noise in (0, 3, 5):
        target = copying_target([2, 8, 1, 9, 4], noise)
        for budget in (1, 2, 9, 30):
            plain_ops, plain, plain_end = drive(
                head=head, suffix=False, depth=0, budget=budget, target=target
            )
            for depth in (1, 3, 8):
                ops, driver, end = drive(
                    head=head, suffix=True, depth=depth, budget=budget, target=target
                )
                case = (noise, budget, depth)
                assert end == plain_end, case
                assert driver.emitted == plain.emitted, case
                assert ops.fed == plain_ops.fed, case
                if head:
                    assert ops.pairs == plain_ops.pairs, case
                check_state(ops, driver)


@pytest.mark.parametrize("kind", ["host", "host-bare", "target"])
def test_a_suffix_round_whose_verify_fails_leaves_the_caches_at_a_named_state(kind):
    """The fault rows of a verify feed hold for suffix drafts: a host failure commits x and
    goes on from the salvage (or ends the request, caches reusable); a target failure ends it
    with the caches not reusable."""
    target = copying_target([X, 1, 9, 4, 11, 5, 7], noise=0)
    ops = FakeOps(PROMPT, vocab=V, head=True, target=target)
    emitter = ScriptedEmitter(eos=())
    drafter = SuffixDrafter(SuffixModel(), PROMPT, lambda: driver.committed, fixed=4)
    driver = RoundDriver(
        ops, emitter.push, lambda: False, depth=FixedDepth(4), budget=20, suffix=drafter
    )
    ops.arm("verify_feed", 0, kind)
    assert driver.plan().suffix  # the prompt's text continues after its 1, 9: 4 is drafted from
    if kind == "target":
        with pytest.raises(RoundError) as raised:
            driver.round(4)
        assert not raised.value.reusable
        return
    if kind == "host-bare":
        with pytest.raises(RoundError) as raised:
            driver.round(4)
        assert raised.value.reusable and driver.committed == [4]
        return
    end = driver.round(4)
    assert ops.events("fixed_proposal") and driver.committed == [4] and not ops.head_alive
    end = run_rounds(driver, end.next)  # the rest of the request, suffix rounds included
    plain_ops, plain, _ = drive(head=True, suffix=False, depth=0, budget=20, target=target, first=4)
    assert driver.emitted == plain.emitted and ops.fed == plain_ops.fed
    check_state(ops, driver)


def test_seeded_rounds_with_suffix_and_head_drafts_equal_plain_sampling():
    """Random drafts from both drafters (the head's own distribution, and the text's
    continuations of a sampled target) against target-only rounds with the same seed."""
    for seed in range(10):
        probs = {"target_probs": spread(70 + seed, V, banned=()), "draft_probs": spread(90, V)}
        runs = [
            drive(
                head=True,
                suffix=suffix,
                depth=depth,
                budget=25,
                target=None,
                sampler=seeded_sampler(seed, V),
                probs=probs,
            )
            for suffix, depth in ((False, 0), (True, 2), (True, 5))
        ]
        (_, plain, _), *others = runs
        for ops, driver, _ in others:
            assert driver.emitted == plain.emitted, seed
            check_state(ops, driver)


# --- real models through the engine

COPY = (
    "<|im_start|>user\nRepeat this list exactly:\n"
    "apples, pears, plums, cherries, grapes, lemons, limes, oranges, figs, dates, kiwis, "
    "melons, peaches, apricots, mangoes<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def default_engine(default_model):
    # Fixed lengths: whether the adaptive choice drafts depends on timings, which a loaded
    # machine skews; a fixed length drafts whenever the text has a continuation.
    return Engine(EngineOptions(model_path=default_model, draft_depth=4))


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0, "repeat_penalty": 1.0},
        {"temperature": 0.7, "seed": 11, "repeat_penalty": 1.0},
    ],
    ids=["greedy", "seeded"],
)
def test_default_model_copies_through_suffix_drafts_losslessly(default_engine, sampling):
    assert default_engine.info.draft_sources == ("head", "suffix")
    plain = complete(default_engine, COPY, speculative=False, num_predict=48, **sampling)
    spec = complete(default_engine, COPY, num_predict=48, **sampling)
    assert spec[0] == plain[0]
    sources = spec[2].speculation.sources
    assert sources["suffix"].drafted > 0
    if sampling["temperature"] == 0.0:  # the list is in the prompt: copied drafts pass
        assert sources["suffix"].accepted > 0


@pytest.mark.parametrize("depth", [None, 4], ids=["adaptive", "fixed-4"])
def test_a_model_without_a_head_speculates_with_the_suffix_drafter(checkpoint_factory, depth):
    path = checkpoint_factory("qwen3")
    engine = Engine(EngineOptions(model_path=path, draft_depth=depth))
    assert engine.head is None and engine.info.draft_sources == ("suffix",)
    # A random model's greedy text falls into loops: text already seen, drafted from.
    prompt = list(range(5, 25)) * 2
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 4}):
        plain = complete(engine, tokens=prompt, speculative=False, num_predict=40, **sampling)
        spec = complete(engine, tokens=prompt, num_predict=40, **sampling)
        assert spec[0] == plain[0], sampling
        assert spec[2].speculation.final_depth == 0  # no head, no head depth
        if depth is not None and sampling["temperature"] == 0.0:
            assert spec[2].speculation.sources["suffix"].rounds > 0, spec[2].speculation


def test_draft_sources_choose_the_drafters(default_model):
    head_only = Engine(EngineOptions(model_path=default_model, draft_sources=("head",)))
    assert head_only.info.draft_sources == ("head",)
    done = complete(head_only, COPY, num_predict=24, temperature=0.0)[2]
    assert "suffix" not in done.speculation.sources
    off = Engine(EngineOptions(model_path=default_model, use_draft=False))
    assert off.speculation is None and off.info.draft_sources == ()


# --- warm rounds: the prompt's last token fed with the first drafts


def warm_and_plain(*, head: bool, suffix: bool, depth: int, budget: int, target, sampler_seed=None):
    """A request started by a warm round, and the same request started by feeding the last
    prompt token alone (a target-only feed, then target-only rounds)."""
    *before, last = PROMPT

    def make(drafting: bool):
        sampler = seeded_sampler(sampler_seed, V) if sampler_seed is not None else None
        ops = FakeOps(before, vocab=V, head=head, target=target, sampler=sampler)
        emitter = ScriptedEmitter(eos=())
        source = None
        if suffix and drafting:
            source = SuffixDrafter(SuffixModel(), PROMPT, lambda: driver.committed, fixed=depth)
        driver = RoundDriver(
            ops,
            emitter.push,
            lambda: False,
            depth=FixedDepth(depth if drafting else 0),
            budget=budget,
            suffix=source,
        )
        return ops, driver

    ops, driver = make(True)
    end = driver.warm_round(last)
    assert end is not None, "the warm round did not run"
    if not end.finished:
        end = run_rounds(driver, end.next)
    ref_ops, ref = make(False)
    first = ref_ops.verify_feed(last, None).successors[0]
    ref_end = run_rounds(ref, first)
    return (ops, driver, end), (ref_ops, ref, ref_end)


@pytest.mark.parametrize("source", ["head", "suffix"])
def test_a_warm_round_starts_generation_as_a_plain_start_would(source):
    target = copying_target([2, 8, 1, 9, 4], noise=4)
    for budget in (2, 5, 17):
        for seed in (None, 3):
            (ops, driver, end), (ref_ops, ref, ref_end) = warm_and_plain(
                head=source == "head",
                suffix=source == "suffix",
                depth=3,
                budget=budget,
                target=target,
                sampler_seed=seed,
            )
            case = (budget, seed)
            assert driver.emitted == ref.emitted and end == ref_end, case
            assert ops.fed == ref_ops.fed, case
            assert driver.committed == ref.committed, case  # generated tokens only
            log = ops.ops_log()
            assert log[0] == ("fed_prompt", PROMPT[-1]), case
            first_verify = next(e for e in log if e[0] == "verify")
            assert first_verify[1][0] == PROMPT[-1] and len(first_verify[1]) > 1, case
            ops.prompt = list(PROMPT)  # the last prompt token is fed now: the invariant's
            check_state(ops, driver)  # prompt is the whole one


def test_no_draft_means_no_warm_round_and_nothing_changed():
    *before, last = PROMPT
    ops = FakeOps(before, vocab=V, head=False)
    emitter = ScriptedEmitter(eos=())
    drafter = SuffixDrafter(SuffixModel(), [*before, 15, last], lambda: [], fixed=3)  # unseen text
    driver = RoundDriver(ops, emitter.push, lambda: False, depth=FixedDepth(3), suffix=drafter)
    assert driver.warm_round(last) is None
    assert ops.fed == before and ops.ops_log() == [] and emitter.pushed == []


def test_a_warm_round_whose_verify_fails_on_the_host_goes_back_to_the_entry():
    *before, last = PROMPT
    ops = FakeOps(before, vocab=V, head=True)
    ops.arm("verify_feed", 0, "host")
    emitter = ScriptedEmitter(eos=())
    driver = RoundDriver(ops, emitter.push, lambda: False, depth=FixedDepth(2), budget=8)
    assert driver.warm_round(last) is None
    assert ops.fed == before and driver.committed == [] and emitter.pushed == []
    assert not ops.head_alive  # the head was discarded; plain decoding goes on


def test_the_cli_reports_its_drafters_and_each_drafters_share(default_model):
    """The real process: ``ready.draft_sources`` and ``done.speculation.sources`` on the wire."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    request = {
        "type": "completion",
        "id": "a",
        "prompt": COPY,
        "options": {"temperature": 0, "num_predict": 40, "repeat_penalty": 1.0},
    }
    argv = [sys.executable, "-m", "runner", "--model", default_model, "--draft-sources", "suffix"]
    argv += ["--draft-depth", "4"]  # drafts whenever the text has a continuation
    out = subprocess.run(
        argv,
        cwd=root,
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    frames = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    frames = [f for f in frames if f["type"] != "progress"]
    assert out.returncode == 0 and frames[0]["type"] == "ready", out.stderr[-2000:]
    assert frames[0]["draft_sources"] == ["suffix"] and frames[0]["mtp"] is False
    done = frames[-1]
    assert done["type"] == "done"
    sources = done["speculation"]["sources"]
    assert set(sources) == {"suffix"} and sources["suffix"]["accepted"] > 0
    assert sources["suffix"]["accepted"] == done["speculation"]["accepted"]


def test_time_spent_elsewhere_cannot_stop_suffix_drafting_for_good():
    """A span that covered shared forwards (or a stall) is clamped, a pause keeps it out of
    the clock, and round costs fade back toward the prior over plain steps."""
    now = [0.0]
    model = SuffixModel()
    bucket = len(BUCKETS) - 1
    for _ in range(30):
        model.observe(bucket, 8, 8)
    drafter = SuffixDrafter(model, [], lambda: [], clock=lambda: now[0])
    for _ in range(5):  # plain steps of 10 ms
        drafter.started("plain")
        now[0] += 0.010
    for _ in range(5):  # suffix rounds of 9 rows at 3 plain steps each
        drafter.started("suffix", 9)
        now[0] += 0.030
    healthy = model.best_length(bucket, 15)[0]
    assert healthy >= 4
    drafter.started("suffix", 9)
    drafter.pause()  # shared forwards follow: 3 s that are no round's cost
    now[0] += 3.0
    drafter.started("suffix", 9)
    assert model.best_length(bucket, 15)[0] == healthy
    now[0] += 3.0  # an unpaused stall: clamped to twice the line's cost
    drafter.started("suffix", 9)
    assert model.best_length(bucket, 15)[0] > 0
    for _ in range(200):  # and any damage fades over plain steps
        model.plain_step(0.010)
    assert model.best_length(bucket, 15)[0] >= healthy - 2
