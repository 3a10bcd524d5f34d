"""The sampler's native row operations against the MLX ops they replace.

The one-pass top-k (``runner.native.top_k_ids``) against the argpartition of the rank key
and the sort: the same ids, in the same order and dtype, for rows with ties, infinities, NaN
and signed zeros, rows sorted ascending (the pass's worst case), rows as long as a
vocabulary and strided views; under ``mx.compile`` (the sampler's filter runs compiled) and
through ``filter_rows``, whose probabilities stay bit for bit those of the MLX path. The row
argmax (``argmax_ids``) against ``mx.argmax``, a NaN at every position of the vector passes'
edges among the rows. The penalties (``penalise_rows``) against the sampler's MLX ops, bit
for bit."""

import mlx.core as mx
import numpy as np
import pytest

from runner import native, sampler

pytestmark = pytest.mark.skipif(
    not (native.top_k_ids_available() and native.penalise_rows_available()),
    reason="no native sampler operations",
)


def _reference(logits: mx.array, k: int) -> mx.array:
    v = logits.shape[-1]
    ranked = mx.argpartition(sampler._rank_key(logits), kth=v - k, axis=-1)
    return mx.sort(ranked[:, v - k :], axis=-1)


def _rows(kind: int, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 0:
        return rng.standard_normal((rows, width)).astype(np.float32)
    if kind == 1:  # few distinct values: most of the k-th value's ties are cut
        return rng.integers(-3, 3, (rows, width)).astype(np.float32)
    if kind == 2:  # a masked row: half of it -inf
        x = rng.standard_normal((rows, width)).astype(np.float32)
        x[rng.random((rows, width)) < 0.5] = -np.inf
        return x
    if kind == 3:
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0], np.float32)
        return rng.choice(special, (rows, width))
    return np.sort(rng.standard_normal((rows, width)).astype(np.float32), axis=1)


@pytest.mark.parametrize("kind", range(5))
def test_same_ids_as_the_partition(kind: int):
    rng = np.random.default_rng(kind)
    for _ in range(40):
        rows, width = int(rng.integers(1, 5)), int(rng.integers(2, 2000))
        k = int(rng.integers(1, width))
        x = _rows(kind, rows, width, rng)
        want = np.array(_reference(mx.array(x), k))
        got = np.array(native.top_k_ids(mx.array(x), k))
        assert got.dtype == want.dtype == np.uint32
        assert np.array_equal(got, want), (kind, rows, width, k)
        strided = mx.array(np.ascontiguousarray(x.T)).T  # column stride = rows
        assert np.array_equal(np.array(native.top_k_ids(strided, k)), want)


def test_ties_go_to_the_lower_id_and_signed_zeros_are_equal():
    x = mx.array([[1.0, -0.0, 2.0, 0.0, 2.0, 0.0, float("nan")]])
    # NaN ranks above every number; of the zeros (-0.0 as 0.0) the lowest ids win
    assert np.array(native.top_k_ids(x, 4)).tolist() == [[0, 2, 4, 6]]
    assert np.array(native.top_k_ids(x, 5)).tolist() == [[0, 1, 2, 4, 6]]


def test_refuses_what_it_does_not_compute():
    x = mx.zeros((2, 8))
    for k in (0, 8, 9):
        with pytest.raises(ValueError, match="k = "):
            native.top_k_ids(x, k)
    with pytest.raises(ValueError, match="float32"):
        native.top_k_ids(x.astype(mx.float16), 2)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        native.top_k_ids(mx.zeros((8,)), 2)


def test_the_sampler_filter_keeps_its_bits(monkeypatch):
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((3, 5000)).astype(np.float32) * 4)
    compiled = sampler._compiled_filter(40, 0.9, 0.05, 0.7)
    native_probs, native_ids = compiled(x)
    assert np.array_equal(np.array(native_ids), np.array(native.top_k_ids(x, 40)))
    monkeypatch.setattr(native, "top_k_ids_available", lambda: False)
    probs, ids = sampler.filter_rows(x, 40, 0.9, 0.05, 0.7)
    assert np.array_equal(np.array(ids), np.array(native_ids))
    assert np.array_equal(np.array(probs), np.array(native_probs))


def _argmax_cases(rng: np.random.Generator):
    for width in (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 49152):
        for kind in range(5):
            yield _rows(kind, 3, width, rng)
        ties = np.full((2, width), -np.inf, np.float32)  # every value the maximum
        yield ties
        zeros = rng.choice(np.array([0.0, -0.0], np.float32), (2, width))
        yield zeros
    for width in (70, 200):  # one NaN at every position, the vector passes' edges among them
        for at in range(width):
            x = rng.standard_normal((1, width)).astype(np.float32)
            x[0, at] = np.nan
            yield x


def test_argmax_is_mlx_argmax():
    rng = np.random.default_rng(11)
    for x in _argmax_cases(rng):
        want = np.array(mx.argmax(mx.array(x), axis=-1)).astype(np.int32)
        got = np.array(native.argmax_ids(mx.array(x)))
        assert got.dtype == np.int32
        assert np.array_equal(got, want), (x.shape, want, got)
        strided = mx.array(np.ascontiguousarray(x.T)).T
        assert np.array_equal(np.array(native.argmax_ids(strided)), want)


def test_argmax_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="float32"):
        native.argmax_ids(mx.zeros((2, 8), dtype=mx.float16))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        native.argmax_ids(mx.zeros((8,)))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        native.argmax_ids(mx.zeros((2, 0)))


def test_top_k_over_a_vocabulary_row():
    """Rows as long as a vocabulary: the vector scan for the next value that can enter."""
    rng = np.random.default_rng(5)
    for kind in range(5):
        x = _rows(kind, 2, 49152, rng)
        for k in (1, 40, 1000):
            want = np.array(_reference(mx.array(x), k))
            assert np.array_equal(np.array(native.top_k_ids(mx.array(x), k)), want), (kind, k)


@pytest.mark.parametrize(
    "repeat, presence, frequency",
    [(1.1, 0.0, 0.0), (0.8, 0.5, 0.25), (1.0, -0.3, 0.7), (1.3, 0.0, 1.5)],
)
def test_penalties_are_the_mlx_ops_bits(repeat, presence, frequency):
    """The native penalties against the sampler's MLX ops (``Sampler._penalise_ops``): every
    row, every window (a shared one or one per row, padded with the vocabulary size, repeated
    tokens), special values among the logits, strided logits."""
    rng = np.random.default_rng(3)
    params = sampler.SamplingParams(
        repeat_penalty=repeat,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repeat_last_n=64,
    )
    for trial in range(30):
        rows, width = int(rng.integers(1, 6)), int(rng.integers(2, 3000))
        s = sampler.Sampler(params, [], width, 4096)
        x = rng.standard_normal((rows, width)).astype(np.float32) * 4
        special = rng.random((rows, width)) < 0.05
        x[special] = rng.choice(
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32), special.sum()
        )
        shared = trial % 2 == 0
        w = rng.integers(0, min(width, 40), (1 if shared else rows, 64)).astype(np.int32)
        w[:, : int(rng.integers(0, 64))] = width  # the padding of a short history
        logits, windows = mx.array(x), mx.array(w)
        want = np.array(s._penalise_ops(logits, windows))
        got = np.array(native.penalise_rows(logits, windows, s._repeat, s._presence, s._frequency))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
        strided = mx.array(np.ascontiguousarray(x.T)).T
        again = native.penalise_rows(strided, windows, s._repeat, s._presence, s._frequency)
        np.testing.assert_array_equal(np.array(again).view(np.int32), want.view(np.int32))
    touched = np.array(native.penalise_rows(mx.ones((1, 8)), mx.array([[2, 2, 5, 8]]), 2.0, 0, 0))
    assert touched.tolist() == [[1, 1, 0.5, 1, 1, 0.5, 1, 1]]  # 8 is padding: untouched


def test_penalties_refuse_what_they_do_not_compute():
    with pytest.raises(ValueError, match="float32"):
        native.penalise_rows(
            mx.zeros((2, 8), dtype=mx.float16), mx.zeros((2, 4), mx.int32), 1.1, 0, 0
        )
    with pytest.raises(ValueError, match="int32"):
        native.penalise_rows(mx.zeros((2, 8)), mx.zeros((2, 4)), 1.1, 0, 0)
    with pytest.raises(ValueError, match="3 windows for 2 rows"):
        native.penalise_rows(mx.zeros((2, 8)), mx.zeros((3, 4), mx.int32), 1.1, 0, 0)
