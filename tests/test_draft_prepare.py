"""DraftSession.prepare: the head's pairs written behind a verify feed, before its sync.

The scripted head and target of ``test_draft_session`` make every pair visible: a verify
row's pair reads its target slot, the head's own chained outputs read negative.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache.kv import KVCache
from drafting.session import DraftSession
from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.faults import Faults
from runner.loader import load_model
from tests.heads import echo_head, write_head
from tests.test_draft_session import (
    EOS,
    GreedySampler,
    ScriptedHead,
    Target,
    draft_kv,
    one_hot_unembed,
    run_greedy,
)

CHAIN = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 8, 8: 9, 9: EOS}
WRONG_AFTER_3 = {**CHAIN, 3: 6}  # the head drafts 6 where the target says 4


def test_prepared_rounds_commit_the_pairs_and_draw_the_drafts_of_unprepared_ones():
    for k in (1, 2, 4):
        plain_head, prepared_head = ScriptedHead(WRONG_AFTER_3), ScriptedHead(WRONG_AFTER_3)
        plain_cache, prepared_cache = KVCache(), KVCache()
        plain_sampler, prepared_sampler = GreedySampler(), GreedySampler()
        plain = run_greedy(
            DraftSession(plain_head, plain_cache, one_hot_unembed),
            Target(CHAIN),
            [1],
            k,
            plain_sampler,
        )
        prepared = run_greedy(
            DraftSession(prepared_head, prepared_cache, one_hot_unembed),
            Target(CHAIN),
            [1],
            k,
            prepared_sampler,
            prepare=True,
        )
        assert prepared == plain == [2, 3, 4, 5, 6, 8, 9, EOS]
        assert draft_kv(prepared_cache) == draft_kv(plain_cache)
        assert prepared_cache.offset == plain_cache.offset == 8
        assert [c.tolist() for c in prepared_sampler.chains] == [
            c.tolist() for c in plain_sampler.chains
        ]


def prepared_round(k: int):
    """A session after the prompt [1] whose round at x = 2 proposed k drafts and prepared its
    verify feed: (head, cache, target, session, the feed's hidden rows)."""
    head, cache, target = ScriptedHead(CHAIN), KVCache(), Target(CHAIN)
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([1], target.feed([1])[1], 0)
    drafts = ds.propose(2, k, GreedySampler(), slot=2).tokens.tolist()
    preds, hiddens = target.feed([2, *drafts])
    assert ds.prepare(2, hiddens, mx.array(preds, dtype=mx.int32), 1)
    return head, cache, target, ds, hiddens


def test_the_next_draft_reads_the_prepared_row_without_a_flush():
    head, cache, _, ds, hiddens = prepared_round(2)
    # One forward over the three rows the feed may commit, each paired with the target's
    # draw after it, written above the committed offset.
    assert head.extends()[-1] == (1, [3, 4, 5], [1, 2, 3])
    assert ds.offset == 1 and cache.offset == 4
    ds.committed([2, 3, 4], hiddens, 1)  # both drafts accepted: two pairs verified
    assert ds.offset == 3 and ds.frontier == 4
    calls = len(head.calls)
    assert ds.propose(5, 1, GreedySampler(), slot=5).tokens.tolist() == [6]
    # The frontier pair (row 2 with 5) was written already: no head forward, not even one.
    assert len(head.calls) == calls and ds.offset == 4 == cache.offset


def test_a_report_the_candidates_did_not_draw_drops_them():
    _, cache, target, ds, hiddens = prepared_round(2)
    # The round keeps x only, and the next token is a forced one (not the draw 3).
    target.cache.rewind(2)
    ds.committed([2], hiddens[:1], 1)
    assert ds.offset == 1 and ds.frontier == 2
    ds.settle(7)
    ds.close()
    assert draft_kv(cache) == ([2, 7], [0, 1])
    assert cache.offset == target.cache.offset == 2


def test_a_run_after_another_first_token_drops_the_candidates():
    _, cache, target, ds, hiddens = prepared_round(2)
    # The draw 3 matches, but the run's first token is not the feed's x: the candidate at
    # slot 1 was not computed for this run, so its pair is queued from the reported rows.
    ds.committed([9, 3], hiddens[:2], 1)
    assert ds.offset == 1 and ds.pending == 1 and cache.offset == 1
    ds.settle(4)
    ds.close()
    assert draft_kv(cache) == ([2, 3, 4], [0, 1, 2])


def test_close_after_a_prepared_feed_leaves_only_verified_pairs():
    _, cache, target, ds, hiddens = prepared_round(3)
    assert cache.offset == 5  # four candidates above the committed offset 1
    target.cache.rewind(3)
    ds.committed([2, 3], hiddens[:2], 1)  # the request stops after draft 1 (a stop string)
    ds.close()  # no final token: the frontier pair stays open
    assert draft_kv(cache) == ([2, 3], [0, 1])
    assert cache.offset == ds.offset == 2


def test_a_session_not_where_a_proposal_leaves_it_prepares_nothing():
    head, cache, target = ScriptedHead(CHAIN), KVCache(), Target(CHAIN)
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([1, 2], target.feed([1, 2])[1], 0)  # a pair pending, the frontier pair open
    rows, draws = target.feed([3, 4])[1], mx.array([4, 5])
    assert not ds.prepare(3, rows, draws, 2)  # no proposal flushed the pending pairs
    assert not ds.prepare(3, rows, draws, 3)  # not the frontier
    assert head.calls == [] and cache.offset == 0
    ds.settle(3)
    cache.rewind(0)  # something lowered the draft cache under the session
    assert not ds.prepare(3, rows, draws, 2)
    ds.discard()
    assert not ds.prepare(3, rows, draws, 2)


# -- a real model: faults anywhere in the head's calls, prepared ones included


@pytest.fixture(scope="module")
def echo_model(tiny_checkpoint, tmp_path_factory):
    loaded = load_model(tiny_checkpoint)
    head_dir = write_head(str(tmp_path_factory.mktemp("echo-head")), loaded, echo_head(loaded))
    return tiny_checkpoint, head_dir


def complete(engine: Engine, prompt: str, **options) -> list[int]:
    frames: list = []
    request = Completion(id="r", prompt=prompt, options=Options(**options))
    engine.run(engine.prepare(request), frames.append, lambda: False)
    assert type(frames[-1]).__name__ == "Done", frames[-1]
    return [t for f in frames if type(f).__name__ == "Token" for t in f.tokens]


@pytest.mark.parametrize("call", [2, 3, 4, 5, 6, 9])
def test_a_head_fault_at_any_call_keeps_the_output_and_levels_the_caches(echo_model, call):
    """Some of the head's calls are the prepared forwards behind a verify feed: a fault there
    is dropped (the round asks the head again), elsewhere it parks or discards the head."""
    path, head_dir = echo_model
    plain = Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))
    faulty = Engine(
        EngineOptions(
            model_path=path, draft_path=head_dir, draft_depth=2, faults=Faults(head_call=call)
        )
    )
    for options in ({"temperature": 0, "repeat_penalty": 1.0}, {"temperature": 0.9, "seed": 4}):
        prompt = "The quick brown fox"
        assert complete(faulty, prompt, num_predict=24, **options) == complete(
            plain, prompt, num_predict=24, **options
        )
        assert len({c.offset for c in faulty.all_caches}) == 1
