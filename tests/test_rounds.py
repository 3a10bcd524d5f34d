"""The round driver on the deterministic fake seam: one test per round transition and failure
row, RNG order, stats, and the greedy equivalence
property (speculation on == off, token for token and in final cache state)."""

from __future__ import annotations

import numpy as np
import pytest

from drafting.depth import MAX_DRAFT_DEPTH, DepthController, FixedDepth
from drafting.rounds import HostError, RoundDriver, RoundEnd, RoundError, RoundPlan, Verification
from runner.sampler import Sampler, SamplingParams
from tests.fakes import (
    FakeOps,
    GreedyDraws,
    ScriptedEmitter,
    check_state,
    emitter_frames,
    hash_token,
    one_hot,
    run_rounds,
    scripted,
    seeded_sampler,
    spread,
    tiny_tokenizer,
)

V = 16
PROMPT = [1, 5, 8]
EOS = 2
CLOSE = 4
X = 6


def sampled(seed: int, vocab: int = V) -> Sampler:
    return seeded_sampler(seed, vocab)


def fallback(seq):
    return hash_token(seq, V)


def make(ops=None, *, depth=2, budget=32, emitter=None, cancel_after=None, think=None, **ops_kw):
    ops = ops if ops is not None else FakeOps(PROMPT, vocab=V, **ops_kw)
    em = emitter if emitter is not None else ScriptedEmitter(think_budget=think)
    if cancel_after is None:
        cancelled = lambda: False
    else:
        cancelled = lambda: len(em.pushed) > cancel_after
    source = FixedDepth(depth) if isinstance(depth, int) else depth
    driver = RoundDriver(ops, em.push, cancelled, depth=source, budget=budget)
    return ops, em, driver


def full_acceptance(**kw):
    """Target wants 12, 13, 14 after x; the head drafts 12, 13."""
    return dict(
        target=scripted(X, [12, 13, 14], fallback), draft=scripted(X, [12, 13], fallback), **kw
    )


# -- target-only rounds ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_disabled_speculation_runs_target_only_rounds(mode):
    sampler = sampled(3) if mode == "sampled" else None
    ops, em, driver = make(
        depth=0, sampler=sampler, target=scripted(X, [12, 13], fallback), head=False
    )
    end = driver.round(X)
    assert end == RoundEnd("continue", 12)
    assert ops.ops_log() == [("verify", [X])]
    assert driver.committed == [X] and em.pushed == [X]
    end = driver.round(end.next)
    assert end == RoundEnd("continue", 13)
    assert ops.ops_log()[1:] == [("verify", [12])]
    assert driver.committed == [X, 12]
    assert driver.stats.rounds == 0 and driver.stats.parked == 2
    check_state(ops, driver)


# -- speculative rounds ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_full_acceptance(mode):
    sampler = sampled(5) if mode == "sampled" else None
    ops, em, driver = make(**full_acceptance(sampler=sampler))
    end = driver.round(X)
    assert end == RoundEnd("continue", 14)  # the bonus row, not yet fed or emitted
    assert em.pushed == [X, 12, 13] and driver.committed == [X, 12, 13]
    n = len(PROMPT)
    assert ops.ops_log() == [
        ("capture",),
        ("head_step", X, 2),
        ("verify", [X, 12, 13]),
        ("rewind", n + 3),
        ("head_rewind", n - 1),
        ("head_commit", [X, 12, 13]),
    ]
    stats = driver.stats
    assert (stats.drafted, stats.rounds, stats.accepted) == (2, 1, 2)
    assert stats.accepted_per_depth == [0, 0, 1]
    check_state(ops, driver)
    # the next round starts from a consistent entry state and keeps it
    end = driver.round(end.next)
    assert not end.finished
    check_state(ops, driver)


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_rejection_at_each_depth(accepted):
    drafts = [10, 11, 12]
    ops, em, driver = make(
        depth=3,
        target=scripted(X, [*drafts[:accepted], 9], fallback),
        draft=scripted(X, drafts, fallback),
    )
    end = driver.round(X)
    assert end == RoundEnd("continue", 9)
    assert driver.committed == [X, *drafts[:accepted]]
    assert em.pushed == [X, *drafts[:accepted]]
    assert ops.events("rewind") == [("rewind", len(PROMPT) + 1 + accepted)]
    assert driver.stats.drafted == 3
    assert driver.stats.accepted_per_depth[accepted] == 1
    assert sum(driver.stats.accepted_per_depth) == 1
    check_state(ops, driver)


@pytest.mark.parametrize("position", [1, 2])
def test_accepted_eos_at_each_draft_position(position):
    drafts = [10, 11, 12]
    drafts[position - 1] = EOS
    controller = DepthController(max_depth=3)
    controller.scheduled = 3
    ops, em, driver = make(
        depth=controller.for_request(),
        target=scripted(X, drafts, fallback),
        draft=scripted(X, drafts, fallback),
    )
    end = driver.round(X)
    assert end == RoundEnd("stop")
    assert em.pushed == [X, *drafts[:position]]  # EOS emitted ...
    assert driver.committed == [X, *drafts[: position - 1]]  # ... never committed
    assert ops.events("replay") == []
    assert driver.stats.rounds == 1
    # the EOS is not a generated token for the host: not counted as accepted
    assert driver.stats.accepted == position - 1 and driver.used == position
    # positions after the accepted EOS carry no verdict
    assert controller.state()["samples"] == [1] * position + [0] * (3 - position)
    check_state(ops, driver)


@pytest.mark.parametrize("token, cancel, reason", [(EOS, None, "stop"), (X, 0, "cancel")])
def test_eos_or_cancel_at_x_costs_nothing(token, cancel, reason):
    ops, em, driver = make(cancel_after=cancel)
    assert driver.round(token) == RoundEnd(reason)
    assert em.pushed == [token] and driver.emitted == [token] and driver.committed == []
    assert ops.log == []
    check_state(ops, driver)


def test_cancel_at_a_draft_keeps_the_emitted_prefix_before_it():
    ops, em, driver = make(cancel_after=1, **full_acceptance())
    assert driver.round(X) == RoundEnd("cancel")
    assert em.pushed == [X, 12]
    assert driver.committed == [X]
    assert ops.events("rewind") == [("rewind", len(PROMPT) + 1)]
    # Two drafts were accepted, one reached the host before the cancel: the stats say one.
    assert (driver.stats.accepted, driver.stats.accepted_per_depth) == (1, [0, 1])
    assert driver.used == 2
    check_state(ops, driver)


@pytest.mark.parametrize("who", ["driver", "emitter"])
def test_budget_exhausted_mid_run_commits_the_retained_prefix(who):
    if who == "driver":
        ops, em, driver = make(depth=5, budget=3, **full_acceptance())
    else:
        emitter = ScriptedEmitter(max_tokens=3)
        ops, em, driver = make(depth=2, budget=None, emitter=emitter, **full_acceptance())
    assert driver.round(X) == RoundEnd("length")
    assert ops.events("head_step") == [("head_step", X, 2)]  # k = remaining - 1
    assert driver.committed == [X, 12, 13] and em.pushed == [X, 12, 13]
    assert driver.stats.accepted == 2 and driver.used == 3
    check_state(ops, driver)


def test_eos_as_successor_is_emitted_by_the_next_round_without_forwards():
    ops, em, driver = make(
        target=scripted(X, [12, 13, EOS], fallback), draft=scripted(X, [12, 13], fallback)
    )
    end = driver.round(X)
    assert end == RoundEnd("continue", EOS)
    logged = len(ops.log)
    assert driver.round(end.next) == RoundEnd("stop")
    assert len(ops.log) == logged
    assert em.pushed == [X, 12, 13, EOS] and driver.committed == [X, 12, 13]
    check_state(ops, driver)


def test_final_slot_feeds_x_without_logits_or_draft():
    ops, em, driver = make(depth=4, budget=1)
    assert driver.plan().why == "last-token"
    assert driver.round(X) == RoundEnd("length")
    assert ops.ops_log() == [("replay", [X], False), ("head_commit", [X])]
    assert driver.committed == [X]
    check_state(ops, driver)


def test_zero_budget_emits_nothing():
    ops, em, driver = make(budget=0)
    assert run_rounds(driver, X) == RoundEnd("length")
    assert em.pushed == [] and driver.committed == [] and ops.log == []


def test_budget_clamps_the_draft_depth():
    ops, em, driver = make(depth=8, budget=4)
    assert run_rounds(driver, X).reason in ("length", "stop")
    assert ops.events("head_step")[0] == ("head_step", X, 3)
    if driver.emitted[-1] != EOS:
        assert len(driver.committed) == 4
    check_state(ops, driver)


def test_a_round_at_the_depth_ceiling_verifies_one_row_more():
    chain = [5 + i % 10 for i in range(MAX_DRAFT_DEPTH + 1)]  # never EOS
    drafts = chain[:-1]
    ops, em, driver = make(
        depth=MAX_DRAFT_DEPTH,
        budget=64,
        target=scripted(X, chain, fallback),
        draft=scripted(X, drafts, fallback),
    )
    assert driver.plan() == RoundPlan(MAX_DRAFT_DEPTH, "speculate")
    assert driver.round(X) == RoundEnd("continue", chain[-1])
    assert ops.events("verify") == [("verify", [X, *drafts])]  # MAX_DRAFT_DEPTH + 1 rows
    assert em.pushed == driver.committed == [X, *drafts]
    assert driver.stats.accepted_per_depth[MAX_DRAFT_DEPTH] == 1
    check_state(ops, driver)


def test_one_token_prompt_can_speculate():
    ops = FakeOps([1], vocab=V, **full_acceptance())
    assert ops.pairs == [] and ops.head_ready
    ops, _, driver = make(ops)
    assert driver.round(X) == RoundEnd("continue", 14)
    assert driver.committed == [X, 12, 13]
    check_state(ops, driver)


def test_unprimed_head_parks_once_then_speculates_without_an_extra_forward():
    ops, _, driver = make(primed=False, **full_acceptance())
    assert driver.plan().why == "no-head"
    end = driver.round(X)
    assert ops.ops_log() == [("verify", [X]), ("head_commit", [X])]
    assert driver.plan().why == "speculate"
    driver.round(end.next)
    assert ops.ops_log()[2:4] == [("capture",), ("head_step", 12, 2)]
    assert ops.fed == PROMPT + driver.committed


# -- forced close (think budget) ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_forced_close_at_x_replays_x_and_the_close_once(mode):
    sampler = sampled(11) if mode == "sampled" else None
    target = scripted(X, [12, 13], fallback)
    ops, em, driver = make(think=0, sampler=sampler, target=target)
    end = driver.round(X)
    assert driver.emitted == [X, CLOSE] and em.pushed == [X]
    assert ops.ops_log() == [("replay", [X, CLOSE], True), ("head_commit", [X, CLOSE])]
    assert driver.committed == [X, CLOSE]
    assert end == RoundEnd("continue", target([X, CLOSE]))
    if mode == "sampled":  # exactly one draw: the post-close successor, for the slot after it
        assert ops.events("rng") == [("rng", "draw", len(PROMPT) + 2, 1)]
    check_state(ops, driver)


def test_cancel_on_a_forced_close_feeds_nothing():
    ops, _, driver = make(think=0, cancel_after=0)
    assert driver.round(X) == RoundEnd("cancel")
    assert driver.emitted == [X, CLOSE] and driver.committed == []
    assert ops.log == []


def test_forced_close_at_a_draft_feeds_the_close_after_the_retained_run():
    emitter = ScriptedEmitter(think_budget=2)  # x is content token 1, d1 token 2
    ops, em, driver = make(emitter=emitter, **full_acceptance())
    end = driver.round(X)
    n = len(PROMPT)
    assert driver.emitted == [X, 12, CLOSE]
    assert ops.ops_log() == [
        ("capture",),
        ("head_step", X, 2),
        ("verify", [X, 12, 13]),
        ("rewind", n + 2),
        ("head_rewind", n - 1),
        ("head_commit", [X, 12]),
        ("replay", [CLOSE], True),
        ("head_commit", [CLOSE]),
    ]
    assert driver.committed == [X, 12, CLOSE]
    assert end == RoundEnd("continue", fallback([X, 12, CLOSE]))
    check_state(ops, driver)


def test_forced_close_on_the_last_token_never_draws_a_successor():
    ops, _, driver = make(budget=1, think=0)
    assert driver.round(X) == RoundEnd("length")
    assert ops.ops_log() == [("replay", [X, CLOSE], False), ("head_commit", [X, CLOSE])]
    assert driver.committed == [X, CLOSE]
    ops, _, driver = make(budget=2, think=2, **full_acceptance())
    assert driver.round(X) == RoundEnd("length")
    assert ops.events("replay") == [("replay", [CLOSE], False)]
    assert driver.committed == [X, 12, CLOSE]
    check_state(ops, driver)


# -- failures ----------------------------------------------------------------------------------


def test_emitter_failure_at_x_leaves_everything_at_entry():
    ops, _, driver = make(emitter=ScriptedEmitter(fail_at=0))
    with pytest.raises(RoundError) as info:
        driver.round(X)
    assert info.value.reusable
    assert driver.emitted == [] and driver.committed == [] and ops.log == []
    check_state(ops, driver)


def test_head_step_failure_discards_the_head_and_finishes_target_only():
    ops, _, driver = make(**full_acceptance())
    ops.arm("head_step", 0, "head")
    end = driver.round(X)
    assert end == RoundEnd("continue", 12)  # the target's own successor of x
    assert ops.ops_log() == [
        ("capture",),
        ("head_step", X, 2),
        ("head_discard",),
        ("verify", [X]),
    ]
    assert driver.committed == [X] and not ops.head_alive
    assert driver.stats.drafted == 0 and driver.stats.rounds == 0
    assert driver.plan().why == "no-head"
    run_rounds(driver, end.next)
    assert len(ops.events("head_step")) == 1
    check_state(ops, driver)


def test_head_step_host_failure_rewinds_the_head_and_resumes_next_round():
    ops, _, driver = make(**full_acceptance())
    ops.arm("head_step", 0, "host")
    end = driver.round(X)
    assert end == RoundEnd("continue", 12)
    assert ops.ops_log()[2:] == [
        ("head_rewind", len(PROMPT) - 1),
        ("verify", [X]),
        ("head_commit", [X]),
    ]
    check_state(ops, driver)  # the pair for x came from the target hidden
    assert driver.plan().why == "speculate"
    driver.round(end.next)
    assert len(ops.events("head_step")) == 2
    check_state(ops, driver)


def test_draft_evaluation_failure_restores_the_entry_and_goes_target_only():
    ops, _, driver = make(**full_acceptance())
    ops.arm("draft_eval", 0, "head")
    end = driver.round(X)
    assert end == RoundEnd("continue", 12)
    assert ops.ops_log()[2:] == [
        ("verify", [X, 12, 13]),
        ("restore",),
        ("head_discard",),
        ("verify", [X]),
    ]
    assert driver.committed == [X]
    assert driver.stats.drafted == 2 and driver.stats.rounds == 0  # proposed, never judged
    check_state(ops, driver)


@pytest.mark.parametrize(("kind", "made"), [("host", 0), ("host", 2), ("head", 0), ("head", 1)])
def test_drafts_a_failing_head_step_made_count_as_drafted(kind, made):
    """HEAD_STEP_FAILED at draft step ``made``: the drafts before it were proposed and
    count, as those of a round that fails at its verification; nothing was judged."""
    ops, _, driver = make(depth=3, **full_acceptance())
    ops.head_fault_at = made
    ops.arm("head_step", 0, kind)
    assert driver.round(X) == RoundEnd("continue", 12)  # target-only
    assert driver.stats.drafted == made and driver.stats.rounds == 0
    assert driver.committed == [X] and ops.head_alive == (kind == "host")
    check_state(ops, driver)
    run_rounds(driver, 12)
    later = sum(e[2] for e in ops.events("head_step")[1:])
    assert driver.stats.drafted == made + later
    assert (later > 0) == (kind == "host")  # a host failure resumes speculation
    check_state(ops, driver)


MALFORMED = {
    "a draft missing": lambda v: Verification(v.drafts[:-1], v.accept, v.successors, v.rows),
    "a decision too many": lambda v: Verification(v.drafts, [*v.accept, True], v.successors),
    "a successor missing": lambda v: Verification(v.drafts, v.accept, v.successors[:-1]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_verification_of_the_wrong_length_is_a_verify_host_failure(case):
    """``RoundDriver._check``: VERIFY_HOST with no salvage. The target keeps x (rewound to
    entry + 1), nothing of the verification is emitted, the head is discarded, and the request
    ends with the caches reusable."""
    ops, em, driver = make(**full_acceptance())
    feed = ops.verify_feed

    def malformed(current, proposal):
        verified = feed(current, proposal)
        return verified if proposal is None else MALFORMED[case](verified)

    ops.verify_feed = malformed
    with pytest.raises(RoundError) as info:
        driver.round(X)
    assert info.value.reusable and isinstance(info.value.cause, HostError)
    assert "verification of 2 drafts came back with" in str(info.value)
    assert em.pushed == driver.emitted == driver.committed == [X]
    assert ops.ops_log()[-3:] == [
        ("verify", [X, 12, 13]),
        ("rewind", len(PROMPT) + 1),
        ("head_discard",),
    ]
    assert not ops.head_alive and driver.plan().why == "no-head"
    assert driver.stats.drafted == 2 and driver.stats.rounds == 0
    check_state(ops, driver)


FULL = full_acceptance()
CLOSING = dict(think=0, target=scripted(X, [CLOSE, 7], fallback))
TARGET_ONLY = dict(depth=0, target=scripted(X, [12], fallback))
LOST, REUSABLE = "not reusable", "reusable"


def go(token):
    return RoundEnd("continue", token)


# name: (setup, armed faults, the round's end or error[, committed after, head alive after])
FAILURE_ROWS = {
    "restore": (FULL, [("draft_eval", "head"), ("restore", "target")], LOST),
    "verify-target": (FULL, [("verify_feed", "target")], LOST),
    "rewind-target": (FULL, [("rewind", "target")], LOST),
    # the salvage is the first token after x, distributed as p_0
    "verify-host": (FULL, [("verify_feed", "host")], go(12), [X], False),
    "verify-host-bare": (FULL, [("verify_feed", "host-bare")], REUSABLE, [X], False),
    "head-host-then-feed": (
        FULL,
        [("head_step", "host"), ("verify_feed", "host-bare")],
        REUSABLE,
        [X],
        False,
    ),
    "target-only-host": (TARGET_ONLY, [("verify_feed", "host")], go(12), [X], False),
    "final-slot-host": (
        {"budget": 1},
        [("replay_feed", "host-bare")],
        RoundEnd("length"),
        [X],
        False,
    ),
    "head-commit": (FULL, [("head_commit", "head")], go(14), [X, 12, 13], False),
    "head-rewind": (FULL, [("head_rewind", "head")], go(14), [X, 12, 13], False),
    "close-head-commit": (CLOSING, [("head_commit", "head")], go(7), [X, CLOSE], False),
    "close-replay-host": (CLOSING, [("replay_feed", "host")], go(7), [X, CLOSE], False),
    "close-replay-bare": (CLOSING, [("replay_feed", "host-bare")], REUSABLE, [X, CLOSE], False),
    "close-replay-target": (CLOSING, [("replay_feed", "target")], LOST),
}


@pytest.mark.parametrize("row", list(FAILURE_ROWS))
def test_failure_rows(row):
    setup, faults, outcome, *after = FAILURE_ROWS[row]
    ops, _, driver = make(**setup)
    for op, kind in faults:
        ops.arm(op, 0, kind)
    if isinstance(outcome, RoundEnd):
        assert driver.round(X) == outcome
    else:
        with pytest.raises(RoundError) as info:
            driver.round(X)
        assert info.value.reusable == (outcome == REUSABLE)
    if after:  # every exit but "not reusable" leaves the caches at the committed prefix
        committed, head_alive = after
        assert driver.committed == committed and ops.head_alive == head_alive
        check_state(ops, driver)
        if isinstance(outcome, RoundEnd) and not outcome.finished and not head_alive:
            assert driver.plan().parked


def test_emitter_failure_at_a_draft_reconciles_to_the_emitted_prefix():
    drafts = [10, 11, 12]
    ops, _, driver = make(
        depth=3,
        emitter=ScriptedEmitter(fail_at=2),
        target=scripted(X, drafts, fallback),
        draft=scripted(X, drafts, fallback),
    )
    with pytest.raises(RoundError) as info:
        driver.round(X)
    assert info.value.reusable
    assert driver.emitted == [X, 10] and driver.committed == [X, 10]
    assert not ops.head_alive and ops.events("head_commit") == []
    check_state(ops, driver)


# -- RNG ---------------------------------------------------------------------------------------


def test_every_draw_is_keyed_by_the_slot_it_fills_and_drafts_share_the_target_slots():
    ops, _, driver = make(
        depth=3,
        budget=40,
        sampler=sampled(21),
        target_probs=spread(1, V, banned=(EOS, CLOSE)),
        draft_probs=spread(2, V, banned=(EOS, CLOSE)),
        think=5,
    )
    run_rounds(driver, X)
    log = ops.log
    names = [e[0] for e in log]
    starts = [i for i, e in enumerate(log) if e[0] == "head_step"]
    assert starts
    for s in starts:
        k = log[s][2]
        head = log[s + 1 : s + 1 + k]
        assert names[s + 1 + k] == "verify"
        verify = log[s + 2 + k : s + 3 + 2 * k]
        first = head[0][2]
        # The head drafts slots first .. first + k - 1; the verify draws the target's token for
        # the same slots and one more (the bonus), with the same noise keys.
        assert [e[2] for e in head] == list(range(first, first + k))
        assert [e[2] for e in verify] == list(range(first, first + k + 1))
    replays = [i for i, e in enumerate(log) if e[0] == "replay"]
    assert any(log[i][2] for i in replays)  # the think budget forced one close
    for i in replays:
        follows = names[i + 1] if i + 1 < len(names) else None
        assert (follows == "rng") == log[i][2]


def test_greedy_rounds_consume_no_randomness():
    greedy = Sampler(SamplingParams(temperature=0.0, seed=1), [], V, 4096)
    for sampler in (GreedyDraws(), greedy):
        ops, _, driver = make(depth=3, budget=16, sampler=sampler)
        run_rounds(driver, X)
        assert driver.stats.rounds > 0 and ops.events("rng") == []


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_coupled_acceptance_accepts_exactly_the_target_s_own_draws(accepted):
    # The head's distribution equals the target's for the first ``accepted`` drafts (so, with
    # the same noise, it draws the target's token) and is one-hot on a token the target never
    # draws after that (so the draft is rejected and the target's draw follows).
    target = spread(5, V, banned=(EOS, 9))

    def draft(seq):
        return target(seq) if len(seq) <= accepted else one_hot(V, 9)

    ops, em, driver = make(depth=3, sampler=sampled(4), target_probs=target, draft_probs=draft)
    end = driver.round(X)
    assert not end.finished
    assert driver.stats.accepted_per_depth[accepted] == 1
    assert 9 not in driver.committed and end.next != 9
    _, _, plain = make(depth=0, sampler=sampled(4), target_probs=target)
    step = plain.round(X)
    for _ in range(accepted):
        step = plain.round(step.next)
    assert driver.committed == plain.committed and end.next == step.next
    check_state(ops, driver)


def test_same_seed_same_output():
    def run(seed):
        probs = dict(target_probs=spread(7, V), draft_probs=spread(8, V))
        ops, _, driver = make(depth=3, budget=24, sampler=sampled(seed), **probs)
        run_rounds(driver, X)
        return driver.emitted, driver.committed, ops.fed, ops.pairs, driver.stats.as_dict()

    first, again, other = run(99), run(99), run(100)
    assert first == again
    assert first[0] != other[0]


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_seeded_speculation_is_token_for_token_plain_sampling(depth):
    """Drafter invariance: with the same seed, speculation at any depth emits exactly what
    target-only rounds emit, through accepted runs, mismatches, bonuses, EOS, stops and the
    budget (the head's distribution differs from the target's)."""
    for seed in range(12):
        # EOS (2) has mass in both rows, so some runs end at an accepted or drawn EOS.
        probs = dict(
            target_probs=spread(40 + seed, V, banned=()),
            draft_probs=spread(60 + seed, V, banned=()),
        )
        # Ends by EOS, by a stop string at push 9, or by the budget.
        stops, budget = ([9] if seed % 3 == 0 else []), 6 + seed
        ops, _, driver = make(
            depth=depth,
            budget=budget,
            sampler=sampled(seed),
            emitter=ScriptedEmitter(stop_at=stops),
            **probs,
        )
        plain_ops, _, plain = make(
            depth=0,
            budget=budget,
            sampler=sampled(seed),
            emitter=ScriptedEmitter(stop_at=stops),
            **probs,
        )
        end = run_rounds(driver, X)
        plain_end = run_rounds(plain, X)
        assert driver.emitted == plain.emitted and end == plain_end, seed
        assert ops.fed == plain_ops.fed
        check_state(ops, driver)


def test_sampled_speculation_matches_plain_sampling_on_the_fake():
    """The three tokens after x follow the target's exact law, over many seeds, through
    accepted runs, mismatch successors and bonuses (vocabulary of 3, no EOS)."""
    from tests.stats import chi_square_pvalue

    vocab = 3
    target = spread(31, vocab, banned=())
    draft = spread(32, vocab, banned=())
    cells = {}
    for a in range(vocab):
        for b in range(vocab):
            for c in range(vocab):
                cells[(a, b, c)] = target([X])[a] * target([X, a])[b] * target([X, a, b])[c]
    counts = dict.fromkeys(cells, 0)
    for seed in range(500):
        probs = dict(target_probs=target, draft_probs=draft)
        ops = FakeOps(PROMPT, vocab=vocab, sampler=sampled(seed, vocab), **probs)
        _, _, driver = make(ops, depth=2, budget=4, emitter=ScriptedEmitter(eos=()))
        run_rounds(driver, X)
        counts[tuple(driver.emitted[1:])] += 1
        check_state(ops, driver)
    keys = sorted(cells)
    p = chi_square_pvalue([counts[k] for k in keys], [float(cells[k]) for k in keys])
    assert p > 0.001, (p, counts)


# -- properties and accounting -----------------------------------------------------------------


PROMPTS = [[1, 5, 8], [3], [7, 7, 9, 11, 0, 13]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["p3", "p1", "p6"])
def test_greedy_speculation_equals_plain_greedy(prompt):
    for budget in (1, 2, 7, 16, 31):
        plain_ops, _, plain = make(FakeOps(prompt, vocab=V), depth=0, budget=budget)
        plain_end = run_rounds(plain, X)
        check_state(plain_ops, plain)  # depth 0 with a live head: every fed token paired
        assert plain_ops.events("head_step") == [] and plain_ops.head_alive
        for depth in (1, 2, 4, 8):
            ops, _, driver = make(FakeOps(prompt, vocab=V), depth=depth, budget=budget)
            end = run_rounds(driver, X)
            case = (budget, depth)
            assert end == plain_end, case
            assert driver.emitted == plain.emitted, case
            assert driver.committed == plain.committed, case
            assert ops.fed == plain_ops.fed, case
            assert ops.pairs == plain_ops.pairs, case
            assert ops.frontier == plain_ops.frontier, case
            check_state(ops, driver)


def test_stats_accounting_is_consistent():
    ops, _, driver = make(depth=3, budget=24)
    run_rounds(driver, X)
    stats = driver.stats
    assert stats.rounds > 0
    assert sum(stats.accepted_per_depth) == stats.rounds
    assert stats.accepted == sum(a * n for a, n in enumerate(stats.accepted_per_depth))
    assert stats.drafted == sum(e[2] for e in ops.events("head_step"))
    assert stats.rounds == len(ops.events("capture"))
    assert 0 < stats.accepted < stats.drafted  # the default draft is wrong every third step
    assert len(driver.committed) <= len(driver.emitted)
    assert stats.final_depth == 3
    assert stats.as_dict()["accepted_per_depth"] == stats.accepted_per_depth


def test_plan_reasons():
    controller = DepthController(max_depth=4)
    _, _, driver = make(depth=controller.for_request(speculative=False))
    assert driver.plan().why == "disabled" and driver.plan().parked
    _, _, driver = make(depth=0)
    assert driver.plan().why == "disabled"
    _, _, driver = make(depth=controller.for_request())
    assert driver.plan().why == "depth-0"  # a fresh controller measures depth 0 first
    _, _, driver = make(head=False)
    assert driver.plan().why == "no-head"
    _, _, driver = make(depth=5, budget=3)
    assert driver.plan() == RoundPlan(2, "speculate")


def test_parked_rounds_are_counted_and_timed():
    ticks = iter(range(100))
    controller = DepthController(max_depth=2, clock=lambda: float(next(ticks)))
    ops, _, driver = make(depth=controller.for_request(), budget=10)
    for token in (12, 13, 14):  # the plain loop writes the shared ledger, then accounts
        driver.ledger.emit(token)
        driver.ledger.commit([token])
        driver.parked_round()
    assert driver.used == 3 and driver.committed == [12, 13, 14]
    assert driver.stats.parked == 3
    assert controller.state()["cost_ms"] == {0: 1000.0}  # third round closed the second
    assert driver.remaining() == 7


def test_controller_driven_run_stays_lossless_and_learns():
    controller = DepthController(max_depth=4, clock=iter(np.arange(0, 1e4, 0.5)).__next__)
    plain_ops, _, plain = make(depth=0, budget=60)
    run_rounds(plain, X)
    ops, _, driver = make(depth=controller.for_request(), budget=60)
    run_rounds(driver, X)
    assert driver.emitted == plain.emitted and ops.fed == plain_ops.fed
    state = controller.state()
    assert 0 in state["cost_ms"] and 1 in state["cost_ms"]
    assert driver.stats.rounds > 0 and driver.stats.parked > 0


# -- with the real emitter ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["p3", "p1", "p6"])
def test_the_host_cannot_tell_speculation_happened(tokenizer, prompt):
    """Real emitter (think budget, stop string, max_tokens): identical frames and caches."""
    plain = emitter_frames(tokenizer, prompt, X, 0)
    assert tokenizer.encode("</think>")[0] in plain[2]  # the think budget fired
    answer = "".join(content for content, _ in plain[0]).split("</think>")[-1]
    middle = range(len(answer) // 2, len(answer) - 1)
    stop = next(answer[i : i + 2] for i in middle if answer[i : i + 2].isascii())
    plain_stopped = emitter_frames(tokenizer, prompt, X, 0, stop=[stop])
    assert plain_stopped[1].reason == "stop"
    for depth in (1, 3, 8):
        assert emitter_frames(tokenizer, prompt, X, depth) == plain, depth
        assert emitter_frames(tokenizer, prompt, X, depth, stop=[stop]) == plain_stopped, depth
