"""Model families and the KV cache: cached decoding must equal one full forward."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVCache
from runner import device
from runner.loader import load_model

FAMILIES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {"tie_word_embeddings": False}),
    ("llama", {"quantize_bits": 4}),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("llama", {"shards": 3, "tie_word_embeddings": False}),
]

TOKENS = [5, 17, 42, 99, 7, 3, 250, 31, 64, 12, 8, 77, 150, 201, 19, 44, 2, 90, 33, 61]


def packed(path: str):
    """The model at ``path`` with its weights laid out for the CPU, blocks eager."""
    model = load_model(path).model
    device.tune(model, layout="packed", compile=False)
    return model


def _ids(*names):
    return "-".join(str(n) for n in names)


@pytest.mark.parametrize(("model_type", "kwargs"), FAMILIES, ids=[_ids(m, *k) for m, k in FAMILIES])
@pytest.mark.parametrize("pack", [False, True], ids=["hf-layout", "packed"])
def test_prefill_then_decode_equals_full_forward(
    checkpoint_factory, model_type, kwargs, pack, exact_products
):
    """The model's arithmetic (quantized checkpoints multiplied exactly: with int8 activations
    a last-bit difference between a 20-row and a 13-row feed's attention moves a rounding)."""
    path = checkpoint_factory(model_type, **kwargs)
    lm = load_model(path)
    if pack:
        device.tune(lm.model, layout="packed", compile=False)
    model = lm.model
    tokens = mx.array([TOKENS])

    full_logits, full_hidden = model.forward(tokens, model.make_caches())

    caches = model.make_caches()
    rows, hiddens = [], []
    logits, hidden = model.forward(tokens[:, :13], caches)
    rows.append(logits)
    hiddens.append(hidden)
    for i in range(13, len(TOKENS)):
        logits, hidden = model.forward(tokens[:, i : i + 1], caches)
        rows.append(logits)
        hiddens.append(hidden)
    step_logits = mx.concatenate(rows, axis=1)
    step_hidden = mx.concatenate(hiddens, axis=1)

    assert caches[0].offset == len(TOKENS)
    np.testing.assert_allclose(np.array(step_logits), np.array(full_logits), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(step_hidden), np.array(full_hidden), atol=1e-4, rtol=1e-4)
    # Logits must actually depend on the tokens (a model that ignores input would pass above).
    assert float(mx.abs(full_logits[0, 0] - full_logits[0, 5]).max()) > 1e-2


def test_quantized_checkpoint_can_stay_quantized(checkpoint_factory, exact_products):
    import mlx.nn as nn

    path = checkpoint_factory("llama", quantize_bits=4)
    dense = load_model(path, keep_quantized=False)
    kept = load_model(path, keep_quantized=True)
    assert kept.quantized and not dense.quantized
    up = kept.model.layers[0].mlp.up_proj
    if mx.default_device() == mx.cpu:  # runner.native's quantized panels: no float copy
        assert "weight" not in up and up._wt.dtype == mx.uint8
    else:
        assert isinstance(up, nn.QuantizedLinear)
    tokens = mx.array([TOKENS[:8]])
    a = dense.model.forward(tokens, dense.model.make_caches())[0]
    b = kept.model.forward(tokens, kept.model.make_caches())[0]
    # Same quantized values either way: dequantize-then-matmul equals quantized matmul.
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-3, rtol=1e-3)


def test_rewind_and_refeed_matches_never_feeding(tiny_checkpoint):
    model = load_model(tiny_checkpoint).model
    caches = model.make_caches()
    model.forward(mx.array([TOKENS[:10]]), caches)
    # Feed a wrong branch, rewind it away, then feed the true continuation.
    model.forward(mx.array([[300, 301, 302, 303]]), caches)
    for c in caches:
        c.rewind(10)
    got = model.forward(mx.array([TOKENS[10:14]]), caches)[0]
    want = model.forward(mx.array([TOKENS[:14]]), model.make_caches())[0][:, 10:]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


def test_kv_cache_grows_in_steps_and_rewinds_by_offset():
    cache = KVCache()
    k = mx.ones((1, 2, 3, 4))
    cache.update_and_fetch(k, k)
    assert cache.keys.shape[2] == 256 and cache.offset == 3
    big = mx.ones((1, 2, 300, 4))
    keys, _ = cache.update_and_fetch(big, big)
    assert cache.keys.shape[2] == 512 and cache.offset == 303 and keys.shape[2] == 303
    buffer = cache.keys
    cache.rewind(100)
    assert cache.offset == 100 and cache.keys is buffer  # no copy on rewind
    keys, _ = cache.update_and_fetch(2 * k, 2 * k)
    assert keys.shape[2] == 103
    assert float(keys[0, 0, 101, 0]) == 2.0 and float(keys[0, 0, 99, 0]) == 1.0
    with pytest.raises(ValueError):
        cache.rewind(104)
    assert cache.nbytes == 2 * 512 * 2 * 4 * 4


def test_batched_rows_are_independent(tiny_checkpoint):
    """Batch > 1 works (the trainer generates in batches)."""
    model = load_model(tiny_checkpoint).model
    a, b = TOKENS[:6], TOKENS[6:12]
    both = model.forward(mx.array([a, b]), model.make_caches())[0]
    one = model.forward(mx.array([b]), model.make_caches())[0]
    np.testing.assert_allclose(np.array(both[1]), np.array(one[0]), atol=1e-4, rtol=1e-4)


def test_row_layout_serves_verify_rows_with_the_same_results(checkpoint_factory):
    from runner.models.layers import MAX_ROWS_LEFT, add_row_layout

    model = packed(checkpoint_factory("qwen2"))  # biases too

    def feed(rows: int):
        caches = model.make_caches()
        model.forward(mx.array([TOKENS[:PREFIX]]), caches)  # a prefill-sized chunk
        return model.forward(mx.array([TOKENS[PREFIX : PREFIX + rows]]), caches)[0]

    PREFIX = MAX_ROWS_LEFT + 1
    assert PREFIX + 3 <= len(TOKENS)
    before = {rows: feed(rows) for rows in (1, 2, 3)}
    # o and down; q/k/v and gate/up are fused, and the fused product serves every row count.
    assert add_row_layout(model) == 2 * len(model.layers)
    for rows, logits in before.items():
        np.testing.assert_allclose(np.array(feed(rows)), np.array(logits), atol=1e-4, rtol=1e-4)
    # The copy is what multi-row feeds read (and only they): spoil it and only they change.
    for _, child in model.named_modules():
        if "_w_rows" in child:
            child._w_rows = mx.zeros_like(child._w_rows)
    np.testing.assert_allclose(np.array(feed(1)), np.array(before[1]), atol=1e-4, rtol=1e-4)
    assert float(mx.abs(feed(3) - before[3]).max()) > 1e-2


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # plain, biases, qk-norm
def test_fused_projections_compute_what_the_separate_ones_do(checkpoint_factory, model_type):
    from runner.device import fuse_projections
    from runner.models.layers import dense_weight

    path = checkpoint_factory(model_type)
    separate = load_model(path).model
    fused = packed(path)
    assert fuse_projections(fused) == 0  # packing fused every block already
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert "_qkv_t" in attn and "_gate_up_t" in mlp
    # Each projection stays readable on its own (exports, the trainer's NumPy copy).
    for name in ("q_proj", "k_proj", "v_proj"):
        want = separate.layers[0].self_attn[name].weight
        np.testing.assert_array_equal(np.array(dense_weight(attn[name])), np.array(want))

    def feed(model, rows: int):
        caches = model.make_caches()
        model.forward(mx.array([TOKENS[:9]]), caches)
        return model.forward(mx.array([TOKENS[9 : 9 + rows]]), caches)[0]

    for rows in (1, 3):
        np.testing.assert_allclose(
            np.array(feed(fused, rows)), np.array(feed(separate, rows)), atol=1e-4, rtol=1e-4
        )
    # The fused matrices are what the forward reads.
    before = feed(fused, 1)
    attn._qkv_t = mx.zeros_like(attn._qkv_t)
    assert float(mx.abs(feed(fused, 1) - before).max()) > 1e-2


LONG = [1.0, 1.3, 1.9, 2.8, 4.0, 5.5, 7.0, 8.0]
SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7]
# (scaling, traditional, RoPE keyword arguments): every variant, static and per-forward.
ROPE_VARIANTS = [
    ({}, False, {}),
    ({}, True, {}),
    ({"type": "linear", "factor": 4.0}, False, {}),
    (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        False,
        {},
    ),
    ({"rope_type": "freq_factors", "factors": [1.0, 2.0, 4.0, 8.0, 1.5, 3.0, 1.0, 2.5]}, True, {}),
    ({"type": "dynamic", "factor": 2.0}, False, {"max_position_embeddings": 48}),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, False, {}),
    (
        {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        True,
        {},
    ),
    (
        {
            "type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 32,
        },
        False,
        {"max_position_embeddings": 256},
    ),
    # Partial rotary (the first 8 of 16 dims), with an attention factor on the rotated part.
    (
        {
            "type": "longrope",
            "short_factor": SHORT[:4],
            "long_factor": LONG[:4],
            "original_max_position_embeddings": 32,
        },
        False,
        {"max_position_embeddings": 256, "dims": 8},
    ),
]


@pytest.mark.parametrize(("scaling", "traditional", "kwargs"), ROPE_VARIANTS)
@pytest.mark.parametrize("offset", [0, 30, 37, 1500])
def test_rope_tables_rotate_like_mlx_fast_rope(scaling, traditional, kwargs, offset):
    """The composed kernel, the ``mx.fast`` path and ``mx.fast.rope`` itself agree for every
    variant (the periods and the attention factor of that forward; a forward of 5 rows from
    ``offset`` ends on either side of the dynamic and longrope thresholds)."""
    from runner.models.rope import RoPE

    kwargs = dict(kwargs)
    dims = kwargs.pop("dims", 16)
    rope = RoPE(
        dims,
        base=10000.0,
        traditional=traditional,
        scaling=scaling or None,
        head_dim=16,
        **kwargs,
    )
    x = mx.random.normal((1, 3, 5, 16), key=mx.random.key(offset))
    periods = rope.periods(offset, 5)
    freqs = (
        {"base": None, "freqs": periods}
        if rope._freqs is not None or rope.depends_on_feed
        else {"base": 1e4}
    )
    rotated = (
        mx.fast.rope(
            x[..., :dims], dims, traditional=traditional, scale=rope.scale, offset=offset, **freqs
        )
        * rope.attention_factor
    )
    expected = mx.concatenate([rotated, x[..., dims:]], axis=-1)
    got = rope.apply(x, rope.tables(offset, 5))
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-4, rtol=1e-4)
    rope.fast = True
    fast = rope.apply(x, rope.tables(offset, 5))
    np.testing.assert_allclose(np.array(fast), np.array(expected), atol=2e-4, rtol=1e-4)


def test_attention_masks_agree_with_mlx_attention(tiny_checkpoint):
    """The grouped attention (None / "causal" / a shared [L, T] mask) equals MLX's own."""
    from runner.models.attention import causal_mask

    model = load_model(tiny_checkpoint).model
    attn = model.layers[0].self_attn
    heads, groups, dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = mx.random.normal((1, heads, 4, dim), key=mx.random.key(1))
    k = mx.random.normal((1, groups, 10, dim), key=mx.random.key(2))
    v = mx.random.normal((1, groups, 10, dim), key=mx.random.key(3))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
    for mask in ("causal", causal_mask(6, 4), causal_mask(6, 4) == 0):
        got = attn._attend(q, k, v, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    one = mx.fast.scaled_dot_product_attention(q[:, :, :1], k, v, scale=attn.scale)
    got = attn._attend(q[:, :, :1], k, v, None)
    np.testing.assert_allclose(np.array(got), np.array(one), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # plain, biases, qk-norm
def test_compiled_blocks_compute_what_the_eager_ones_do(checkpoint_factory, model_type):
    from runner.device import compile_blocks, uncompile_blocks
    from runner.models.llama import COMPILED_MAX_ROWS

    path = checkpoint_factory(model_type)
    eager = packed(path)
    compiled = packed(path)
    assert compile_blocks(compiled) == len(compiled.layers)

    def feed(model, prefix: int, rows: int):
        caches = model.make_caches()
        model.forward(mx.array([TOKENS[:prefix]]), caches)
        return model.forward(mx.array([TOKENS[prefix : prefix + rows]]), caches)[0]

    # Decode and verify rows after a cached prefix, and a first chunk too long to compile.
    long = COMPILED_MAX_ROWS + 1
    assert long + 3 <= len(TOKENS)
    for prefix, rows in ((9, 1), (9, 2), (9, 3), (1, long), (long, 2)):
        np.testing.assert_allclose(
            np.array(feed(compiled, prefix, rows)),
            np.array(feed(eager, prefix, rows)),
            atol=1e-4,
            rtol=1e-4,
        )
    # Compiled parts read the weights they traced: few-row feeds keep them after a change,
    # longer (eager) ones see it at once, and uncompiling makes every feed see it.
    before_short, before_long = feed(compiled, 9, 2), feed(compiled, 1, long)
    mlp = compiled.layers[0].mlp
    mlp.down_proj._wt = mx.zeros_like(mlp.down_proj._wt)
    np.testing.assert_array_equal(np.array(feed(compiled, 9, 2)), np.array(before_short))
    assert float(mx.abs(feed(compiled, 1, long) - before_long).max()) > 1e-2
    assert uncompile_blocks(compiled) == len(compiled.layers)
    assert float(mx.abs(feed(compiled, 9, 2) - before_short).max()) > 1e-2


KERNEL_FAMILIES = [
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2", {}),
    ("qwen3", {}),
    # Per-forward frequencies (through compiled blocks as an input): the 12-token prompt and
    # the decode steps cross max_position_embeddings 16 / the original length 16.
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16}),
    (
        "llama",
        {
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0 + i for i in range(8)],
                "original_max_position_embeddings": 16,
            }
        },
    ),
    (
        "llama",
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
]


@pytest.mark.parametrize(("model_type", "kwargs"), KERNEL_FAMILIES, ids=lambda v: str(v)[:12])
def test_composed_and_fast_kernels_decode_the_same_greedy_tokens(
    checkpoint_factory, model_type, kwargs
):
    """The CPU's composed attention and RoPE and the ``mx.fast`` kernels a GPU runs, each
    forced on the CPU through the device door: the same greedy tokens, prefill chunks of
    several rows, compiled decode rows and a two-row verify-like feed included."""
    path = checkpoint_factory(model_type, seed=3, **kwargs)

    def greedy(fast: bool) -> tuple[list[int], mx.array]:
        model = load_model(path).model
        tuning = device.tune(model, fast_kernels=fast)
        assert tuning.fast_kernels is fast and tuning.compiled
        caches = model.make_caches()
        logits, _ = model.forward(mx.array([TOKENS[:12]]), caches)
        out = [int(mx.argmax(logits[0, -1]))]
        for _ in range(20):
            logits, _ = model.forward(mx.array([[out[-1]]]), caches)
            out.append(int(mx.argmax(logits[0, -1])))
        rows, _ = model.forward(mx.array([out[-2:]]), caches)
        return out, rows

    composed, composed_rows = greedy(False)
    fast, fast_rows = greedy(True)
    assert composed == fast
    np.testing.assert_allclose(np.array(composed_rows), np.array(fast_rows), atol=1e-4)


@pytest.mark.skipif(not device.native.available(), reason=device.native.reason())
@pytest.mark.parametrize(
    ("model_type", "kwargs"),
    [("qwen2", {}), ("llama", {"tie_word_embeddings": False})],
    ids=["qwen2", "llama-untied"],
)
def test_panel_layout_computes_what_the_packed_one_does(checkpoint_factory, model_type, kwargs):
    """Every product in the native panels (fused ones, biases, the output projection): the same
    logits as the packed layout for prefill, decode and verify-sized feeds, the projections
    still readable in the Hugging Face layout."""
    from runner.models.layers import dense_weight

    path = checkpoint_factory(model_type, seed=4, **kwargs)
    packed, panels = load_model(path).model, load_model(path).model
    device.tune(packed, layout="packed")
    assert device.tune(panels, layout="panels").layout == "panels"
    attn = panels.layers[0].self_attn
    assert attn._qkv_t.ndim == 3 and attn.q_proj._wt.ndim == 3
    np.testing.assert_array_equal(
        np.array(dense_weight(attn.k_proj)),
        np.array(dense_weight(packed.layers[0].self_attn.k_proj)),
    )
    packed_caches, panel_caches = packed.make_caches(), panels.make_caches()
    for rows in (12, 1, 3, 1, 5):
        ids = mx.array([TOKENS[:rows]])
        want, _ = packed.forward(ids, packed_caches)
        got, _ = panels.forward(ids, panel_caches)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-4, rtol=1e-4)


def test_quantize_at_load_keeps_every_product_in_quantized_panels(checkpoint_factory):
    """``--quantize q8``: every projection and the tied embedding in 8-bit panels (float16
    scales), a fraction of the float weights' memory, logits close to the float model's."""
    from runner.models.layers import Linear, PanelEmbedding

    path = checkpoint_factory("llama")
    tokens = mx.array([TOKENS[:8]])
    ref = load_model(path).model
    device.tune(ref)
    want = np.array(ref.forward(tokens, ref.make_caches())[0])
    model = load_model(path).model
    device.tune(model, quantize=8)
    linears = [m for _, m in model.named_modules() if isinstance(m, Linear)]
    assert linears and all("weight" not in m and m._wt.dtype == mx.uint8 for m in linears)
    assert isinstance(model.model.embed_tokens, PanelEmbedding)
    assert device.weight_bytes(model) < device.weight_bytes(ref) / 3
    got = np.array(model.forward(tokens, model.make_caches())[0])
    assert np.sqrt(((got - want) ** 2).mean() / (want**2).mean()) < 0.03
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("quantize_head", [True, False])
def test_float_head_beside_a_quantized_target_is_quantized(checkpoint_factory, quantize_head):
    """A quantized checkpoint kept quantized on the CPU: its float head's products go to 8-bit
    panels too (every round reads them), unless the head is asked to stay float."""
    from runner.models.layers import Linear
    from tests.test_head import random_head

    loaded = load_model(checkpoint_factory("llama", quantize_bits=4))
    head = random_head(loaded)
    assert device.holds_quantized_panels(loaded.model)
    assert not device.holds_quantized_panels(load_model(checkpoint_factory("llama")).model)
    device.tune(loaded.model, head, quantize_head=quantize_head)
    linears = [m for _, m in head.named_modules() if isinstance(m, Linear) and "_wt" in m]
    assert linears
    held = {m._wt.dtype for m in linears}
    assert held == ({mx.uint8} if quantize_head else {mx.float32})
