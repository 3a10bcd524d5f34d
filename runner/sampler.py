"""Per-request token sampler: penalties, filters, draws and the processed distributions.

Everything stays on the MLX device as lazy arrays until the caller reads a token; nothing here
loops over the vocabulary in Python or syncs with the host.

Pipeline per row: penalties (over the last ``repeat_last_n`` tokens) -> top-k -> temperature ->
top-p -> min-p -> renormalise -> draw. Edge values and ties, exactly:

- penalties: repeat divides positive logits and multiplies negative ones (zero stays zero);
  presence subtracts once per distinct token in the window; frequency subtracts once per
  occurrence. ``repeat_penalty <= 0`` counts as 1 (off). The window starts with the request's
  history (prompt) and slides over appended tokens.
- top-k (``0 < top_k < vocab``): keeps exactly the k largest logits; among tokens tied at the
  k-th value the lower ids win (a stable descending sort, cut at k). -0.0 ranks as 0.0.
- temperature: divides the logits; ``temperature <= 0`` is greedy (below).
- top-p (``0 < top_p < 1``): sorted by probability, a token is kept when the mass of the tokens
  strictly before it is < top_p (the smallest prefix reaching top_p; the top token always
  stays); tokens tied with the last kept probability are kept too. With top-k active only
  the k kept tokens are sorted.
- min-p (``min_p > 0``): drops tokens with probability < min_p * max probability; values >= 1
  keep only the most probable token(s).
- draw: Gumbel-max, ``argmax(log p + G)`` over the kept tokens, where ``G`` is standard Gumbel
  noise keyed by the request's seed and the *slot* (cache position) the token will occupy, and
  by the token id: the same (seed, slot, id) always gets the same noise, whatever was drawn
  before, whichever rows share the call and whoever asks (the target's verify rows and the
  draft head draw with the same noise, which is what makes speculation invisible in seeded
  output; see ``drafting.accept``). A zero-probability token is never drawn.
- greedy: the first (lowest id) argmax of the penalised logits; no noise.
- a row with no finite mass (all -inf, or NaN) draws token 0 (with top-k: its lowest kept id)
  rather than raising.

Unseeded requests take a random seed from ``os.urandom`` at the start and then work the same
way; MLX's global RNG is never used.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from drafting.columns import Columns
from runner import native

_U64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN64) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def slot_keys(seed: int, first_slot: int, rows: int) -> mx.array:
    """[rows, 2] uint32 noise keys of slots ``first_slot ..`` under ``seed`` (host-side)."""
    keys = []
    for slot in range(first_slot, first_slot + rows):
        h = _splitmix64(_splitmix64(seed & _U64) ^ (slot & _U64))
        keys.append([h & 0xFFFFFFFF, h >> 32])
    return mx.array(keys, dtype=mx.uint32)


def _mix32(x: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser (a bijection that mixes every bit)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, dtype=mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return x ^ (x >> 16)


def exponential_noise(keys: mx.array, ids: mx.array) -> mx.array:
    """Standard exponential noise [R, N] for token ``ids`` [R, N] (or [N]) under ``keys``
    [R, 2]: a counter-based hash of (key, id), so any subset of a row's tokens costs only its
    size and gets the values the whole row would."""
    x = ids.astype(mx.uint32) * mx.array(0x9E3779B1, dtype=mx.uint32)
    x = _mix32(x ^ keys[:, :1])
    x = _mix32(x ^ keys[:, 1:])
    # 23 bits: (n + 0.5) / 2**23 is exact in float32, so u stays strictly inside (0, 1).
    u = ((x >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
    return -mx.log(u)


def gumbel_noise(keys: mx.array, ids: mx.array) -> mx.array:
    """Standard Gumbel noise, ``-log`` of :func:`exponential_noise`."""
    return -mx.log(exponential_noise(keys, ids))


def _gumbel_pick(probs: mx.array, ids: mx.array | None, keys: mx.array) -> mx.array:
    """The Gumbel-max draw ``argmax(log p + G)`` per row [R] int32, in token ids (``ids``:
    sparse top-k rows), computed as the equal ``argmin(E / p)`` with ``E = exp(G)`` exponential
    noise: one logarithm per token instead of three."""
    columns = ids if ids is not None else mx.arange(probs.shape[-1], dtype=mx.int32)
    pick = mx.argmin(exponential_noise(keys, columns) / probs, axis=-1).astype(mx.int32)
    if ids is None:
        return pick
    return mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(mx.int32)


_pick_dense = mx.compile(lambda probs, keys: _gumbel_pick(probs, None, keys))
_pick_sparse = mx.compile(_gumbel_pick)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options with Ollama's names and defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _as_tokens(token) -> mx.array:
    """A python int, sequence or (lazy) array of token ids as a flat int32 array."""
    if isinstance(token, mx.array):
        return token.reshape(-1).astype(mx.int32)
    if hasattr(token, "__iter__"):
        return mx.array([int(t) for t in token], dtype=mx.int32).reshape(-1)
    return mx.array([int(token)], dtype=mx.int32)


def _rank_key(logits: mx.array) -> mx.array:
    """An int64 key ordering logits by value, ties toward the lower id (for argpartition).

    The float bits become an order-preserving int (negatives flipped), shifted above a
    descending id so equal values rank by id. Adding 0.0 turns -0.0 into 0.0.
    """
    bits = mx.view(logits + 0.0, mx.int32)
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)
    ids = mx.arange(logits.shape[-1], dtype=mx.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def _top_k_ids(logits: mx.array, k: int) -> mx.array:
    """The ids (uint32 [R, k], ascending) of each row's k largest logits by ``_rank_key``:
    ``runner.native``'s one pass over the row where it is built (the same array), else the
    rank key's argpartition and a sort, which move the whole row."""
    if native.top_k_ids_available() and logits.dtype == mx.float32:
        return native.top_k_ids(logits, k)
    v = logits.shape[-1]
    ranked = mx.argpartition(_rank_key(logits), kth=v - k, axis=-1)
    return mx.sort(ranked[:, v - k :], axis=-1)


def _argmax(rows: mx.array) -> mx.array:
    """The first (lowest id) argmax of each row of ``rows`` [R, V] as int32 [R] (a NaN wins, as
    in ``mx.argmax``): ``runner.native``'s vector passes where it is built (the same ids),
    else ``mx.argmax``, which compares value by value, one row after another."""
    if native.argmax_ids_available() and rows.dtype == mx.float32 and rows.ndim == 2:
        return native.argmax_ids(rows)
    return mx.argmax(rows, axis=-1).astype(mx.int32)


def filter_rows(
    logits: mx.array, top_k: int, top_p: float, min_p: float, temperature: float
) -> tuple[mx.array, mx.array | None]:
    """Top-k, temperature, top-p, min-p and renormalisation of penalised logits [R, V] (the
    module docstring's rules; ``top_k``/``top_p``/``min_p`` 0 = off): (probabilities [R, N],
    ids [R, N] in ascending order with top-k, else None and N = V)."""
    ids = None
    if top_k:
        ids = _top_k_ids(logits, top_k)
        logits = mx.take_along_axis(logits, ids, axis=-1)
    probs = mx.softmax(logits / temperature, axis=-1)
    if top_p:
        ordered = -mx.sort(-probs, axis=-1)
        before = mx.cumsum(ordered, axis=-1, inclusive=False)
        kept = (before < top_p).sum(axis=-1, keepdims=True)
        floor = mx.take_along_axis(ordered, kept - 1, axis=-1)
        probs = mx.where(probs >= floor, probs, 0.0)
    if min_p:
        floor = min_p * probs.max(axis=-1, keepdims=True)
        probs = mx.where(probs >= floor, probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True), ids


@functools.lru_cache(maxsize=64)
def _compiled_filter(top_k: int, top_p: float, min_p: float, temperature: float):
    """``filter_rows`` compiled for one setting (traced once per row count): its ~25 small ops
    run as one graph instead of one dispatch each, most of a sampled step's overhead over a
    greedy one. Plain sampling, the draft head and the verify rows share it, so each draws
    from bit-for-bit the distribution :meth:`Sampler.distributions` reports."""

    def run(logits: mx.array) -> tuple[mx.array, ...]:
        probs, ids = filter_rows(logits, top_k, top_p, min_p, temperature)
        return (probs,) if ids is None else (probs, ids)

    return mx.compile(run)


class Sampler:
    """Samples the tokens of one request; see the module docstring for the exact rules."""

    def __init__(
        self,
        params: SamplingParams,
        history: Sequence[int],
        vocab_size: int,
        context_length: int,
    ) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)
        self.greedy = params.greedy
        v = self.vocab_size
        self._temperature = float(params.temperature)
        self._top_k = int(params.top_k) if 0 < params.top_k < v else 0
        self._top_p = float(params.top_p) if 0 < params.top_p < 1 else 0.0
        self._min_p = min(float(params.min_p), 1.0) if params.min_p > 0 else 0.0
        self._filter_fn = None  # the compiled filter, bound at first use (never when greedy)
        # The compiled filters of rows over a draft vocabulary's columns, by their top-k (a
        # compiled function made anew per draw would be traced anew per draw).
        self._column_filters: dict[int, object] = {}
        self._repeat = float(params.repeat_penalty) if params.repeat_penalty > 0 else 1.0
        self._presence = float(params.presence_penalty)
        self._frequency = float(params.frequency_penalty)
        window = max(int(context_length), 1) if params.repeat_last_n < 0 else params.repeat_last_n
        penalised = self._repeat != 1.0 or self._presence != 0.0 or self._frequency != 0.0
        self._window = int(window) if window > 0 and penalised else 0
        # The window is a fixed-length int32 array, oldest first; id == vocab_size pads the
        # front while the history is shorter than the window (it counts into a dropped slot).
        if self._window:
            recent = [int(t) for t in list(history)[-self._window :]]
            padded = [v] * (self._window - len(recent)) + recent
            self._history = mx.array(padded, dtype=mx.int32)
        else:
            self._history = None
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = int(seed) & _U64

    @property
    def penalises(self) -> bool:
        """Some penalty rewrites logits (so a greedy pick is not the raw argmax)."""
        return self._window > 0

    # -- history --------------------------------------------------------------------------

    def append(self, token) -> None:
        """Extend the penalty history by one token or a 1-D run (ints or lazy arrays)."""
        if self._window == 0:
            return
        joined = mx.concatenate([self._history, _as_tokens(token)])
        self._history = joined[-self._window :]

    def _windows(self, rows: int, chain) -> mx.array:
        """[rows, W] penalty windows ([1, W] when every row sees the history alone).

        With a chain of L tokens, row i sees history + chain[:L - rows + 1 + i]: verification
        (L = rows - 1) gives row i the first i drafts, and a single draft step (rows = 1) sees
        the whole chain drafted so far. Without a chain every row sees the history alone
        (independent rows of one context).
        """
        if chain is None:
            return self._history[None]
        extra = _as_tokens(chain)
        length = extra.shape[0]
        if length < rows - 1:
            raise ValueError(f"chain has {length} tokens, {rows} rows need at least {rows - 1}")
        if length == 0:
            return self._history[None]
        full = mx.concatenate([self._history, extra])
        first = length - rows + 1
        index = mx.arange(self._window)[None, :] + (first + mx.arange(rows))[:, None]
        return full[index]

    # -- the pipeline ---------------------------------------------------------------------

    def _penalise(self, logits: mx.array, chain, columns: Columns | None = None) -> mx.array:
        """Apply the penalties by rewriting only the logits of tokens in each row's window
        (with ``columns``, rows in their ascending order: the window's ids mapped to them)."""
        if self._window == 0:
            return logits
        rows, v = logits.shape
        windows = self._windows(rows, chain)
        if columns is not None:  # ids past the table (none in a consistent model) drop too
            windows = columns.inverse[mx.minimum(windows, columns.inverse.shape[0] - 1)]
        if native.penalise_rows_available() and logits.dtype == mx.float32:
            # The same float32 operations on the same values, one copy of each row.
            return native.penalise_rows(
                logits, windows.astype(mx.int32), self._repeat, self._presence, self._frequency
            )
        return self._penalise_ops(logits, windows)

    def _penalise_ops(self, logits: mx.array, windows: mx.array) -> mx.array:
        """:meth:`_penalise` in MLX ops (without the native module, and its reference)."""
        rows, v = logits.shape
        # Flat positions in a [rows, v + 1] layout: column v of each row absorbs the padding.
        flat = (windows + mx.arange(rows, dtype=mx.int32)[:, None] * (v + 1)).reshape(-1)
        counts = mx.zeros((rows * (v + 1),), dtype=mx.float32).at[flat].add(1.0)
        padded = mx.concatenate([logits, mx.zeros((rows, 1), dtype=logits.dtype)], axis=1)
        padded = padded.reshape(-1)
        old = padded[flat]
        new = old
        if self._repeat != 1.0:
            new = mx.where(old > 0, old / self._repeat, old * self._repeat)
        if self._presence != 0.0:
            new = new - self._presence
        if self._frequency != 0.0:
            new = new - self._frequency * counts[flat]
        # A token repeated in the window writes the same value at every copy.
        padded[flat] = new
        return padded.reshape(rows, v + 1)[:, :v]

    def _filter(
        self, logits: mx.array, columns: Columns | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Penalised logits [R, V] -> (renormalised probabilities [R, N], ids [R, N] or None).

        With top-k the rows are sparse: N = k entries in ascending id order; otherwise the
        rows are dense over the vocabulary (ids None). Runs compiled (see ``_compiled_filter``).
        With ``columns`` the rows are theirs in ascending order and ids are token ids.
        """
        if columns is None:
            if self._filter_fn is None:
                self._filter_fn = _compiled_filter(
                    self._top_k, self._top_p, self._min_p, self._temperature
                )
            out = self._filter_fn(logits)
            return out[0], (out[1] if len(out) > 1 else None)
        top_k = self._top_k if self._top_k < columns.count else 0
        fn = self._column_filters.get(top_k)
        if fn is None:
            fn = _compiled_filter(top_k, self._top_p, self._min_p, self._temperature)
            self._column_filters[top_k] = fn
        out = fn(logits)
        if len(out) == 1:
            return out[0], mx.broadcast_to(columns.ids, out[0].shape)
        return out[0], columns.ids[out[1]]

    def _dense(self, probs: mx.array, ids: mx.array | None) -> mx.array:
        if ids is None:
            return probs
        zeros = mx.zeros((probs.shape[0], self.vocab_size), dtype=mx.float32)
        return mx.put_along_axis(zeros, ids, probs, axis=-1)

    @staticmethod
    def _rows(logits: mx.array) -> mx.array:
        return logits.reshape(-1, logits.shape[-1]).astype(mx.float32)

    def _one_hot(self, index: mx.array) -> mx.array:
        return (mx.arange(self.vocab_size)[None, :] == index[:, None]).astype(mx.float32)

    # -- public draws ---------------------------------------------------------------------

    def penalised(self, logits: mx.array, chain=None) -> mx.array:
        """Raw logits [R, V] -> penalised logits [R, V] float32 (row i sees ``chain[:i]``)."""
        return self._penalise(self._rows(logits), chain)

    def sample(self, logits: mx.array, slot: int) -> mx.array:
        """Raw logits [V] or [1, V] -> lazy int32 token (scalar or [1]) for cache slot ``slot``."""
        return self.tokens(logits, None, slot=slot).reshape(logits.shape[:-1])

    def tokens(
        self, logits: mx.array, chain=None, *, slot: int, columns: Columns | None = None
    ) -> mx.array:
        """Raw logits [R, V] -> the R drawn tokens [R] int32 (lazy), row i's for cache slot
        ``slot + i`` and penalised as in :meth:`distributions` (with a chain, verification's
        alignment; without one, every row sees the history alone). Greedy: the penalised
        argmax. ``columns``: the rows hold those tokens only (:class:`Columns`; a row with
        no finite value gives the lowest of them, where a full row would give token 0)."""
        rows = self._rows(logits)
        if columns is not None and self.greedy and not self._window:
            # The lowest id among the row's maxima, read where the columns lie: no reorder.
            top = mx.where(
                rows == rows.max(axis=-1, keepdims=True), columns.listed, columns.vocab_size
            )
            return top.min(axis=-1).astype(mx.int32)
        if columns is not None:
            rows = mx.take(rows, columns.order, axis=-1)
        penalised = self._penalise(rows, chain, columns)
        if self.greedy:
            pick = _argmax(penalised)
            return pick if columns is None else columns.ids[pick]
        probs, ids = self._filter(penalised, columns)
        keys = slot_keys(self.seed, slot, rows.shape[0])
        return _pick_dense(probs, keys) if ids is None else _pick_sparse(probs, ids, keys)

    def distributions(self, logits: mx.array, chain=None) -> mx.array:
        """Raw logits [R, V] -> processed probabilities [R, V] float32.

        Rows are aligned to the end of ``chain`` (ints or an int32 array, possibly lazy): with
        R - 1 tokens, row i sees the history and ``chain[:i]``; with more, a single row sees
        them all; without a chain, every row the history alone. Greedy gives a one-hot row at
        the penalised argmax.
        """
        rows = self._rows(logits)
        penalised = self._penalise(rows, chain)
        if self.greedy:
            return self._one_hot(_argmax(penalised))
        return self._dense(*self._filter(penalised))

    def logprobs(self, logits: mx.array, token, top_n: int) -> tuple[mx.array, mx.array, mx.array]:
        """Log-softmax of the raw logits: (chosen logprob, top_n ids, top_n logprobs), lazy.

        The top list is sorted by descending logprob; ``top_n`` is clamped to [0, vocab].
        """
        chosen, ids, values = self.logprob_rows(logits.reshape(1, -1), token, top_n)
        return chosen[0], ids[0], values[0]

    @staticmethod
    def logprob_rows(logits: mx.array, tokens, top_n: int) -> tuple[mx.array, mx.array, mx.array]:
        """:meth:`logprobs` for every row of ``logits [R, V]`` with ``tokens [R]`` the chosen
        ids: ``[R]``, ``[R, n]``, ``[R, n]``, lazy (a verify feed's rows in one go)."""
        rows = logits.astype(mx.float32)
        logp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logp, _as_tokens(tokens)[:, None], axis=-1)[:, 0]
        vocab = rows.shape[-1]
        n = max(0, min(int(top_n), vocab))
        if n == 0:
            empty = (rows.shape[0], 0)
            return chosen, mx.zeros(empty, dtype=mx.int32), mx.zeros(empty, dtype=mx.float32)
        top = mx.argpartition(logp, kth=vocab - n, axis=-1)[:, vocab - n :]
        values = mx.take_along_axis(logp, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        ids = mx.take_along_axis(top, order, axis=-1).astype(mx.int32)
        return chosen, ids, mx.take_along_axis(values, order, axis=-1)
