"""MTPHead numerics against a float64 numpy reference, the KV cache, the draft vocabulary."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cache.kv import KVCache
from drafting.head import HeadConfig, MTPHead
from runner.loader import load_model
from runner.models import head_layer


def random_head(loaded, seed: int = 0, **config) -> MTPHead:
    """A head of the target's family with seeded random weights (norm gains jittered so a
    skipped or shifted norm shows up)."""
    args = loaded.model.args
    mx.random.seed(seed)
    head = MTPHead(
        HeadConfig(args.hidden_size, args.rms_norm_eps, **config),
        head_layer(loaded.model),
        loaded.model.embed,
        loaded.model.output_weight,
    )
    params = dict(tree_flatten(head.parameters()))
    for name, value in params.items():
        if "norm" in name:
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        else:
            params[name] = 3.0 * value  # larger than the default init: sharper drafts
    head.load_weights(list(params.items()), strict=True)
    mx.eval(head.parameters())
    return head


# -- a float64 numpy reference of the head ------------------------------------------------


def np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_rope(x, positions, base):
    """Rotate-half RoPE (the Hugging Face layout) over ``x`` ``[heads, L, d]``."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = positions[:, None] * inv[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def np_block(x, p, args, positions):
    """One Llama decoder layer over ``x`` ``[L, D]`` (causal, no cached prefix)."""
    eps, nh, nkv, hd = (
        args.rms_norm_eps,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
    )
    h = np_rms(x, p["input_layernorm.weight"], eps)
    length = x.shape[0]
    q = (h @ p["self_attn.q_proj.weight"].T).reshape(length, nh, hd).transpose(1, 0, 2)
    k = (h @ p["self_attn.k_proj.weight"].T).reshape(length, nkv, hd).transpose(1, 0, 2)
    v = (h @ p["self_attn.v_proj.weight"].T).reshape(length, nkv, hd).transpose(1, 0, 2)
    q, k = np_rope(q, positions, args.rope_theta), np_rope(k, positions, args.rope_theta)
    k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
    scores = q @ k.transpose(0, 2, 1) * hd**-0.5
    scores = scores + np.triu(np.full((length, length), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attn = (weights @ v).transpose(1, 0, 2).reshape(length, nh * hd)
    x = x + attn @ p["self_attn.o_proj.weight"].T
    h = np_rms(x, p["post_attention_layernorm.weight"], eps)
    gate, up = h @ p["mlp.gate_proj.weight"].T, h @ p["mlp.up_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * up) @ p["mlp.down_proj.weight"].T


def np_head_logits(head, loaded, tokens, hiddens):
    """logits = unembed(norm(block(fc(concat(norm_e(embed(t)), norm_h(h)))))) in float64."""
    p = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(head.parameters())}
    args, eps = loaded.model.args, loaded.model.args.rms_norm_eps
    table = np.array(loaded.model.output_weight(), dtype=np.float64)  # tied: embedding = head
    e = np_rms(table[tokens], p["pre_fc_norm_embedding.weight"], eps)
    h = np_rms(np.asarray(hiddens, dtype=np.float64), p["pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([h, e] if head.config.hidden_first else [e, h], axis=-1)
    x = x @ p["fc.weight"].T
    block = {k[len("layers.0.") :]: v for k, v in p.items() if k.startswith("layers.0.")}
    x = np_block(x, block, args, np.arange(len(tokens), dtype=np.float64))
    return np_rms(x, p["norm.weight"], eps) @ table.T


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.mark.parametrize("hidden_first", [False, True], ids=["embed-first", "hidden-first"])
def test_head_logits_match_float64_reference(target, hidden_first):
    head = random_head(target, seed=3, hidden_first=hidden_first)
    tokens = [5, 40, 17, 99, 3]
    mx.random.seed(11)
    hiddens = mx.random.normal((len(tokens), target.model.args.hidden_size))
    y = head(mx.array([tokens]), hiddens[None], KVCache())
    got = np.array(head.draft_logits(y, target.model.unembed)[0])
    want = np_head_logits(head, target, tokens, np.array(hiddens))
    assert want.std() > 0.5  # the check has something to compare
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_pair_by_pair_through_the_cache_equals_one_batched_forward(target):
    head = random_head(target, seed=4)
    tokens = mx.array([[8, 2, 61, 33, 7, 150]])
    mx.random.seed(12)
    hiddens = mx.random.normal((1, 6, target.model.args.hidden_size))
    batched = head(tokens, hiddens, KVCache())
    cache = KVCache()
    rows = [head(tokens[:, i : i + 1], hiddens[:, i : i + 1], cache) for i in range(6)]
    assert cache.offset == 6
    np.testing.assert_allclose(
        np.array(mx.concatenate(rows, axis=1)), np.array(batched), atol=1e-5, rtol=1e-5
    )


def test_embedding_and_hidden_order_matters(target):
    # The two concat orders differ unless fc's halves are swapped with them.
    a = random_head(target, seed=5)
    b = random_head(target, seed=5, hidden_first=True)
    d = target.model.args.hidden_size
    tokens, hidden = mx.array([[12, 13]]), mx.random.normal((1, 2, d))
    ya, yb = a(tokens, hidden, KVCache()), b(tokens, hidden, KVCache())
    assert not np.allclose(np.array(ya), np.array(yb), atol=1e-3)
    w = b.fc.weight
    b.fc.weight = mx.concatenate([w[:, d:], w[:, :d]], axis=1)
    yb = b(tokens, hidden, KVCache())
    np.testing.assert_allclose(np.array(ya), np.array(yb), atol=1e-5, rtol=1e-5)


def test_draft_vocabulary_scatters_into_a_full_row(target):
    head = random_head(target, seed=6)
    vocab = target.model.args.vocab_size
    y = head(mx.array([[4, 9]]), mx.random.normal((1, 2, target.model.args.hidden_size)), KVCache())
    full = np.array(head.draft_logits(y, target.model.unembed))
    ids = [3, 250, 17, 0, vocab - 1]
    head.set_draft_vocab(ids)
    sub = np.array(head.logits(y, target.model.unembed))
    assert sub.shape == (1, 2, len(ids))
    scattered = np.array(head.draft_logits(y, target.model.unembed))
    assert scattered.shape == (1, 2, vocab)
    np.testing.assert_allclose(scattered[..., ids], full[..., ids], atol=1e-5, rtol=1e-5)
    others = np.setdiff1d(np.arange(vocab), ids)
    assert np.all(np.isneginf(scattered[..., others]))
    head.set_draft_vocab(None)
    np.testing.assert_allclose(np.array(head.draft_logits(y, target.model.unembed)), full)


def test_greedy_draft_is_the_argmax_of_the_scattered_row(target):
    """A greedy draft is drawn from the draft vocabulary's columns, never a full-vocabulary
    row; it must pick the same token, the lowest id among ties, whatever order the draft
    vocabulary lists its ids in."""
    from runner.sampler import Sampler, SamplingParams

    head = random_head(target, seed=7)
    d, vocab = target.model.args.hidden_size, target.model.args.vocab_size
    y = head(mx.array([[4, 9, 31]]), mx.random.normal((1, 3, d)), KVCache())
    greedy = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.0), [], vocab, 4096)

    def draft(h: MTPHead, rows: mx.array, unembed) -> list[int]:
        columns = {} if h.draft_columns is None else {"columns": h.draft_columns}
        return greedy.tokens(h.logits(rows, unembed), slot=0, **columns).tolist()

    def both():
        want = mx.argmax(head.draft_logits(y, target.model.unembed), axis=-1)
        return draft(head, y, target.model.unembed), want.reshape(-1).tolist()

    got, want = both()
    assert got == want
    ids = sorted(set(range(0, vocab, 7)), reverse=True)  # most-frequent-first: not ascending
    head.set_draft_vocab(ids)
    got, want = both()
    assert got == want and all(t in ids for t in got)
    # A tie: two ids share one output row, so their logits are equal.
    weight = target.model.output_weight()
    low, high = 5, 6
    tied = MTPHead(
        head.config,
        head.layers[0],
        target.model.embed,
        lambda: weight.at[high].add(weight[low] - weight[high]),
    )
    tied.update(head.parameters())
    tied.set_draft_vocab([high, low])  # the higher id listed first
    row = mx.zeros((1, 1, d)) + weight[low] * 50.0  # points at the tied pair
    assert draft(tied, row, None) == [low]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=40, top_p=0.9, repeat_penalty=1.0, seed=3),
        dict(temperature=1.0, top_k=5, top_p=0.0, min_p=0.05, repeat_penalty=1.3, seed=4),
        dict(temperature=0.0, repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.2),
    ],
    ids=["T0.7-top-k", "T1-min-p-penalties", "greedy-penalties"],
)
def test_drafts_from_the_columns_equal_the_scattered_rows_draws(target, params):
    """A sampled draft is drawn from the draft vocabulary's own logits (``draft_columns``),
    never the scattered full row: the same token for every slot, chain and history, with the
    penalty window holding ids inside and outside the draft vocabulary."""
    from drafting.columns import Columns
    from runner.sampler import Sampler, SamplingParams

    head = random_head(target, seed=8)
    d, vocab = target.model.args.hidden_size, target.model.args.vocab_size
    ids = sorted(set(range(1, vocab, 3)), reverse=True)  # not ascending, as a trained head's
    head.set_draft_vocab(ids)
    assert head.draft_columns is not None
    mx.random.seed(13)
    y = head(mx.array([[4, 9, 31, 2]]), mx.random.normal((1, 4, d)) * 4, KVCache())
    history = [1, 2, 4, 7, 10, 11, 7]  # 1, 4, 7, 10 are draft ids; 2, 11 are not
    sampler = Sampler(SamplingParams(**params), history, vocab, 4096)
    same = 0
    for slot in range(40):
        row = y[0, slot % 4 : slot % 4 + 1]
        chain = mx.array([ids[slot % len(ids)], 2][: slot % 3], dtype=mx.int32)
        want = sampler.tokens(head.draft_logits(row, None), chain, slot=slot)
        got = sampler.tokens(head.logits(row, None), chain, slot=slot, columns=head.draft_columns)
        assert got.tolist() == want.tolist(), slot
        same += int(want.item()) in ids
    assert same == 40
    head.set_draft_vocab([3, 3, 5])  # repeated ids: drafts drawn from the scattered row
    assert head.draft_columns is None
    with pytest.raises(ValueError, match="distinct"):
        Columns([3, 3, 5], vocab)
