"""Speculative acceptance on MLX arrays (Leviathan et al. 2023 / Chen et al. 2023).

Given the target's processed probabilities ``p`` ``[..., k+1, V]`` (row i = the distribution of
the token after the prefix plus i drafts), the draft's processed probabilities ``q``
``[..., k, V]`` and the drafts ``[..., k]``:

- draft i is accepted when ``u_i < min(1, p_i(d_i) / q_i(d_i))``; a draft with ``q_i(d_i) = 0``
  (only possible through numerics) is rejected;
- if the first rejection is at i, the next token is drawn from ``normalise(max(0, p_i - q_i))``;
  when that residual has no mass (p_i == q_i) it falls back to ``p_i``;
- if every draft is accepted, the next token is drawn from ``p_k`` (the bonus row).

Everything is lazy: the caller evaluates the decision together with the verify forward, so a
round costs one host sync. The residuals for every possible rejection depth and the bonus row
are drawn in one batched ``draw`` (one key), after the acceptance uniforms; the RNG calls are
the request's ``Sampler.uniform`` and ``Sampler.draw``, so the key stream stays the request's.

With one-hot p and q (greedy) this reduces to an argmax match and the residual is the target
argmax; ``greedy_decision`` computes that directly without touching the RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import mlx.core as mx


class DrawSource(Protocol):
    """The two RNG calls of ``runner.sampler.Sampler`` that acceptance needs."""

    def draw(self, probs: mx.array) -> mx.array: ...

    def uniform(self, shape) -> mx.array: ...


class Decision(NamedTuple):
    """``accept[..., i]``: draft i+1 passed its test; ``successors[..., i]``: the next token
    when exactly i drafts are accepted (i < k: a residual draw; i == k: the bonus draw)."""

    accept: mx.array  # [..., k] bool
    successors: mx.array  # [..., k+1] int32


def _at(rows: mx.array, tokens: mx.array) -> mx.array:
    """rows [..., k, V], tokens [..., k] -> rows[..., i, tokens[..., i]]."""
    index = tokens.astype(mx.int32)[..., None]
    return mx.take_along_axis(rows, index, axis=-1)[..., 0]


def accept_mask(p: mx.array, q: mx.array, drafts: mx.array, uniforms: mx.array) -> mx.array:
    """``u < min(1, p(d)/q(d))`` per draft, written as ``u * q(d) < p(d)`` (no division; u < 1
    makes the min implicit) and false whenever ``q(d) == 0``."""
    k = drafts.shape[-1]
    p_d = _at(p[..., :k, :], drafts)
    q_d = _at(q, drafts)
    return (q_d > 0) & (uniforms * q_d < p_d)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``normalise(max(0, p_i - q_i))`` for every draft row i, or ``p_i`` where that is all zero."""
    k = q.shape[-2]
    target = p[..., :k, :]
    excess = mx.maximum(target - q, 0.0)
    mass = excess.sum(axis=-1, keepdims=True)
    has_mass = mass > 0
    return mx.where(has_mass, excess / mx.where(has_mass, mass, 1.0), target)


def draw_rows(sampler: DrawSource, probs: mx.array) -> mx.array:
    """One ``draw`` over every row of ``probs`` ``[..., R, V]`` -> ``[..., R]`` int32."""
    flat = probs.reshape(-1, probs.shape[-1])
    return sampler.draw(flat).astype(mx.int32).reshape(probs.shape[:-1])


def speculate(p: mx.array, q: mx.array, drafts: mx.array, sampler: DrawSource) -> Decision:
    """Rejection-sampling decision for one round (or a batch of rounds), lazily.

    RNG order: the acceptance uniforms, then one draw for all residual rows and the bonus row.
    """
    if q.shape[-2] != drafts.shape[-1] or p.shape[-2] != drafts.shape[-1] + 1:
        raise ValueError(f"shapes p {p.shape}, q {q.shape}, drafts {drafts.shape} disagree")
    k = drafts.shape[-1]
    if k == 0:  # a target-only row: plain sampling, no uniforms spent
        return Decision(mx.zeros(drafts.shape, dtype=mx.bool_), draw_rows(sampler, p))
    uniforms = sampler.uniform(tuple(drafts.shape))
    accept = accept_mask(p, q, drafts, uniforms)
    rows = mx.concatenate([residual(p, q), p[..., k:, :]], axis=-2)
    return Decision(accept, draw_rows(sampler, rows))


def greedy_decision(p: mx.array, drafts: mx.array) -> Decision:
    """Greedy verification: accept while the draft equals the target's argmax; the successor
    after i accepted drafts is the target's argmax at row i. Consumes no randomness. ``p`` may
    be the one-hot rows or the (penalised) logits themselves: both have the same argmax."""
    target = mx.argmax(p, axis=-1).astype(mx.int32)
    k = drafts.shape[-1]
    return Decision(drafts.astype(mx.int32) == target[..., :k], target)


def accepted_count(accept: Sequence[bool]) -> int:
    """Length of the leading run of accepted drafts (host side, after the sync)."""
    count = 0
    for ok in accept:
        if not ok:
            break
        count += 1
    return count


def accepted_count_lazy(accept: mx.array) -> mx.array:
    """The same on the device: ``[..., k]`` bool -> ``[...]`` int32."""
    if accept.shape[-1] == 0:
        return mx.zeros(accept.shape[:-1], dtype=mx.int32)
    return mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)
