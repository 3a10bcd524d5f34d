"""runner.native: the few-row panel product primitive (exactness, batch invariance, MLX
integration) and the MLX path over the same panels for many rows."""

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


# --- the routed-experts product (gather_panel_matmul)

needs_gathered = pytest.mark.skipif(
    not native.gathered_available(), reason=native.reason() or "built without gather_panel_matmul"
)
# (E, K, N): a model's shape cut down, N not a multiple of the panel, K odd, one expert.
EXPERT_SHAPES = [(16, 256, 96), (8, 33, 70), (5, 64, 16), (1, 7, 1)]


def _experts(e: int, k: int, n: int, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed + 7 * e + 1000 * k + n)
    return mx.array(rng.standard_normal((e, n, k), dtype=np.float32))  # [E, out, in]


def _routes(rows: int, top: int, e: int, seed: int, shared: bool) -> np.ndarray:
    """top distinct experts per row; with ``shared`` every row also takes expert 0 and the
    first two rows pick the same set (repeated experts across rows)."""
    rng = np.random.default_rng(seed)
    out = np.stack([rng.choice(e, top, replace=False) for _ in range(rows)]).astype(np.int32)
    if shared and e > top:
        out[:, 0] = 0
        out[:, 1:] = np.where(out[:, 1:] == 0, top, out[:, 1:])  # keep each row distinct
        if rows > 1:
            out[1] = out[0][::-1]
    return out


def _gathered_reference(x: mx.array, w: mx.array, idx: np.ndarray) -> mx.array:
    """mx.gather_mm over the [E, out, in] experts, as runner.models.moe computes them."""
    rows = x[:, :, None, :]  # [T, X, 1, K]
    return mx.gather_mm(rows, w.swapaxes(-1, -2), rhs_indices=mx.array(idx, mx.uint32)).squeeze(-2)


def _gathered_bound(x: mx.array, w: mx.array, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product of every (row, expert) pair and its float32 dot-product bound."""
    x64 = np.broadcast_to(np.asarray(x, np.float64), (idx.shape[0], idx.shape[1], x.shape[-1]))
    w64 = np.asarray(w, np.float64)[idx]  # [T, k, N, K]
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    bound = gamma * np.einsum("tjk,tjnk->tjn", np.abs(x64), np.abs(w64)) + 1e-30
    return np.einsum("tjk,tjnk->tjn", x64, w64), bound


def _check_gathered(y: mx.array, x: mx.array, w: mx.array, idx: np.ndarray) -> None:
    """Within the float32 dot-product bound of the float64 product, pair by pair."""
    exact, bound = _gathered_bound(x, w, idx)
    err = np.abs(np.asarray(y, np.float64) - exact)
    assert (err <= bound).all(), f"max err {err.max()}, max err/bound {(err / bound).max()}"


@needs_gathered
@pytest.mark.parametrize("e,k,n", EXPERT_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("per_pair", [False, True], ids=["shared-input", "per-pair-input"])
@pytest.mark.parametrize("shared", [False, True], ids=["random", "repeated-experts"])
def test_gathered_matches_gather_mm(e, k, n, rows, per_pair, shared):
    """Every (row, expert) pair against mx.gather_mm (within float32 rounding) and against the
    float64 product (within the dot-product bound), 1-4 rows, experts repeated across rows."""
    top = min(e, 4)
    idx = _routes(rows, top, e, seed=rows + 10 * e, shared=shared)
    w = _experts(e, k, n)
    x, _ = _data(k, 1, rows * (top if per_pair else 1), seed=rows)
    x = x.reshape(rows, top if per_pair else 1, k)
    y = native.gather_panel_matmul(x, native.expert_panels(w), mx.array(idx), n)
    assert y.shape == (rows, top, n) and y.dtype == mx.float32
    _check_gathered(y, x, w, idx)
    _, bound = _gathered_bound(x, w, idx)  # both within it of the exact product
    reference = np.asarray(_gathered_reference(x, w, idx), np.float64)
    assert (np.abs(np.asarray(y, np.float64) - reference) <= 2 * bound).all()


@needs_gathered
@pytest.mark.parametrize("per_pair", [False, True], ids=["shared-input", "per-pair-input"])
def test_gathered_pairs_are_bitwise_one_row_panel_products(per_pair):
    """Each pair is the one-row panel product of its row and expert, bit for bit, whatever
    rows share the feed (and so share experts): verify rows match plain decoding."""
    e, k, n, top = 8, 200, 48, 3
    w = _experts(e, k, n, seed=5)
    p = native.expert_panels(w)
    idx = _routes(6, top, e, seed=3, shared=True)
    x, _ = _data(k, 1, 6 * top, seed=9)
    x = x.reshape(6, top, k) if per_pair else x[:6].reshape(6, 1, k)
    y = np.asarray(native.gather_panel_matmul(x, p, mx.array(idx), n))
    for t in range(6):
        for j in range(top):
            row = x[t, j if per_pair else 0][None]
            one = native.panel_matmul(row, native.to_panels(w[int(idx[t, j])].T), n)
            assert np.array_equal(y[t, j], np.asarray(one)[0]), (t, j)
    for rows in range(1, 6):  # the first rows alone, and each row alone
        part = native.gather_panel_matmul(x[:rows], p, mx.array(idx[:rows]), n)
        assert np.array_equal(np.asarray(part), y[:rows])
        alone = native.gather_panel_matmul(x[rows : rows + 1], p, mx.array(idx[rows : rows + 1]), n)
        assert np.array_equal(np.asarray(alone), y[rows : rows + 1])


def test_expert_panels_layout():
    w = _experts(3, 5, 37)
    p = native.expert_panels(w)
    mx.eval(p)
    assert p.shape == (3, 3, 5, native.PANEL) and p.dtype == mx.float32
    for e in range(3):
        assert np.array_equal(np.asarray(p[e]), np.asarray(native.to_panels(w[e].T)))


@needs_gathered
def test_gathered_threads_and_many_rows():
    """A prefill chunk's rows (experts split over threads) match gather_mm, and every row is
    what it is alone, whatever the thread count."""
    e, k, n, top, rows = 16, 96, 64, 4, 40
    w = _experts(e, k, n, seed=2)
    p = native.expert_panels(w)
    idx = _routes(rows, top, e, seed=4, shared=True)
    x, _ = _data(k, 1, rows, seed=4)
    x = x.reshape(rows, 1, k)
    one = np.asarray(native.gather_panel_matmul(x, p, mx.array(idx), n, threads=1))
    for threads in (2, 3, 64):
        y = native.gather_panel_matmul(x, p, mx.array(idx), n, threads=threads)
        assert np.array_equal(np.asarray(y), one), threads
    _check_gathered(mx.array(one), x, w, idx)
    default = native.gather_panel_matmul(x, p, mx.array(idx), n)  # > SMALL_ROWS: every core
    assert np.array_equal(np.asarray(default), one)
    alone = native.gather_panel_matmul(x[7:8], p, mx.array(idx[7:8]), n)
    assert np.array_equal(np.asarray(alone)[0], one[7])


@needs_gathered
def test_gathered_strided_inputs_and_fused_views():
    """Indices as the router leaves them (a slice of argpartition's output), uint32 or int32;
    x transposed; panels as a view of a fused gate/up stack (per-expert blocks contiguous,
    experts further apart); a fully strided panel array (gathered first)."""
    e, k, n, top = 8, 64, 32, 2
    w = _experts(e, k, 2 * n, seed=1)
    fused = native.expert_panels(w)  # gate columns [0, n), up [n, 2n)
    x, _ = _data(k, 1, 5, seed=2)
    scores = mx.array(np.random.default_rng(0).standard_normal((5, e), dtype=np.float32))
    idx = mx.argpartition(-scores, kth=top - 1, axis=-1)[..., :top]  # strided, uint32
    dense_idx = np.asarray(idx)
    want = _gathered_reference(x[:, None], w, dense_idx)
    y = native.gather_panel_matmul(x[:, None], fused, idx, 2 * n)
    assert np.array_equal(
        np.asarray(y),
        np.asarray(
            native.gather_panel_matmul(
                x[:, None], fused, mx.array(dense_idx.astype(np.int32)), 2 * n
            )
        ),
    )
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    half = n // native.PANEL
    up = native.gather_panel_matmul(x[:, None], fused[:, half:], idx, n)
    assert np.array_equal(np.asarray(up), np.asarray(y)[..., n:])
    xt = mx.contiguous(x.T).T[:, None]  # column-major rows
    assert np.array_equal(np.asarray(native.gather_panel_matmul(xt, fused, idx, 2 * n)), y)
    strided = mx.contiguous(fused.transpose(2, 0, 1, 3)).transpose(1, 2, 0, 3)
    assert np.array_equal(
        np.asarray(native.gather_panel_matmul(x[:, None], strided, idx, 2 * n)), y
    )


@needs_gathered
def test_gathered_out_of_range_expert_is_a_zero_row():
    w = _experts(4, 16, 16)
    x, _ = _data(16, 1, 2)
    idx = mx.array([[0, 4], [-1, 3]], dtype=mx.int32)
    y = np.asarray(native.gather_panel_matmul(x[:, None], native.expert_panels(w), idx, 16))
    assert not y[0, 1].any() and not y[1, 0].any()
    assert y[0, 0].any() and y[1, 1].any()
    fallback = native.mlx_gather_panel_matmul(x[:, None], native.expert_panels(w), idx, 16)
    np.testing.assert_allclose(np.asarray(fallback), y, rtol=1e-5, atol=1e-5)


@needs_gathered
def test_gathered_inside_compile():
    """In a compiled block (also shapeless: output_shapes), bitwise as eager, and one trace
    over one row and over four stays row-for-row identical."""
    e, k, n, top = 6, 48, 32, 2
    w1, w2 = _experts(e, k, n, seed=1), _experts(e, n, k, seed=2)
    p1, p2 = native.expert_panels(w1), native.expert_panels(w2)
    mx.eval(p1, p2)

    def block(h: mx.array, idx: mx.array) -> mx.array:
        a = native.gather_panel_matmul(h[:, None], p1, idx, n)
        return native.gather_panel_matmul(mx.maximum(a, 0.0), p2, idx, k).sum(axis=1)

    x, _ = _data(k, 1, 4, seed=6)
    idx = mx.array(_routes(4, top, e, seed=6, shared=True))
    eager = np.asarray(block(x, idx))
    for compiled in (mx.compile(block), mx.compile(block, shapeless=True)):
        assert np.array_equal(np.asarray(compiled(x, idx)), eager)
        one = np.concatenate([np.asarray(compiled(x[i : i + 1], idx[i : i + 1])) for i in range(4)])
        assert np.array_equal(one, eager)


@needs_gathered
def test_gathered_bad_arguments():
    w = _experts(4, 16, 32)
    p = native.expert_panels(w)
    x, _ = _data(16, 1, 2)
    idx = mx.array([[0, 1], [2, 3]], dtype=mx.int32)
    with pytest.raises(ValueError):
        native.gather_panel_matmul(x[:, None, :15], p, idx, 32)  # K differs
    with pytest.raises(ValueError):
        native.gather_panel_matmul(x[:, None], p, idx, 33)  # more columns than the panels
    with pytest.raises(ValueError):
        native.gather_panel_matmul(mx.stack([x, x, x], axis=1), p, idx, 32)  # 3 rows for k = 2
    with pytest.raises(ValueError):
        native.gather_panel_matmul(x[:, None], p, idx.astype(mx.float32), 32)


def test_gathered_unavailable_falls_back(monkeypatch):
    """Without the compiled module the MLX-ops path computes the same pairs."""
    monkeypatch.setattr(native, "_ext", None)
    assert not native.gathered_available()
    w = _experts(6, 33, 40)
    idx = _routes(3, 2, 6, seed=1, shared=True)
    x, _ = _data(33, 1, 6, seed=1)
    x = x.reshape(3, 2, 33)
    y = native.gather_panel_matmul(x, native.expert_panels(w), mx.array(idx), 40)
    assert y.shape == (3, 2, 40)
    _check_gathered(y, x, w, idx)
