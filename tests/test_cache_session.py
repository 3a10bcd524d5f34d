"""The prefix cache end to end on a real tiny model: every cached run equals a fresh one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache
from cache.session import CacheDesyncError, PrefixCache, trie_keys
from runner.loader import load_model

ATOL = 1e-4
DRAFT_HEADS, DRAFT_DIM = 2, 8


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def model(loaded):
    return loaded.model


# ---------------------------------------------------------------------------- a fake draft KV
class DraftWriter:
    """Stands in for an MTP head with its own KV: slot S holds a function of (token S+1, S),
    so a slot is only right when the token after it is the right one."""

    def __init__(self, vocab: int) -> None:
        self.table = mx.random.normal((vocab, DRAFT_HEADS * DRAFT_DIM), key=mx.random.key(7))

    def expected(self, tokens: list[int], start: int, end: int) -> mx.array:
        nxt = mx.array(tokens[start + 1 : end + 1])
        rows = self.table[nxt] + 0.01 * mx.arange(start, end, dtype=mx.float32)[:, None]
        return rows.reshape(1, end - start, DRAFT_HEADS, DRAFT_DIM).transpose(0, 2, 1, 3)

    def settle(self, cache: KVCache, tokens: list[int], upto: int) -> None:
        """Write slots [offset, upto), as a draft session's settle would."""
        if upto > cache.offset:
            rows = self.expected(tokens, cache.offset, upto)
            cache.update_and_fetch(rows, -rows)
            mx.eval(cache.state)

    def check(self, cache: KVCache, tokens: list[int], upto: int) -> None:
        if upto == 0:
            return
        want = np.array(self.expected(tokens, 0, upto))
        np.testing.assert_array_equal(np.array(cache.keys[..., :upto, :]), want)
        np.testing.assert_array_equal(np.array(cache.values[..., :upto, :]), -want)


# ---------------------------------------------------------------------------- one request
@dataclass
class Served:
    prompt: list[int]
    cached: int
    positions: list[int] = field(default_factory=list)  # absolute position of each row
    rows: list[np.ndarray] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # generated tokens the caches hold
    final: int | None = None  # sampled, never fed
    cancelled: bool = False


def forward_rows(model, caches, tokens: list[int]) -> np.ndarray:
    logits, _ = model.forward(mx.array([tokens]), caches)
    mx.eval(logits, [c.state for c in caches])
    return np.array(logits[0])


def serve(
    model,
    pc: PrefixCache,
    prompt: list[int],
    *,
    gen: int,
    stop_at: int | None = None,
    extra_ends: tuple[int, ...] = (),
    draft: DraftWriter | None = None,
) -> Served:
    """begin -> prefill in chunks ending at the snapshot points -> greedy decode -> close."""
    target = pc.caches[: len(model.layers)]
    session = pc.begin(prompt)
    out = Served(prompt, session.cached)
    assert 0 <= session.cached < len(prompt) and session.remaining == prompt[session.cached :]
    assert all(c.offset == session.cached for c in pc.caches)
    if draft is not None:
        draft.check(pc.caches[-1], prompt, session.cached)
    points = session.snapshot_points()
    assert points == sorted(points) and all(session.cached < p < len(prompt) for p in points)
    last = len(prompt) if stop_at is None else stop_at
    ends = sorted({p for p in (*points, *extra_ends, last) if session.cached < p <= last})
    try:
        pos = session.cached
        for end in ends:
            out.rows.extend(forward_rows(model, target, prompt[pos:end]))
            out.positions.extend(range(pos, end))
            pos = end
        if stop_at is not None:
            out.cancelled = True
            return out
        token = int(np.argmax(out.rows[-1]))
        for _ in range(gen):
            out.fed.append(token)
            out.rows.extend(forward_rows(model, target, [token]))
            out.positions.append(pos)
            pos += 1
            token = int(np.argmax(out.rows[-1]))
        out.final = token
        session.record([*out.fed, token])
        return out
    finally:
        if draft is not None:
            stored = prompt + session.recorded
            draft.settle(pc.caches[-1], stored, target[0].offset)
        session.close()


def check_against_fresh(model, served: Served) -> None:
    """The cached run's rows and greedy picks equal a from-scratch forward of the same tokens."""
    tokens = served.prompt + served.fed
    if served.cancelled:
        tokens = served.prompt[: served.positions[-1] + 1]
    fresh = forward_rows(model, model.make_caches(), tokens)
    np.testing.assert_allclose(np.stack(served.rows), fresh[served.positions], atol=ATOL, rtol=0)
    if not served.cancelled:
        picks = np.argmax(fresh[len(served.prompt) - 1 :], axis=-1).tolist()
        assert picks == [*served.fed, served.final]


def check_resting_state(pc: PrefixCache) -> None:
    offsets = {c.offset for c in pc.caches}
    assert len(offsets) == 1
    assert pc.nbytes <= pc.budget_bytes
    assert pc.nbytes == pc.trie.recount()
    assert pc.entries == sum(1 for _ in pc.trie.nodes())
    for node in pc.trie.nodes():
        assert len(node.snapshots) == len(pc.caches)
        assert all((s.start, s.end) == (node.start, node.end) for s in node.snapshots)


# ---------------------------------------------------------------------------- property test
def random_prompt(rng: random.Random, history: list[Served], vocab: int) -> list[int]:
    def noise(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    kind = rng.choices(["fresh", "continue", "branch", "regenerate", "repeat"], [2, 3, 3, 2, 2])[0]
    if not history or kind == "fresh":
        return noise(5, 60)
    past = rng.choice(history[-6:])
    held = past.prompt + past.fed if not past.cancelled else past.prompt
    if kind == "continue":  # previous prompt + answer + a new user turn
        prompt = held + ([past.final] if past.final is not None else []) + noise(3, 15)
    elif kind == "branch":
        prompt = held[: rng.randint(1, len(held))] + noise(1, 15)
    elif kind == "regenerate":  # the last few template tokens change
        k = rng.randint(1, 4)
        prompt = past.prompt[:-k] + noise(k, k)
    else:
        prompt = list(past.prompt)
    prompt = prompt[:80]
    return prompt if len(prompt) >= 5 else prompt + noise(5 - len(prompt), 5 - len(prompt))


def run_property(model, pc: PrefixCache, requests: int, seed: int, draft=None) -> dict:
    rng = random.Random(seed)
    vocab = model.args.vocab_size
    history: list[Served] = []
    stats = {"hits": 0, "full": 0, "cancels": 0, "evicted": 0, "copied_out": 0}
    evict = pc.trie.evict

    def counting_evict(budget, keep):
        gone = evict(budget, keep)
        stats["evicted"] += gone
        return gone

    pc.trie.evict = counting_evict
    for _ in range(requests):
        prompt = random_prompt(rng, history, vocab)
        stop_at = None
        if rng.random() < 0.15:
            stop_at = rng.randint(1, len(prompt) - 1)
        extra = tuple(rng.randint(1, len(prompt)) for _ in range(rng.randint(0, 2)))
        bytes_before = pc.nbytes
        served = serve(
            model,
            pc,
            prompt,
            gen=rng.randint(0, 5),
            stop_at=stop_at,
            extra_ends=extra,
            draft=draft,
        )
        if served.cancelled and not served.positions:
            # The cache already held everything up to the cancel point: nothing evaluated.
            assert stop_at <= served.cached
        else:
            check_against_fresh(model, served)
        check_resting_state(pc)
        stats["hits"] += served.cached > 0
        stats["full"] += served.cached == len(prompt) - 1
        stats["cancels"] += served.cancelled
        stats["copied_out"] += pc.nbytes > bytes_before
        history.append(served)
    for c in pc.caches:
        assert c.keys.shape[2] <= 256  # prompts + answers stay under one buffer step
    return stats


def test_cached_runs_equal_fresh_runs_over_random_request_sequences(model):
    pc = PrefixCache(model.make_caches(), 96 * 1024, snapshot_interval=16)
    stats = run_property(model, pc, 200, seed=1234)
    # The workload really exercised restores, cancels, copies and eviction.
    assert stats["hits"] >= 80 and stats["full"] >= 10 and stats["cancels"] >= 15
    assert stats["copied_out"] >= 20 and stats["evicted"] >= 20


def test_pair_keys_with_a_draft_cache_over_random_request_sequences(model):
    """Pair keys: every restore also leaves the draft slots right (DraftWriter.check)."""
    draft = DraftWriter(model.args.vocab_size)
    pc = PrefixCache(
        [*model.make_caches(), KVCache()], 96 * 1024, pair_keys=True, snapshot_interval=16
    )
    stats = run_property(model, pc, 100, seed=99, draft=draft)
    assert stats["hits"] >= 40 and stats["full"] >= 5 and stats["evicted"] >= 5


# ---------------------------------------------------------------------------- scenarios
def chat_prompt(tokenizer, turns: list[tuple[str, str]]) -> list[int]:
    text = "".join(f"<|im_start|>{role}\n{body}<|im_end|>\n" for role, body in turns)
    return tokenizer.encode(text + "<|im_start|>assistant\n")


def test_next_turn_reuses_the_previous_prompt_and_answer(loaded):
    model = loaded.model
    pc = PrefixCache(model.make_caches(), 1 << 24)
    turns = [("system", "You are a helpful assistant."), ("user", "The capital of France?")]
    first = serve(model, pc, chat_prompt(loaded.tokenizer, turns), gen=6)
    assert first.cached == 0
    old = first.prompt + first.fed
    follow = old + loaded.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n")
    second = serve(model, pc, follow, gen=4)
    assert second.cached >= len(old) - 1
    check_against_fresh(model, second)


def test_exact_repeat_restores_all_but_the_last_token(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(10, 50))
    first = serve(model, pc, prompt, gen=3)
    again = serve(model, pc, prompt, gen=3)
    assert again.cached == len(prompt) - 1 and again.positions[0] == len(prompt) - 1
    assert again.fed == first.fed and again.final == first.final
    check_against_fresh(model, again)
    # The repeat rewrote the same positions: no copy is left paged out for them.
    assert pc.nbytes == 0


def test_regenerated_turn_hits_the_snapshot_before_the_prompt_end(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(20, 60))
    serve(model, pc, prompt, gen=2)
    regen = serve(model, pc, prompt[:-2] + [3, 4], gen=2)
    assert regen.cached == len(prompt) - 2
    node = pc.trie.match(trie_keys(prompt, False))[0][1]
    assert node.end == len(prompt) - 4 and node.user  # the requested snapshot point
    check_against_fresh(model, regen)


def test_cancelled_prefill_keeps_what_it_passed_and_a_retry_resumes(model):
    pc = PrefixCache(model.make_caches(), 1 << 24, snapshot_interval=16)
    prompt = [(7 * i) % 300 for i in range(60)]
    cancelled = serve(model, pc, prompt, gen=0, stop_at=40)
    check_against_fresh(model, cancelled)
    ends = sorted(n.end for n in pc.trie.nodes())
    assert ends == [16, 32, 40]
    assert [n.user for n in sorted(pc.trie.nodes(), key=lambda n: n.end)] == [True, True, False]
    retry = serve(model, pc, prompt, gen=3)
    assert retry.cached == 40
    check_against_fresh(model, retry)


def test_snapshot_points_every_interval_and_before_the_prompt_end(model):
    pc = PrefixCache(model.make_caches(), 1 << 24, snapshot_interval=16)
    session = pc.begin(list(range(50)))
    assert session.snapshot_points() == [16, 32, 46, 48]  # every 16, and 50 - 4
    session.close()
    pc.set_pair_keys(True)
    session = pc.begin(list(range(50)))
    assert session.snapshot_points() == [15, 31, 45, 47]
    session.close()


def test_small_budget_keeps_memory_flat_over_a_stream_of_distinct_prompts(model):
    budget = 48 * 1024
    pc = PrefixCache(model.make_caches(), budget)
    rng = random.Random(5)
    entries, buffers, other_memory = [], [], []
    for _ in range(60):
        prompt = [rng.randrange(model.args.vocab_size) for _ in range(rng.randint(40, 80))]
        serve(model, pc, prompt, gen=3)
        check_resting_state(pc)
        entries.append(pc.entries)
        buffers.append(sum(c.nbytes for c in pc.caches))
        other_memory.append(mx.get_active_memory() - pc.nbytes)
    assert max(entries[20:]) <= max(entries[:20])  # no creeping growth
    assert max(entries) <= 8  # bytes per node ~ 20-40 KiB: a handful fit the budget
    assert len(set(buffers)) == 1  # live buffers stay one 256-slot step
    assert pc.nbytes > budget // 4  # and the budget is actually used
    # Evicted copies are really freed: MLX memory beyond the paged-out bytes stays put
    # (one leaked copy per request would add ~30 KiB each time).
    assert max(other_memory[10:]) - min(other_memory[10:]) < 64 * 1024


def test_pair_keys_restore_points_respect_the_look_ahead(model):
    """A branch that diverges at token m: pair keys restore m - 1 slots (the draft slot m - 1
    depends on token m); plain keys would restore m and leave that draft slot stale."""
    draft = DraftWriter(model.args.vocab_size)
    base = list(range(30, 70))
    branch = base[:25] + [1, 2, 3, 4, 5]
    for pair, expected in ((True, 24), (False, 25)):
        pc = PrefixCache([*model.make_caches(), KVCache()], 1 << 24, pair_keys=pair)
        serve(model, pc, base, gen=2, draft=draft)
        session = pc.begin(branch)
        assert session.cached == expected
        stale = not np.array_equal(
            np.array(pc.caches[-1].keys[..., :expected, :]),
            np.array(draft.expected(branch, 0, expected)),
        )
        assert stale is (not pair)
        session.close()


def test_pair_keys_leave_the_last_fed_position_unindexed_without_a_successor(model):
    pc = PrefixCache(model.make_caches(), 1 << 24, pair_keys=True)
    prompt = list(range(40, 60))
    session = pc.begin(prompt)
    forward_rows(model, pc.caches, prompt)  # caches hold all 20 positions, nothing recorded
    session.close()
    # The key of position 19 needs token 20: the index stops at 19 (15 is the pre-turn point).
    assert sorted(n.end for n in pc.trie.nodes()) == [15, 19]
    assert serve(model, pc, prompt + [5], gen=1).cached == len(prompt) - 1


def test_close_rejects_uneven_caches_and_caches_ahead_of_the_record(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(100, 130))
    session = pc.begin(prompt)
    forward_rows(model, pc.caches, prompt[:20])
    pc.caches[0].rewind(10)
    with pytest.raises(CacheDesyncError, match="different offsets"):
        session.close()
    session = pc.begin(prompt)  # levels the caches; the request still runs correctly
    assert session.cached == 0 and {c.offset for c in pc.caches} == {0}
    forward_rows(model, pc.caches, prompt)
    session.record([1])
    forward_rows(model, pc.caches, [1, 2])  # fed a token that was never recorded
    with pytest.raises(CacheDesyncError, match="recorded"):
        session.close()
    again = serve(model, pc, prompt, gen=2)
    check_against_fresh(model, again)


def test_abandoned_session_is_inert_and_disabled_cache_restores_nothing(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(5, 25))
    serve(model, pc, prompt, gen=1)
    entries = pc.entries
    stale = pc.begin(prompt)
    forward_rows(model, pc.caches, prompt[-1:])
    fresh = pc.begin(prompt[:10] + [1, 2, 3])
    stale.close()  # abandoned: changes nothing
    assert fresh.cached == 10 and pc.entries == entries
    fresh.close()

    off = PrefixCache(model.make_caches(), 1 << 24, enabled=False)
    serve(model, off, prompt, gen=1)
    repeat = serve(model, off, prompt, gen=1)
    assert repeat.cached == 0 and off.entries == 0
    check_against_fresh(model, repeat)


def test_switching_the_key_scheme_clears_the_trie(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(60, 90))
    serve(model, pc, prompt, gen=2)
    assert pc.entries > 0
    pc.set_pair_keys(True)
    assert pc.entries == 0 and pc.nbytes == 0
    assert serve(model, pc, prompt, gen=2).cached == 0
    assert serve(model, pc, prompt, gen=2).cached == len(prompt) - 1


def test_caches_moved_behind_its_back_are_levelled_and_restored_from_snapshots(model):
    pc = PrefixCache(model.make_caches(), 1 << 24)
    prompt = list(range(130, 170))
    first = serve(model, pc, prompt, gen=2)
    pc.caches[0].rewind(5)  # one slot left behind, as after a failed forward
    again = serve(model, pc, prompt, gen=2)
    assert again.cached == len(prompt) - 1 and again.fed == first.fed
    check_against_fresh(model, again)
    for c in pc.caches:  # an engine reset: lazy ranges are copied out, then restored
        c.reset()
    assert pc.nbytes > 0
    again = serve(model, pc, prompt, gen=2)
    assert again.cached == len(prompt) - 1 and again.fed == first.fed
    check_against_fresh(model, again)


def test_a_long_chat_keeps_one_node_per_turn(model):
    """Each turn leaves a node at its pre-turn point; the plain node between is folded."""
    pc = PrefixCache(model.make_caches(), 1 << 24)
    rng = random.Random(3)
    prompt: list[int] = []
    for turn in range(1, 7):
        prompt = prompt + [rng.randrange(300) for _ in range(rng.randint(6, 12))]
        served = serve(model, pc, prompt, gen=3)
        prompt = prompt + served.fed
        nodes = sorted(pc.trie.nodes(), key=lambda n: n.end)
        assert len(nodes) == turn + 1
        assert all(n.user for n in nodes[:-1]) and len(nodes[-1].children) == 0
    check_against_fresh(model, served)


# ---------------------------------------------------------------------------- several slots
def _write(cache: KVCache, tokens: list[int], start: int) -> None:
    """Append positions [start, len(tokens)) whose key is (token, position): a slot's content
    is right only if the whole prefix before it was restored or written in order."""
    if len(tokens) > start:
        ids = mx.array(tokens[start:], dtype=mx.float32)
        pos = mx.arange(start, len(tokens), dtype=mx.float32)
        rows = mx.stack([ids, pos], axis=-1).reshape(1, 1, len(tokens) - start, 2)
        cache.update_and_fetch(rows, -rows)
        mx.eval(cache.state)


def _check(cache: KVCache, tokens: list[int], upto: int) -> None:
    if upto:
        keys = np.array(cache.keys[0, 0, :upto])
        np.testing.assert_array_equal(keys[:, 0], np.array(tokens[:upto], dtype=np.float32))
        np.testing.assert_array_equal(keys[:, 1], np.arange(upto, dtype=np.float32))


@pytest.mark.parametrize("budget", [0, 1 << 10, 1 << 20], ids=["no-budget", "tight", "roomy"])
def test_concurrent_slots_restore_only_what_their_prefix_holds(budget):
    """Three cache slots with sessions open at once over prompts that share prefixes: every
    restore holds exactly the prompt's cached prefix, whichever slot indexed it and whatever
    the others did since (eviction, splits, copies out of another slot's live buffers)."""
    rng = random.Random(3)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    pc = PrefixCache([KVCache(), KVCache()], budget)
    slots = [0, pc.add_slot([KVCache(), KVCache()]), pc.add_slot([KVCache(), KVCache()])]
    open_ = {}
    hits = 0
    for _ in range(120):
        slot = rng.choice(slots)
        caches = pc.slots[slot].caches
        if slot in open_:  # finish the open request: prefill, generate, close
            session, prompt = open_.pop(slot)
            answer = [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            fed = prompt + answer[:-1] if answer else prompt[:-1]
            for c in caches:
                _write(c, fed, c.offset)
            session.record(answer)
            session.close()
            continue
        stem = rng.choice(stems)
        prompt = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(50) for _ in range(rng.randrange(1, 8))
        ]
        session = pc.begin(prompt, slot)
        hits += session.cached
        for c in caches:
            assert c.offset == session.cached
            _check(c, prompt, session.cached)
        open_[slot] = (session, prompt)
        # every slot's live path is attached to the trie, and the counts are the nodes'
        reachable = {id(n) for n in pc.trie.nodes()} | {id(pc.trie.root)}
        assert all(id(n) in reachable for s in pc.slots for n in s.live)
        assert pc.trie.nbytes == pc.trie.recount()
        assert pc.trie.entries == sum(1 for n in pc.trie.nodes() if n.snapshots)
    assert hits > 0
    if budget:
        assert pc.nbytes <= budget or pc.trie.entries <= 3


def test_a_slot_must_match_the_first():
    pc = PrefixCache([KVCache(), KVCache()], 0)
    with pytest.raises(ValueError, match="cache slot"):
        pc.add_slot([KVCache()])
