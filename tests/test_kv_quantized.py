"""Quantized KV caches (--kv-bits): the packed cache against quantize-dequantize of its float
rows, the native row attention over packed rows against a NumPy reference, and the engine:
speculation lossless and prefix-cache restores equal to uncached runs with the same bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.kv import KVSnapshot, concat_snapshots
from cache.kv_quantized import QuantizedKVCache, dequantize, pack, quantize_caches, words
from runner import native
from runner.engine import Engine, EngineOptions
from tests.test_speculative import GREEDY, run

LAYOUTS = [(8, 32), (8, 64), (4, 32), (4, 64)]


def qdq(x: mx.array, bits: int, group: int) -> mx.array:
    """Quantize-dequantize through MLX directly: what the cache must hold."""
    return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)


def rows(length: int, dim: int = 64, seed: int = 0) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k, v = mx.random.normal((2, 1, 2, length, dim), key=key)
    return k, v


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
def test_appends_rewinds_and_snapshots_hold_quantize_dequantize_of_the_rows(bits, group):
    cache = QuantizedKVCache(bits, group)
    k, v = rows(300)
    assert words(64, bits, group) == pack(k, bits, group).shape[-1]
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])
    snap = cache.snapshot(20, 100)  # lazy, then copied out by the overwrite below
    cache.rewind(50)
    cache.update_and_fetch(k[:, :, 100:300], v[:, :, 100:300])
    assert cache.offset == 250
    got_k, got_v = cache.float_state()
    want_k = mx.concatenate([k[:, :, :50], k[:, :, 100:300]], axis=2)
    want_v = mx.concatenate([v[:, :, :50], v[:, :, 100:300]], axis=2)
    assert mx.array_equal(got_k, qdq(want_k, bits, group))
    assert mx.array_equal(got_v, qdq(want_v, bits, group))
    # The snapshot stays quantized (packed uint32) and restores the old rows exactly.
    assert not snap.lazy and snap.keys.dtype == mx.uint32
    packed = snap.keys, snap.values  # a restore below hands the copy back to its cache
    other = QuantizedKVCache(bits, group)
    other.update_and_fetch(k[:, :, :20], v[:, :, :20])
    other.restore(snap)
    assert other.offset == 100
    assert mx.array_equal(other.float_state()[0], qdq(k[:, :, :100], bits, group))
    # A snapshot read back as arrays (the disk tier) restores into a fresh cache.
    head = cache.snapshot(0, 20)
    head.materialise()
    disk = KVSnapshot.of_arrays(20, 100, *packed)
    fresh = QuantizedKVCache(bits, group)
    fresh.restore(concat_snapshots(head, disk))
    assert mx.array_equal(fresh.float_state()[1], qdq(v[:, :, :100], bits, group))
    # Packed rows take bits/32 of float32's words plus a scale and bias per group.
    assert cache.nbytes == 2 * (2 * 256 * words(64, bits, group) * 4)  # keys, values


def test_keep_rows_and_only_full_attention_caches_are_quantized():
    cache = QuantizedKVCache(8, 64)
    k, v = rows(10)
    k, v = mx.concatenate([k, k + 1]), mx.concatenate([v, v + 1])  # a batch of two
    cache.update_and_fetch(k, v)
    cache.keep_rows(mx.array([1]))
    assert mx.array_equal(cache.float_state()[0], qdq(k[1:], 8, 64))
    from cache.kv import KVCache, RotatingKVCache

    kinds = quantize_caches([KVCache(), RotatingKVCache(8)], 8, 64)
    assert type(kinds[0]) is QuantizedKVCache and type(kinds[1]) is RotatingKVCache
    assert quantize_caches(kinds, None, 64) is kinds


def reference(q, k, v, scale):
    """softmax(scale q k^T) v in float64, row i over keys 0 .. T - L + i."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    batch, heads, length, dim = q.shape
    groups, keys = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // groups)
            for i in range(length):
                n = keys - length + i + 1
                s = scale * (k[b, g, :n] @ q[b, h, i])
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, g, :n]
    return out


needs_native = pytest.mark.skipif(
    not native.row_attention_quantized_available(64), reason=native.reason()
)


@needs_native
@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_native_quantized_rows_match_the_reference_and_are_batch_invariant(bits, group, dim):
    if dim % group:
        pytest.skip("group larger than the head")
    key = mx.random.key(dim + bits)
    k, v = mx.random.normal((2, 2, 2, 37, dim), key=key)
    q = mx.random.normal((2, 6, 5, dim), key=mx.random.key(1))
    pk, pv = pack(k, bits, group), pack(v, bits, group)
    scale = dim**-0.5
    got = native.row_attention_quantized(q, pk, pv, scale=scale, bits=bits, group=group)
    fk, fv = dequantize(pk, dim, bits, group), dequantize(pv, dim, bits, group)
    want = reference(q, fk, fv, scale)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # The float kernel over the dequantized rows: the same bits.
    assert mx.array_equal(got, native.row_attention(q, fk, fv, scale=scale))
    # Row i alone over its keys: the bits it has in the 5-row call.
    for i in range(5):
        cut = 37 - 5 + i + 1
        one = native.row_attention_quantized(
            q[:, :, i : i + 1], pk[:, :, :cut], pv[:, :, :cut], scale=scale, bits=bits, group=group
        )
        assert mx.array_equal(one, got[:, :, i : i + 1])


@pytest.mark.skipif(not native.flash_attention_quantized_available(), reason=native.reason())
@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_prefill_attention_over_packed_rows_is_the_float_kernel_over_their_values(
    bits, group, causal
):
    q = mx.random.normal((1, 6, 150, 64), key=mx.random.key(3))
    k, v = mx.random.normal((2, 1, 2, 333, 64), key=mx.random.key(4))
    pk, pv = pack(k, bits, group), pack(v, bits, group)
    fk, fv = dequantize(pk, 64, bits, group), dequantize(pv, 64, bits, group)
    got = native.flash_attention_quantized(
        q, pk, pv, scale=0.125, causal=causal, bits=bits, group=group
    )
    assert mx.array_equal(got, native.flash_attention(q, fk, fv, scale=0.125, causal=causal))
    if causal:
        np.testing.assert_allclose(
            np.asarray(got), reference(q, fk, fv, 0.125), rtol=1e-4, atol=1e-5
        )


@pytest.fixture(scope="module")
def wide(checkpoint_factory, tmp_path_factory):
    """A tiny llama with 32-wide heads (groups of 32 fit) and an echo head for it."""
    from runner.loader import load_model
    from tests.heads import echo_head, write_head

    path = checkpoint_factory("llama", hidden_size=128)
    loaded = load_model(path)
    head_dir = write_head(str(tmp_path_factory.mktemp("echo-head-kv")), loaded, echo_head(loaded))
    return path, head_dir


PROMPTS = ["The quick brown fox", "def add(a, b):\n    return"]


@pytest.mark.parametrize("bits", [8, 4])
def test_speculation_with_quantized_kv_equals_plain_decoding(wide, bits):
    path, head_dir = wide
    kv = {"kv_bits": bits, "kv_group": 32, "prefix_cache": False}
    plain = Engine(EngineOptions(model_path=path, use_draft=False, **kv))
    spec = Engine(EngineOptions(model_path=path, draft_path=head_dir, draft_depth=3, **kv))
    assert type(plain.caches[0]) is QuantizedKVCache
    accepted = 0
    for prompt in PROMPTS:
        for sampling in (GREEDY, {"temperature": 0.8, "seed": 5}):
            want, _, want_offset = run(plain, prompt, num_predict=24, **sampling)
            got, done, offset = run(spec, prompt, num_predict=24, **sampling)
            assert got == want and offset == want_offset
            accepted += done.speculation.accepted
    assert accepted > 5


def test_prefix_cache_restore_with_quantized_kv_equals_uncached(wide):
    path, _ = wide
    kv = {"kv_bits": 8, "kv_group": 32, "use_draft": False}
    cached = Engine(EngineOptions(model_path=path, prefill_chunk=8, **kv))
    fresh = Engine(EngineOptions(model_path=path, prefill_chunk=8, prefix_cache=False, **kv))
    base = "The quick brown fox jumps over the lazy dog. " * 3
    hits = 0
    for prompt in (base, base + "Again", base[:40] + "a branch", base):
        got, done, _ = run(cached, prompt, num_predict=12, **GREEDY)
        want, _, _ = run(fresh, prompt, num_predict=12, **GREEDY)
        assert got == want
        hits += done.prompt_cached_tokens > 0
    assert hits >= 2


def test_disk_tier_keeps_packed_rows_and_restores_them(wide, tmp_path):
    path, _ = wide
    kv = {"kv_bits": 4, "kv_group": 32, "use_draft": False}
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    first = Engine(EngineOptions(model_path=path, cache_dir=str(tmp_path), **kv))
    want, done, _ = run(first, prompt, num_predict=10, **GREEDY)
    assert done.prompt_disk_tokens == 0
    first.prefix.disk.close()
    again = Engine(EngineOptions(model_path=path, cache_dir=str(tmp_path), **kv))
    got, done, _ = run(again, prompt, num_predict=10, **GREEDY)
    assert done.prompt_disk_tokens > 0 and got == want
    assert again.caches[0].keys.dtype == mx.uint32
    again.prefix.disk.close()
    # Float KV is another fingerprint: nothing of the quantized segments is served to it.
    plain = Engine(EngineOptions(model_path=path, cache_dir=str(tmp_path), use_draft=False))
    _, done, _ = run(plain, prompt, num_predict=10, **GREEDY)
    assert done.prompt_disk_tokens == 0
    plain.prefix.disk.close()


def test_heads_narrower_than_a_group_keep_float_kv(tiny_checkpoint):
    engine = Engine(EngineOptions(model_path=tiny_checkpoint, kv_bits=8, kv_group=32))
    assert engine.kv_bits is None and type(engine.caches[0]) is not QuantizedKVCache


def test_status_counts_the_packed_buffers(wide):
    path, _ = wide
    engines = [
        Engine(EngineOptions(model_path=path, use_draft=False, kv_bits=bits, kv_group=32))
        for bits in (None, 8, 4)
    ]
    for engine in engines:
        run(engine, "The quick brown fox", num_predict=4, **GREEDY)
    floats, eight, four = (e.status()["kv_bytes"] for e in engines)
    # Rows of 32 values: 8 or 4 words of integers and a scale and bias, against 32 words.
    assert eight * 32 == floats * 10 and four * 32 == floats * 6


def test_the_flags_are_off_by_default_and_parsed():
    from runner.cli import build_parser

    args = build_parser().parse_args([])
    assert args.kv_bits is None and args.kv_group == 64
    args = build_parser().parse_args(["--kv-bits", "4", "--kv-group", "32"])
    assert (args.kv_bits, args.kv_group) == (4, 32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-bits", "2"])
    assert EngineOptions().kv_bits is None


def test_shared_forwards_over_quantized_caches_equal_each_request_alone(wide):
    from tests.test_batch import alone, request, together

    path, head_dir = wide
    engine = Engine(
        EngineOptions(model_path=path, draft_path=head_dir, parallel=3, kv_bits=8, kv_group=32)
    )
    reqs = [request(f"r{i}", q, num_predict=8 + 4 * i) for i, q in enumerate(PROMPTS * 2)]
    solo = {r.id: alone(engine, r).ids for r in reqs}
    outs, scheduler = together(engine, reqs)
    assert scheduler.shared_steps > 0
    assert all(outs[r.id].ids == solo[r.id] for r in reqs)
