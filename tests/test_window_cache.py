"""Sliding-window attention: the rotating cache on its own, then real sliding models (the
reference fixtures, window 16) fed in chunks, verify feeds and rewinds, and the prefix cache.

Every model-level run is compared with one full forward of the same tokens, which transformers
agrees with (tests/test_reference_models.py). Small buffer steps make the cache drop positions
and re-lay its buffer every few appends, so the window really slides within these short runs.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache, RotatingKVCache, WindowSnapshot
from cache.session import PrefixCache, trie_keys
from drafting.accept import accepted_count
from drafting.depth import MAX_DRAFT_DEPTH
from drafting.mlx_ops import MlxRoundOps
from drafting.rounds import TargetError
from runner import device
from runner.loader import load_model
from runner.models.attention import window_mask
from runner.sampler import Sampler, SamplingParams
from tests.test_cache_session import check_against_fresh, run_property, serve

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
HEADS, DIM = 2, 4
WINDOW = 16  # the fixtures' sliding_window


class SmallSteps(RotatingKVCache):
    step = 8


@pytest.fixture
def small_steps(monkeypatch):
    """Rotating caches made by the models re-lay their buffers every few appends."""
    monkeypatch.setattr(RotatingKVCache, "step", 8)


def rows(positions, branch: int = 0) -> np.ndarray:
    """Recognisable keys: position p of branch b holds p + 1000 b (+ a per-slot pattern)."""
    base = np.array(positions, dtype=np.float32)[None, None, :, None] + 1000.0 * branch
    return base + 0.001 * np.arange(HEADS * DIM, dtype=np.float32).reshape(1, HEADS, 1, DIM)


def feed(cache, positions, branch: int = 0) -> tuple[np.ndarray, np.ndarray]:
    keys = mx.array(rows(positions, branch))
    k, v = cache.update_and_fetch(keys, -keys)
    mx.eval(k, v, cache.state)
    return np.array(k), np.array(v)


class Truth:
    """What a cache should hold: the key data of each position of the current branch."""

    def __init__(self) -> None:
        self.data: list[np.ndarray] = []

    def feed(self, cache, count: int, branch: int, window: int) -> None:
        start = len(self.data)
        positions = list(range(start, start + count))
        got_k, got_v = feed(cache, positions, branch)
        self.data.extend(rows(positions, branch)[0, :, i] for i in range(count))
        lo = max(0, start - window + 1)
        want = np.stack(self.data[lo:], axis=1)[None]
        np.testing.assert_array_equal(got_k, want)
        np.testing.assert_array_equal(got_v, -want)

    def rewind(self, cache, to: int) -> None:
        cache.rewind(to)
        del self.data[to:]


# ---------------------------------------------------------------------------- the cache alone
def test_returns_each_rows_window_and_stays_bounded_by_it():
    cache = SmallSteps(5, slack=2)
    truth = Truth()
    rng = random.Random(0)
    for _ in range(150):
        count = rng.choice([1, 1, 1, 2, 3, 7, 12])  # 12 > window: a long chunk
        truth.feed(cache, count, 0, 5)
        assert cache.offset == len(truth.data)
        # window - 1 + slack kept, plus the feed, the headroom and one step of rounding
        assert cache.keys.shape[2] <= 5 - 1 + 2 + 12 + cache.headroom + cache.step
    assert cache.offset > 300 and cache.base > 0


def test_any_part_of_a_feed_rewinds_exactly():
    """Speculation's pattern: feed k + 1 rows, rewind to any accepted count. Rewinds further
    down (into the slack) are exact whenever ``can_rewind`` allows them."""
    window, slack = 6, 3
    cache = SmallSteps(window, slack=slack)
    truth = Truth()
    rng = random.Random(1)
    truth.feed(cache, 9, 0, window)
    deeper = 0
    for branch in range(1, 400):
        before = cache.offset
        count = rng.randint(1, 12)
        truth.feed(cache, count, branch, window)
        to = before + count - rng.randint(0, count)
        assert cache.can_rewind(to)
        if rng.random() < 0.3 and cache.can_rewind(to - slack):
            to -= slack
            deeper += 1
        truth.rewind(cache, to)
    assert cache.base > 0 and deeper > 50


def test_rewinding_past_the_window_refuses_the_next_append():
    cache = SmallSteps(4, slack=1)
    truth = Truth()
    for _ in range(40):
        truth.feed(cache, 1, 0, 4)
    assert not cache.can_rewind(10) and cache.can_rewind(40 - 1) and cache.can_rewind(0)
    cache.rewind(10)  # allowed (the engine levels caches this way) ...
    with pytest.raises(RuntimeError, match="rewound past its window"):
        feed(cache, [10])  # ... but the cache cannot go on from there
    cache.rewind(0)
    truth = Truth()
    truth.feed(cache, 3, 7, 4)


def test_window_snapshots_lazy_then_copied_restore_exactly():
    cache = SmallSteps(4, slack=1)
    truth = Truth()
    truth.feed(cache, 10, 0, 4)
    snap = cache.snapshot(2, 10)
    assert isinstance(snap, WindowSnapshot) and snap.lazy and snap.restorable
    assert (snap.start, snap.end, snap.lo) == (2, 10, 7) and snap.nbytes == 0
    saved = truth.data[:10]
    assert not cache.can_restore(snap, 9)  # a window restores at its end only
    with pytest.raises(ValueError):
        cache.restore(snap, 8)
    for _ in range(30):  # the buffer moves on: the window is copied out before it is dropped
        truth.feed(cache, 1, 1, 4)
    assert not snap.lazy and snap.nbytes == 3 * HEADS * DIM * 4 * 2
    assert isinstance(cache.snapshot(30, 35), WindowSnapshot)
    gone = cache.snapshot(5, 8)
    assert not gone.restorable  # the window before 8 is no longer held
    cache.restore(snap)
    assert cache.offset == 10 and snap.lazy and snap.nbytes == 0
    truth.data = list(saved)
    truth.feed(cache, 2, 5, 4)  # attends over the restored window
    # Restored lazily again: rewinding to its end is an offset move.
    truth.feed(cache, 3, 6, 4)
    cache.restore(snap)
    truth.data = list(saved)
    truth.feed(cache, 1, 8, 4)


def test_reset_copies_out_and_an_empty_window_restores_to_zero():
    cache = SmallSteps(4, slack=1)
    truth = Truth()
    truth.feed(cache, 6, 0, 4)
    snap = cache.snapshot(0, 6)
    start = cache.snapshot(0, 0)
    cache.reset()
    assert cache.keys is None and not snap.lazy and snap.restorable and start.restorable
    cache.restore(snap)
    truth.data = truth.data[:6]
    truth.feed(cache, 2, 3, 4)
    cache.restore(start)
    assert cache.offset == 0
    truth = Truth()
    truth.feed(cache, 3, 4, 4)


def test_pins_keep_the_windows_a_long_chunk_passes():
    cache = SmallSteps(4, slack=1)
    truth = Truth()
    cache.set_pins([5, 17, 40])
    truth.feed(cache, 30, 0, 4)  # passes 5 and 17 in one chunk
    for _ in range(20):
        truth.feed(cache, 1, 0, 4)  # their windows are dropped from the buffer
    kept = truth.data
    for end in (5, 17):
        snap = cache.snapshot(end - 2, end)
        assert snap.restorable and not snap.lazy and snap.start == end - 2
        got = np.array(snap.keys)
        np.testing.assert_array_equal(got, np.stack(kept[end - 3 : end], axis=1)[None])
    unpinned = cache.snapshot(20, 25)
    assert not unpinned.restorable
    snap40 = cache.snapshot(30, 40)
    assert snap40.restorable
    # A rewind below a kept pin forgets it: those tokens may change.
    cache.set_pins([45])
    cache.rewind(48)
    truth.rewind(cache, 48)
    cache.rewind(44)
    truth.rewind(cache, 44)
    truth.feed(cache, 3, 9, 4)
    snap45 = cache.snapshot(44, 45)
    assert snap45.lazy and snap45.restorable


def test_kept_windows_stay_within_their_budget_most_wanted_first():
    cache = SmallSteps(4, slack=1)
    truth = Truth()
    truth.feed(cache, 1, 0, 4)
    one = cache.window_nbytes  # a window of 3 positions
    cache.set_pins([30, 10, 20, 15], budget=2 * one)  # most wanted first
    truth.feed(cache, 40, 0, 4)
    for _ in range(30):
        truth.feed(cache, 1, 0, 4)
    kept = {p: cache.snapshot(p - 1, p) for p in (10, 15, 20, 30)}
    assert {p for p, s in kept.items() if s.restorable} == {30, 10}
    np.testing.assert_array_equal(np.array(kept[10].keys), np.stack(truth.data[7:10], axis=1)[None])


def test_window_mask_is_transformers_sliding_mask():
    """kv_idx > q_idx - window and kv_idx <= q_idx, over the keys the cache returns."""
    for offset, length, window in [(0, 5, 3), (10, 4, 6), (20, 1, 6), (3, 30, 16)]:
        start = max(0, offset - window + 1)
        mask = window_mask(offset, length, window, start)
        if mask is None:
            assert length == 1
            continue
        got = np.array(mask) == 0
        q = np.arange(offset, offset + length)[:, None]
        k = np.arange(start, offset + length)[None, :]
        np.testing.assert_array_equal(got, (k <= q) & (k > q - window))
    # Full caches under a sliding layer: keys from 0, the window still applies to one row.
    one = np.array(window_mask(20, 1, 6, 0)) == 0
    np.testing.assert_array_equal(one[0], np.arange(21) > 14)


# ---------------------------------------------------------------------------- real models
SLIDING = ["mistral_sliding", "qwen2_sliding_new", "gemma2_old", "gemma3_text_new"]


def load(case: str, **tune):
    model = load_model(str(FIXTURES / case), dtype="float32").model
    if tune:
        device.tune(model, **tune)
    return model


def full_logits(model, tokens: list[int]) -> np.ndarray:
    logits, _ = model.forward(mx.array([tokens]), model.make_caches())
    return np.array(logits[0])


def tokens_for(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.mark.parametrize("case", SLIDING)
@pytest.mark.parametrize(
    "tune", [{}, {"fast_kernels": True}, {"layout": "packed"}], ids=["hf", "fast", "tuned"]
)
def test_chunked_prefill_and_decoding_equal_one_forward(small_steps, case, tune):
    model = load(case, **tune)
    caches = model.make_caches()
    assert any(isinstance(c, RotatingKVCache) for c in caches)
    tokens = tokens_for(121)
    want = full_logits(model, tokens)
    got, pos = [], 0
    for size in [5, 40, 1, 17, 3, 1, 1, 30, 2, 1, 1, 1, 16, 1, 1]:  # chunks longer than 16 too
        logits, _ = model.forward(mx.array([tokens[pos : pos + size]]), caches)
        got.append(np.array(logits[0]))
        pos += size
    np.testing.assert_allclose(np.concatenate(got), want[:pos], atol=1e-4, rtol=0)
    windowed = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert all(c.base > 0 for c in windowed)  # the window really slid out of the buffers
    assert all(c.keys.shape[2] <= WINDOW + 16 + 40 + c.headroom + c.step for c in windowed)


@pytest.mark.parametrize("case", SLIDING)
def test_verify_feeds_and_rewinds_equal_plain_decoding(small_steps, case):
    """Speculation's seam on the caches: feed [x, d1..dk], keep a random accepted count, go on
    from the verified row; every kept row equals one full forward of the accepted tokens."""
    model = load(case, layout="packed")
    caches = model.make_caches()
    rng = random.Random(5)
    seq = tokens_for(20, seed=3)
    logits, _ = model.forward(mx.array([seq[:-1]]), caches)
    checked: dict[int, np.ndarray] = {}
    x = seq[-1]
    seq = seq[:-1]
    while len(seq) < 200:
        entry = caches[0].offset
        k = rng.randint(0, 8)
        drafts = [rng.randrange(3, 320) for _ in range(k)]
        logits, _ = model.forward(mx.array([[x, *drafts]]), caches)
        keep = rng.randint(0, k)
        for c in caches:
            c.rewind(entry + 1 + keep)
        seq += [x, *drafts[:keep]]
        row = np.array(logits[0, keep])
        checked[len(seq) - 1] = row
        x = int(row.argmax()) if rng.random() < 0.5 else rng.randrange(3, 320)
    want = full_logits(model, seq)
    for pos, row in checked.items():
        np.testing.assert_allclose(row, want[pos], atol=1e-4, rtol=0, err_msg=str(pos))


def plain_greedy(model, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``, one row per forward."""
    caches = model.make_caches()
    logits, _ = model.forward(mx.array([prompt]), caches)
    out: list[int] = []
    for _ in range(count):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits, _ = model.forward(mx.array([out[-1:]]), caches)
    return out


def greedy_ops(model, caches) -> MlxRoundOps:
    """The round driver's MLX seam over ``caches``, greedy, no head (drafts are passed in)."""
    sampler = Sampler(
        SamplingParams(temperature=0, repeat_penalty=1.0), [], model.args.vocab_size, 4096
    )
    return MlxRoundOps(model, caches, None, sampler)


def prefill(ops: MlxRoundOps, prompt: list[int], chunk: int) -> int:
    """Feed ``prompt`` in chunks (so the windows slide); the first token after it."""
    starts = range(0, len(prompt), chunk)
    for i in starts[:-1]:
        ops.replay_feed(prompt[i : i + chunk], successor=False)
    return ops.replay_feed(prompt[starts[-1] :], successor=True).successor


@pytest.mark.parametrize("case", SLIDING)
def test_rounds_at_the_depth_ceiling_never_need_a_rewind_the_window_cannot_undo(small_steps, case):
    """Verify feeds of MAX_DRAFT_DEPTH drafts (as many rows as the window) through the seam,
    accepted up to every depth: after each, every rollback the round can make (the entry, x
    kept, any accepted count) is one every sliding cache can undo, and rewinding there and
    going on decodes exactly what plain greedy decoding does."""
    model = load(case)
    caches = model.make_caches()
    windowed = [c for c in caches if isinstance(c, RotatingKVCache)]
    prompt = tokens_for(23, seed=len(case))
    want = plain_greedy(model, prompt, 100)
    ops = greedy_ops(model, caches)
    x = prefill(ops, prompt, 5)
    rng = random.Random(11)
    got: list[int] = []
    accepted = set()
    while len(got) < 80:
        entry = ops.position
        right = want[len(got) + 1 : len(got) + 1 + MAX_DRAFT_DEPTH]  # the tokens after x
        wrong_from = rng.randint(0, MAX_DRAFT_DEPTH)
        drafts = [t if i < wrong_from else (t + 1) % 320 for i, t in enumerate(right)]
        proposal = SimpleNamespace(tokens=mx.array(drafts, dtype=mx.int32))
        verified = ops.verify_feed(x, proposal)
        for c in windowed:
            reachable = [c.can_rewind(p) for p in range(entry, entry + MAX_DRAFT_DEPTH + 2)]
            assert all(reachable), (case, entry, c.valid_lo, reachable)
        a = accepted_count(verified.accept)
        if rng.random() < 0.2:  # as after a failed draft evaluation: the entry, then x alone
            ops.restore(entry)
            verified, a = ops.verify_feed(x, None), 0
        else:
            ops.rewind(entry + 1 + a)
        accepted.add(a)
        got += [x, *verified.drafts[:a]]
        x = verified.successors[a]
    assert got == want[: len(got)]
    assert all(c.base > 0 for c in windowed)  # the windows slid out of the buffers
    assert {0, MAX_DRAFT_DEPTH} <= accepted and len(accepted) > 5


def test_a_rewind_past_the_window_is_refused_before_any_cache_moves(small_steps):
    """The seam refuses a rewind to where a sliding cache no longer holds the window, with
    every cache left where it was, instead of failing at the next append; decoding goes on."""
    model = load("qwen2_sliding_new")  # full layer 0, sliding layers 1 and 2
    caches = model.make_caches()
    prompt = tokens_for(61, seed=9)
    want = plain_greedy(model, prompt, 4)
    ops = greedy_ops(model, caches)
    x = prefill(ops, prompt, 7)
    lost = [p for p in range(ops.position) if not all(c.can_rewind(p) for c in caches)]
    assert lost and all(caches[0].can_rewind(p) for p in lost)  # the full layer could
    offsets = [c.offset for c in caches]
    with pytest.raises(TargetError, match="sliding-window layer .* the window before"):
        ops.rewind(lost[-1])
    with pytest.raises(TargetError, match="sliding-window layer"):
        ops.restore(lost[0])
    assert [c.offset for c in caches] == offsets
    got = [x]
    while len(got) < len(want):
        got.append(ops.verify_feed(got[-1], None).successors[0])
    assert got == want


def test_a_full_cache_under_a_sliding_layer_masks_the_same(small_steps):
    """Plain KVCaches everywhere (as a tool that builds its own would): the window is masked
    out of the whole history, so the logits are the same."""
    model = load("mistral_sliding")
    tokens = tokens_for(60, seed=9)
    want = full_logits(model, tokens)
    caches = [KVCache() for _ in model.layers]
    got = [np.array(model.forward(mx.array([tokens[:25]]), caches)[0][0])]
    for t in tokens[25:]:
        got.append(np.array(model.forward(mx.array([[t]]), caches)[0][0]))
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- prefix cache
@pytest.mark.parametrize("case", ["mistral_sliding", "qwen2_sliding_old", "gemma2_new"])
def test_cached_runs_equal_fresh_runs_with_sliding_layers(small_steps, case):
    """The prefix-cache property test of tests/test_cache_session.py on sliding models (every
    layer sliding; full and sliding layers mixed): restores stop where every cache can resume,
    and ``cached`` is exactly what the caches then hold."""
    model = load(case)
    pc = PrefixCache(model.make_caches(), 96 * 1024, snapshot_interval=16)
    stats = run_property(model, pc, 120, seed=77)
    assert stats["hits"] >= 40 and stats["full"] >= 5 and stats["cancels"] >= 5
    assert stats["evicted"] >= 5


def test_pair_keys_with_a_draft_cache_and_sliding_layers(small_steps):
    from tests.test_cache_session import DraftWriter

    model = load("gemma3_text_old")
    draft = DraftWriter(model.args.vocab_size)
    pc = PrefixCache(
        [*model.make_caches(), KVCache()], 96 * 1024, pair_keys=True, snapshot_interval=16
    )
    stats = run_property(model, pc, 60, seed=8, draft=draft)
    assert stats["hits"] >= 20


def test_next_turn_restores_the_whole_previous_answer(small_steps):
    model = load("mistral_sliding")
    pc = PrefixCache(model.make_caches(), 1 << 24)
    first = serve(model, pc, tokens_for(70, seed=1), gen=30)
    old = first.prompt + first.fed
    second = serve(model, pc, old + [first.final, *tokens_for(10, seed=2)], gen=5)
    # The live caches still hold the window at the end of the last request.
    assert second.cached == len(old)
    check_against_fresh(model, second)


def test_regenerated_turn_falls_back_to_the_kept_window_before_the_prompt_end(small_steps):
    """The regenerated prompt leaves the trie 2 tokens before the old prompt's end, where the
    sliding caches no longer hold a window (the answer ran on): the restore stops at the
    pre-turn point, whose window was kept when prefill passed it."""
    model = load("qwen2_sliding_new")  # full layer 0, sliding layers 1 and 2
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = tokens_for(90, seed=4)
    serve(model, pc, prompt, gen=40)
    regen = serve(model, pc, prompt[:-2] + [3, 4], gen=3)
    assert regen.cached == len(prompt) - 4
    node = pc.trie.match(trie_keys(prompt, False))[0][1]
    assert node.end == len(prompt) - 4 and node.user
    check_against_fresh(model, regen)


def test_deepest_point_every_cache_can_reach_is_restored(small_steps):
    """A branch inside a long node: full caches could restore the whole match, the sliding
    ones only at a node end they kept a window for; the session restores that common point,
    reports it and stays exact."""
    model = load("gemma2_old")
    pc = PrefixCache(model.make_caches(), 1 << 24, snapshot_interval=32)
    base = tokens_for(100, seed=6)
    serve(model, pc, base, gen=30)
    branch = base[:50] + tokens_for(20, seed=7)
    served = serve(model, pc, branch, gen=4)
    assert served.cached == 32  # the interval point below the divergence at 50
    check_against_fresh(model, served)
    # The divergence was pinned: the split there kept a window, so a second branch from the
    # same point restores all of it.
    again = serve(model, pc, base[:50] + tokens_for(20, seed=8), gen=2)
    assert again.cached == 50
    check_against_fresh(model, again)
