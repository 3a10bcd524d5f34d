"""Coupled acceptance (drafting/accept.py): a draft drawn with the target's noise is accepted
exactly when it is the target's own draw. 50,000 coupled draws per shape of p and q: the
target's draws follow p and the drafts q (chi-square, p > 0.001), and acceptance is at least
the coupling's bound (1 - TV) / (1 + TV)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from drafting.accept import accepted_count, matched_decision
from runner.sampler import Sampler, SamplingParams
from tests.stats import chi_square_pvalue

V = 8
TRIALS = 50_000


def sampler(seed: int) -> Sampler:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0, seed=seed)
    return Sampler(params, history=[], vocab_size=V, context_length=4096)


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


def draws(s: Sampler, row: np.ndarray, slot: int) -> np.ndarray:
    """TRIALS draws from ``row``, trial i for slot ``slot + i`` (independent noise per trial)."""
    with np.errstate(divide="ignore"):
        logits = mx.broadcast_to(mx.array(np.log(row))[None], (TRIALS, V))
    return np.array(s.tokens(logits, slot=slot))


@pytest.mark.parametrize("case", list(shapes()))
def test_coupled_draws_follow_their_own_distributions_and_agree_often(case):
    p_rows, q_rows = shapes()[case]
    s = sampler(sum(map(ord, case)))
    for i, (p, q) in enumerate(zip(p_rows, q_rows, strict=False)):
        target = draws(s, p, slot=1000 * i)
        draft = draws(s, q, slot=1000 * i)  # the same slots: the same noise
        for tokens, row in ((target, p), (draft, q)):
            counts = np.bincount(tokens, minlength=V)
            assert counts[row == 0].sum() == 0  # never a zero-probability token
            keep = row > 0
            if keep.sum() > 1:
                pvalue = chi_square_pvalue(counts[keep], row[keep] * TRIALS)
                assert pvalue > 0.001, (case, i, pvalue)
        agree = (target == draft).mean()
        tv = 0.5 * np.abs(p - q).sum()
        assert agree >= (1 - tv) / (1 + tv) - 0.01, (case, i, agree, tv)
        assert agree <= 1 - tv + 0.01  # no coupling beats the maximal one


def test_identical_distributions_always_agree_and_disjoint_ones_never():
    s = sampler(7)
    p = rows(11, 1)[0]
    assert (draws(s, p, 0) == draws(s, p, 0)).all()
    a, b = normalise([1, 1, 1, 1, 0, 0, 0, 0]), normalise([0, 0, 0, 0, 1, 2, 3, 4])
    assert not (draws(s, a, 0) == draws(s, b, 0)).any()


def test_other_slots_or_seeds_give_other_draws():
    p = rows(12, 1)[0]
    first = draws(sampler(1), p, 0)
    assert (first == draws(sampler(1), p, 0)).all()
    assert (first != draws(sampler(1), p, 1)).mean() > 0.5
    assert (first != draws(sampler(2), p, 0)).mean() > 0.5


def test_matched_decision_accepts_equal_drafts_and_offers_every_successor():
    target = mx.array([4, 7, 1, 3])
    decision = matched_decision(target, mx.array([4, 7, 2]))
    assert decision.accept.tolist() == [True, True, False]
    assert decision.successors.tolist() == [4, 7, 1, 3]
    assert accepted_count(decision.accept.tolist()) == 2
    empty = matched_decision(mx.array([5]), mx.zeros((0,), dtype=mx.int32))
    assert empty.accept.tolist() == [] and empty.successors.tolist() == [5]


def test_accepted_count_stops_at_the_first_rejection():
    assert accepted_count([]) == 0
    assert accepted_count([True, True, True]) == 3
    assert accepted_count([True, False, True]) == 1
    assert accepted_count([False, True]) == 0
