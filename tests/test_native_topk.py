"""The sampler's one-pass top-k (``runner.native.top_k_ids``) against the argpartition of the
rank key and the sort it replaces: the same ids, in the same order and dtype, for rows with
ties, infinities, NaN and signed zeros, rows sorted ascending (the pass's worst case) and
strided views; under ``mx.compile`` (the sampler's filter runs compiled) and through
``filter_rows``, whose probabilities stay bit for bit those of the MLX path."""

import mlx.core as mx
import numpy as np
import pytest

from runner import native, sampler

pytestmark = pytest.mark.skipif(not native.top_k_ids_available(), reason="no native top-k")


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
