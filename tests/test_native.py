"""runner.native: the few-row panel product primitive (exactness, batch invariance, MLX
integration) and the MLX path over the same panels for many rows."""

import runner  # noqa: F401, I001  (first: loads the BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from runner import native

needs_ext = pytest.mark.skipif(not native.available(), reason=native.reason())

# (K, N): model shapes (some cut down in N to keep the test short), N not a multiple of 64,
# K odd, tiny.
SHAPES = [(576, 960), (1536, 576), (577, 130), (33, 70), (64, 64), (7, 1), (1, 65)]
U32 = np.finfo(np.float32).eps / 2  # unit roundoff


def _data(k: int, n: int, rows: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed + 1000 * k + n)
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return mx.array(x), mx.array(w)


def _check_close(y: mx.array, x: mx.array, w: mx.array) -> None:
    """|y - x @ w| within the float32 dot-product bound gamma_K * (|x| @ |w|) (float64 ref)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    k = x64.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    bound = gamma * (np.abs(x64) @ np.abs(w64)) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - x64 @ w64)
    assert (err <= bound).all(), f"max err {err.max()}, max err/bound {(err / bound).max()}"


def test_to_panels_layout():
    _, w = _data(5, 130, 1)
    p = native.to_panels(w)
    mx.eval(p)
    width = native.PANEL
    nb = -(-130 // width)
    assert p.shape == (nb, 5, width) and p.dtype == mx.float32
    pn, wn = np.asarray(p), np.asarray(w)
    for b in range(nb):
        cols = min(width, 130 - width * b)
        assert np.array_equal(pn[b, :, :cols], wn[:, width * b : width * b + cols])
        assert not pn[b, :, cols:].any()


@needs_ext
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16])
def test_matches_float64(k: int, n: int, m: int):
    x, w = _data(k, n, m)
    y = native.panel_matmul(x, native.to_panels(w), n)
    assert y.shape == (m, n) and y.dtype == mx.float32
    _check_close(y, x, w)


@needs_ext
@pytest.mark.parametrize("k,n", SHAPES)
def test_batch_invariance_bitwise(k: int, n: int):
    """Row i of every M-row product (M = 1..16) equals the one-row product of row i, bit for
    bit, wherever the row sits in the batch."""
    x, w = _data(k, n, 16, seed=1)
    p = native.to_panels(w)
    single = np.concatenate(
        [np.asarray(native.panel_matmul(x[i : i + 1], p, n)) for i in range(16)]
    )
    for m in range(1, 17):
        y = np.asarray(native.panel_matmul(x[:m], p, n))
        assert np.array_equal(y, single[:m]), f"M={m}: rows differ from one-row products"
    # The same rows in another order and position (the last rows of a reversed batch).
    order = list(range(15, -1, -1))
    y = np.asarray(native.panel_matmul(x[mx.array(order)], p, n))
    assert np.array_equal(y, single[order])


@needs_ext
def test_threads_split_is_bitwise_identical():
    x, w = _data(96, 64 * 9 + 5, 6)
    p = native.to_panels(w)
    one = np.asarray(native.panel_matmul(x, p, w.shape[1]))
    for threads in (2, 3):
        assert np.array_equal(
            np.asarray(native.panel_matmul(x, p, w.shape[1], threads=threads)), one
        )


@needs_ext
def test_leading_dims_and_vector():
    x, w = _data(40, 100, 6)
    p = native.to_panels(w)
    flat = np.asarray(native.panel_matmul(x, p, 100))
    y = native.panel_matmul(x.reshape(2, 3, 40), p, 100)
    assert y.shape == (2, 3, 100)
    assert np.array_equal(np.asarray(y).reshape(6, 100), flat)
    v = native.panel_matmul(x[2], p, 100)
    assert v.shape == (100,) and np.array_equal(np.asarray(v), flat[2])
    y4 = native.panel_matmul(x.reshape(1, 2, 3, 40), p, 100)
    assert y4.shape == (1, 2, 3, 100)


@needs_ext
def test_non_contiguous_inputs():
    x, w = _data(48, 80, 12)
    p = native.to_panels(w)
    dense = np.asarray(native.panel_matmul(mx.contiguous(x[::2]), p, 80))
    assert np.array_equal(np.asarray(native.panel_matmul(x[::2], p, 80)), dense)  # row stride
    xt = mx.contiguous(x[::2].T).T  # column-major rows
    assert np.array_equal(np.asarray(native.panel_matmul(xt, p, 80)), dense)
    wide = mx.stack([x, mx.zeros_like(x)], axis=-1).reshape(12, 96)[:, ::2]  # inner stride 2
    assert np.array_equal(np.asarray(native.panel_matmul(wide[::2], p, 80)), dense)
    row = mx.broadcast_to(x[:1], (4, 48))  # zero row stride
    assert np.array_equal(
        np.asarray(native.panel_matmul(row, p, 80)),
        np.repeat(np.asarray(native.panel_matmul(x[:1], p, 80)), 4, axis=0),
    )
    # Panels that are a strided view are gathered first (slow path, same result).
    pt = mx.contiguous(p.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert np.array_equal(np.asarray(native.panel_matmul(x[::2], pt, 80)), dense)


@needs_ext
def test_inside_compile():
    x, w1 = _data(64, 192, 4)
    _, w2 = _data(192, 70, 1, seed=3)
    p1, p2 = native.to_panels(w1), native.to_panels(w2)
    mx.eval(p1, p2)

    def block(h: mx.array) -> mx.array:
        a = native.panel_matmul(h, p1, 192)
        b = native.panel_matmul(h, p1, 192)  # equivalent node: may be merged
        return native.panel_matmul(mx.maximum(a + b, 0.0), p2, 70) * 0.5

    compiled = mx.compile(block)
    for seed in range(3):
        h, _ = _data(64, 1, 4, seed=seed)
        assert np.array_equal(np.asarray(compiled(h)), np.asarray(block(h)))
    # A compiled function over the one-row and the 4-row shapes stays batch-invariant.
    one = np.concatenate([np.asarray(compiled(x[i : i + 1])) for i in range(4)])
    assert np.array_equal(np.asarray(compiled(x)), one)


@needs_ext
def test_inside_shapeless_compile():
    """output_shapes: one trace serves every row count."""
    _, w = _data(64, 40, 1)
    p = native.to_panels(w)
    mx.eval(p)
    compiled = mx.compile(lambda h: native.panel_matmul(h, p, 40) + 1.0, shapeless=True)
    for m in (1, 3, 7):
        h, _ = _data(64, 1, m, seed=m)
        y = compiled(h)
        assert y.shape == (m, 40)
        assert np.array_equal(np.asarray(y), np.asarray(native.panel_matmul(h, p, 40) + 1.0))


@needs_ext
def test_async_eval():
    x, w = _data(128, 256, 3)
    p = native.to_panels(w)
    mx.eval(p)
    y = native.panel_matmul(x, p, 256)
    z = native.panel_matmul(y[:, :128], p, 256)  # a chain of two products
    mx.async_eval(z)
    ref_y = np.asarray(native.panel_matmul(x, p, 256))
    assert np.array_equal(np.asarray(y), ref_y)
    _check_close(z, mx.array(ref_y[:, :128]), w)


@needs_ext
def test_bad_arguments():
    x, w = _data(32, 64, 2)
    p = native.to_panels(w)
    with pytest.raises(ValueError):
        native.panel_matmul(x[:, :31], p, 64)
    with pytest.raises(ValueError):
        native.panel_matmul(x, p, 65)  # more columns than the panels hold
    with pytest.raises(ValueError):
        native.panel_matmul(x, p, 0)


@needs_ext
@pytest.mark.parametrize("k,n", [(576, 960), (577, 130)])
@pytest.mark.parametrize("m", [17, 100])
def test_large_m_matches_matmul_and_stays_invariant(k: int, n: int, m: int):
    """More rows than a decode step (prefill chunks): the primitive on every core, against
    x @ w_t, and still row-for-row identical to the one-row products."""
    x, w = _data(k, n, m)
    p = native.to_panels(w)
    y = native.panel_matmul(x.reshape(1, m, k), p, n)
    assert y.shape == (1, m, n)
    _check_close(y.reshape(m, n), x, w)
    np.testing.assert_allclose(np.asarray(y).reshape(m, n), np.asarray(x @ w), rtol=1e-4, atol=1e-3)
    rows = [0, m // 2, m - 1]
    single = np.concatenate([np.asarray(native.panel_matmul(x[i : i + 1], p, n)) for i in rows])
    assert np.array_equal(np.asarray(y)[0, rows], single)


@pytest.mark.parametrize("method", ["rebuild", "batched"])
@pytest.mark.parametrize("m", [1, 40])
def test_mlx_ops_over_panels(method: str, m: int):
    """The MLX-ops path over the panel layout (no primitive needed), against x @ w_t."""
    x, w = _data(577, 130, m)
    y = native.mlx_panel_matmul(x.reshape(1, m, 577), native.to_panels(w), 130, method=method)
    assert y.shape == (1, m, 130)
    _check_close(y.reshape(m, 130), x, w)


def test_unavailable_falls_back(monkeypatch):
    """Without the compiled module every M goes through MLX ops (same results to rounding)."""
    monkeypatch.setattr(native, "_ext", None)
    assert not native.available()
    x, w = _data(33, 70, 3)
    y = native.panel_matmul(x, native.to_panels(w), 70)
    _check_close(y, x, w)
