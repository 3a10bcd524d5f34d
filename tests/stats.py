"""Chi-square goodness of fit without scipy: the p-value is Q(df/2, statistic/2), where Q is
the regularized upper incomplete gamma function (series below a + 1, continued fraction above).
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-15
_TINY = 1e-300
_MAX_TERMS = 10_000


def _lower_series(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x) by its power series (good for x < a + 1)."""
    term = 1.0 / a
    total = term
    n = a
    for _ in range(_MAX_TERMS):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) by Lentz's continued fraction (x >= a + 1)."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_TERMS):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def upper_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a) for a > 0, x >= 0."""
    if a <= 0:
        raise ValueError("a must be positive")
    if x <= 0:
        return 1.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return _upper_fraction(a, x)


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with ``df`` degrees of freedom."""
    return upper_gamma_q(df / 2.0, statistic / 2.0)


def chi_square_pvalue(observed, probabilities, min_expected: float = 5.0) -> float:
    """p-value of observed counts against expected probabilities (goodness of fit).

    Categories with zero expected probability must be empty (else 0.0 is returned); those
    expecting fewer than ``min_expected`` draws are pooled into one bin so the chi-square
    approximation holds.
    """
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probabilities, dtype=np.float64)
    if observed.shape != probs.shape:
        raise ValueError("observed and probabilities differ in shape")
    if np.any(observed[probs <= 0] > 0):
        return 0.0
    expected = probs / probs.sum() * observed.sum()
    possible = probs > 0
    large = possible & (expected >= min_expected)
    small = possible & ~large
    obs = list(observed[large])
    exp = list(expected[large])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    if len(exp) < 2:
        return 1.0
    obs_a, exp_a = np.array(obs), np.array(exp)
    statistic = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return chi_square_sf(statistic, len(exp) - 1)
