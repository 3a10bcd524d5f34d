"""The gated delta rule (Gated DeltaNet's recurrence) on MLX: one row at a time, or chunkwise.

Per value head, with a float32 state ``S [Dk, Dv]``, each row t does (transformers'
``torch_recurrent_gated_delta_rule``)::

    S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S = S + k_t delta^T;  y_t = S^T q_t

``q``/``k`` arrive L2-normalised, ``q`` also scaled by ``Dk ** -0.5`` (:func:`normalize_qk`);
``g`` is the log decay (<= 0) and ``beta`` the write strength, per row and value head. Key heads
are shared: value head h reads key head ``h // (Hv // Hk)``.

**Chunkwise (prefill and verify rows).** Rows are cut into chunks of ``chunk``; inside a chunk
the rule is solved in matrix form (the WY / UT form of transformers'
``torch_chunk_gated_delta_rule``): with ``G`` the cumulative log decay from the chunk start
and ``D[i, j] = exp(G_i - G_j)`` for ``j <= i``, the corrected values of all rows satisfy one
unit lower-triangular system ``(I + strict_lower(diag(beta) K K^T * D)) U = beta V -
diag(beta exp(G)) K S0``; the outputs are ``exp(G) Q S0 + (Q K^T * D) U`` and the state at the
chunk end ``exp(G_C) S0 + (exp(G_C - G) K)^T U``. Only the chunks run one after another, so
a forward costs a handful of batched matrix products per chunk instead of a Python step per
row. The triangular inverse is built by block doubling (log2(chunk) rounds of small batched
matrix products: no LAPACK call, so the same code runs on every device and compiles).

**States at boundaries.** The state after any row p of a chunk is
``exp(G_p) S0 + (K * D[p])^T U`` (the rows up to p only), one batched product for any set
of rows: ``states_at`` returns them with the forward, so a k-row verify feed yields the state
after every prefix without a second forward or a per-row loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from runner import native

CHUNK = 64  # rows solved together: more rows, fewer sequential steps but more C^2 work
L2_EPS = 1e-6  # transformers' l2norm: x * rsqrt(sum(x^2) + eps)


def normalize_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    """L2-normalise q and k over their last axis in float32 (transformers' ``l2norm``), q
    also scaled by ``Dk ** -0.5``."""
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    q = q * mx.rsqrt((q * q).sum(axis=-1, keepdims=True) + L2_EPS)
    k = k * mx.rsqrt((k * k).sum(axis=-1, keepdims=True) + L2_EPS)
    return q * (q.shape[-1] ** -0.5), k


def decay_and_beta(
    a: mx.array, b: mx.array, a_log: mx.array, dt_bias: mx.array
) -> tuple[mx.array, mx.array]:
    """``g = -exp(A_log) softplus(a + dt_bias)`` (log decay) and ``beta = sigmoid(b)``, float32."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    g = -mx.exp(a_log.astype(mx.float32)) * nn.softplus(a)
    return g, mx.sigmoid(b.astype(mx.float32))


def _heads_first(x: mx.array, heads: int) -> mx.array:
    """``[B, L, Hk, D]`` -> ``[B, heads, L, D]``, each key head repeated for its value heads."""
    x = x.transpose(0, 2, 1, 3)
    if x.shape[1] != heads:
        x = mx.repeat(x, heads // x.shape[1], axis=1)
    return x


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    *,
    states_at: Sequence[int] = (),
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """Run the rule over L rows.

    ``q``, ``k``: ``[B, L, Hk, Dk]`` (normalised); ``v``: ``[B, L, Hv, Dv]``; ``g``, ``beta``:
    ``[B, L, Hv]``; ``state``: ``[B, Hv, Dk, Dv]`` float32 (None: zeros). Returns the outputs
    ``[B, L, Hv, Dv]`` (float32), the state after the last row, and the state after each of
    the first ``states_at[i]`` rows (``1 <= states_at[i] <= L``, in the order given). One row
    takes the recurrent step; more rows the chunkwise form.
    """
    batch, length, _, dk = k.shape
    heads, dv = v.shape[2], v.shape[3]
    if state is None:
        state = mx.zeros((batch, heads, dk, dv), dtype=mx.float32)
    for r in states_at:
        if not 1 <= r <= length:
            raise ValueError(f"states_at entry {r} is outside 1..{length}")
    q, k = _heads_first(q.astype(mx.float32), heads), _heads_first(k.astype(mx.float32), heads)
    v = v.astype(mx.float32).transpose(0, 2, 1, 3)
    g, beta = g.astype(mx.float32).transpose(0, 2, 1), beta.astype(mx.float32).transpose(0, 2, 1)
    if length == 1:
        y, state = recurrent_step(
            q[:, :, 0], k[:, :, 0], v[:, :, 0], g[..., 0], beta[..., 0], state
        )
        return y[:, None], state, [state for _ in states_at]
    y, state, kept = _chunked(q, k, v, g, beta, state, list(states_at), chunk)
    return y.transpose(0, 2, 1, 3), state, kept


def recurrent_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One row, heads first: ``q``, ``k`` ``[B, H, Dk]``, ``v`` ``[B, H, Dv]``, ``g``, ``beta``
    ``[B, H]``, ``state`` ``[B, H, Dk, Dv]``; returns ``y [B, H, Dv]`` and the new state.

    On the CPU, ``runner.native``'s step: two passes over the state, where these ops take
    several and a temporary of the state each (the state is the step's memory traffic)."""
    if mx.default_device() == mx.cpu and native.delta_available():
        y, state = native.delta_step(q, k, v, g, beta, state)
        return y, state
    return composed_step(q, k, v, g, beta, state)


def composed_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """:func:`recurrent_step` in MLX ops (any device)."""
    state = state * mx.exp(g)[..., None, None]
    remembered = (k[:, :, None, :] @ state)[:, :, 0]  # S^T k
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[:, :, None, :] @ state)[:, :, 0], state


def unit_lower_inverse(n: mx.array) -> mx.array:
    """``(I + N)^-1`` for ``N`` ``[..., C, C]`` strictly lower triangular, by block doubling:
    the inverse of ``[[A, 0], [B, D]]`` is ``[[A^-1, 0], [-D^-1 B A^-1, D^-1]]``, so every round
    doubles the size of the inverted diagonal blocks with two batched products. ``C`` is
    padded to a power of two with identity rows (a block-diagonal extension: the inverse's
    leading block is unchanged)."""
    size = n.shape[-1]
    full = 1 << max(size - 1, 0).bit_length()
    if full != size:
        pad = [(0, 0)] * (n.ndim - 2) + [(0, full - size), (0, full - size)]
        n = mx.pad(n, pad)
    lead = n.shape[:-2]
    inv = mx.ones((*lead, full, 1, 1), dtype=n.dtype)  # the inverses of the 1x1 blocks
    s = 1
    while s < full:
        m = full // (2 * s)
        pairs = inv.reshape(*lead, m, 2, s, s)
        a_inv, d_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        blocks = _diagonal_blocks(n, 2 * s)  # [..., m, 2s, 2s]
        lower = -(d_inv @ blocks[..., s:, :s] @ a_inv)
        top = mx.concatenate([a_inv, mx.zeros_like(a_inv)], axis=-1)
        bottom = mx.concatenate([lower, d_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        s *= 2
    inv = inv.reshape(*lead, full, full)
    return inv[..., :size, :size] if full != size else inv


def _diagonal_blocks(x: mx.array, size: int) -> mx.array:
    """The ``size x size`` blocks on the diagonal of ``x [..., C, C]``: ``[..., C/size, size,
    size]``."""
    lead, count = x.shape[:-2], x.shape[-1] // size
    grid = x.reshape(*lead, count, size, count, size)
    blocks = mx.diagonal(grid, axis1=-4, axis2=-2)  # [..., size, size, count]
    return mx.moveaxis(blocks, -1, -3)


class _ChunkTerms(NamedTuple):
    """What each chunk's sequential step reads, computed for every chunk at once (module
    docstring), ``[B, H, N, C, ...]`` for N chunks of C rows."""

    cum: mx.array  # G: log decay from the chunk start through each row
    decay: mx.array  # D, zero above the diagonal
    values: mx.array  # U before the initial state's share
    from_state: mx.array  # ... and that share's keys
    read: mx.array  # q decayed from the chunk start
    write: mx.array  # k decayed to the chunk end
    inner: mx.array  # the chunk's own causal scores, decayed
    chunk_decay: mx.array  # the decay across each whole chunk, [B, H, N, 1, 1]


def _in_chunks(xs: tuple[mx.array, ...], count: int, size: int, pad: int) -> tuple[mx.array, ...]:
    """``q, k, v`` ``[B, H, L, D]`` and ``g, beta`` ``[B, H, L]`` as ``count`` chunks of
    ``size`` rows, ``pad`` rows appended: padded rows write nothing (beta = 0, k = 0) and do
    not decay (g = 0)."""
    q, k, v, g, beta = xs
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    batch, heads = k.shape[:2]
    q, k, v = (x.reshape(batch, heads, count, size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, count, size) for x in (g, beta))
    return q, k, v, g, beta


def _chunk_terms(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> _ChunkTerms:
    """The per-chunk matrices of the chunkwise form, from chunked ``q, k, v, g, beta``."""
    size = g.shape[-1]
    cum = mx.cumsum(g, axis=-1)
    rows = mx.arange(size)
    causal = rows[:, None] >= rows[None, :]
    gap = cum[..., :, None] - cum[..., None, :]
    decay = mx.where(causal, mx.exp(mx.where(causal, gap, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    strict = rows[:, None] > rows[None, :]
    system = mx.where(strict, (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    inverse = unit_lower_inverse(system)
    return _ChunkTerms(
        cum=cum,
        decay=decay,
        values=inverse @ (v * beta[..., None]),
        from_state=inverse @ (k_beta * mx.exp(cum)[..., None]),
        read=q * mx.exp(cum)[..., None],
        write=k * mx.exp(cum[..., -1:] - cum)[..., None],
        inner=(q @ k.swapaxes(-1, -2)) * decay,
        chunk_decay=mx.exp(cum[..., -1])[..., None, None],
    )


def _states_in_chunk(
    terms: _ChunkTerms, k: mx.array, c: int, at: mx.array, state: mx.array, corrected: mx.array
) -> mx.array:
    """The states after rows ``at`` of chunk ``c`` (``[B, H, P, Dk, Dv]``), from the state at
    the chunk's start and the chunk's corrected values ``U``: ``exp(G_p) S0 + (K * D[p])^T U``."""
    weights = terms.decay[:, :, c][:, :, at]  # [B, H, P, C]: rows up to p, decayed to p
    keys = weights[..., None] * k[:, :, c][:, :, None]  # [B, H, P, C, Dk]
    start = mx.exp(terms.cum[:, :, c][:, :, at])[..., None, None]
    return start * state[:, :, None] + keys.swapaxes(-1, -2) @ corrected[:, :, None]


def _chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    states_at: list[int],
    chunk: int,
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """Heads-first chunkwise form (module docstring): ``q``, ``k`` ``[B, H, L, Dk]``, ``v``
    ``[B, H, L, Dv]``, ``g``, ``beta`` ``[B, H, L]``."""
    length = k.shape[2]
    size = min(chunk, length)
    count = -(-length // size)
    pad = count * size - length
    q, k, v, g, beta = _in_chunks((q, k, v, g, beta), count, size, pad)
    terms = _chunk_terms(q, k, v, g, beta)

    wanted: dict[int, list[int]] = {}
    for i, r in enumerate(states_at):
        wanted.setdefault((r - 1) // size, []).append(i)
    kept: list[mx.array | None] = [None] * len(states_at)
    outputs = []
    for c in range(count):
        corrected = terms.values[:, :, c] - terms.from_state[:, :, c] @ state  # U
        outputs.append(terms.read[:, :, c] @ state + terms.inner[:, :, c] @ corrected)
        if c in wanted:
            picks = wanted[c]
            at = mx.array([(states_at[i] - 1) % size for i in picks])
            states = _states_in_chunk(terms, k, c, at, state, corrected)
            for j, i in enumerate(picks):
                kept[i] = states[:, :, j]
        write = terms.write[:, :, c].swapaxes(-1, -2)
        state = state * terms.chunk_decay[:, :, c] + write @ corrected
    y = mx.concatenate(outputs, axis=2)
    if pad:
        y = y[:, :, :length]
    return y, state, kept
