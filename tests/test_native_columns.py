"""Embedding lookups from quantized panels (``runner.native.qpanel_columns``, what a tied
``PanelEmbedding`` calls) against the MLX ops they replace (``quantized.columns``, also the
fallback without the compiled module) and the dequantized weight: the same float32 bits for
4- and 8-bit panels, float16 and float32 headers, groups of 16 to 128, int32 and uint32 ids
in any shape and stride; an id outside the panels reads zeros; the wrong operands are
refused by name."""

import mlx.core as mx
import numpy as np
import pytest

from runner import native
from runner.native import quantized
from runner.quantized import affine_dense
from tests.test_native_quantized import _affine

pytestmark = pytest.mark.skipif(
    not native.qpanel_columns_available(), reason="no native column reads"
)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("fp16", [True, False])
def test_columns_equal_the_mlx_ops_and_the_dequantized_weight(
    bits: int, group: int, fp16: bool, monkeypatch
):
    n, k = 16 * 5 + 7, 256
    affine = _affine(n, k, group, bits, seed=3, fp16=fp16)
    panels = quantized.to_qpanels(*affine, bits)
    dense = np.array(affine_dense(*affine), dtype=np.float32)  # [N, K]
    ids = mx.array([[0, 15, 16, n - 1], [3, 3, 40, 17]], dtype=mx.int32)
    got = np.array(native.qpanel_columns(panels, ids))
    assert got.shape == (2, 4, k)
    want = np.array(quantized.columns(panels, ids))
    assert np.array_equal(got, want)
    monkeypatch.setattr(native, "qpanel_columns_available", lambda: False)
    assert np.array_equal(np.array(native.qpanel_columns(panels, ids)), want)
    assert np.array_equal(got.reshape(-1, k), dense[np.array(ids).reshape(-1)])


def test_uint32_strided_and_out_of_range_ids():
    n, k = 16 * 3, 64
    affine = _affine(n, k, 32, 4, seed=5)
    panels = quantized.to_qpanels(*affine, 4)
    dense = np.array(affine_dense(*affine), dtype=np.float32)
    ids = mx.array([5, 9, 2, 47, 0, 31], dtype=mx.uint32)[::2]  # stride 2: 5, 2, 0
    got = np.array(native.qpanel_columns(panels, ids))
    assert np.array_equal(got, dense[[5, 2, 0]])
    outside = mx.array([-1, 16 * 3, 7], dtype=mx.int32)
    got = np.array(native.qpanel_columns(panels, outside))
    assert not got[:2].any() and np.array_equal(got[2], dense[7])


def test_other_integer_ids_take_the_mlx_ops():
    """int64 ids (the trainer's batches) are read by the MLX ops: the same values."""
    affine = _affine(32, 64, 32, 4, seed=2)
    panels = quantized.to_qpanels(*affine, 4)
    ids = mx.array([[3, 31], [0, 17]], dtype=mx.int64)
    got = np.array(native.qpanel_columns(panels, ids))
    assert np.array_equal(got, np.array(native.qpanel_columns(panels, ids.astype(mx.int32))))
    assert np.array_equal(got.reshape(4, -1), affine_dense(*affine)[[3, 31, 0, 17]])


def test_refuses_other_operands():
    panels = quantized.to_qpanels(*_affine(32, 64, 32, 4, seed=1), 4)
    with pytest.raises(ValueError, match="not quantized panels"):
        native.qpanel_columns(panels.astype(mx.int32), mx.zeros((2,), dtype=mx.int32))
