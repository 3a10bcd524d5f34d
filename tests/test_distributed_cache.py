"""The prefix cache across ranks (runner.distributed.remote): the other ranks' snapshots
kept where their layers are, under ids rank 0 gives, and real runners resuming from it as one
process does."""

from __future__ import annotations

import contextlib
import os
import random

import mlx.core as mx
import pytest

from cache.kv_quantized import QuantizedKVCache, quantize_caches
from cache.recurrent import RecurrentCache
from cache.session import PrefixCache
from runner.distributed import follower, stage
from runner.distributed.channel import Command, Op
from runner.distributed.engine import kv_row_bytes, recurrent_layers, windowed_layers
from runner.distributed.remote import Link, RemoteStates
from runner.models import qwen3_5
from runner.models.llama import Model
from tests.conformance.harness import RunnerProcess
from tests.test_distributed import (
    HYBRID,
    LAYERS,
    LONG_PROMPT,
    ScriptedChannel,
    _later_stage,
    _runner,
    noop,
)
from tests.test_vision_pipe import FIXTURE as VISION
from tests.test_vision_pipe import A as IMAGE


@pytest.fixture(scope="module")
def deep_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama", num_hidden_layers=LAYERS)


GROUP = 32  # --kv-group of the tests with --kv-bits


class NoWatchdog:
    @contextlib.contextmanager
    def exchange(self, what: str, timed: bool = True):
        yield


class LoopChannel:
    """Rank 0's channel to one later rank run in this process: each command is applied as it
    is sent (``follower.apply``), a forward's rows run through the rank's stage."""

    def __init__(self, model: Model, kv_bits: int | None = None) -> None:
        self.model = model
        self.kv_bits = kv_bits
        self.sets: dict[int, list] = {}
        self.kept = follower.Snapshots()
        self.pending: tuple[Command, list] | None = None
        self.back: mx.array | None = None
        self.table: list[list[int]] = []

    def caches(self, number: int) -> list:
        if number not in self.sets:
            self.sets[number] = quantize_caches(self.model.make_caches(), self.kv_bits, GROUP)
        return self.sets[number]

    def send_command(self, command: Command) -> None:
        caches = self.caches(command.caches)
        if command.op is Op.FORWARD or (command.op is Op.PINS and command.rows):
            self.pending = (command, caches)  # applied when its rows or table come
        else:
            follower.apply(self, self.model, caches, self.kept, command)

    def send_table(self, table: list[list[int]]) -> None:
        if self.pending is None:
            return  # the rank passing a table on: the last rank passes nothing
        (command, caches), self.pending = self.pending, None
        self.table = table
        follower.apply(self, self.model, caches, self.kept, command)

    def recv_table(self, shape: tuple[int, int]) -> list[list[int]]:
        assert [len(self.table), len(self.table[0])] == list(shape)
        return self.table

    def send_rows(self, rows: mx.array) -> None:
        (command, caches), self.pending = self.pending, None
        assert caches[0].offset == command.offset
        self.back = self.model.hidden(rows, caches, prenorm=True)
        mx.eval(self.back, [c.state for c in caches])

    def recv_rows(self, count: int, dtype: mx.Dtype) -> mx.array:
        return self.back

    def held_bytes(self) -> int:
        """Bytes of the copies this rank's kept snapshots hold (lazy ones hold none)."""
        return sum(s.nbytes for snaps in self.kept.values() for s in snaps)


@pytest.fixture(scope="module")
def wide_checkpoint(checkpoint_factory) -> str:
    """Heads of 32 (a --kv-group): the quantized KV caches' layout."""
    return checkpoint_factory("llama", num_hidden_layers=LAYERS, hidden_size=128)


@pytest.mark.parametrize("bits", [None, 8], ids=["float", "kv-bits-8"])
def test_the_prefix_cache_keeps_a_later_ranks_snapshots_there_by_id(wide_checkpoint, bits):
    # With --kv-bits the later rank's caches hold packed rows: rank 0 counts their copies'
    # bytes as such, without asking.
    model = _later_stage(wide_checkpoint)
    channel = LoopChannel(model, bits)
    args = stage.read_checkpoint(wide_checkpoint, noop).args
    assert args.head_dim == GROUP
    dtype = model.layers[0].input_layernorm.weight.dtype
    layers = range(LAYERS - len(model.layers), LAYERS)
    packed = (bits, GROUP) if bits else None
    link = Link(channel, NoWatchdog(), kv_row_bytes(args, layers, dtype, packed))
    remote = link.new_set()
    prefix = PrefixCache(remote, budget_bytes=1 << 30)
    table = mx.random.normal((64, model.args.hidden_size), key=mx.random.key(5)).astype(dtype)

    def turn(prompt: list[int], generated: list[int]) -> int:
        """One request: what the prefix cache restored, the rest fed, the rows checked
        against a fresh run over everything fed."""
        session = prefix.begin(prompt)
        fed = prompt + generated[:-1]
        out = link.forward(table[mx.array([fed[session.cached :]])], remote)
        fresh = quantize_caches(model.make_caches(), bits, GROUP)
        expected = model.hidden(table[mx.array([fed])], fresh, prenorm=True)
        # Packed rows: a restored prefix is read back quantized where one feed of everything
        # attends over the chunk's own float rows, so close, not equal.
        tolerance = 1e-3 if bits else 1e-5
        assert mx.allclose(out, expected[:, session.cached :], atol=tolerance).item(), prompt
        session.record(generated)
        session.close()
        # The trie holds a handle for every snapshot the rank holds, and counts its copies.
        handles = {s.number for node in prefix.trie.nodes() for s in node.snapshots}
        assert handles == set(channel.kept)
        assert prefix.nbytes == channel.held_bytes() == prefix.trie.recount()
        return session.cached

    first, answer, more = list(range(1, 13)), [30, 31, 32], [40, 41, 42, 43]
    assert turn(first, answer) == 0
    packed = [isinstance(c, QuantizedKVCache) for c in channel.sets[remote[0].number]]
    assert packed == [bool(bits)] * len(model.layers)
    assert turn(first + answer + more, [50, 51]) == len(first) + len(answer) - 1
    assert prefix.nbytes == 0  # every snapshot is still a range of the live buffers
    # A branch off the middle splits a node and overwrites the live ranges past it: the
    # rank copies them out, and rank 0 counts the copies without asking.
    assert turn(first[:5] + [60, 61, 62], [63]) == 5
    assert prefix.nbytes > 0
    # Back on the first branch: its copies are written into the live buffers again.
    assert turn(first + answer + more + [50, 52], [53]) == len(first + answer + more) + 1
    # Over budget: nodes are dropped and folded, and the rank lets their snapshots go.
    prefix.budget_bytes = 0
    assert turn(first[:3] + [20, 21], [22, 23]) == 3
    assert prefix.nbytes == 0
    prefix.clear()
    assert not channel.kept


def _mirror(states: RemoteStates) -> tuple:
    """What rank 0 says the other ranks' recurrent layers hold: kept positions, pins taken."""
    return sorted(states.rewind_points()), sorted(p for p, t in states._pins.items() if t)


def _held(cache: RecurrentCache) -> tuple:
    return sorted(cache.rewind_points()), sorted(p for p, s in cache._pins.items() if s)


@pytest.mark.parametrize(
    ("budget", "roomy"), [(1 << 30, True), (15_000, False)], ids=["roomy", "one-copy"]
)
def test_the_prefix_cache_over_a_later_ranks_recurrent_layers_resumes_as_their_own(budget, roomy):
    # The later stage holds Gated DeltaNet and attention layers: rank 0 drives its set as a
    # full cache and a windowed one, mirroring what every recurrent layer keeps and pins.
    # The same turns over the stage's own caches in this process are the reference: the
    # same prefix hits, the same bytes counted, the same rows.
    path = os.path.join(HYBRID, "qwen3_5_text")
    model = _later_stage(path)
    channel = LoopChannel(model)
    args = stage.read_checkpoint(path, noop).args
    dtype = mx.float32
    later = range(
        len(args.extra["hybrid"].layer_types) - len(model.layers),
        len(args.extra["hybrid"].layer_types),
    )
    recurrent = recurrent_layers(args, later)
    assert recurrent and len(recurrent) < len(later)
    full = [i for i in later if i not in recurrent]
    size = len(recurrent) * qwen3_5.state_bytes(args, dtype)
    link = Link(channel, NoWatchdog(), kv_row_bytes(args, full, dtype), len(recurrent), size)
    parts = link.new_set()
    assert [p.windowed for p in parts] == [False, True]
    own = model.make_caches()
    remote, local = PrefixCache(parts, budget), PrefixCache(own, budget)
    table = mx.random.normal((64, model.args.hidden_size), key=mx.random.key(7)).astype(dtype)

    def turn(prompt: list[int], generated: list[int]) -> int:
        sessions = remote.begin(prompt), local.begin(prompt)
        assert sessions[0].cached == sessions[1].cached, prompt
        cached = sessions[0].cached
        fed = prompt + generated[:-1]
        out = link.forward(table[mx.array([fed[cached:]])], parts)
        expected = model.hidden(table[mx.array([fed[cached:]])], own, prenorm=True)
        assert mx.allclose(out, expected, atol=1e-5).item(), prompt
        # A verify feed of three rows, all rejected: back to the state it started from.
        at = len(fed)
        for caches in (parts, own):
            for c in caches:
                c.keep(range(at + 1, at + 3))
        link.forward(table[mx.array([[1, 2, 3]])], parts)
        model.hidden(table[mx.array([[1, 2, 3]])], own, prenorm=True)
        for caches in (parts, own):
            for c in caches:
                c.rewind(at)
        for cache in channel.sets[parts[0].number]:
            if isinstance(cache, RecurrentCache):
                assert _held(cache) == _mirror(parts[1]), prompt
        for session in sessions:
            session.record(generated)
            session.close()
        handles = {s.number for node in remote.trie.nodes() for s in node.snapshots}
        assert handles - {0} == set(channel.kept)
        assert remote.nbytes == channel.held_bytes() == local.nbytes == remote.trie.recount()
        return cached

    first, answer, more = list(range(1, 13)), [30, 31, 32], [40, 41, 42, 43]
    hits = [
        turn(first, answer),
        turn(first + answer + more, [50, 51]),
        turn(first[:5] + [60, 61, 62], [63]),  # a branch off the middle
        turn(first + answer + more + [50, 52], [53]),  # back on the first branch
        turn(first + answer + [44, 45], [46]),
    ]
    assert hits[0] == 0 and hits[1] > 0, hits
    # Room for every pin: the turns back on a branch resume from the states kept there
    # (with one copy a layer, the budget let them go).
    assert (hits[3] > 0 and hits[4] > 0) == roomy, hits
    remote.clear()
    assert not channel.kept


def test_rank_0s_mirror_of_the_recurrent_layers_follows_any_command_sequence():
    # Random feeds, verify feeds with kept prefixes and rejections, pins under budgets,
    # snapshots, restores, drops and resets on the states part: after each, every recurrent
    # layer of the later rank holds what rank 0 says (a restore it could not do would stop
    # it: ``follower.apply`` raises).
    path = os.path.join(HYBRID, "qwen3_5_text")
    model = _later_stage(path)
    channel = LoopChannel(model)
    args = stage.read_checkpoint(path, noop).args
    size = qwen3_5.state_bytes(args, mx.float32)
    states = Link(channel, NoWatchdog(), 0, 1, size).new_set()[1]
    table = mx.random.normal((4, model.args.hidden_size), key=mx.random.key(2))
    rng = random.Random(11)
    snaps: list = []
    for _ in range(400):
        op = rng.choice(["feed", "verify", "verify", "pins", "snapshot", "restore", "drop"])
        if op == "feed":
            states.link.forward(table[: rng.randint(1, 4)][None], [states])
        elif op == "verify":
            at, depth = states.offset, rng.randint(1, 3)
            states.keep(range(at + 1, at + depth + 1))
            states.link.forward(table[: depth + 1][None], [states])
            states.rewind(rng.choice([p for p in states.rewind_points() if p >= at]))
        elif op == "pins":
            wanted = rng.sample(range(1, states.offset + 8), rng.randint(0, 5))
            states.set_pins(wanted, budget=rng.choice([None, size * rng.randint(0, 3)]))
        elif op == "snapshot":
            end = rng.randint(0, states.offset)
            snaps.append(states.snapshot(max(0, end - 2), end))
        elif op == "restore" and any(s.restorable for s in snaps):
            states.restore(rng.choice([s for s in snaps if s.restorable]))
        elif op == "drop" and snaps:
            snaps.pop(rng.randrange(len(snaps))).close()
        if rng.random() < 0.02:
            states.reset()
        for cache in channel.sets[states.number]:
            if isinstance(cache, RecurrentCache):
                assert _held(cache) == _mirror(states), op
    for snap in snaps:
        snap.close()
    assert not channel.kept


def test_the_later_ranks_sliding_layers_are_what_turns_the_prefix_cache_off(checkpoint_factory):
    path = checkpoint_factory("mistral", num_hidden_layers=LAYERS, sliding_window=6)
    args = stage.read_checkpoint(path, noop).args
    assert windowed_layers(args, range(2, LAYERS)) == [2, 3]
    args = stage.read_checkpoint(checkpoint_factory("llama", num_hidden_layers=LAYERS), noop).args
    assert windowed_layers(args, range(2, LAYERS)) == []


def test_a_later_rank_told_of_a_snapshot_it_does_not_hold_stops(deep_checkpoint):
    model = _later_stage(deep_checkpoint)
    channel = ScriptedChannel([Command(Op.RESTORE, 1, offset=0, snap=7)])
    with pytest.raises(follower.OutOfStep, match="no snapshot 7"):
        follower.follow(channel, model)


async def _chat(cmd: list[str], text: str = LONG_PROMPT, logprobs: bool = False) -> list[tuple]:
    """A conversation over token ids whose later turns resume from the prefix cache, a
    cancelled turn and a branch off the middle among them: each turn's ids and
    ``prompt_cached_tokens`` (and its tokens' log-probabilities when ``logprobs``)."""
    runner = await RunnerProcess.start(cmd)
    turns = []

    async def turn(tokens: list[int], options: dict) -> list[int]:
        request_id = f"t{len(turns)}"
        request = {"type": "completion", "id": request_id, "tokens": tokens, **options}
        await runner.send({**request, "logprobs": True} if logprobs else request)
        frames, done = await runner.completion(request_id)
        ids = [t for frame in frames for t in frame["tokens"]]
        got = (ids, done["prompt_cached_tokens"])
        if logprobs:
            got += ([p["logprob"] for frame in frames for p in frame["logprobs"]],)
        turns.append(got)
        return ids

    try:
        await runner.send({"type": "tokenize", "id": "p", "text": text})
        prompt = (await runner.reply("p"))["tokens"]
        greedy = {"options": {"temperature": 0, "num_predict": 8}}
        seeded = {"options": {"temperature": 0.8, "seed": 4, "num_predict": 8}}
        answer = await turn(prompt, greedy)
        second = prompt + answer + prompt[:9]
        reply = await turn(second, seeded)
        # Cancelled mid-decode: the ranks' caches rest where it stopped.
        options = {"temperature": 0, "num_predict": 1_000_000}
        tokens = second + reply + prompt[3:12]
        await runner.send({"type": "completion", "id": "x", "tokens": tokens, "options": options})
        assert (await runner.reply("x"))["type"] == "token"
        await runner.send({"type": "cancel", "id": "x"})
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == "x")
        assert done["done_reason"] == "cancelled"
        await turn(second + reply + prompt[20:30], greedy)
        await turn(prompt[:40] + answer, seeded)  # a branch off the middle of the first turn
        await turn(second + reply + prompt[20:30], greedy)
        await runner.send({"type": "shutdown"})
        assert await runner.wait_exit() == 0, runner.stderr_tail()
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:3]
    return turns


async def test_ranks_resume_from_the_prefix_cache_as_one_process_does(deep_checkpoint):
    expected = await _chat(_runner(deep_checkpoint, "--no-draft"))
    cached = [hit for _, hit in expected]
    assert cached[0] == 0 and all(hit > 0 for hit in cached[1:]), cached
    assert await _chat(_runner(deep_checkpoint, "--no-draft", "--ranks", "2")) == expected
    # Speculating at a fixed depth (the suffix drafter): a verify feed may have fed a turn's
    # last token, so a turn can resume a position further on, as it does in one process.
    fixed = ("--draft-depth", "2")
    speculating = await _chat(_runner(deep_checkpoint, *fixed))
    assert [ids for ids, _ in speculating] == [ids for ids, _ in expected]
    assert await _chat(_runner(deep_checkpoint, *fixed, "--ranks", "3")) == speculating


async def test_ranks_serve_a_qwen3_model_as_one_process_does(checkpoint_factory):
    # Its per-head query and key norms on every rank; speculating at a fixed depth, over
    # three ranks with room for two completions.
    path = checkpoint_factory("qwen3", num_hidden_layers=LAYERS)
    fixed = ("--draft-depth", "2")
    expected = await _chat(_runner(path, *fixed))
    assert all(hit > 0 for _, hit in expected[1:]), expected
    assert await _chat(_runner(path, *fixed, "--ranks", "3", "--parallel", "2")) == expected


async def test_ranks_serve_packed_kv_caches_as_one_process_does(wide_checkpoint):
    # --kv-bits on every rank (each decides it for its own layers, as one process does):
    # log-probabilities equal one process's with packed caches, and differ from float ones.
    packed = ("--kv-bits", "8", "--kv-group", str(GROUP), "--draft-depth", "2")
    expected = await _chat(_runner(wide_checkpoint, *packed), logprobs=True)
    assert all(hit > 0 for _, hit, _ in expected[1:]), expected
    assert await _chat(_runner(wide_checkpoint, *packed, "--ranks", "2"), logprobs=True) == expected
    floats = await _chat(_runner(wide_checkpoint, *packed[4:]), logprobs=True)
    assert [lp for *_, lp in floats] != [lp for *_, lp in expected]


async def test_ranks_resume_a_hybrid_from_the_prefix_cache_as_one_process_does():
    # Gated DeltaNet layers on both ranks: the later rank's states are pinned, snapshotted
    # and restored on rank 0's word, and speculation's rejected rows rewind them.
    path = os.path.join(HYBRID, "qwen3_5_text")
    options = ("--draft-sources", "suffix", "--draft-depth", "2")
    text = LONG_PROMPT[: len(LONG_PROMPT) // 3]  # the fixture's context is short
    expected = await _chat(_runner(path, *options), text)
    assert sum(hit > 0 for _, hit in expected) >= 3, expected
    # With room for two completions (a chat's turns come one after another): each slot
    # keeps a set of caches on every rank, and the prefix cache serves both sets.
    ranked = _runner(path, *options, "--ranks", "2", "--parallel", "2")
    assert await _chat(ranked, text) == expected


async def test_split_image_models_keep_one_completion_at_a_time():
    # A shared forward hands the later ranks each row's offset, and an image request's rows
    # sit past theirs: refused where the ranks are linked, said in the log.
    runner = await RunnerProcess.start(_runner(str(VISION), "--ranks", "2", "--parallel", "2"))
    try:
        await runner.send({"type": "shutdown"})
        assert await runner.wait_exit() == 0, runner.stderr_tail()
    finally:
        await runner.stop()
    log = runner.stderr.decode()
    assert "image positions do not cross the ranks in shared forwards" in log, log[-2000:]
    assert "across 2 ranks: one completion at a time" in log, log[-2000:]


async def test_ranks_serve_a_prompt_with_an_image_as_one_process_does():
    # Rank 0 holds the vision tower and embeds the image's rows; the later rank's attention
    # layer rotates them by the 3-channel positions rank 0 sends with them. The same image
    # again resumes from the prefix cache, and the inline MTP head drafts after it.
    # Log-probabilities too: a few greedy tokens of a tiny model can survive wrong positions.
    greedy = {"temperature": 0, "num_predict": 6}
    seeded = {"temperature": 0.8, "seed": 5, "num_predict": 6}

    async def serve(cmd: list[str]) -> list[tuple[list[int], list[float], int]]:
        runner = await RunnerProcess.start(cmd)
        outputs = []
        try:
            for index, options in enumerate((greedy, seeded, greedy)):
                prompt = {"prompt": "x [img-0] y", "images": [IMAGE], "logprobs": True}
                prompt["options"] = options
                await runner.send({"type": "completion", "id": f"i{index}", **prompt})
                frames, done = await runner.completion(f"i{index}")
                tokens = [t for frame in frames for t in frame["tokens"]]
                logprobs = [p["logprob"] for frame in frames for p in frame["logprobs"]]
                outputs.append((tokens, logprobs, done["prompt_cached_tokens"]))
            await runner.send({"type": "shutdown"})
            assert await runner.wait_exit() == 0, runner.stderr_tail()
        finally:
            await runner.stop()
        assert not runner.violations, runner.violations[:3]
        return outputs

    path = str(VISION)
    expected = await serve(_runner(path, "--draft-depth", "2"))
    assert expected[1][2] > 0 and expected[2][2] > 0, expected
    assert await serve(_runner(path, "--draft-depth", "2", "--ranks", "2")) == expected
