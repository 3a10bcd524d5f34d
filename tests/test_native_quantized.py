"""Quantized column panels (runner.native.quantized, qkernels.h): the layout and its readers,
the exact and fast native products, the MLX fallback, MLX affine unpacking, and the layers
that hold quantized panels."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner import native
from runner.models import layers
from runner.models.layers import Linear, PanelEmbedding, dense_weight, fuse_linears, product
from runner.native import quantized
from runner.quantized import MlxAffine, affine_dense, unpack_bits

needs_qpanels = pytest.mark.skipif(
    not native.qpanels_available(),
    reason=native.reason() or "the native build has no qpanel_matmul: rebuild it",
)

Affine = tuple[np.ndarray, np.ndarray, np.ndarray]  # values [N, K], scales, biases [N, K / g]
EXACT_ROWS = [*range(1, 10), 17, 40]


def _affine(n: int, k: int, group: int, bits: int, *, seed: int = 0, fp16: bool = True) -> Affine:
    """Random affine weights; ``fp16``: scales and biases with fp16 values (s * q exact)."""
    rng = np.random.default_rng([seed, n, k, group, bits])
    values = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // group)) * 0.02).astype(np.float32)
    biases = (rng.standard_normal((n, k // group)) * 0.1).astype(np.float32)
    if fp16:
        scales = scales.astype(np.float16).astype(np.float32)
        biases = biases.astype(np.float16).astype(np.float32)
    return values, scales, biases


def _rows(m: int, k: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng([seed, m, k]).standard_normal((m, k), dtype=np.float32))


def _np(a: mx.array) -> np.ndarray:
    return np.array(a, copy=True)


def _float_product(x: mx.array, w: np.ndarray) -> np.ndarray:
    """The float32 panel product of the dense ``[N, K]`` weight ``w``."""
    return _np(native.panel_matmul(x, native.to_panels(mx.array(w.T)), w.shape[0]))


def _emulate_fast(x: np.ndarray, affine: Affine, group: int, levels: int = 2) -> np.ndarray:
    """qkernels.h's fast product in float64: each row quantized per block of ``ab = min(group,
    32)`` inputs in ``levels`` int8 levels (each d = max|r| / 127 of what the levels before left,
    float32 ops), exact integer sums, then the sum over blocks and levels of isum * float32(s *
    d) plus, per group, b * sum(d * xq) (the quantized inputs' sum, so that their rounding
    cancels against the value term's)."""
    values, scales, biases = affine
    m, k = x.shape
    ab = min(group, 32)
    r = x.reshape(m, k // ab, ab).astype(np.float32)
    vb = values.reshape(values.shape[0], k // ab, ab).astype(np.int64)
    out = np.zeros((m, values.shape[0]))
    dq = np.zeros((m, k // group))
    for _ in range(levels):
        d = (np.abs(r).max(-1) / np.float32(127)).astype(np.float32)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.clip(np.rint(r * inv[..., None]), -127, 127).astype(np.float32)
        r = (r - (d[..., None] * q).astype(np.float32)).astype(np.float32)
        xq = q.astype(np.int64)
        isum = np.einsum("mai,nai->mna", xq, vb)
        sd = (np.repeat(scales, group // ab, axis=1)[None] * d[:, None, :]).astype(np.float32)
        out += (isum * sd.astype(np.float64)).sum(-1)
        dq += (d.astype(np.float64) * xq.sum(-1)).reshape(m, k // group, group // ab).sum(-1)
    return out + dq @ biases.T


def _scale(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x| @ |w.T| in float64: the size of every output's terms."""
    return np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T


# -- layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("n", [64, 70, 33])
@pytest.mark.parametrize("half", [False, True])
def test_dense_and_layout_roundtrip(bits: int, group: int, n: int, half: bool):
    """Float32 headers for any scales, float16 ones (chosen by default) for float16 values."""
    k = 2 * group
    affine = _affine(n, k, group, bits, fp16=half)
    panels = quantized.to_qpanels(*affine, bits)
    nb = -(-n // 16)
    assert panels.dtype == mx.uint8
    head = (32 if half else 64) // bits
    assert panels.shape == (nb, k // group, head + group, 2 * bits)
    assert quantized.layout(panels) == (k, group, bits, half)
    assert np.array_equal(_np(quantized.dense(panels, n)), affine_dense(*affine).T)
    padded = _np(quantized.dense(panels, nb * 16))
    assert not padded[:, n:].any(), "padding columns must be zero"


@pytest.mark.parametrize("bits,group,n", [(4, 32, 70), (8, 16, 70), (4, 128, 33)])
def test_columns_are_dense_rows(bits: int, group: int, n: int):
    k = 2 * group
    affine = _affine(n, k, group, bits, seed=1)
    panels = quantized.to_qpanels(*affine, bits)
    w = affine_dense(*affine)
    for ids in ([0], [n - 1], [0, n - 1, 5, 5], [[3, 64 % n, n - 1], [1, 2, 17]]):
        got = quantized.columns(panels, mx.array(ids, dtype=mx.int32))
        assert got.shape == (*np.shape(ids), k)
        assert np.array_equal(_np(got), w[np.array(ids)])
    scalar = quantized.columns(panels, mx.array(n - 1))
    assert scalar.shape == (k,) and np.array_equal(_np(scalar), w[n - 1])
    last_panel = list(range(16 * (n // 16), n))  # the partial last panel
    got = quantized.columns(panels, mx.array(last_panel, dtype=mx.uint32))
    assert np.array_equal(_np(got), w[last_panel])


def test_bad_inputs_raise():
    v, s, b = _affine(32, 64, 8, 4)  # groups of 8
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s, b, 4)
    v, s, b = _affine(32, 96, 48, 4)  # groups of 48
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s, b, 4)
    v, s, b = _affine(32, 64, 32, 4)
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s, b, 5)
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s[:31], b[:31], 4)  # scales for fewer rows
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s, b[:, :1], 4)  # biases of another shape
    with pytest.raises(ValueError):
        quantized.to_qpanels(v[:, :60], s, b, 4)  # K not a whole number of groups
    with pytest.raises(ValueError):
        quantized.to_qpanels(v, s[:, :0], b[:, :0], 4)  # no groups
    with pytest.raises(ValueError):
        quantized.layout(mx.zeros((2, 64, 16)))  # float panels
    with pytest.raises(ValueError):
        quantized.kernel_bits(9)
    assert [quantized.kernel_bits(b) for b in (2, 3, 4, 5, 6, 8)] == [4, 4, 4, 8, 8, 8]
    panels = quantized.to_qpanels(v, s, b, 4)
    with pytest.raises(ValueError):
        native.qpanel_matmul(mx.ones((2, 63)), panels, 32)  # K differs


@needs_qpanels
def test_native_rejects_bad_widths():
    v, s, b = _affine(32, 64, 32, 4)
    panels = quantized.to_qpanels(v, s, b, 4)
    for n in (0, 16, 33):  # 2 panels hold 17..32 columns
        with pytest.raises(ValueError):
            mx.eval(native.qpanel_matmul(mx.ones((2, 64)), panels, n))


# -- exact path -------------------------------------------------------------------------------


@needs_qpanels
@pytest.mark.parametrize("bits,group", [(4, 16), (4, 32), (8, 64), (8, 128)])
@pytest.mark.parametrize("n", [70, 64])
@pytest.mark.parametrize("fp16", [True, False])
def test_exact_is_float_panel_product(bits: int, group: int, n: int, fp16: bool):
    k = 256
    affine = _affine(n, k, group, bits, seed=2, fp16=fp16)
    panels = quantized.to_qpanels(*affine, bits)
    w = affine_dense(*affine)  # s * q, then + b: two roundings for float32 scales
    x = _rows(max(EXACT_ROWS), k, seed=3)
    for m in EXACT_ROWS:
        want = _float_product(x[:m], w)
        for threads in (1, 2):
            got = native.qpanel_matmul(x[:m], panels, n, exact=True, threads=threads)
            assert got.shape == (m, n) and got.dtype == mx.float32
            assert np.array_equal(_np(got), want), f"M={m} threads={threads}"


@needs_qpanels
@pytest.mark.parametrize("exact", [True, False])
def test_views_and_leading_dims(exact: bool):
    n, k = 70, 128
    panels = quantized.to_qpanels(*_affine(n, k, 32, 4, seed=4), 4)
    x = _rows(12, k, seed=5)
    flat = _np(native.qpanel_matmul(x, panels, n, exact=exact))

    def run(v: mx.array) -> np.ndarray:
        return _np(native.qpanel_matmul(v, panels, n, exact=exact))

    assert run(x.reshape(3, 4, k)).shape == (3, 4, n)
    assert np.array_equal(run(x.reshape(3, 4, k)).reshape(12, n), flat)
    assert np.array_equal(run(x[5]), flat[5])  # one vector
    assert np.array_equal(run(x[::2]), flat[::2])  # row stride
    assert np.array_equal(run(x[::-1]), flat[::-1])  # negative row stride
    assert np.array_equal(run(mx.contiguous(x.T).T), flat)  # column-major
    wide = mx.stack([x, mx.zeros_like(x)], axis=-1).reshape(12, 2 * k)[:, ::2]
    assert np.array_equal(run(wide), flat)  # inner stride 2
    assert np.array_equal(run(x.reshape(3, 4, k)[:, 1:3]), flat.reshape(3, 4, n)[:, 1:3])
    assert run(x[:0]).shape == (0, n)


# -- fast path --------------------------------------------------------------------------------


@needs_qpanels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_fast_accuracy_and_contract(bits: int, group: int):
    n, k = 70, 256
    affine = _affine(n, k, group, bits, seed=6, fp16=False)
    panels = quantized.to_qpanels(*affine, bits)
    x = _np(_rows(9, k, seed=7))
    y = _np(native.qpanel_matmul(mx.array(x), panels, n)).astype(np.float64)
    w = affine_dense(*affine)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    rms = np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2))
    assert rms < 0.02, f"relative RMS error {rms:.4f}"
    # The documented algorithm, to float rounding (its quantization error is ~1000x more).
    err = np.abs(y - _emulate_fast(x, affine, group))
    assert (err <= 1e-6 * _scale(x, w)).all(), f"max err {err.max()}"


@needs_qpanels
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (4, 128)])
@pytest.mark.parametrize("exact", [False, True])
def test_batch_invariance_bitwise(bits: int, group: int, exact: bool):
    n, k = 16 * 9 + 5, 256
    panels = quantized.to_qpanels(*_affine(n, k, group, bits, seed=8), bits)
    x = _rows(31, k, seed=9)
    single = np.concatenate(
        [_np(native.qpanel_matmul(x[i : i + 1], panels, n, exact=exact)) for i in range(31)]
    )
    for m in [*range(1, 18), 31]:
        got = _np(native.qpanel_matmul(x[:m], panels, n, exact=exact))
        assert np.array_equal(got, single[:m]), f"M={m}: rows differ from one-row products"
    order = mx.array(list(range(30, -1, -1)))
    got = _np(native.qpanel_matmul(x[order], panels, n, exact=exact))
    assert np.array_equal(got, single[::-1])


@needs_qpanels
@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_sized_fast_product(bits: int):
    """From 32 rows on (qkernels.h kExactRows), AVX2 builds compute the fast product as the exact
    one (the faster of the two there); every build keeps each row independent of the others
    at those sizes too, and the threads do not change a bit."""
    n, k, m = 16 * 7 + 9, 256, 40
    affine = _affine(n, k, 32, bits, seed=21)
    panels = quantized.to_qpanels(*affine, bits)
    x = _rows(m, k, seed=22)
    got = _np(native.qpanel_matmul(x, panels, n, threads=1))
    assert np.array_equal(_np(native.qpanel_matmul(x, panels, n, threads=2)), got)
    assert np.array_equal(_np(native.qpanel_matmul(x[:33], panels, n)), got[:33])
    exact = _np(native.qpanel_matmul(x, panels, n, exact=True))
    if native.qpanel_isa() == "avx2":
        assert np.array_equal(got, exact)
        # below the handover: the int8 product, rows alone
        few = _np(native.qpanel_matmul(x[:8], panels, n))
        assert not np.array_equal(few, exact[:8])
        assert np.array_equal(few[3], _np(native.qpanel_matmul(x[3:4], panels, n))[0])
    else:
        assert not np.array_equal(got, exact)
        err = np.abs(got - _emulate_fast(_np(x), affine, 32))
        assert (err <= 1e-6 * _scale(_np(x), affine_dense(*affine))).all()


@needs_qpanels
@pytest.mark.parametrize("bits", [4, 8])
def test_fast_threads_bitwise(bits: int):
    n, k = 16 * 11 + 3, 128
    panels = quantized.to_qpanels(*_affine(n, k, 32, bits, seed=10), bits)
    for m in (1, 3, 4, 9, 20):
        x = _rows(m, k, seed=11)
        one = _np(native.qpanel_matmul(x, panels, n, threads=1))
        for threads in (2, 3):
            got = _np(native.qpanel_matmul(x, panels, n, threads=threads))
            assert np.array_equal(got, one), f"M={m} threads={threads}"


@needs_qpanels
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (8, 64)])
def test_fast_zero_rows_are_zero(bits: int, group: int):
    """x = 0: every block's d is 0, so each isum term and each b * sum(x) term is 0."""
    n, k = 70, 128
    affine = _affine(n, k, group, bits, seed=12)
    panels = quantized.to_qpanels(*affine, bits)
    x = _np(_rows(6, k, seed=13))
    x[[0, 3, 5]] = 0.0
    x[1, : k // 2] = 0.0  # zero blocks in a nonzero row
    y = _np(native.qpanel_matmul(mx.array(x), panels, n))
    assert np.array_equal(y[[0, 3, 5]], np.zeros((3, n), np.float32))
    assert np.count_nonzero(y[1]) > n // 2  # half a row of zeros is not a zero row
    err = np.abs(y - _emulate_fast(x, affine, group))
    assert (err <= 1e-6 * _scale(x, affine_dense(*affine))).all()


@needs_qpanels
@pytest.mark.parametrize("group", [16, 32])
def test_fast_8bit_full_range_no_saturation(group: int):
    """Values up to 255 against int8 activations of +-127 of both signs: the pair sums that
    an int16 path would form (255 * 127 * 2) overflow int16; the integer sums must not."""
    n, k = 48, 128
    rng = np.random.default_rng(14)
    values = rng.integers(200, 256, (n, k), dtype=np.uint8)
    values[: n // 2] = 255
    scales = np.full((n, k // group), 0.01, np.float32)
    biases = np.full((n, k // group), -1.0, np.float32)
    affine = (values, scales, biases)
    x = np.where(rng.random((5, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[1] = 1.0  # all positive: the largest integer sums
    x[2, ::2], x[2, 1::2] = 1.0, -1.0  # alternating pairs
    panels = quantized.to_qpanels(*affine, 8)
    y = _np(native.qpanel_matmul(mx.array(x), panels, n)).astype(np.float64)
    w = affine_dense(*affine)
    err = np.abs(y - _emulate_fast(x, affine, group))
    assert (err <= 1e-6 * _scale(x, w)).all(), f"max err {err.max()}"
    # +-1 quantizes exactly (d = 1/127): the fast product is the exact one to rounding.
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (np.abs(y - ref) <= 1e-5 * _scale(x, w)).all()


# -- the pure-MLX fallback --------------------------------------------------------------------


@needs_qpanels
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (4, 128)])
def test_mlx_fallback_matches_exact(bits: int, group: int, monkeypatch: pytest.MonkeyPatch):
    n, k = 70, 256
    affine = _affine(n, k, group, bits, seed=15, fp16=False)
    panels = quantized.to_qpanels(*affine, bits)
    x = _rows(5, k, seed=16)
    exact = _np(native.qpanel_matmul(x, panels, n, exact=True))
    fallback = _np(x @ quantized.dense(panels, n))
    bound = 1e-5 * _scale(_np(x), affine_dense(*affine))
    assert (np.abs(fallback - exact) <= bound).all()
    monkeypatch.setattr(native, "qpanels_available", lambda: False)
    wrapped = native.qpanel_matmul(x.reshape(5, 1, k), panels, n)
    assert wrapped.shape == (5, 1, n)
    assert (np.abs(_np(wrapped).reshape(5, n) - exact) <= bound).all()


# -- MLX affine triples -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_mlx_affine_unpack(bits: int, group: int, dtype: mx.Dtype):
    n, k = 24, 256
    rng = np.random.default_rng([bits, group])
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    f32 = mx.float32  # dequantize in float32: s * q + b, as affine_dense
    want = _np(mx.dequantize(packed, scales.astype(f32), biases.astype(f32), group, bits))
    tensor = MlxAffine(packed, scales, biases, group, bits)
    assert tensor.shape == (n, k) and (tensor.group, tensor.bits) == (group, bits)
    values, s, b = tensor.unpack()
    assert values.dtype == np.uint8 and values.shape == (n, k) and values.max() < 1 << bits
    assert s.dtype == b.dtype == np.float32 and s.shape == b.shape == (n, k // group)
    assert np.array_equal(affine_dense(values, s, b), want)
    assert np.array_equal(unpack_bits(np.asarray(packed), k, bits), values)
    # Every width widens to a kernel width with the same weight.
    panels = quantized.to_qpanels(values, s, b, quantized.kernel_bits(bits))
    assert np.array_equal(_np(quantized.dense(panels, n)), want.T)


# -- layers -----------------------------------------------------------------------------------


@pytest.fixture
def exact_products() -> Iterator[None]:
    before = layers.exact_products()
    layers.set_exact_products(True)
    yield
    layers.set_exact_products(before)


def _qlinear(n: int, k: int, group: int, bits: int, seed: int) -> tuple[Linear, Affine]:
    affine = _affine(n, k, group, bits, seed=seed)
    layer = Linear(k, n, bias=False)
    layer._wt = quantized.to_qpanels(*affine, bits)
    del layer["weight"]
    return layer, affine


def _pointer(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


@needs_qpanels
@pytest.mark.parametrize("exact", [False, True])
def test_fuse_quantized_linears(exact: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(layers, "_exact_products", exact)
    k = 128
    parts = [_qlinear(n, k, 32, 4, seed)[0] for seed, n in enumerate((64, 32, 48))]
    before = [p._wt for p in parts]
    x = _rows(3, k, seed=17)
    want = np.concatenate([_np(p(x)) for p in parts], axis=1)
    owner = nn.Module()
    assert fuse_linears(owner, "qkv", parts)
    fused = owner["qkv"]
    assert fused.shape == (9, *parts[0]._wt.shape[1:]) and "qkv_bias" not in owner
    assert np.array_equal(_np(product(x, fused)), want)
    assert np.array_equal(_np(layers.fused_product(owner, "qkv", x)), want)
    start = 0
    for part, old in zip(parts, before, strict=True):
        assert part.fused and np.array_equal(_np(part._wt), _np(old))
        assert _pointer(part._wt) == _pointer(fused) + start * fused[0].nbytes  # a view
        start += part._wt.shape[0]
    assert np.array_equal(np.concatenate([_np(p(x)) for p in parts], axis=1), want)
    assert not fuse_linears(owner, "again", parts)  # already fused


def test_fuse_refuses_mixed_layouts():
    k = 128
    for other in ((64, 4), (32, 8)):  # another group, another width
        parts = [_qlinear(32, k, 32, 4, 0)[0], _qlinear(32, k, *other, 1)[0]]
        owner = nn.Module()
        assert not fuse_linears(owner, "qkv", parts)
        assert "qkv" not in owner and not any(getattr(p, "fused", False) for p in parts)


def test_dense_weight_of_quantized_linear():
    layer, affine = _qlinear(48, 96, 32, 8, seed=18)
    w = dense_weight(layer)
    assert w.shape == (48, 96) and np.array_equal(_np(w), affine_dense(*affine))


@pytest.mark.parametrize("vocab", [70, 64])
def test_panel_embedding(vocab: int):
    d = 64
    affine = _affine(vocab, d, 16, 4, seed=19)
    table = affine_dense(*affine)  # [V, D]
    emb = PanelEmbedding(quantized.to_qpanels(*affine, 4), vocab)
    ids = mx.array([[0, vocab - 1, 3], [vocab - 2, 17, 0]], dtype=mx.int32)
    assert np.array_equal(_np(emb(ids)), table[np.asarray(ids)])
    assert np.array_equal(_np(emb.dense()), table)
    if native.qpanels_available():
        x = _rows(4, d, seed=20)
        y = emb.as_linear(x)
        assert y.shape == (4, vocab)
        assert np.array_equal(_np(y), _np(product(x, emb._table))[:, :vocab])


@needs_qpanels
def test_set_exact_products(exact_products: None):
    layer, affine = _qlinear(64, 128, 32, 4, seed=21)
    x = _rows(5, 128, seed=22)
    want = _float_product(x, affine_dense(*affine))
    assert np.array_equal(_np(product(x, layer._wt)), want)
    assert np.array_equal(_np(layer(x)), want)
    layers.set_exact_products(False)
    fast = _np(product(x, layer._wt))
    assert np.array_equal(fast, _np(native.qpanel_matmul(x, layer._wt, 64)))
    assert not np.array_equal(fast, want)
