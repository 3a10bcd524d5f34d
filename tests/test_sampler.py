"""Sampler: penalties, filters, the slot-keyed Gumbel draws, processed distributions, logprobs."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from drafting.columns import Columns
from runner.sampler import (
    Sampler,
    SamplingParams,
    _compiled_filter,
    filter_rows,
    gumbel_noise,
    slot_keys,
)
from tests.stats import chi_square_pvalue, chi_square_sf, upper_gamma_q

# Hand-made logits over a 16-token vocabulary: distinct values in no particular id order.
LOGITS16 = np.array(
    [0.3, 2.0, -1.0, 1.2, 0.8, -0.5, 1.5, 0.0, -2.0, 1.0, -0.2, 0.5, -3.0, 1.1, -0.8, -1.5],
    dtype=np.float32,
)
DRAWS = 20_000
PLAIN = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def reference_probs(
    logits,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.9,
    min_p: float = 0.0,
    repeat_penalty: float = 1.1,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    window=(),
) -> np.ndarray:
    """An independent float64 implementation of the documented pipeline."""
    x = np.array(logits, dtype=np.float64)
    v = len(x)
    for token in sorted(set(window)):
        n = list(window).count(token)
        if repeat_penalty != 1.0:
            x[token] = x[token] / repeat_penalty if x[token] > 0 else x[token] * repeat_penalty
        x[token] -= presence_penalty + frequency_penalty * n
    if temperature <= 0:
        out = np.zeros(v)
        out[int(np.argmax(x))] = 1.0
        return out
    keep = np.ones(v, dtype=bool)
    if 0 < top_k < v:
        keep[:] = False
        keep[np.argsort(-x, kind="stable")[:top_k]] = True
    z = np.where(keep, x / temperature, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < top_p < 1:
        desc = np.sort(p)[::-1]
        cum = np.cumsum(desc)
        assert np.abs(cum - top_p).min() > 1e-4, "test case sits on the top-p boundary"
        n = int(np.searchsorted(cum, top_p)) + 1
        p = np.where(p >= desc[min(n, v) - 1], p, 0.0)
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def make(history=(), vocab: int = 16, context: int = 256, **options) -> Sampler:
    return Sampler(SamplingParams(**options), list(history), vocab, context)


def counts_of(tokens, vocab: int = 16) -> np.ndarray:
    return np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab)


# -- the chi-square helper ----------------------------------------------------------------


def test_upper_gamma_matches_closed_forms():
    for x in (0.1, 1.0, 2.0, 7.5, 30.0):
        assert upper_gamma_q(1.0, x) == pytest.approx(math.exp(-x), rel=1e-12)
        assert upper_gamma_q(0.5, x) == pytest.approx(math.erfc(math.sqrt(x)), rel=1e-10)
        poly = 1 + x + x * x / 2
        assert upper_gamma_q(3.0, x) == pytest.approx(math.exp(-x) * poly, rel=1e-10)
    assert upper_gamma_q(2.0, 0.0) == 1.0


def test_chi_square_table_values():
    # Critical values from standard chi-square tables.
    assert chi_square_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi_square_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert chi_square_sf(30.577914, 15) == pytest.approx(0.01, abs=1e-6)
    assert chi_square_sf(0.0, 4) == 1.0


def test_chi_square_pvalue_accepts_truth_and_rejects_a_skew():
    rng = np.random.default_rng(5)
    p = reference_probs(LOGITS16, **PLAIN, temperature=1.0)
    draws = rng.choice(16, size=DRAWS, p=p)
    assert chi_square_pvalue(counts_of(draws), p) > 0.001
    skewed = p.copy()
    skewed[1] *= 1.25
    assert chi_square_pvalue(counts_of(draws), skewed / skewed.sum()) < 0.001
    impossible = p.copy()
    impossible[counts_of(draws).argmax()] = 0.0
    assert chi_square_pvalue(counts_of(draws), impossible) == 0.0


# -- penalties ------------------------------------------------------------------------------


PEN_LOGITS = np.array([2.0, -1.5, 0.0, 3.0, -2.0, 1.0, 0.5, -0.25], dtype=np.float32)
PEN = dict(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=5)


def test_penalties_match_hand_computed_logits():
    # Window = last 5 of the history = [1, 2, 0, 1, 0]: 0 twice, 1 twice, 2 once.
    s = make([3, 5, 0, 1, 2, 0, 1, 0], vocab=8, **PEN)
    got = np.array(s.penalised(mx.array(PEN_LOGITS)))[0]
    # 0: 2/2 - .5 - 2*.25; 1: -1.5*2 - .5 - 2*.25; 2: 0*2 - .5 - .25; the rest untouched.
    assert got.tolist() == [0.0, -4.0, -0.75, 3.0, -2.0, 1.0, 0.5, -0.25]
    s.append(5)  # window slides to [2, 0, 1, 0, 5]
    got = np.array(s.penalised(mx.array(PEN_LOGITS)))[0]
    assert got.tolist() == [0.0, -3.75, -0.75, 3.0, -2.0, -0.25, 0.5, -0.25]


def test_penalised_rows_follow_the_chain():
    s = make([3, 5, 0, 1, 2, 0, 1, 0], vocab=8, **PEN)
    rows = mx.array(np.stack([PEN_LOGITS] * 3))
    got = np.array(s.penalised(rows, chain=[5, 5]))
    assert got[0].tolist() == [0.0, -4.0, -0.75, 3.0, -2.0, 1.0, 0.5, -0.25]
    assert got[1].tolist() == [0.0, -3.75, -0.75, 3.0, -2.0, -0.25, 0.5, -0.25]
    # Window [0, 1, 0, 5, 5]: 1 once, 2 gone, 5 twice.
    assert got[2].tolist() == [0.0, -3.75, 0.0, 3.0, -2.0, -0.5, 0.5, -0.25]


def test_penalty_window_edges():
    logits = mx.array(PEN_LOGITS)
    # repeat_last_n = 0: no penalties at all; repeat_penalty <= 0 counts as 1.
    off = make([0, 1, 3], vocab=8, repeat_penalty=2.0, repeat_last_n=0)
    assert np.array(off.penalised(logits))[0].tolist() == PEN_LOGITS.tolist()
    off = make([0, 1, 3], vocab=8, repeat_penalty=0.0, repeat_last_n=8)
    assert np.array(off.penalised(logits))[0].tolist() == PEN_LOGITS.tolist()
    # repeat_last_n = -1: the whole context, so a token 40 positions back still counts.
    history = [3] + [7] * 40
    whole = make(history, vocab=8, context=64, repeat_penalty=2.0, repeat_last_n=-1)
    assert np.array(whole.penalised(logits))[0][3] == 1.5
    short = make(history, vocab=8, context=64, repeat_penalty=2.0, repeat_last_n=8)
    assert np.array(short.penalised(logits))[0][3] == 3.0


def test_lazy_appends_penalise_like_ints():
    a = make([1], vocab=8, **PEN)
    b = make([1], vocab=8, **PEN)
    for token in (2, 5, 5, 0):
        a.append(token)
        b.append(mx.array(token) + 0)  # an unevaluated graph
    b.append(mx.array([6, 7], dtype=mx.int32) * 1)
    a.append(6)
    a.append(7)
    logits = mx.array(PEN_LOGITS)
    assert np.array_equal(np.array(a.penalised(logits)), np.array(b.penalised(logits)))


# -- filters: exact distributions and draws -------------------------------------------------

CASES = {
    "temperature": dict(PLAIN, temperature=0.7),
    "top_k": dict(PLAIN, temperature=1.0, top_k=5),
    "top_p": dict(PLAIN, temperature=1.0, top_p=0.8),
    "min_p": dict(PLAIN, temperature=1.0, min_p=0.2),
    "top_k+top_p": dict(PLAIN, temperature=0.8, top_k=8, top_p=0.9),
    "top_k+min_p": dict(PLAIN, temperature=1.3, top_k=10, min_p=0.1),
    "all": dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05, repeat_penalty=1.1),
    "penalties": dict(
        temperature=1.0,
        top_k=12,
        top_p=0.95,
        repeat_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        repeat_last_n=6,
    ),
}
CASE_HISTORY = [1, 1, 6, 0, 3, 6, 1, 9]


def reference_for(options: dict) -> np.ndarray:
    ref = {k: v for k, v in options.items() if k not in ("repeat_last_n", "seed")}
    window = CASE_HISTORY[-options.get("repeat_last_n", 64) :]
    return reference_probs(LOGITS16, window=window, **ref)


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_reference(name):
    options = CASES[name]
    s = make(CASE_HISTORY, seed=11, **options)
    probs = np.array(s.distributions(mx.array(LOGITS16)[None]))[0]
    ref = reference_for(options)
    assert np.array_equal(probs > 0, ref > 0)
    np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-7)
    # One draw per slot: DRAWS independent Gumbel-max draws from the processed row.
    draws = s.tokens(mx.broadcast_to(mx.array(LOGITS16), (DRAWS, 16)), slot=0)
    assert chi_square_pvalue(counts_of(np.array(draws)), ref) > 0.001


@pytest.mark.slow
def test_sample_draws_match_reference():
    # One sample() call per slot, read one at a time as the decoder does (about 10 s).
    options = CASES["penalties"]
    s = make(CASE_HISTORY, seed=3, **options)
    logits = mx.array(LOGITS16)
    counts = counts_of([s.sample(logits, slot=i).item() for i in range(DRAWS)])
    assert chi_square_pvalue(counts, reference_for(options)) > 0.001


def support(sampler: Sampler, logits) -> list[int]:
    probs = np.array(sampler.distributions(mx.array(logits, dtype=mx.float32)[None]))[0]
    return np.nonzero(probs)[0].tolist()


def test_top_k_ties_go_to_lower_ids():
    logits = [1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]
    assert support(make(vocab=8, **dict(PLAIN, top_k=3)), logits) == [1, 2, 3]
    assert support(make(vocab=8, **dict(PLAIN, top_k=5)), logits) == [1, 2, 3, 4, 5]
    # top_k >= vocab and top_k <= 0 are off.
    assert len(support(make(vocab=8, **dict(PLAIN, top_k=8)), logits)) == 8
    assert len(support(make(vocab=8, **dict(PLAIN, top_k=-1)), logits)) == 8


def test_top_p_keeps_ties_and_at_least_one():
    tied = [0.0, 0.0, 0.0, 0.0] + [-30.0] * 4
    s = make(vocab=8, **dict(PLAIN, temperature=1.0, top_p=0.3))
    assert support(s, tied) == [0, 1, 2, 3]
    s = make(vocab=8, **dict(PLAIN, temperature=1.0, top_p=0.01))
    assert support(s, PEN_LOGITS) == [3]
    # top_p >= 1 and <= 0 are off.
    for value in (1.0, 0.0):
        s = make(vocab=8, **dict(PLAIN, temperature=1.0, top_p=value))
        assert len(support(s, PEN_LOGITS)) == 8


def test_min_p_edges():
    logits = [2.0, 2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -3.0]
    s = make(vocab=8, **dict(PLAIN, temperature=1.0, min_p=1.0))
    assert support(s, logits) == [0, 1]
    s = make(vocab=8, **dict(PLAIN, temperature=1.0, min_p=5.0))
    assert support(s, logits) == [0, 1]
    # min_p = e^-1 keeps tokens within one logit of the best (>=, so 1.0 stays).
    s = make(vocab=8, **dict(PLAIN, temperature=1.0, min_p=math.exp(-1.0) * 0.999))
    assert support(s, logits) == [0, 1, 2, 6]


# -- greedy -----------------------------------------------------------------------------------


def test_greedy_is_the_first_penalised_argmax_and_uses_no_randomness():
    logits = mx.array([1.0, 4.0, 4.0, 3.9, 0.0])
    g = make([], vocab=5, temperature=0.0, repeat_penalty=1.0, seed=9)
    assert g.sample(logits, slot=0).item() == 1
    probs = np.array(g.distributions(logits[None]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]
    # No noise: another seed or slot draws the same token.
    other = make([], vocab=5, temperature=0.0, repeat_penalty=1.0, seed=10)
    assert other.tokens(mx.broadcast_to(logits, (6, 5)), slot=77).tolist() == [1] * 6
    # The penalty on 1 and 2 (4/1.1 < 3.9) moves the argmax to 3.
    p = make([1, 2], vocab=5, temperature=0.0, repeat_penalty=1.1, seed=9)
    assert p.sample(logits, slot=0).item() == 3


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(2)
    greedy = make([4, 4, 7], vocab=64, temperature=0.0, repeat_penalty=1.5)
    top1 = make([4, 4, 7], vocab=64, temperature=0.8, top_k=1, repeat_penalty=1.5, seed=1)
    for slot in range(30):
        logits = mx.array(rng.normal(0, 1, 64).astype(np.float32))
        a, b = greedy.sample(logits, slot).item(), top1.sample(logits, slot).item()
        assert a == b
        greedy.append(a)
        top1.append(b)


# -- the noise: keyed by seed, slot and token id -------------------------------------------------


def run_seeded(seed, steps: int = 24, between=None) -> list[int]:
    s = make([2, 3], seed=seed, **dict(PLAIN, temperature=1.5, top_k=12, repeat_penalty=1.2))
    flat = mx.array(np.linspace(0.0, 0.5, 16, dtype=np.float32))
    out = []
    for slot in range(steps):
        token = s.sample(flat, slot)
        s.append(token)
        out.append(token.item())
        if between:
            between()
    return out


def test_seeded_sampling_is_reproducible_and_isolated():
    first = run_seeded(42)
    assert len(set(first)) > 3

    def noise():
        mx.random.seed(123)
        mx.eval(mx.random.uniform(shape=(7,)))
        other = make([], seed=7, **dict(PLAIN, temperature=1.0))
        mx.eval(other.sample(mx.zeros((16,)), 3), other.tokens(mx.zeros((5, 16)), slot=0))

    noise()
    assert run_seeded(42) == first
    assert run_seeded(42, between=noise) == first
    assert run_seeded(43) != first


def test_unseeded_samplers_differ():
    assert run_seeded(None) != run_seeded(None)
    assert run_seeded(-1) != run_seeded(-5)


def test_noise_is_standard_gumbel_and_a_pure_function_of_key_and_id():
    keys = slot_keys(1, 0, 4)
    ids = mx.arange(50_000, dtype=mx.int32)
    g = np.array(gumbel_noise(keys, ids))
    assert g.shape == (4, 50_000) and np.isfinite(g).all()
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - math.pi**2 / 6) < 0.03
    # Rows (slots) are independent of each other; a subset of ids gets the full row's values.
    assert abs(np.corrcoef(g[0], g[1])[0, 1]) < 0.02
    subset = mx.array([[7, 49_999, 3], [0, 1, 2], [5, 5, 5], [42, 9, 11]], dtype=mx.int32)
    np.testing.assert_array_equal(
        np.array(gumbel_noise(keys, subset)), np.take_along_axis(g, np.array(subset), axis=1)
    )
    assert slot_keys(1, 2, 1).tolist() == slot_keys(1, 0, 3)[2:].tolist()
    assert slot_keys(2, 0, 1).tolist() != slot_keys(1, 0, 1).tolist()


# -- distributions vs sample ------------------------------------------------------------------

PIPELINES = {
    "sparse": dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.3),
    "dense": dict(temperature=1.1, top_k=0, top_p=0.95, repeat_penalty=1.2, repeat_last_n=4),
    "plain": dict(PLAIN, temperature=1.0),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_sample_is_the_noised_argmax_of_distributions(name):
    rng = np.random.default_rng(4)
    options = PIPELINES[name]
    a = make([1, 2, 3], vocab=300, seed=17, **options)
    b = make([1, 2, 3], vocab=300, seed=17, **options)
    for slot in range(60):
        logits = mx.array(rng.normal(0, 2, 300).astype(np.float32))
        from_sample = a.sample(logits, slot).item()
        noise = gumbel_noise(slot_keys(b.seed, slot, 1), mx.arange(300, dtype=mx.int32))
        with np.errstate(divide="ignore"):
            scores = np.log(np.array(b.distributions(logits[None]))) + np.array(noise)
        from_draw = int(np.argmax(scores[0]))
        assert from_sample == from_draw
        a.append(from_sample)
        b.append(from_draw)


@pytest.mark.parametrize(
    "setting", [(40, 0.9, 0.0, 0.7), (5, 0.0, 0.1, 1.3), (0, 0.95, 0.0, 1.0), (0, 0.0, 0.05, 0.5)]
)
def test_compiled_filter_equals_the_eager_one_bit_for_bit(setting):
    # The sampler runs the filter compiled (fused kernels); it must not move one probability.
    rng = np.random.default_rng(11)
    compiled = _compiled_filter(*setting)
    for rows in (1, 3):
        # Coarse values give many ties, at the top-k cut and at the top-p floor.
        logits = mx.array(np.round(rng.normal(0, 2, (rows, 500)), 1).astype(np.float32))
        probs, ids = filter_rows(logits, *setting)
        got = compiled(logits)
        assert np.array_equal(np.array(got[0]), np.array(probs))
        assert (ids is None) == (len(got) == 1)
        if ids is not None:
            assert np.array_equal(np.array(got[1]), np.array(ids))


@pytest.mark.parametrize("name", ["sparse", "dense"])
def test_distributions_with_chain_equal_sequential_sampling(name):
    rng = np.random.default_rng(6)
    options = dict(PIPELINES[name], repeat_last_n=4)
    rows = mx.array(rng.normal(0, 1.5, (6, 300)).astype(np.float32))
    # Plain decoding: sample, append, next row.
    plain = make([9, 8], vocab=300, seed=5, **options)
    tokens = []
    for i in range(6):
        token = plain.sample(rows[i], slot=40 + i)
        plain.append(token)
        tokens.append(token.item())
    # Speculative view: all rows at once, row i penalised with the chain tokens[:i].
    spec = make([9, 8], vocab=300, seed=5, **options)
    chain = mx.array(tokens[:5], dtype=mx.int32) + 0  # lazy
    probs = spec.distributions(rows, chain)
    for i in range(6):
        single = make([9, 8, *tokens[:i]], vocab=300, seed=5, **options)
        expect = np.array(single.distributions(rows[i : i + 1]))
        assert np.array_equal(np.array(probs[i : i + 1]), expect)
    # And the draws for all rows at once (a verify) are the sequential draws.
    assert spec.tokens(rows, chain, slot=40).tolist() == tokens


def test_sample_shapes():
    s = make(seed=1, **dict(PLAIN, temperature=1.0))
    assert s.sample(mx.zeros((16,)), 0).shape == ()
    assert s.sample(mx.zeros((1, 16)), 0).shape == (1,)
    assert s.sample(mx.zeros((16,)), 0).dtype == mx.int32


# -- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    s = make([1, 1, 1], seed=1, temperature=0.5, top_k=3, repeat_penalty=2.0)
    x = LOGITS16.astype(np.float64)
    ref = x - np.log(np.exp(x).sum())
    chosen, ids, values = s.logprobs(mx.array(LOGITS16), mx.array(6), 4)
    assert chosen.item() == pytest.approx(ref[6], abs=1e-5)
    assert np.array(ids).tolist() == np.argsort(-ref)[:4].tolist()
    np.testing.assert_allclose(np.array(values), np.sort(ref)[::-1][:4], atol=1e-5)
    chosen, ids, values = s.logprobs(mx.array(LOGITS16)[None], 1, 0)
    assert chosen.item() == pytest.approx(ref[1], abs=1e-5)
    assert ids.shape == (0,) and values.shape == (0,)
    _, ids, _ = s.logprobs(mx.array(LOGITS16), 0, 99)
    assert sorted(np.array(ids).tolist()) == list(range(16))


def test_single_row_with_a_chain_sees_the_whole_chain():
    """A draft step (one row) is penalised by every draft drawn before it in the round."""
    logits = mx.array([[2.0, 1.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=8, top_k=0, top_p=1.0)
    drafted = Sampler(params, history=[0], vocab_size=6, context_length=64)
    plain = Sampler(params, history=[0], vocab_size=6, context_length=64)
    plain.append([4, 3])
    got = drafted.penalised(logits, chain=[4, 3])
    np.testing.assert_array_equal(np.array(got), np.array(plain.penalised(logits)))
    assert float(got[0, 4]) == 1.5 and float(got[0, 3]) == 0.25


def test_columns_ignore_window_ids_past_their_table():
    """A penalty window id beyond the columns' vocabulary (the padding id of a sampler over a
    larger vocabulary, or a token outside the columns' table) drops out, as the full row's
    padding does, never penalising some column."""
    ids = [7, 2, 5, 0]
    columns = Columns(ids, 8)
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0), [2, 9, 11], 12, 64)
    logits = np.array([[3.0, 4.0, 3.2, 3.9]], np.float32)  # tokens 7, 2, 5, 0
    row = np.full((1, 12), -np.inf, np.float32)
    row[0, ids] = logits[0]
    want = int(s.tokens(mx.array(row), slot=0).item())
    got = int(s.tokens(mx.array(logits), slot=0, columns=columns).item())
    assert got == want == 0  # 2's 4.0 is penalised to 2.0, under 0's 3.9
