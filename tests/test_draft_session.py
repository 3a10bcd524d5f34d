"""DraftSession bookkeeping, ported from Ollama's draft-session tests (mtp_test.go).

A scripted head makes every pair visible: target hiddens are rows ``[S, 0]`` that name their
slot S; the head's own output is ``[-n, prediction]`` where n counts the head outputs chained
before it (so recycled hiddens read -1, -2, ... by draft step), and the head writes
(look-ahead token, hidden slot) into a real KVCache, so the committed draft KV can be read
back after rewinds.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache.kv import KVCache
from drafting.session import FLUSH_AT, DraftSession

VOCAB = 16
EOS = 7


def target_hiddens(start: int, count: int) -> mx.array:
    """Target hiddens of slots start..start+count-1: row S is [S, 0]."""
    slots = mx.arange(start, start + count, dtype=mx.float32)
    return mx.stack([slots, mx.zeros_like(slots)], axis=-1)


def one_hot_unembed(y: mx.array) -> mx.array:
    """The scripted head's output carries its prediction in column 1."""
    return 30.0 * (mx.arange(VOCAB) == y[..., 1:2].astype(mx.int32)).astype(mx.float32)


class ScriptedHead:
    """Predicts ``predict[token]`` (default 0); records every forward as
    (draft cache offset, look-ahead ids, hidden slots), its own hiddens negative."""

    feature_width = 2  # target rows [S, 0] (``target_hiddens``)

    def __init__(self, predict: dict[int, int]):
        self.predict = predict
        self.calls: list[tuple[int, mx.array, mx.array]] = []

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        self.calls.append((cache.offset, tokens[0], hidden[0, :, 0]))
        keys = tokens.astype(mx.float32)[:, None, :, None]
        cache.update_and_fetch(keys, hidden[:, None, :, :1])
        table = mx.array([self.predict.get(i, 0) for i in range(VOCAB)], dtype=mx.float32)
        pred = table[tokens]
        mark = hidden[..., 0]
        return mx.stack([mx.where(mark < 0, mark - 1, -1.0), pred], axis=-1)

    def draft_logits(self, y: mx.array, unembed) -> mx.array:
        return unembed(y)

    def extends(self) -> list[tuple[int, list[int], list[int]]]:
        return [(o, t.tolist(), [int(h) for h in hs.tolist()]) for o, t, hs in self.calls]


class GreedySampler:
    """The runner Sampler's draw contract at temperature 0 (the argmax), recording the chain
    and the slot of every draw."""

    def __init__(self):
        self.chains: list[list[int]] = []
        self.slots: list[int] = []

    def tokens(self, logits: mx.array, chain: mx.array, *, slot: int) -> mx.array:
        self.chains.append(chain)
        self.slots.append(slot)
        return mx.argmax(logits, axis=-1).astype(mx.int32)


def draft_kv(cache: KVCache) -> tuple[list[int], list[int]]:
    """(look-ahead token, hidden slot) of every committed draft KV entry."""
    keys = cache.keys[0, 0, : cache.offset, 0].tolist()
    values = cache.values[0, 0, : cache.offset, 0].tolist()
    return [int(k) for k in keys], [int(v) for v in values]


class Target:
    """A scripted target: next token = predict[token]; a real KVCache tracks its offset."""

    feature_width = 2  # target rows [S, 0] (``target_hiddens``)

    def __init__(self, predict: dict[int, int]):
        self.predict = predict
        self.cache = KVCache()

    def feed(self, tokens: list[int]) -> tuple[list[int], mx.array]:
        start = self.cache.offset
        keys = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
        self.cache.update_and_fetch(keys, keys)
        return [self.predict.get(t, 0) for t in tokens], target_hiddens(start, len(tokens))


def test_settle_after_prefill_writes_all_pairs_in_one_extend():
    head, cache = ScriptedHead({}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    target = Target({})
    _, hiddens = target.feed([1, 2, 3, 4])
    ds.committed([1, 2, 3, 4], hiddens, 0)
    assert head.calls == [] and ds.pending == 3 and ds.frontier == 4
    ds.settle(mx.array(5, dtype=mx.int32))
    assert head.extends() == [(0, [2, 3, 4, 5], [0, 1, 2, 3])]
    assert cache.offset == ds.offset == target.cache.offset == 4
    assert draft_kv(cache) == ([2, 3, 4, 5], [0, 1, 2, 3])


def test_committed_run_longer_than_flush_cap_goes_in_one_forward():
    n = FLUSH_AT + 8
    tokens = [i % 7 + 1 for i in range(n)]
    head, cache = ScriptedHead({}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed(mx.array([tokens], dtype=mx.int32), target_hiddens(0, n)[None], 0)
    assert len(head.calls) == 1
    offset, ids, slots = head.extends()[0]
    assert (offset, ids, slots) == (0, tokens[1:], list(range(n - 1)))
    assert cache.offset == ds.offset == n - 1 and ds.pending == 0


def test_flush_cap_is_checked_after_the_whole_run():
    head, cache = ScriptedHead({}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed, flush_at=4)
    ds.committed([1, 2, 3], target_hiddens(0, 3), 0)  # 2 pairs pending, below the cap
    assert head.calls == []
    ds.committed([4, 5, 6, 7, 8], target_hiddens(3, 5), 3)  # 7 pending: one forward
    assert head.extends() == [(0, [2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6])]
    assert ds.offset == 7 and ds.frontier == 8


def test_session_that_never_drafts_defers_every_pair_to_one_flush_at_close():
    chain = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: EOS, EOS: 0}
    head, cache = ScriptedHead(chain), KVCache()
    target = Target(chain)
    ds = DraftSession(head, cache, one_hot_unembed)
    preds, hiddens = target.feed([1])
    ds.committed([1], hiddens, 0)
    token = preds[-1]
    # Plain decoding forwards every emitted token (the EOS too) and reports each forward.
    while True:
        position = target.cache.offset
        preds, hiddens = target.feed([token])
        ds.committed([token], hiddens, position)
        if token == EOS:
            break
        token = preds[-1]
    assert head.calls == [] and ds.pending == 6
    ds.settle(preds[-1])  # the in-flight sample the decoder discards completes the last pair
    ds.close()
    assert head.extends() == [(0, [2, 3, 4, 5, 6, EOS, 0], [0, 1, 2, 3, 4, 5, 6])]
    assert cache.offset == target.cache.offset == 7


def test_restored_prefix_rewrites_the_boundary_pair():
    chain = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: EOS}
    head, cache = ScriptedHead(chain), KVCache()
    target = Target(chain)
    ds = DraftSession(head, cache, one_hot_unembed)
    # First request: prompt 1, generates 2..6 then EOS, which is emitted but never fed.
    _, hiddens = target.feed([1, 2, 3, 4, 5, 6])
    ds.committed([1], hiddens[:1], 0)
    ds.committed([2, 3, 4, 5, 6], hiddens[1:], 1)
    ds.settle(EOS)
    ds.close()
    assert draft_kv(cache) == ([2, 3, 4, 5, 6, EOS], [0, 1, 2, 3, 4, 5])

    # The next request matches six tokens and restores one below (the draft look-ahead);
    # its prefill re-evaluates token 6 at slot 5, followed by a new prompt token 1.
    target.cache.rewind(5)
    cache.rewind(5)
    ds = DraftSession(head, cache, one_hot_unembed)
    assert (ds.offset, ds.frontier, ds.primed) == (5, 5, False)
    _, hiddens = target.feed([6, 1])
    ds.committed([6, 1], hiddens, 5)
    assert ds.primed
    ds.close()
    assert head.extends()[-1] == (5, [1], [5])
    assert draft_kv(cache) == ([2, 3, 4, 5, 6, 1], [0, 1, 2, 3, 4, 5])


def run_greedy(ds, target, prompt, k, sampler, max_tokens=20, prepare=False):
    """A minimal greedy round driver over the session: returns the emitted tokens.
    ``prepare``: each verify feed's pairs are prepared (``DraftSession.prepare``) before its
    result is read."""
    preds, hiddens = target.feed(prompt)
    ds.committed(prompt, hiddens, 0)
    current, emitted = preds[-1], [preds[-1]]
    while current != EOS and len(emitted) < max_tokens:
        position = target.cache.offset
        proposal = ds.propose(current, k, sampler, slot=position + 1)
        drafts = proposal.tokens.tolist()
        preds, hiddens = target.feed([current, *drafts])
        if prepare:
            assert ds.prepare(current, hiddens, mx.array(preds, dtype=mx.int32), position)
        accepted = 0
        while accepted < k and drafts[accepted] == preds[accepted]:
            accepted += 1
        keep = accepted
        if EOS in drafts[:accepted]:  # an accepted EOS ends generation and is never fed
            keep = drafts.index(EOS)
            accepted = keep + 1
        emitted += drafts[:accepted]
        target.cache.rewind(position + 1 + keep)
        ds.committed([current, *drafts[:keep]], hiddens[: keep + 1], position)
        current = drafts[keep] if keep < accepted else preds[accepted]
        if keep == accepted:
            emitted.append(current)
    ds.settle(current)
    ds.close()
    return emitted


def test_rejection_rolls_back_speculative_entries_and_rewrites_them_from_target_hiddens():
    target = Target({1: 2, 2: 3, 3: 4, 4: 5, 5: EOS})
    # The head agrees with the target except after 3, where it drafts 6.
    head, cache = ScriptedHead({1: 2, 2: 3, 3: 6, 4: 5, 5: EOS}), KVCache()
    sampler = GreedySampler()
    ds = DraftSession(head, cache, one_hot_unembed)
    emitted = run_greedy(ds, target, [1], 4, sampler)
    assert emitted == [2, 3, 4, 5, EOS]
    assert head.extends() == [
        (0, [2], [0]),  # round 1: settle(2) flushes the prompt pair: its row is draft 1 (3)
        (1, [3], [-1]),  # speculative steps from the head's own hiddens: drafts 6, 0, 0
        (2, [6], [-2]),
        (3, [0], [-3]),
        (1, [3, 4], [1, 2]),  # round 2: rewound to 1, verified pairs from target hiddens
        (3, [5], [-1]),  # drafts 5, EOS (accepted, ends generation), 0, 0
        (4, [EOS], [-2]),
        (5, [0], [-3]),
        (3, [5, EOS], [3, 4]),  # close: the EOS completes the last pair, no trace of 6
    ]
    assert draft_kv(cache) == ([2, 3, 4, 5, EOS], [0, 1, 2, 3, 4])
    assert cache.offset == target.cache.offset == 5
    # Penalties see the draft chain: step i gets the i drafts before it.
    assert [c.tolist() for c in sampler.chains] == [[], [3], [3, 6], [3, 6, 0]] + [
        [],
        [5],
        [5, EOS],
        [5, EOS, 0],
    ]


def test_propose_returns_lazy_drafts_drawn_for_consecutive_slots():
    chain = {1: 2, 2: 3, 3: 4, 4: 5}
    head, cache = ScriptedHead(chain), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([9, 1], target_hiddens(0, 2), 0)
    sampler = GreedySampler()
    proposal = ds.propose(2, 3, sampler, slot=3)
    assert proposal.tokens.dtype == mx.int32 and proposal.tokens.tolist() == [3, 4, 5]
    assert proposal.slot == 3 and sampler.slots == [3, 4, 5]
    # One flush (whose last row is step 0) plus k-1 head steps; speculative slots 2 and 3.
    assert head.extends() == [(0, [1, 2], [0, 1]), (2, [3], [-1]), (3, [4], [-2])]
    assert ds.offset == 2 and cache.offset == 4


def test_propose_again_without_a_report_rewinds_the_speculative_entries():
    head, cache = ScriptedHead({1: 2, 2: 3, 3: 4}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([1], target_hiddens(0, 1), 0)
    first = ds.propose(2, 3, GreedySampler(), slot=2).tokens.tolist()
    again = ds.propose(2, 3, GreedySampler(), slot=2).tokens.tolist()
    assert first == again == [3, 4, 0]
    # The second proposal reuses the held row and rewrites slots 1.. (no second flush).
    assert [e[0] for e in head.extends()] == [0, 1, 2, 1, 2]
    assert cache.offset == 3 and ds.offset == 1


def test_unprimed_session_does_not_draft():
    head, cache = ScriptedHead({}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    assert not ds.primed
    assert ds.propose(3, 4, GreedySampler(), slot=1) is None
    assert ds.propose(3, 0, GreedySampler(), slot=1) is None
    assert head.calls == []


def test_discard_stops_drafting_and_rewinds_speculative_entries():
    head, cache = ScriptedHead({1: 2, 2: 3}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([1, 2], target_hiddens(0, 2), 0)
    ds.propose(3, 3, GreedySampler(), slot=1)
    assert cache.offset == 4 and ds.offset == 2
    calls = len(head.calls)
    ds.discard()
    assert ds.discarded and cache.offset == 2
    ds.committed([3, 4], target_hiddens(2, 2), 2)
    ds.settle(5)
    assert ds.propose(5, 3, GreedySampler(), slot=1) is None
    ds.close()
    assert len(head.calls) == calls and cache.offset == 2 and ds.frontier == 4


def test_a_gap_in_the_reported_slots_is_an_error():
    ds = DraftSession(ScriptedHead({}), KVCache(), one_hot_unembed)
    ds.committed([1, 2], target_hiddens(0, 2), 0)
    with pytest.raises(ValueError, match="gap"):
        ds.committed([4], target_hiddens(3, 1), 3)
    with pytest.raises(ValueError, match="hidden rows"):
        ds.committed([3, 4], target_hiddens(2, 1), 2)


def test_reports_overlapping_written_pairs_are_skipped():
    head, cache = ScriptedHead({}), KVCache()
    ds = DraftSession(head, cache, one_hot_unembed)
    ds.committed([1, 2, 3], target_hiddens(0, 3), 0)
    ds.settle(4)
    # The verified run of a round starts with the token settle already paired.
    ds.committed([4, 5], target_hiddens(3, 2), 3)
    ds.settle(6)
    assert head.extends() == [(0, [2, 3, 4], [0, 1, 2]), (3, [5, 6], [3, 4])]
    assert cache.offset == 5 == ds.frontier
