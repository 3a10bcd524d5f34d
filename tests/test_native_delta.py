"""runner.native.delta_step: one row of the gated delta rule against a float64 reference and
the composed MLX step, over strided operands, batches and thread splits, and its refusals."""

import mlx.core as mx
import numpy as np
import pytest

from runner import native
from runner.models.gated_delta import composed_step

pytestmark = pytest.mark.skipif(
    not native.delta_available(), reason=native.reason() or "no delta step"
)


def operands(batch: int, heads: int, dk: int, dv: int, seed: int = 0) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, dk), dtype=np.float32)
    k = rng.standard_normal((batch, heads, dk), dtype=np.float32) / np.sqrt(dk)
    v = rng.standard_normal((batch, heads, dv), dtype=np.float32)
    g = -np.abs(rng.standard_normal((batch, heads), dtype=np.float32))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, heads), dtype=np.float32)))
    state = rng.standard_normal((batch, heads, dk, dv), dtype=np.float32)
    return [mx.array(x) for x in (q, k, v, g, beta, state)]


def reference(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    s = s * np.exp(g)[..., None, None]
    delta = (v - np.einsum("bhk,bhkv->bhv", k, s)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, s), s


@pytest.mark.parametrize("shape", [(1, 16, 128, 128), (2, 4, 16, 32), (3, 2, 8, 24), (1, 1, 5, 7)])
def test_the_step_matches_the_rule_and_the_composed_step(shape):
    ops = operands(*shape)
    y, state = native.delta_step(*ops)
    want_y, want_state = reference(*ops)
    np.testing.assert_allclose(np.array(y), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(state), want_state, rtol=1e-5, atol=1e-5)
    composed_y, composed_state = composed_step(*ops)
    np.testing.assert_allclose(np.array(y), np.array(composed_y), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(state), np.array(composed_state), rtol=1e-5, atol=1e-5)


def test_strided_operands_give_the_dense_operands_bits():
    q, k, v, g, beta, state = operands(2, 4, 16, 32, seed=1)
    transposed = mx.contiguous(state.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    wide = mx.concatenate([q, q], axis=-1)[..., ::2]  # a view with stride 2 along Dk
    dense = native.delta_step(mx.contiguous(wide), k, v, g, beta, state)
    strided = native.delta_step(wide, k, v, g, beta, transposed)
    for a, b in zip(dense, strided, strict=True):
        assert mx.array_equal(a, b).item()


def test_each_sequence_and_head_has_its_bits_whatever_the_batch_and_threads():
    ops = operands(3, 6, 16, 32, seed=2)
    whole = native.delta_step(*ops, threads=2)
    one_thread = native.delta_step(*ops, threads=1)
    for b in range(3):
        alone = native.delta_step(*(x[b : b + 1] for x in ops), threads=1)
        for a, w in zip(alone, whole, strict=True):
            assert mx.array_equal(a, w[b : b + 1]).item()
    for a, b in zip(one_thread, whole, strict=True):
        assert mx.array_equal(a, b).item()


def test_the_state_it_returns_feeds_the_next_step():
    q, k, v, g, beta, state = operands(1, 4, 16, 16, seed=3)
    y1, s1 = native.delta_step(q, k, v, g, beta, state)
    y2, s2 = native.delta_step(q, k, v, g, beta, s1)
    want_y1, want_s1 = reference(q, k, v, g, beta, state)
    want_y2, want_s2 = reference(q, k, v, g, beta, want_s1)
    np.testing.assert_allclose(np.array(y2), want_y2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(s2), want_s2, rtol=1e-5, atol=1e-5)


def test_bad_operands_are_refused_by_name():
    q, k, v, g, beta, state = operands(1, 2, 8, 8)
    with pytest.raises(ValueError, match="delta_step.*float32"):
        native.delta_step(q.astype(mx.float16), k, v, g, beta, state)
    with pytest.raises(ValueError, match="delta_step.*state"):
        native.delta_step(q, k, v, g, beta, state[..., :4])
    with pytest.raises(ValueError, match="delta_step.*g and beta"):
        native.delta_step(q, k, v, g[:, :1], beta, state)


def test_the_fused_row_equals_the_composed_mixer_of_a_hybrid_layer():
    """``GatedDeltaNet.row`` (one native node) against ``mix`` (the composed ops) on the
    hybrid fixture's layers: grouped key heads, a conv of 4, several sequences at once."""
    from pathlib import Path

    from runner.loader import load_model
    from runner.models.qwen3_5 import LinearBlock

    fixture = Path(__file__).resolve().parent / "fixtures" / "reference" / "hybrid" / "qwen3_5_text"
    model = load_model(str(fixture), dtype="float32")
    layers = [layer.linear_attn for layer in model.model.layers if isinstance(layer, LinearBlock)]
    rng = np.random.default_rng(4)
    for mixer in layers:
        channels, heads = sum(mixer.widths), mixer.value_heads
        shapes = [
            (3, 1, channels),
            (3, 1, heads),
            (3, 1, heads),
            (3, mixer.kernel - 1, channels),
            (3, heads, mixer.key_dim, mixer.value_dim),
        ]
        qkv, b, a, conv, state = (
            mx.array(rng.standard_normal(s, dtype=np.float32)) for s in shapes
        )
        fused = mixer.row(qkv, b, a, conv, state)
        composed = mixer.mix(qkv, b, a, conv, state)[:3]
        for got, want in zip(fused, composed, strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        assert mx.array_equal(fused[1], composed[1]).item()  # the conv rows kept: a copy
