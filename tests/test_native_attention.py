"""runner.native.flash_attention: the fused prefill attention against a float64 softmax, over
its block and tile boundaries, strided operands, grouped heads and thread splits."""

import mlx.core as mx
import numpy as np
import pytest

from runner import native

pytestmark = pytest.mark.skipif(
    not native.attention_available(), reason=native.reason() or "no fused attention"
)


def reference(q, k, v, scale: float, causal: bool) -> np.ndarray:
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    length, keys = q.shape[2], k.shape[2]
    per_group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, per_group, axis=1), np.repeat(v, per_group, axis=1)
    s = scale * np.einsum("bhld,bhtd->bhlt", q, k)
    if causal:
        visible = np.arange(keys)[None, :] <= (keys - length + np.arange(length))[:, None]
        s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhlt,bhtd->bhld", w / w.sum(axis=-1, keepdims=True), v)


def operands(batch, heads, groups, length, keys, dim, seed=0, spread=3.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, dim), dtype=np.float32) * spread
    k = rng.standard_normal((batch, groups, keys, dim), dtype=np.float32)
    v = rng.standard_normal((batch, groups, keys, dim), dtype=np.float32)
    return mx.array(q), mx.array(k), mx.array(v)


# (batch, heads, groups, rows, keys, dim): under one block (64 rows), exactly one, one more,
# several blocks and key tiles (64 keys), a cached prefix that leaves the diagonal inside a
# tile, head dims that are not a multiple of the 6-wide register blocks or of 8, one key.
SHAPES = [
    (1, 4, 2, 5, 5, 16),
    (1, 9, 3, 64, 64, 64),
    (1, 9, 3, 65, 65, 64),
    (1, 9, 3, 200, 200, 64),
    (2, 4, 2, 70, 333, 40),
    (1, 2, 1, 33, 129, 128),
    (1, 3, 3, 17, 100, 7),
    (1, 2, 2, 1, 1, 64),
    (1, 6, 1, 130, 197, 80),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all-keys"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_the_float64_softmax(shape, causal):
    batch, heads, groups, length, keys, dim = shape
    q, k, v = operands(*shape, seed=sum(shape))
    got = native.flash_attention(q, k, v, scale=dim**-0.5, causal=causal)
    assert got.shape == q.shape and got.dtype == mx.float32
    want = reference(q, k, v, dim**-0.5, causal)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=0)


def test_scores_far_apart_keep_their_weights():
    """Scores spanning more than float32's exponent range: the running maximum rescales the
    earlier tiles; nothing overflows, what underflows in the softmax underflows here too."""
    q, k, v = operands(1, 2, 1, 150, 300, 16, seed=3, spread=40.0)
    got = np.array(native.flash_attention(q, k, v, scale=0.25, causal=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference(q, k, v, 0.25, True), atol=2e-5, rtol=0)


def test_strided_operands_equal_contiguous_ones():
    """A cache's keys as a slice of a larger buffer, queries transposed from [B, L, H, D], and
    operands whose rows are not contiguous (copied inside) give the same bits as dense ones."""
    q, k, v = operands(1, 4, 2, 90, 150, 32, seed=5)
    want = np.array(native.flash_attention(q, k, v, scale=0.2, causal=True))
    buffer_k = mx.concatenate([k, mx.zeros((1, 2, 50, 32))], axis=2)
    buffer_v = mx.concatenate([v, mx.ones((1, 2, 50, 32))], axis=2)
    q_t = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    k_cols = mx.contiguous(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # inner stride != 1
    got = native.flash_attention(
        q_t, buffer_k[:, :, :150], buffer_v[:, :, :150], scale=0.2, causal=True
    )
    np.testing.assert_array_equal(np.array(got), want)
    got = native.flash_attention(q, k_cols, v, scale=0.2, causal=True)
    np.testing.assert_array_equal(np.array(got), want)


def test_threads_and_pieces_give_the_same_bits():
    """Each block is one thread's whole computation, so the thread count changes no bit, and
    a causal feed cut into pieces (each with the keys up to its last row) equals the whole."""
    q, k, v = operands(1, 9, 3, 300, 1000, 64, seed=6)
    one = np.array(native.flash_attention(q, k, v, scale=0.125, causal=True, threads=1))
    for threads in (2, 3, 8):
        many = native.flash_attention(q, k, v, scale=0.125, causal=True, threads=threads)
        np.testing.assert_array_equal(np.array(many), one)
    pieces = [
        native.flash_attention(
            q[:, :, s : s + 64],
            k[:, :, : 700 + s + 64],
            v[:, :, : 700 + s + 64],
            scale=0.125,
            causal=True,
        )
        for s in range(0, 300, 64)
    ]
    np.testing.assert_array_equal(np.array(mx.concatenate(pieces, axis=2)), one)


def test_inside_compile_and_async_eval():
    q, k, v = operands(1, 4, 2, 80, 120, 16, seed=7)
    want = np.array(native.flash_attention(q, k, v, scale=0.25, causal=True))
    fn = mx.compile(lambda a, b, c: native.flash_attention(a, b, c, scale=0.25, causal=True) * 2)
    np.testing.assert_array_equal(np.array(fn(q, k, v)), want * 2)
    out = native.flash_attention(q, k, v, scale=0.25, causal=True)
    mx.async_eval(out)
    np.testing.assert_array_equal(np.array(out), want)


def test_bad_arguments_name_what_is_wrong():
    q, k, v = operands(1, 4, 2, 8, 8, 16)
    cases = [
        ((q.astype(mx.float16), k, v), "float32"),
        ((q[0], k, v), r"\[B, H, L, D\]"),
        ((q, k[:, :1], v), "do not match"),
        ((operands(1, 3, 2, 8, 8, 16)[0], k, v), "do not match"),
        ((q, k[:, :, :4], v[:, :, :4]), "at least as many keys"),
        ((q, k[:, :, :0], v[:, :, :0]), "no keys"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            native.flash_attention(*args, scale=0.25, causal=True)


# --- runner.native.row_attention: a few rows (decode steps, verify rows), each row alone


@pytest.mark.skipif(not native.row_attention_available(), reason="no row attention")
@pytest.mark.parametrize(
    "shape",
    [
        (1, 9, 3, 1, 40, 64),
        (2, 4, 2, 5, 5, 16),
        (1, 8, 8, 16, 300, 32),
        (1, 4, 2, 3, 37, 128),  # a last block of 5 keys
        (1, 2, 1, 2, 21, 80),
        (1, 2, 1, 3, 19, 24),  # not a multiple of 16: the scalar loops
    ],
)
def test_row_attention_matches_a_float64_causal_softmax(shape):
    batch, heads, groups, rows, keys, dim = shape
    q, k, v = operands(batch, heads, groups, rows, keys, dim)
    got = np.asarray(native.row_attention(q, k, v, scale=0.125))
    want = reference(q, k, v, 0.125, causal=True)
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.skipif(not native.row_attention_available(), reason="no row attention")
@pytest.mark.parametrize("dim, rows, keys", [(32, 7, 50), (24, 7, 50), (64, 19, 83)])
def test_each_row_is_the_one_row_call_over_its_keys(dim, rows, keys):
    """Row i of an L-row call equals, bit for bit, the one-row call a decode step makes over
    the keys up to its position: what makes verify rows plain decoding's. Rows are attended
    in tiles of a group's consecutive rows (19 rows of 3 heads a group: 57, more than one
    tile, each row's key count odd or even, whole and partial blocks of keys)."""
    q, k, v = operands(1, 6, 2, rows, keys, dim, seed=3)
    cache_k = mx.concatenate([k, mx.zeros_like(k)], axis=2)[:, :, :keys]  # a buffer's view
    together = np.asarray(native.row_attention(q, cache_k, v, scale=0.2))
    for threads in (2, 3):
        split = native.row_attention(q, cache_k, v, scale=0.2, threads=threads)
        assert np.array_equal(np.asarray(split), together), threads
    for i in range(rows):
        seen = keys - rows + i + 1
        alone = native.row_attention(
            q[:, :, i : i + 1], cache_k[:, :, :seen], v[:, :, :seen], scale=0.2
        )
        assert np.array_equal(np.asarray(alone)[:, :, 0], together[:, :, i]), i
    # A head dimension that is not unit-stride: q stored [B, H, D, L] and viewed transposed.
    strided = mx.array(np.ascontiguousarray(np.asarray(q).transpose(0, 1, 3, 2)))
    strided = strided.transpose(0, 1, 3, 2)
    assert np.array_equal(
        np.asarray(native.row_attention(strided, cache_k, v, scale=0.2)), together
    )


@pytest.mark.skipif(not native.row_attention_available(), reason="no row attention")
def test_row_attention_threads_give_the_same_bits():
    """The rows of every head split over threads (past the work that pays a split) each keep
    the code and bits of the one-thread call: the split changes no bit, on float and packed
    caches, for more threads than rows and under MLX's compile."""
    for shape in [(1, 9, 3, 1, 700, 64), (2, 4, 2, 3, 300, 32), (1, 2, 1, 1, 9, 16)]:
        batch, heads, groups, rows, keys, dim = shape
        q, k, v = operands(batch, heads, groups, rows, keys, dim, seed=keys)
        one = np.asarray(native.row_attention(q, k, v, scale=0.125, threads=1))
        assert np.abs(one - reference(q, k, v, 0.125, causal=True)).max() < 1e-5
        for threads in (2, 3, 64):
            many = native.row_attention(q, k, v, scale=0.125, threads=threads)
            assert np.array_equal(np.asarray(many), one), (shape, threads)
    q, k, v = operands(1, 9, 3, 1, 700, 64, seed=700)  # split: 9 x 700 x 64 multiply-adds
    compiled = mx.compile(lambda a, b, c: native.row_attention(a, b, c, scale=0.125, threads=2))
    want = np.asarray(native.row_attention(q, k, v, scale=0.125))
    assert np.array_equal(np.asarray(compiled(q, k, v)), want)
    with pytest.raises(ValueError, match="threads"):
        native.row_attention(q, k, v, scale=0.125, threads=0)
    if native.row_attention_quantized_available(64):
        from cache.kv_quantized import pack

        q, k, v = operands(1, 9, 3, 2, 500, 64, seed=5)
        pk, pv = pack(k, 4, 32), pack(v, 4, 32)
        one = native.row_attention_quantized(q, pk, pv, scale=0.125, bits=4, group=32)
        two = native.row_attention_quantized(q, pk, pv, scale=0.125, bits=4, group=32, threads=2)
        assert mx.array_equal(one, two)


# --- runner.native.rows_attention: several sequences' rows in one node (shared forwards)


@pytest.mark.skipif(not native.rows_attention_available(), reason="no multi-sequence attention")
@pytest.mark.parametrize("dim", [64, 24])
def test_rows_attention_gives_each_sequence_the_row_attention_over_its_own_buffer(dim):
    """Three sequences (1, 4 and 2 rows over 30, 9 and 57 keys) in one node over whole
    buffers of larger capacity (zeros past each length): each sequence's rows have the bits
    of ``row_attention`` over its cache fetched up to its length, with any thread count."""
    counts, lengths, capacity = [1, 4, 2], [30, 9, 57], 64
    qs, ks, vs = [], [], []
    for i, (n, length) in enumerate(zip(counts, lengths, strict=True)):
        q, k, v = operands(1, 6, 2, n, length, dim, seed=10 + i)
        pad = mx.zeros((1, 2, capacity - length, dim))
        qs.append(q)
        ks.append(mx.concatenate([k, pad], axis=2))
        vs.append(mx.concatenate([v, pad], axis=2))
    q = mx.concatenate(qs, axis=2)
    for threads in (1, 2):
        got = np.asarray(
            native.rows_attention(q, ks, vs, lengths, counts, scale=0.2, threads=threads)
        )
        start = 0
        for qi, ki, vi, n, length in zip(qs, ks, vs, counts, lengths, strict=True):
            alone = native.row_attention(
                qi, ki[:, :, :length], vi[:, :, :length], scale=0.2, threads=threads
            )
            assert np.array_equal(got[:, :, start : start + n], np.asarray(alone)), (n, threads)
            start += n
    with pytest.raises(ValueError, match="add up"):
        native.rows_attention(q, ks, vs, lengths, [1, 4, 1], scale=0.2)
    with pytest.raises(ValueError, match="length"):
        native.rows_attention(q, ks, vs, [30, 9, 65], counts, scale=0.2)
    with pytest.raises(ValueError, match="per sequence"):
        native.rows_attention(q, ks, vs[:2], lengths, counts, scale=0.2)
