"""Acceptance math (drafting/accept.py): exact edge cases, and 50,000 speculative draws per
shape of p and q that must follow plain sampling from p (chi-square, p > 0.001)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from drafting.accept import (
    accept_mask,
    accepted_count,
    accepted_count_lazy,
    greedy_decision,
    residual,
    speculate,
)
from runner.sampler import Sampler, SamplingParams
from tests.stats import chi_square_pvalue

V = 8
TRIALS = 50_000


def sampler(seed: int) -> Sampler:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0, seed=seed)
    return Sampler(params, history=[], vocab_size=V, context_length=4096)


class Recording:
    """Forwards to a sampler and records the RNG calls in order."""

    def __init__(self, inner, *, allow_uniform: bool = True):
        self.inner, self.calls, self.allow_uniform = inner, [], allow_uniform

    def draw(self, probs):
        self.calls.append(("draw", probs.shape[0]))
        return self.inner.draw(probs)

    def uniform(self, shape):
        assert self.allow_uniform, "uniforms requested"
        self.calls.append(("uniform", tuple(shape)))
        return self.inner.uniform(shape)


class Fixed:
    """Scripted uniforms; draws are the argmax (only used where rows are one-hot)."""

    def __init__(self, u):
        self.u = u

    def uniform(self, shape):
        return mx.full(shape, self.u, dtype=mx.float32)

    def draw(self, probs):
        return mx.argmax(probs, axis=-1).astype(mx.int32)


def normalise(row) -> np.ndarray:
    row = np.asarray(row, dtype=np.float64)
    return (row / row.sum()).astype(np.float32)


def softmax(logits, temperature=1.0) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    e = np.exp(z - z.max())
    return normalise(e)


def top_k(row, k) -> np.ndarray:
    keep = np.argsort(-row)[:k]
    out = np.zeros_like(row)
    out[keep] = row[keep]
    return normalise(out)


def top_p(row, p) -> np.ndarray:
    order = np.argsort(-row)
    cum = np.cumsum(row[order])
    n = int(np.searchsorted(cum, p) + 1)
    out = np.zeros_like(row)
    out[order[:n]] = row[order[:n]]
    return normalise(out)


def rows(seed: int, count: int, temperature: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [softmax(rng.normal(size=V) * 2.0, temperature) for _ in range(count)]


def shapes() -> dict[str, tuple[list[np.ndarray], list[np.ndarray]]]:
    """(p rows [3], q rows [2]) per case: k = 2 drafts."""
    p_t, q_t = rows(1, 3, 0.7), rows(2, 2, 1.3)
    p_base, q_base = rows(3, 3), rows(4, 2)
    q_sub = [r.copy() for r in rows(5, 2)]
    for r in q_sub:  # q has zeros where p has mass
        r[[0, 3, 5]] = 0
    p_sub = [r.copy() for r in rows(6, 3)]
    for r in p_sub:  # p has zeros where q has mass
        r[[1, 2, 6]] = 0
    one_hot = lambda t: np.eye(V, dtype=np.float32)[t]
    return {
        "temperature": (p_t, q_t),
        "top-k": ([top_k(r, 4) for r in p_base], [top_k(r, 3) for r in q_base]),
        "top-p": ([top_p(r, 0.8) for r in p_base], [top_p(r, 0.6) for r in q_base]),
        "q-zeros": (rows(7, 3), [normalise(r) for r in q_sub]),
        "p-zeros": ([normalise(r) for r in p_sub], rows(8, 2)),
        "q-equals-p": (p_base, p_base[:2]),
        "disjoint": (
            [normalise([1, 1, 1, 1, 0, 0, 0, 0])] * 3,
            [normalise([0, 0, 0, 0, 1, 2, 3, 4])] * 2,
        ),
        "one-hot": ([one_hot(3), one_hot(5), one_hot(1)], [one_hot(3), one_hot(6)]),
        "peaked-draft": (p_t, [top_k(r, 1) for r in q_t]),
    }


@pytest.mark.parametrize("case", list(shapes()))
def test_speculative_draws_follow_plain_sampling(case):
    p_rows, q_rows = shapes()[case]
    p = mx.broadcast_to(mx.array(np.stack(p_rows))[None], (TRIALS, 3, V))
    q = mx.broadcast_to(mx.array(np.stack(q_rows))[None], (TRIALS, 2, V))
    s = sampler(sum(map(ord, case)))
    drafts = s.draw(q.reshape(-1, V)).reshape(TRIALS, 2)
    decision = speculate(p, q, drafts, s)
    mx.eval(drafts, decision)
    d = np.array(drafts)
    acc = np.array(decision.accept)
    succ = np.array(decision.successors)

    # Reading the round as the driver does: token i+1 is the draft if accepted, else the
    # successor of depth i; the bonus follows a fully accepted run. The target rows are
    # context-free here, so each position must follow its own row of p.
    first = np.where(acc[:, 0], d[:, 0], succ[:, 0])
    second = np.where(acc[:, 1], d[:, 1], succ[:, 1])[acc[:, 0]]
    third = succ[:, 2][acc[:, 0] & acc[:, 1]]
    for name, tokens, row in (("t1", first, p_rows[0]), ("t2", second, p_rows[1])):
        counts = np.bincount(tokens, minlength=V)
        assert chi_square_pvalue(counts, row) > 0.001, (case, name, counts)
    if len(third) >= 100:
        counts = np.bincount(third, minlength=V)
        assert chi_square_pvalue(counts, p_rows[2]) > 0.001, (case, "bonus", counts)

    # The first draft is accepted with probability sum(min(p0, q0)).
    rate = float(np.minimum(p_rows[0], q_rows[0]).sum())
    sd = math.sqrt(max(rate * (1 - rate), 1e-12) / TRIALS)
    assert abs(acc[:, 0].mean() - rate) < 5 * sd + 1e-9, (case, acc[:, 0].mean(), rate)


def test_zero_draft_probability_rejects_even_at_u_zero():
    p = mx.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.0, 1.0, 0.0]])
    mask = accept_mask(p, q, mx.array([0]), mx.array([0.0]))
    assert mask.tolist() == [False]


def test_zero_target_probability_rejects_even_at_u_zero():
    p = mx.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.5, 0.5, 0.0]])
    assert accept_mask(p, q, mx.array([0]), mx.array([0.0])).tolist() == [False]


def test_target_at_least_draft_always_accepts():
    p = mx.array([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.5, 0.25, 0.25]])
    u = mx.array([0.999999])
    assert accept_mask(p, q, mx.array([0]), u).tolist() == [True]
    assert accept_mask(p, q, mx.array([1]), u).tolist() == [True]
    assert accept_mask(p, q, mx.array([2]), mx.array([0.0])).tolist() == [False]


def test_acceptance_threshold_is_the_ratio():
    p = mx.array([[0.2, 0.8], [0.5, 0.5]])
    q = mx.array([[0.8, 0.2]])  # ratio at token 0: 0.25
    below = accept_mask(p, q, mx.array([0]), mx.array([0.249])).tolist()
    above = accept_mask(p, q, mx.array([0]), mx.array([0.251])).tolist()
    assert (below, above) == ([True], [False])


def test_residual_is_the_normalised_positive_part_or_falls_back_to_p():
    p = mx.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    q = mx.array([[0.2, 0.5, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])
    r = np.array(residual(p, q))
    np.testing.assert_allclose(r[0], [0.75, 0.0, 0.25, 0.0], atol=1e-6)
    np.testing.assert_allclose(r[1], [0.25] * 4, atol=0)  # p == q: fall back to p
    assert r.shape == (2, 4)


def test_one_hot_rows_reduce_to_greedy_verification():
    rng = np.random.default_rng(0)
    for _ in range(50):
        target = rng.integers(0, V, size=4)
        drafts = np.where(rng.random(3) < 0.6, target[:3], rng.integers(0, V, size=3))
        p = mx.array(np.eye(V, dtype=np.float32)[target])
        q = mx.array(np.eye(V, dtype=np.float32)[drafts])
        d = mx.array(drafts.astype(np.int32))
        want = greedy_decision(p, d)
        for u in (0.0, 0.5, 0.999):
            got = speculate(p, q, d, Fixed(u))
            assert got.accept.tolist() == want.accept.tolist()
            assert got.successors.tolist() == target.tolist()
        assert want.accept.tolist() == (drafts == target[:3]).tolist()


def test_greedy_decision_uses_the_argmax_of_each_row():
    p = mx.array([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    decision = greedy_decision(p, mx.array([1, 2]))
    assert decision.accept.tolist() == [True, False]
    assert decision.successors.tolist() == [1, 0, 2]
    assert accepted_count(decision.accept.tolist()) == 1


def test_rng_order_is_uniforms_then_one_draw_for_all_successors():
    rec = Recording(sampler(1))
    p = mx.array(np.stack(rows(9, 4)))
    q = mx.array(np.stack(rows(10, 3)))
    mx.eval(*speculate(p, q, mx.array([1, 2, 3]), rec))
    assert rec.calls == [("uniform", (3,)), ("draw", 4)]


def test_no_drafts_is_plain_sampling_without_uniforms():
    rec = Recording(sampler(2), allow_uniform=False)
    p = mx.array(np.stack(rows(11, 1)))
    decision = speculate(p, mx.zeros((0, V)), mx.zeros((0,), dtype=mx.int32), rec)
    assert decision.accept.shape == (0,) and decision.successors.shape == (1,)
    assert rec.calls == [("draw", 1)]
    again = sampler(2).draw(p)
    assert decision.successors.tolist() == again.tolist()  # same key, same draw as plain


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        speculate(mx.zeros((2, V)), mx.zeros((2, V)), mx.array([0, 1]), sampler(0))


def test_accepted_count_host_and_device_agree():
    cases = [[], [True], [False], [True, True, False, True], [True, True, True]]
    for case in cases:
        lazy = accepted_count_lazy(mx.array(case, dtype=mx.bool_)).item()
        assert lazy == accepted_count(case)
    assert accepted_count([True, False, True]) == 1
