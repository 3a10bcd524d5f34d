"""Native decoder blocks (runner/native/block.cpp, runner.models.native_block): the two nodes
against the MLX ops they replace, per-row bit invariance (verify rows and shared forwards keep
plain decoding's bits), which blocks they serve, and the errors they raise."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner import device, native
from runner.models import build_model, layers, native_block
from runner.models.llama import CompiledBlock, Model, ModelArgs
from runner.models.rope import RoPE
from tests.checkpoints import model_config, random_weights

pytestmark = pytest.mark.skipif(
    not native.block_available(), reason=native.reason() or "no native decoder block"
)

VOCAB = 320
PROMPT = [(i * 37) % 300 + 5 for i in range(11)]


@pytest.fixture(autouse=True)
def restore_exact_products() -> Iterator[None]:
    before = layers.exact_products()
    yield
    layers.set_exact_products(before)


def _jitter_norms(model: nn.Module, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _, module in model.named_modules():
        if isinstance(module, nn.RMSNorm):
            noise = rng.standard_normal(module.weight.shape).astype(np.float32)
            module.weight = 1.0 + 0.1 * mx.array(noise)


def _model(kind: str, weights: str, native_blocks: bool = True, seed: int = 3) -> Model:
    """A random two-layer model of ``kind`` (llama, qwen2: q/k/v bias, qwen3: q/k norms,
    traditional: adjacent-pair RoPE) in ``weights`` (float panels, q4 fast or exact, q8)."""
    if kind == "traditional":
        mx.random.seed(seed)
        args = ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            rope_traditional=True,
            tie_word_embeddings=True,
        )
        model = Model(args)
        _jitter_norms(model, seed)
    else:
        config = model_config(kind, vocab_size=VOCAB)
        model = build_model(config)
        model.load_weights(list(random_weights(config, seed=seed).items()))
    quantize = {"float": None, "q4": 4, "q4-exact": 4, "q8": 8}[weights]
    device.tune(
        model,
        layout="panels",
        quantize=quantize,
        exact_products=weights == "q4-exact",
        native_blocks=native_blocks,
    )
    mx.eval(model.parameters())
    return model


def _decode(model: Model, steps: int = 5) -> tuple[mx.array, list[mx.array]]:
    """Prefill the prompt (eager), then ``steps`` greedy one-row forwards: their logits."""
    caches = model.make_caches()
    logits = model(mx.array([PROMPT]), caches)[:, -1]
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1).reshape(1, 1)
        logits = model(token, caches)[:, -1]
        out.append(logits)
    return mx.concatenate(out), caches


KINDS = ["llama", "qwen2", "qwen3", "traditional"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_block_runs_native(kind: str):
    model = _model(kind, "q4")
    blocks = device.blocks_of(model)
    assert len(blocks) == 2
    assert all(isinstance(b, native_block.NativeBlock) for b in blocks)
    compiled = _model(kind, "q4", native_blocks=False)
    assert all(isinstance(b, CompiledBlock) for b in device.blocks_of(compiled))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weights", ["float", "q4-exact", "q8"])
def test_decode_matches_compiled_blocks(kind: str, weights: str):
    """Native and compiled blocks compute the same decode steps up to float32 rounding (with
    int8 activations, q8, a last-bit difference in an input can move a rounding step)."""
    native_logits, _ = _decode(_model(kind, weights))
    compiled_logits, _ = _decode(_model(kind, weights, native_blocks=False))
    span = float(mx.max(compiled_logits) - mx.min(compiled_logits))
    diff = float(mx.max(mx.abs(native_logits - compiled_logits)))
    assert diff <= (2e-4 if weights == "q8" else 2e-5) * span, (diff, span)
    assert mx.array_equal(mx.argmax(native_logits, -1), mx.argmax(compiled_logits, -1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weights", ["float", "q4", "q4-exact"])
def test_rows_are_the_one_row_bits(kind: str, weights: str):
    """An L-row feed (a verify) gives, row for row, the bits of feeding the rows one at a
    time: the native block computes each row alone."""
    model = _model(kind, weights)
    caches = model.make_caches()
    mx.eval(model.hidden(mx.array([PROMPT]), caches))
    base = caches[0].offset
    feed = mx.array([[17, 250, 3, 99, 41, 7]])
    together = model.hidden(feed, caches)
    mx.eval(together)
    for c in caches:
        c.rewind(base)
    alone = []
    for i in range(feed.shape[1]):
        alone.append(model.hidden(feed[:, i : i + 1], caches))
        mx.eval(alone[-1])
    assert mx.array_equal(together, mx.concatenate(alone, axis=1))


@pytest.mark.parametrize("weights", ["float", "q4"])
def test_shared_forward_rows_are_alone_bits(weights: str):
    """``hidden_rows`` (one decode row per sequence, each at its own offset) gives each row
    the bits of decoding that sequence alone."""
    model = _model("qwen3", weights)
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:9]]
    lists = []
    for p in prompts:
        caches = model.make_caches()
        mx.eval(model.hidden(mx.array([p]), caches))
        lists.append(caches)
    tokens = mx.array([9, 200, 31])
    shared = model.hidden_rows(tokens, lists)
    mx.eval(shared)
    for i, caches in enumerate(lists):
        for c in caches:
            c.rewind(c.offset - 1)
        alone = model.hidden(tokens[i].reshape(1, 1), caches)
        assert mx.array_equal(shared[i], alone[0, 0])


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


@pytest.mark.parametrize("rotary", [16, 8])
def test_front_is_the_composed_block(rotary: int):
    """block_front against MLX ops (norm, product, bias, q/k norms, rotation), partial
    rotary included."""
    rng = np.random.default_rng(rotary)
    dim, heads, kv_heads, head_dim, rows = 64, 4, 2, 16, 3
    width = (heads + 2 * kv_heads) * head_dim

    def arr(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale)

    x, norm, w = arr(1, rows, dim), 1 + arr(dim, scale=0.1), arr(dim, width, scale=0.1)
    bias, qn, kn = arr(width, scale=0.1), 1 + arr(head_dim, scale=0.1), 1 + arr(head_dim)
    rope = RoPE(rotary, head_dim=head_dim)
    cos, sin, rotation = rope.tables(40, rows)
    q, k, v = native.block_front(
        x,
        norm,
        native.to_panels(w),
        bias,
        qn,
        kn,
        cos,
        sin,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rotary=rotary,
        traditional=False,
        eps=1e-5,
        qk_eps=1e-6,
        exact=False,
    )
    y = _rms(x, norm, 1e-5) @ w + bias
    parts = mx.split(
        y.reshape(1, rows, heads + 2 * kv_heads, head_dim), [heads, heads + kv_heads], 2
    )
    want_q = rope.apply(_rms(parts[0], qn, 1e-6).transpose(0, 2, 1, 3), (cos, sin, rotation))
    want_k = rope.apply(_rms(parts[1], kn, 1e-6).transpose(0, 2, 1, 3), (cos, sin, rotation))
    want_v = parts[2].transpose(0, 2, 1, 3)
    for got, want in ((q, want_q), (k, want_k), (v, want_v)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_back_is_the_composed_block():
    rng = np.random.default_rng(1)
    dim, heads, head_dim, hidden, rows = 64, 4, 16, 96, 2

    def arr(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale)

    x, att, norm = arr(1, rows, dim), arr(1, heads, rows, head_dim), 1 + arr(dim, scale=0.1)
    wo, wgu, wd = (
        arr(heads * head_dim, dim, scale=0.1),
        arr(dim, 2 * hidden, scale=0.1),
        arr(hidden, dim, scale=0.1),
    )
    got = native.block_back(
        x,
        att,
        native.to_panels(wo),
        norm,
        native.to_panels(wgu),
        native.to_panels(wd),
        heads=heads,
        kv_heads=2,
        head_dim=head_dim,
        eps=1e-5,
        exact=False,
    )
    h = x + att.transpose(0, 2, 1, 3).reshape(1, rows, -1) @ wo
    gate, up = mx.split(_rms(h, norm, 1e-5) @ wgu, 2, axis=-1)
    want = h + (nn.silu(gate) * up) @ wd
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_reason():
    model = _model("llama", "q4")
    layer = model.layers[0]
    assert native_block.refusal(layer) is None
    assert "not a DecoderLayer" in native_block.refusal(nn.Linear(4, 4))
    hf = build_model(model_config("llama", vocab_size=VOCAB))
    device.tune(hf, layout="hf")
    assert "not fused into panels" in native_block.refusal(hf.layers[0])
    assert all(isinstance(b, CompiledBlock) for b in device.blocks_of(hf))
    biased = build_model(model_config("llama", vocab_size=VOCAB, attention_bias=True))
    device.tune(biased, layout="panels")
    assert "bias" in native_block.refusal(biased.layers[0])
    gemma = build_model(model_config("gemma2", vocab_size=VOCAB, head_dim=16))
    device.tune(gemma, layout="panels")
    assert native_block.refusal(gemma.layers[0]) is not None


def test_bad_inputs_raise_naming_the_operand():
    x = mx.zeros((1, 2, 64))
    panels = native.to_panels(mx.zeros((64, 128)))
    cos = sin = mx.zeros((2, 16))
    kw = dict(
        heads=4,
        kv_heads=2,
        head_dim=16,
        rotary=16,
        traditional=False,
        eps=1e-5,
        qk_eps=1e-5,
        exact=False,
    )
    native.block_front(x, mx.ones(64), panels, None, None, None, cos, sin, **kw)
    with pytest.raises(ValueError, match="cos and sin"):
        native.block_front(x, mx.ones(64), panels, None, None, None, cos[:1], sin, **kw)
    with pytest.raises(ValueError, match="norm"):
        native.block_front(x, mx.ones(32), panels, None, None, None, cos, sin, **kw)
    with pytest.raises(ValueError, match="qkv has 4 panels"):
        native.block_front(x, mx.ones(64), panels[:4], None, None, None, cos, sin, **kw)
    with pytest.raises(ValueError, match="heads must be"):
        native.block_front(
            x, mx.ones(64), panels, None, None, None, cos, sin, **{**kw, "kv_heads": 3}
        )
    o = native.to_panels(mx.zeros((64, 64)))
    with pytest.raises(ValueError, match="down"):
        native.block_back(
            x,
            mx.zeros((1, 4, 2, 16)),
            o,
            mx.ones(64),
            native.to_panels(mx.zeros((64, 256))),
            native.to_panels(mx.zeros((64, 64))),
            heads=4,
            kv_heads=2,
            head_dim=16,
            eps=1e-5,
            exact=False,
        )


def test_float16_blocks_stay_compiled():
    config = model_config("llama", vocab_size=VOCAB)
    model = build_model(config)
    model.set_dtype(mx.float16)
    device.tune(model, layout="panels")
    assert "float32" in native_block.refusal(model.layers[0])
    assert all(isinstance(b, CompiledBlock) for b in device.blocks_of(model))


def _row_threads(model: Model) -> set[int]:
    from runner.models.llama import Attention

    return {m.row_threads for _, m in model.named_modules() if isinstance(m, Attention)}


def test_row_attention_takes_the_decode_threads_and_keeps_its_bits(monkeypatch):
    """``device.tune`` gives the row attention a decode step's threads (every core for a
    quantized model where the fast product runs on vector kernels), the user's count where
    one is set, and a decode step over enough keys to split the attention computes the bits
    of the one-thread attention."""
    from runner import blas

    monkeypatch.delenv("MTP_RUNNER_DECODE_THREADS", raising=False)
    cores = blas.decode_threads()
    assert _row_threads(_model("llama", "float")) == {cores}
    quantized_threads = native.LARGE_M_THREADS if native.qpanels_fast() else cores
    assert _row_threads(_model("llama", "q4")) == {quantized_threads}
    monkeypatch.setenv("MTP_RUNNER_DECODE_THREADS", "3")
    model = _model("llama", "q4")
    assert _row_threads(model) == {3}
    prompt = mx.array([[(i * 37) % 300 + 5 for i in range(1100)]])  # 4 heads x 16 x 1,100 keys
    logits = {}
    for threads in (1, 3):
        for _, m in model.named_modules():
            if hasattr(m, "row_threads"):
                m.row_threads = threads
        caches = model.make_caches()
        model(prompt, caches)
        steps = [model(mx.array([[7 + i]]), caches)[:, -1] for i in range(3)]
        logits[threads] = np.array(mx.concatenate(steps))
    assert np.array_equal(logits[1], logits[3])
