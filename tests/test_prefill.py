"""Prefill at the compute rate: the blocked attention of long feeds against a float64
softmax and the five-op composition, and cancels that land between the layers of a chunk.

Most tests shrink the kernel's blocks and tiles (``small_tiles``) so that short feeds cross
every boundary: partial blocks, partial tiles, tiles that straddle a block's diagonal, a
cached prefix that is not tile-aligned. One test runs the default model at the real sizes.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from runner import native
from runner import prefill as prefilling
from runner.loader import load_model
from runner.models import attention
from runner.models.attention import causal_mask, window_mask
from runner.prefill import Cancelled, chunk_ends, prefill

# ---------------------------------------------------------------------------- the kernel


@pytest.fixture(params=["mlx-ops", "fused"])
def small_tiles(request, monkeypatch):
    """Blocks of 16 rows, key tiles of 48, last tiles rounded to 8: short feeds cross them.
    Twice: through the MLX ops (the native kernel hidden) and through the native fused kernel
    where it serves (its blocks of 64 rows and tiles of 64 keys: the longer shapes cross them)."""
    if request.param == "fused" and not native.attention_available():
        pytest.skip(native.reason() or "the native build has no fused attention")
    if request.param == "mlx-ops":
        monkeypatch.setattr(native, "attention_available", lambda: False)
    monkeypatch.setattr(attention, "BLOCK_ROWS", 16)
    monkeypatch.setattr(attention, "KEY_TILE", 48)
    monkeypatch.setattr(attention, "GRAIN", 8)
    monkeypatch.setattr(attention, "MIN_ROWS", 4)


@pytest.fixture
def five_ops(monkeypatch):
    """Every feed through the five-op composition (the reference path)."""
    monkeypatch.setattr(attention, "MIN_ROWS", 1 << 30)


def reference(q, k, v, scale, visible=None, softcap=None) -> np.ndarray:
    """softmax(scale q k^T) v in float64 with grouped heads; ``visible`` [L, T] booleans."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    per_group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, per_group, axis=1), np.repeat(v, per_group, axis=1)
    s = np.einsum("bhld,bhtd->bhlt", q * scale, k)
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    return np.einsum("bhlt,bhtd->bhld", w / w.sum(axis=-1, keepdims=True), v)


def causal(offset: int, length: int) -> np.ndarray:
    return np.arange(offset + length)[None, :] <= np.arange(offset, offset + length)[:, None]


def qkv(length: int, keys: int, batch=1, heads=4, groups=2, dim=16, seed=0, spread=3.0):
    q = mx.random.normal((batch, heads, length, dim), key=mx.random.key(seed)) * spread
    k = mx.random.normal((batch, groups, keys, dim), key=mx.random.key(seed + 1))
    v = mx.random.normal((batch, groups, keys, dim), key=mx.random.key(seed + 2))
    return q, k, v


# (rows, cached prefix): shorter than a block, one block, block + 1, several blocks and tiles,
# prefixes that leave the diagonal inside a tile or across a tile boundary, a tile whose last
# key is one or two past a block's first row.
SHAPES = [
    (5, 0),
    (16, 0),
    (17, 0),
    (37, 11),
    (48, 0),
    (50, 47),
    (64, 95),
    (100, 133),
    (20, 46),
    (3, 93),
    (130, 70),
    (65, 0),
    (64, 64),
]


@pytest.mark.parametrize("length,offset", SHAPES)
def test_causal_blocks_equal_the_softmax(small_tiles, length, offset):
    q, k, v = qkv(length, offset + length, seed=length + offset)
    got = attention.blocked_attention(q, k, v, scale=0.25, mask="causal")
    want = reference(q, k, v, 0.25, causal(offset, length))
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("length,offset", [(37, 11), (100, 133)])
def test_array_masks_no_mask_batches_and_softcap(small_tiles, length, offset):
    keys = offset + length
    q, k, v = qkv(length, keys, batch=2, heads=6, groups=3, seed=7)
    want_causal = reference(q, k, v, 0.25, causal(offset, length))
    additive = causal_mask(offset, length)
    for mask in (additive, additive == 0):  # an additive and a boolean [L, T] mask
        got = attention.blocked_attention(q, k, v, scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(got), want_causal, atol=2e-5, rtol=0)
    got = attention.blocked_attention(q, k, v, scale=0.25, mask=None)
    np.testing.assert_allclose(np.array(got), reference(q, k, v, 0.25), atol=2e-5, rtol=0)
    window = window_mask(offset, length, 20)  # a sliding window's additive mask, -inf outside
    want = reference(q, k, v, 0.25, np.array(window) == 0)
    got = attention.blocked_attention(q, k, v, scale=0.25, mask=window)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=0)
    got = attention.blocked_attention(q, k, v, scale=0.25, mask="causal", softcap=5.0)
    want = reference(q, k, v, 0.25, causal(offset, length), softcap=5.0)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=0)


def test_scores_far_apart_keep_their_weights(small_tiles):
    """Rows whose scores span more than float32's exponent range: what underflows in the
    softmax underflows here too, the rest keeps full precision (the row maximum is exact)."""
    q, k, v = qkv(40, 90, seed=3, spread=40.0)
    got = attention.blocked_attention(q, k, v, scale=0.25, mask="causal")
    want = reference(q, k, v, 0.25, causal(50, 40))
    assert np.isfinite(np.array(got)).all()
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=0)


def test_exp2_of_nonpositive_values():
    d = np.concatenate(
        [
            -np.linspace(0.0, 130.0, 20001),
            [-0.5, -0.49999997, -1.5, -126.4, -126.6, -127.0],
            [-127.5, -200.0, -1e6, attention.MASKED],
        ]
    ).astype(np.float32)
    got = np.array(attention.exp2_nonpositive(mx.array(d))).astype(np.float64)
    want = np.exp2(d.astype(np.float64))
    normal = d >= -125.0
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 4e-7
    assert np.all(got[d <= -127.5] == 0.0)
    assert np.all(np.abs(got[~normal] - want[~normal]) < 1e-37)


def test_only_many_row_float32_feeds_on_the_cpu_take_the_kernel():
    assert attention.serves(attention.MIN_ROWS, mx.float32, "causal")
    assert not attention.serves(attention.MIN_ROWS - 1, mx.float32, "causal")  # decode, verify
    assert not attention.serves(512, mx.bfloat16, "causal")
    assert not attention.serves(512, mx.float32, mx.zeros((2, 1, 512, 600)))  # per sequence
    assert attention.serves(512, mx.float32, None)


# ---------------------------------------------------------------------------- the model


def collect(rows: list):
    """An ``on_commit`` hook appending each chunk's hidden rows to ``rows``."""
    return lambda ids, hidden, position: rows.append(np.array(hidden))


def hidden_rows(model, tokens, chunk, start_tokens=()):
    """Every prompt row's hidden (post-norm) after prefilling ``start_tokens`` then ``tokens``
    in chunks of ``chunk``, and the caches."""
    caches = model.make_caches()
    position = prefill(model, caches, list(start_tokens), 0, chunk=chunk)
    rows: list[np.ndarray] = []
    prefill(model, caches, tokens, position, chunk=chunk, on_commit=collect(rows))
    return np.concatenate(rows), caches


def greedy(model, caches, first: int, steps: int) -> list[int]:
    out, token = [], first
    for _ in range(steps):
        logits, _ = model.forward(mx.array([[token]]), caches)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


def prompt(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


@pytest.mark.parametrize("length,prefix", [(9, 0), (33, 0), (70, 0), (131, 0), (100, 45)])
def test_chunked_prefill_equals_one_five_op_forward(small_tiles, tiny_checkpoint, length, prefix):
    """Blocked chunks of 1, 24, 64 rows and the whole prompt against one unchunked forward
    through the five-op composition: hiddens within float32 tolerance, the same greedy run."""
    model = load_model(tiny_checkpoint).model
    tokens = prompt(prefix + length)
    saved = attention.MIN_ROWS
    attention.MIN_ROWS = 1 << 30
    try:
        caches = model.make_caches()
        want = np.array(model.hidden(mx.array([tokens]), caches)[0])
        want_run = greedy(model, caches, tokens[-1], 6)
    finally:
        attention.MIN_ROWS = saved
    for chunk in (1, 24, 64, prefix + length):
        got, caches = hidden_rows(model, tokens[prefix:], chunk, tokens[:prefix])
        np.testing.assert_allclose(got, want[prefix:], atol=1e-4, rtol=0, err_msg=str(chunk))
        assert greedy(model, caches, tokens[-1], 6) == want_run


def test_default_model_long_prompt_keeps_its_greedy_tokens(default_loaded, exact_products):
    """The real sizes (blocks of 128, tiles of 512) on the default model: a 700-token prompt
    after a 150-token cached prefix, prefilled in 512-token chunks, against the five-op
    composition in one forward (the attention kernels compared: exact products, since int8
    activations would turn their last-bit differences into rounding steps)."""
    model = default_loaded.model
    tokens = prompt(850, seed=4, vocab=default_loaded.vocab_size)
    saved = attention.MIN_ROWS
    attention.MIN_ROWS = 1 << 30
    try:
        caches = model.make_caches()
        want = model.hidden(mx.array([tokens]), caches)[0]
        want_logits = np.array(model.unembed(want[-1]))
        want_run = greedy(model, caches, tokens[-1], 8)
    finally:
        attention.MIN_ROWS = saved
    got, caches = hidden_rows(model, tokens[150:], 512, tokens[:150])
    np.testing.assert_allclose(got, np.array(want)[150:], atol=2e-4, rtol=0)
    logits = np.array(model.unembed(mx.array(got[-1])))
    np.testing.assert_allclose(logits, want_logits, atol=2e-3, rtol=0)
    assert greedy(model, caches, tokens[-1], 8) == want_run


# ---------------------------------------------------------------------------- cancels


@pytest.fixture(scope="module")
def four_layers(checkpoint_factory):
    return load_model(checkpoint_factory("llama", num_hidden_layers=4)).model


class Recorder:
    def __init__(self) -> None:
        self.runs: list[tuple[list[int], int, int]] = []

    def __call__(self, ids, hidden, position) -> None:
        self.runs.append((np.array(ids).tolist(), hidden.shape[0], position))


def flips_after(n: int):
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > n

    return cancelled, calls


def chunk_polls(model, tokens, chunk) -> list[int]:
    """How many times an uncancelled prefill polls up to the end of each chunk."""
    calls = {"n": 0}
    marks: list[int] = []

    def cancelled() -> bool:
        calls["n"] += 1
        return False

    prefill(
        model,
        model.make_caches(),
        tokens,
        0,
        chunk=chunk,
        cancelled=cancelled,
        on_commit=lambda ids, hidden, pos: marks.append(calls["n"]),
    )
    return marks


@pytest.mark.parametrize("blocks", [1, 5], ids=["one-block", "five-blocks"])
def test_a_cancel_inside_a_chunk_keeps_exactly_the_whole_chunks(four_layers, monkeypatch, blocks):
    """Long chunks are polled before the chunk, after each layer and between the query blocks
    of each layer's attention; a cancel at any poll leaves every cache at the end of the last
    whole chunk, the hook saw exactly those chunks, and resuming from there gives what one
    uninterrupted prefill gives."""
    model, layers, chunk = four_layers, len(four_layers.layers), 80
    monkeypatch.setattr(attention, "BLOCK_ROWS", -(-chunk // blocks))
    monkeypatch.setattr(attention, "FUSED_PIECE_ROWS", -(-chunk // blocks))
    tokens = prompt(310, seed=2)
    ends = chunk_ends(0, len(tokens), chunk)
    want, _ = hidden_rows(model, tokens, chunk)
    assert chunk >= prefilling.POLL_ROWS and len(tokens) - ends[-2] >= prefilling.POLL_ROWS
    marks = chunk_polls(model, tokens, chunk)
    # one poll ahead of the chunk, then per layer one between each two blocks and one after
    assert marks[0] == 1 + layers * blocks
    for n in range(marks[-1]):
        caches = model.make_caches()
        cancelled, calls = flips_after(n)
        seen = Recorder()
        with pytest.raises(Cancelled) as raised:
            prefill(model, caches, tokens, 0, chunk=chunk, cancelled=cancelled, on_commit=seen)
        kept = ([0] + ends)[sum(n >= m for m in marks)]  # the chunk that poll n + 1 was in
        assert calls["n"] == n + 1  # it stopped at the first poll that saw the cancel
        assert raised.value.args == (kept,)
        assert [c.offset for c in caches] == [kept] * layers
        starts = [0] + ends[:-1]
        whole = [(a, b - a) for a, b in zip(starts, ends, strict=True) if b <= kept]
        assert [(pos, rows) for _, rows, pos in seen.runs] == whole
        assert [t for ids, _, _ in seen.runs for t in ids] == tokens[:kept]
        rows: list[np.ndarray] = [np.array(want[:kept])]
        prefill(model, caches, tokens[kept:], kept, chunk=chunk, on_commit=collect(rows))
        np.testing.assert_allclose(np.concatenate(rows), want, atol=1e-5, rtol=0)


def test_short_chunks_poll_once_per_chunk(four_layers):
    """Below POLL_ROWS a chunk runs as one graph: the poll count stays one per chunk."""
    chunk = prefilling.POLL_ROWS - 1
    tokens = prompt(4 * chunk + 5, seed=6)
    cancelled, calls = flips_after(3)
    caches = four_layers.make_caches()
    with pytest.raises(Cancelled) as raised:
        prefill(four_layers, caches, tokens, 0, chunk=chunk, cancelled=cancelled)
    assert raised.value.args == (3 * chunk,) and calls["n"] == 4
    assert {c.offset for c in caches} == {3 * chunk}


def test_a_cancel_set_from_another_thread_mid_chunk(four_layers):
    """The cancel flag is set by another thread while a chunk is between its layers."""
    flag, asked, answered = threading.Event(), threading.Event(), threading.Event()
    polls = {"n": 0}

    def cancelled() -> bool:
        polls["n"] += 1
        if polls["n"] == 7:  # chunk 2 (polls 6-10), after its first layer
            asked.set()
            assert answered.wait(10)
        return flag.is_set()

    def canceller() -> None:
        assert asked.wait(10)
        flag.set()
        answered.set()

    thread = threading.Thread(target=canceller)
    thread.start()
    caches = four_layers.make_caches()
    seen = Recorder()
    with pytest.raises(Cancelled) as raised:
        prefill(
            four_layers,
            caches,
            prompt(400, seed=8),
            0,
            chunk=100,
            cancelled=cancelled,
            on_commit=seen,
        )
    thread.join()
    assert raised.value.args == (100,) and polls["n"] == 7
    assert [c.offset for c in caches] == [100] * len(caches)
    assert [(pos, rows) for _, rows, pos in seen.runs] == [(0, 100)]


def test_models_without_a_layer_hook_are_polled_between_chunks(four_layers):
    class Plain:
        """A model whose ``hidden`` takes no ``on_layer`` (as another family's may not)."""

        def hidden(self, tokens, caches):
            return four_layers.hidden(tokens, caches)

    assert prefilling.takes_layer_hook(four_layers) and not prefilling.takes_layer_hook(Plain())
    cancelled, calls = flips_after(2)
    caches = four_layers.make_caches()
    with pytest.raises(Cancelled) as raised:
        prefill(Plain(), caches, prompt(500, seed=9), 0, chunk=128, cancelled=cancelled)
    assert raised.value.args == (256,) and calls["n"] == 3
    assert {c.offset for c in caches} == {256}


def test_a_model_without_a_layer_hook_takes_a_chunk_once_its_budgets_add_up(
    four_layers, monkeypatch
):
    # Between shared forwards (a budget each) a split model's prompt runs whole chunks: one
    # as soon as the budgets given since the last one cover what that one took.
    now = [0.0]
    monkeypatch.setattr(prefilling.time, "perf_counter", lambda: now[0])

    class Whole:
        def hidden(self, tokens, caches):
            now[0] += 10.0  # each chunk takes ten seconds on the fake clock
            return four_layers.hidden(tokens, caches)

    caches, cancel = four_layers.make_caches(), [False]
    work = prefilling.ChunkedPrefill(
        Whole(), caches, prompt(320, seed=3), 0, chunk=64, cancelled=lambda: cancel[0]
    )
    offsets = []
    for _ in range(8):
        work.run(budget_s=4.0)
        offsets.append(caches[0].offset)
    # 4 in, 10 spent: -6; then -2 (none); 2 (a chunk): -8; -4; 0 (a chunk): -10; -6; -2; 2.
    assert offsets == [64, 64, 128, 128, 192, 192, 192, 256]
    cancel[0] = True  # a step without a chunk (-4) still sees the cancel
    with pytest.raises(Cancelled) as raised:
        work.run(budget_s=4.0)
    assert raised.value.args == (256,) and caches[0].offset == 256


def test_sliding_window_caches_rewind_a_cancelled_chunk(small_tiles, monkeypatch):
    """Rotating caches (a sliding-window model, small buffer steps so the window re-lays its
    buffer inside the chunk) rewound after a cancel inside a chunk, then resumed."""
    from pathlib import Path

    from cache.kv import RotatingKVCache

    monkeypatch.setattr(RotatingKVCache, "step", 8)
    fixture = Path(__file__).resolve().parent / "fixtures" / "reference" / "mistral_sliding"
    model = load_model(str(fixture), dtype="float32").model
    tokens = prompt(230, seed=11, vocab=300)
    want, _ = hidden_rows(model, tokens, 70)
    marks = chunk_polls(model, tokens, 70)
    assert marks[1] - marks[0] > 1 + len(model.layers)  # polls between query blocks too
    cancelled, _ = flips_after((marks[1] + marks[2]) // 2)  # mid-way through chunk 3
    caches = model.make_caches()
    assert any(isinstance(c, RotatingKVCache) for c in caches)
    with pytest.raises(Cancelled) as raised:
        prefill(model, caches, tokens, 0, chunk=70, cancelled=cancelled)
    assert raised.value.args == (140,) and {c.offset for c in caches} == {140}
    rows: list[np.ndarray] = [np.array(want[:140])]
    prefill(model, caches, tokens[140:], 140, chunk=70, on_commit=collect(rows))
    np.testing.assert_allclose(np.concatenate(rows), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- threads


def test_attention_products_give_the_same_bits_on_one_or_every_core():
    """What lets ``ThreadChoice`` pick the thread count by timing alone."""
    from runner import blas

    counts = blas.thread_counts()
    if counts is None or counts[0] == counts[1]:
        pytest.skip("the runner does not set this BLAS's thread count, or there is one core")
    for length, offset in ((512, 0), (300, 1111), (128, 2000)):
        q, k, v = qkv(length, offset + length, heads=9, groups=3, dim=64, seed=length)
        narrow = np.array(attention.blocked_attention(q, k, v, scale=0.125, mask="causal"))
        with blas.wide():
            wide = np.array(attention.blocked_attention(q, k, v, scale=0.125, mask="causal"))
        np.testing.assert_array_equal(narrow, wide)


def test_thread_choice_switches_on_a_faster_probe_and_backs_off_otherwise(monkeypatch):
    from runner import blas

    monkeypatch.setattr(blas, "thread_counts", lambda: (1, 2))
    choice = prefilling.ThreadChoice()
    assert choice.wide and choice.next_probe(30) == 1  # the first chunk probes
    choice.settle(0.5, [1.0] * 29)  # narrow was twice as fast: switch, probe again next chunk
    assert not choice.wide and choice.next_probe(30) == 1
    plan = []
    for _ in range(40):  # probes that change nothing come at doubling intervals
        probe = choice.next_probe(30)
        plan.append(probe)
        if probe is not None:
            choice.settle(1.0, [1.0] * 29)
    assert not choice.wide
    assert [i for i, p in enumerate(plan) if p is not None] == [0, 2, 6, 14, 30]
    assert choice.next_probe(2) is None  # too few layers to time one against the rest
    monkeypatch.setattr(blas, "thread_counts", lambda: None)
    assert prefilling.ThreadChoice().next_probe(30) is None  # a BLAS the runner does not set


def test_prefill_probes_one_layer_the_other_way(four_layers, monkeypatch):
    """A probing chunk runs layer 1 under the other thread count, the rest under the choice."""
    from runner import blas

    monkeypatch.setattr(blas, "thread_counts", lambda: (1, 2))
    monkeypatch.setattr(prefilling, "THREADS", prefilling.ThreadChoice())
    widths: list[bool] = []
    entered = {"wide": False}

    class Wide:
        def __enter__(self):
            entered["wide"] = True

        def __exit__(self, *exc):
            entered["wide"] = False

    real_eval = mx.eval

    def eval_(*args):
        widths.append(entered["wide"])
        return real_eval(*args)

    monkeypatch.setattr(prefilling.blas, "wide", Wide)
    monkeypatch.setattr(prefilling.mx, "eval", eval_)
    prefill(four_layers, four_layers.make_caches(), prompt(128, seed=1), 0, chunk=128)
    assert widths == [True, False, True, True, False]  # 4 layers (1 probed), then the norm


def test_fast_silu_matches_nn_silu_on_long_feeds_and_is_unused_on_short_ones():
    """Prefill chunks' SiLU (``runner.models.activations``) agrees with ``nn.silu`` to float32
    rounding over the whole range (below about -88 both are under 1e-30); decode and verify
    rows (fewer than ``MIN_ROWS``) get ``nn.silu`` itself, bit for bit."""
    import mlx.nn as nn

    from runner.models import activations

    rows = activations.MIN_ROWS
    x = mx.concatenate(
        [mx.linspace(-120, 120, rows * 64).reshape(rows, 64), 4 * mx.random.normal((rows, 64))]
    )
    up = mx.random.normal(x.shape)
    want = np.array(nn.silu(x), dtype=np.float64)
    got = np.array(activations.silu(x), dtype=np.float64)
    assert activations.serves(x)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(
        np.array(activations.silu_mul(x, up)), np.array(nn.silu(x) * up), rtol=2e-6, atol=1e-6
    )
    short = x[: rows - 1]
    assert not activations.serves(short)
    assert mx.array_equal(
        activations.silu_mul(short, up[: rows - 1]), nn.silu(short) * up[: rows - 1]
    )
    assert not activations.serves(x.astype(mx.bfloat16))


def test_whole_chunk_probes_compare_chunks_of_a_like_size(monkeypatch):
    from runner import blas

    monkeypatch.setattr(blas, "thread_counts", lambda: (1, 2))
    choice = prefilling.ThreadChoice()
    assert not choice.chunk_probe(512)  # nothing timed yet to compare a probe with
    choice.chunk_done(512, 1.0, probed=False)
    assert not choice.chunk_probe(100)  # no recent chunk of a like size
    assert not choice.chunk_probe(32)  # too short to time
    assert choice.chunk_probe(400)
    choice.chunk_done(400, 0.4, probed=True)  # 1 ms a row against 2: switch to narrow
    assert not choice.wide and not choice.chunk_probe(512)  # the wide times no longer count
    plan = []
    for _ in range(20):  # probes that change nothing come at doubling intervals
        probe = choice.chunk_probe(512)
        plan.append(probe)
        choice.chunk_done(512, 1.0, probed=probe)
    assert not choice.wide
    assert [i for i, p in enumerate(plan) if p] == [1, 3, 7, 15]
    monkeypatch.setattr(blas, "thread_counts", lambda: None)
    assert not choice.chunk_probe(512)  # a BLAS the runner does not set


def test_a_model_without_the_layer_hook_probes_a_whole_chunk_with_the_same_bits(monkeypatch):
    """The hybrid is fed whole chunks: its second timed chunk runs the other way, and every
    way of running the chunks leaves the same hidden rows and recurrent states."""
    from pathlib import Path

    from runner import blas

    counts = blas.thread_counts()
    if counts is None or counts[0] == counts[1]:
        pytest.skip("the runner does not set this BLAS's thread count, or there is one core")
    case = Path(__file__).resolve().parent / "fixtures" / "reference" / "hybrid" / "qwen3_5_text"
    model = load_model(str(case), dtype="float32").model
    assert not prefilling.takes_layer_hook(model)
    tokens = prompt(3 * 96, seed=4)
    real_wide, widths = blas.wide, []

    def wide():
        widths.append(len(rows))
        return real_wide()

    def run(wide: bool | None) -> list[np.ndarray]:
        """Every chunk ``wide`` (or narrow), or as a fresh choice probes (None)."""
        rows.clear()
        widths.clear()
        monkeypatch.setattr(prefilling, "THREADS", prefilling.ThreadChoice())
        if wide is not None:
            prefilling.THREADS.wide = wide
            monkeypatch.setattr(prefilling.THREADS, "chunk_probe", lambda rows: False)
        caches = model.make_caches()
        prefill(model, caches, tokens, 0, chunk=96, on_commit=lambda ids, h, p: rows.append(h))
        return [np.array(h) for h in rows] + [np.array(s) for c in caches for s in c.state]

    rows: list[mx.array] = []
    monkeypatch.setattr(prefilling.blas, "wide", wide)
    probed = run(None)
    assert widths[0] == 0 and 1 not in widths  # chunk 0 wide, chunk 1 the probe: narrow
    assert run(True) and widths == [0, 1, 2]
    for way in (True, False):
        for a, b in zip(probed, run(way), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_short_prompt_resuming_a_long_ones_opening_computes_its_cold_bits(default_model):
    """Every chat prompt starts with the template's opening, so a short prompt often resumes
    it from the prefix cache, cached there by whatever prompt came first. A long prompt's
    first chunk ends at ``ROW_BY_ROW`` (``chunk_ends``), so the opening is computed row by row
    as a short prompt computes it cold: the short prompt's logprobs are the same bits after a
    long prompt ran as on a fresh engine (before, a greedy answer could change token)."""
    from runner.engine import Engine, EngineOptions
    from tests.test_engine import complete

    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    short = chat.format("Why is the sky blue?")
    long_prompt = chat.format("The weather report for the coast, hour by hour. " * 30)
    options = {"temperature": 0, "num_predict": 6, "logprobs": True, "top_logprobs": 3}

    def answer(engine):
        _, _, done, frames = complete(engine, short, **options)
        return [(f.tokens, f.logprobs) for f in frames], done.prompt_cached_tokens

    cold, cached = answer(Engine(EngineOptions(model_path=default_model)))
    assert cached == 0
    warm = Engine(EngineOptions(model_path=default_model))
    complete(warm, long_prompt, temperature=0, num_predict=1)
    resumed, cached = answer(warm)
    assert cached > 0  # the opening came from the long prompt's cache entry
    assert resumed == cold
