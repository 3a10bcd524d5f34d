"""Prefill in chunks and the pipelined plain decoder.

The plain decoder keeps one forward in flight: the forward that feeds token n is dispatched
(``mx.async_eval``) before token n is read on the host, so detokenizing, frame writing and
Python overhead overlap the model. Token n's own successor is the next in-flight result.

Ledgers: a token is *fed* when its forward is dispatched; its effects are *reported*
(penalty history, draft session) and it is *committed* in the request's ``cache.ledger.Ledger``
only once it is known to stay. An EOS dispatched before it was read is rewound away.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from cache.ledger import Ledger, Outcome
from runner import blas
from runner.constraint import masked
from runner.models.attention import between_blocks

# Called with (tokens [L] int32 array, hiddens [L, D], position of tokens[0]) for every run of
# tokens whose state the target caches keep: the draft session's `committed`.
CommitHook = Callable[[mx.array, mx.array, int], None]


class Cancelled(Exception):
    """Raised by ``prefill`` when the request was cancelled; ``args[0]`` is the offset the
    caches were left at (the end of the last whole chunk)."""


class _CancelledInChunk(Exception):
    """A cancel seen between the layers of a chunk (``_LayerPoll``): the chunk is rewound."""


# Chunks of at least this many rows are evaluated piecewise with a cancel poll after each
# layer and each query block of its attention, so a cancel lands within about one block's or
# one layer's linear products' time instead of a whole chunk's. Shorter chunks are polled
# only ahead of each chunk (one call of ``cancelled`` per chunk).
POLL_ROWS = 64
# While a prefill runs MLX may keep this many bytes of freed buffers for reuse (its default
# is small on the CPU): the blocked attention's score tiles have fixed shapes, and a buffer
# handed back to the system comes back as fresh pages to fault in on the next tile. The old
# limit returns when prefill ends; the engine clears the cache after every request.
PREFILL_BUFFER_CACHE = 1 << 30


def chunk_ends(start: int, end: int, chunk: int) -> list[int]:
    """Absolute offsets where prefill chunks of at most ``chunk`` tokens end.

    Chunks need not end at prefix-cache snapshot points: KV snapshots are ranges of the live
    buffers, taken when the request closes."""
    return [*range(start + chunk, end, chunk), end]


def dispatch_layer(index: int, x: mx.array) -> None:
    """``on_layer`` hook of a decode forward: start evaluating each layer as soon as its graph
    is built. MLX lets only a bounded number of tasks be in flight, so one ``async_eval`` at
    the end of a forward waits while most of it computes, and the graph of the next layers is
    built after the previous ones ran; dispatching layer by layer overlaps building with
    computing (the values are the same: only when they are computed changes)."""
    mx.async_eval(x)


def takes_layer_hook(model) -> bool:
    """Whether ``model.hidden`` accepts ``on_layer`` (``runner.models.llama.Model.hidden``):
    such models are evaluated and polled layer by layer inside long chunks, and a chunk
    cancelled there is rewound, so their caches must rewind to any offset of the last feed
    (``KVCache``, ``RotatingKVCache``)."""
    try:
        return "on_layer" in inspect.signature(model.hidden).parameters
    except (TypeError, ValueError):
        return False


class ThreadChoice:
    """Whether prefill layers run the BLAS on every core (``blas.wide``) or on the decode
    count, chosen by timing, process-wide.

    Every core speeds the attention products when the other cores are free; but each product
    is a fork-join, and while another process holds a core every product waits for that
    core's scheduler slice, which on a shared machine makes a layer several times slower than
    on one thread. The layers of one chunk do the same work, so now and then a chunk runs one
    layer (``PROBE_LAYER``) the other way: a probe faster than ``MARGIN`` times the chunk's
    median layer switches the choice (and the next chunk probes again), one that is not
    doubles the interval to the next probe, up to ``MAX_INTERVAL`` chunks. Both ways compute
    the same bits (oneMKL's products here do not depend on the thread count; a test checks
    it), so the choice moves speed only. Only where the runner sets MKL's thread counts."""

    PROBE_LAYER = 1
    MARGIN = 0.85
    MAX_INTERVAL = 16

    def __init__(self) -> None:
        self.wide = True
        self.interval = 1
        self.countdown = 1  # chunks until the next probe

    def next_probe(self, layers: int) -> int | None:
        """The layer of the next chunk that runs the other way, or None."""
        counts = blas.thread_counts()
        if counts is None or counts[0] == counts[1] or layers <= self.PROBE_LAYER + 1:
            return None
        self.countdown -= 1
        return self.PROBE_LAYER if self.countdown <= 0 else None

    def settle(self, probe: float, others: Sequence[float]) -> None:
        """Record a probe's seconds against the seconds of the chunk's other layers."""
        if probe < self.MARGIN * statistics.median(others):
            self.wide = not self.wide
            self.interval = 1
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)
        self.countdown = self.interval


THREADS = ThreadChoice()


class _LayerPoll:
    """``on_layer`` hook of one chunk, a context for its forward: evaluates every layer (and
    every query block of a blocked attention, ``attention.between_blocks``) as soon as it is
    built, polls for a cancel after each, times the layers, and runs each wide or not as
    ``THREADS`` says (layer ``probe`` the other way)."""

    def __init__(self, caches: list, cancelled: Callable[[], bool], probe: int | None) -> None:
        self.caches = caches
        self.cancelled = cancelled
        self.probe = probe
        self.seconds: list[float] = []
        self._threads = contextlib.ExitStack()  # holds blas.wide() while a layer runs wide
        self._wide = False
        self._mark = 0.0

    def __enter__(self) -> _LayerPoll:
        self._threads_for(0)
        self._mark = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._threads.close()
        self._wide = False

    def _threads_for(self, layer: int) -> None:
        wide = THREADS.wide != (layer == self.probe)
        if wide and not self._wide:
            self._threads.enter_context(blas.wide())
        elif self._wide and not wide:
            self._threads.close()
        self._wide = wide

    def _poll(self) -> None:
        if self.cancelled():
            raise _CancelledInChunk

    def block(self, out: mx.array) -> None:
        """Between two query blocks of a layer's attention."""
        mx.eval(out)
        self._poll()

    def __call__(self, index: int, x: mx.array) -> None:
        mx.eval(x, self.caches[index].state)
        now = time.perf_counter()
        self.seconds.append(now - self._mark)
        self._mark = now
        self._poll()
        self._threads_for(index + 1)

    def settle(self) -> None:
        if self.probe is not None and len(self.seconds) > self.probe + 1:
            others = self.seconds[: self.probe] + self.seconds[self.probe + 1 :]
            THREADS.settle(self.seconds[self.probe], others)


@contextlib.contextmanager
def _buffer_cache(limit: int) -> Iterator[None]:
    """MLX's buffer-cache limit raised to ``limit`` (never lowered) for the block."""
    previous = mx.set_cache_limit(limit)
    if previous > limit:
        mx.set_cache_limit(previous)
    try:
        yield
    finally:
        mx.set_cache_limit(previous)


def prefill(
    model,
    caches: list,
    tokens: Sequence[int],
    position: int,
    *,
    chunk: int = 512,
    cancelled: Callable[[], bool] = lambda: False,
    on_commit: CommitHook | None = None,
) -> int:
    """Evaluate ``tokens`` (starting at cache offset ``position``) in chunks of ``chunk``;
    return the new offset. Cancellation is checked before each chunk and, in chunks of
    ``POLL_ROWS`` rows or more of a model that takes a layer hook, after each layer and between
    the query blocks of its blocked attention (``runner.models.attention``). A cancelled
    prefill raises ``Cancelled`` and keeps the chunks it finished: a chunk cancelled inside is
    rewound, so every cache rests at the end of the last whole chunk, and ``on_commit`` only
    ever sees whole chunks."""
    start = position
    if not tokens:
        return start
    layered = takes_layer_hook(model)
    with _buffer_cache(PREFILL_BUFFER_CACHE):
        for end in chunk_ends(position, position + len(tokens), chunk):
            if cancelled():
                raise Cancelled(start)
            ids = mx.array(tokens[start - position : end - position], dtype=mx.int32)
            try:
                if layered and end - start >= POLL_ROWS:
                    poll = _LayerPoll(caches, cancelled, THREADS.next_probe(len(caches)))
                    with poll, between_blocks(poll.block):
                        hidden = model.hidden(ids[None], caches, on_layer=poll)
                    mx.eval(hidden, [c.state for c in caches])
                    poll.settle()
                else:
                    with blas.wide() if THREADS.wide else contextlib.nullcontext():
                        hidden = model.hidden(ids[None], caches)
                        mx.eval(hidden, [c.state for c in caches])
            except _CancelledInChunk:
                for c in caches:  # the layers evaluated so far appended this chunk
                    if c.offset > start:
                        c.rewind(start)
                raise Cancelled(start) from None
            if on_commit is not None:
                on_commit(ids, hidden[0], start)
            start = end
    return start


@dataclass
class Sampled:
    """One sampled token, still lazy until :meth:`PlainDecoder.read`."""

    token: mx.array  # int32 [1]
    logprobs: tuple | None  # (chosen, top ids, top logprobs) lazy, when asked
    fed_hidden: mx.array | None = None  # hidden row of the token whose forward produced this
    fed_token: mx.array | None = None
    fed_position: int = -1


class PlainDecoder:
    """One forward per token, always one in flight.

    ``start(seed)`` feeds the seed (the last prompt token) and returns the in-flight sample for
    the first generated token. ``advance(sampled)`` dispatches the forward that feeds
    ``sampled`` and returns the next in-flight sample; the caller then reads ``sampled`` with
    ``read``. A token's forward is reported to ``on_commit`` only through ``commit`` once the
    caller knows the token stays in the caches.
    """

    def __init__(
        self,
        model,
        caches: list,
        sampler,
        *,
        top_logprobs: int | None = None,
        on_commit: CommitHook | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sampler = sampler
        self.top_logprobs = top_logprobs
        self.on_commit = on_commit
        self.forwards = 0
        self._layer_hook = {"on_layer": dispatch_layer} if takes_layer_hook(model) else {}

    @property
    def position(self) -> int:
        """The slot the next fed token occupies (the caches' offset)."""
        return self.caches[0].offset

    def _feed(self, tokens: mx.array, append: bool) -> Sampled:
        """Dispatch one forward over ``tokens`` and the sample of the token after them."""
        tokens, position = self.row_feed(tokens, append)
        hidden = self.model.hidden(tokens[None], self.caches, **self._layer_hook)
        sampled = self.row_sample(tokens, hidden[0], self.model.unembed(hidden[:, -1])[0], position)
        mx.async_eval(sampled.token, hidden, *(sampled.logprobs or ()), self.cache_state())
        return sampled

    def cache_state(self) -> list:
        """What to evaluate with a step so no lazy graph accumulates across steps."""
        return [c.state for c in self.caches]

    # A forward shared with other requests (``runner.batch``) feeds a token in two parts:
    # ``row_feed`` before it, ``row_sample`` on this request's rows of its output.
    def row_feed(self, tokens: mx.array, append: bool) -> tuple[mx.array, int]:
        """Record ``tokens`` as fed (``append``: generated ones, into the penalty history);
        returns them as int32 ``[L]`` and the position of the first."""
        tokens = tokens.reshape(-1).astype(mx.int32)
        if append:
            self.sampler.append(tokens)
        self._append = append
        return tokens, self.position

    def row_sample(
        self, tokens: mx.array, hidden: mx.array, logits: mx.array, position: int
    ) -> Sampled:
        """The sample after ``tokens`` fed at ``position`` (lazy): ``hidden`` ``[L, D]`` their
        hidden rows, ``logits`` ``[V]`` the last row's."""
        logits = self._constrain(logits, hidden, self._append)
        nxt = self.sampler.sample(logits, slot=position + tokens.shape[0]).reshape(1)
        lp = None
        if self.top_logprobs is not None:
            lp = self.sampler.logprobs(logits, nxt, self.top_logprobs)
        self.forwards += 1
        return Sampled(nxt, lp, hidden, tokens, position)

    def _constrain(self, logits: mx.array, hidden: mx.array, emitted: bool) -> mx.array:
        """The logits the next token is sampled from (unconstrained: as they are);
        ``emitted``: the fed tokens are generated ones (not the prompt's seed)."""
        return logits

    def start(self, seed: int) -> Sampled:
        """Feed the decode seed (already in the penalty history as part of the prompt)."""
        return self._feed(mx.array([seed], dtype=mx.int32), append=False)

    def advance(self, sampled: Sampled) -> Sampled:
        """Dispatch the forward feeding ``sampled`` (still lazy); return its successor."""
        return self._feed(sampled.token, append=True)

    def feed_forced(self, tokens: Sequence[int]) -> Sampled:
        """Feed tokens the runner inserts itself (a forced ``</think>``); return the successor."""
        return self._feed(mx.array(list(tokens), dtype=mx.int32), append=True)

    @staticmethod
    def read(sampled: Sampled) -> int:
        return int(sampled.token.item())

    def commit(self, successor: Sampled) -> None:
        """Report the forward that produced ``successor`` (its fed tokens stay in the caches)."""
        if self.on_commit is not None and successor.fed_hidden is not None:
            self.on_commit(successor.fed_token, successor.fed_hidden, successor.fed_position)

    def unfeed(self, successor: Sampled) -> None:
        """Drop the tokens fed by the forward that produced ``successor`` from the caches
        (e.g. an EOS that was dispatched before it was read). An offset move, no copy."""
        n = int(successor.fed_token.shape[0])
        for c in self.caches:
            c.rewind(c.offset - n)


class ConstrainedDecoder(PlainDecoder):
    """A :class:`PlainDecoder` whose every sample obeys a grammar (``runner.constraint``).

    The forward feeding a token is dispatched first; then the token itself is read (it was
    sampled by the previous step), the matcher consumes it and computes the next mask on the
    CPU while that forward runs, and the sample is taken from the masked logits. The token is
    read from the array the previous step evaluated, never from a new node, which would queue
    behind the forward just dispatched and leave the stream idle while the mask is computed.
    """

    def __init__(self, *args, constraint, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.constraint = constraint
        self._emitted: mx.array | None = None

    def row_feed(self, tokens: mx.array, append: bool) -> tuple[mx.array, int]:
        if append:
            self._emitted = tokens
        return super().row_feed(tokens, append)

    def _constrain(self, logits: mx.array, hidden: mx.array, emitted: bool) -> mx.array:
        mx.async_eval(logits, hidden, self.cache_state())
        if emitted:  # generated tokens the grammar has not seen (the seed is the prompt's)
            for token in self._emitted.tolist():
                self.constraint.consume(int(token))
        return masked(logits, self.constraint.mask())


@dataclass(frozen=True)
class LoopStep:
    """What one :meth:`PlainLoop.step` did: ``outcome`` when generation ended, else ``next``,
    the current token of the next step (in flight)."""

    outcome: Outcome | None
    next: Sampled | None = None


class PlainLoop:
    """The pipelined plain decoding loop, one token per :meth:`step`.

    Each step dispatches the forward feeding the current token before reading it, unless that
    token is certainly the last one (budget or context end), so no forward is wasted on a
    token that will never be fed. Every token goes into ``ledger`` as it is emitted and, once
    it stays in the caches, as committed.
    """

    def __init__(
        self,
        dec: PlainDecoder,
        emitter,
        ledger: Ledger | None = None,
        *,
        max_tokens: int,
        context_length: int,
        logprob_entry: Callable[[Sampled], object] = lambda s: None,
        on_first_token: Callable[[], None] = lambda: None,
    ) -> None:
        self.dec = dec
        self.emitter = emitter
        self.ledger = ledger if ledger is not None else Ledger()
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.logprob_entry = logprob_entry
        self.on_first_token = on_first_token
        self._first = True

    @property
    def fed(self) -> list[int]:
        """The generated tokens the caches hold (the ledger's committed tokens)."""
        return self.ledger.committed

    def start(self, seed: int) -> Sampled:
        """Feed the decode seed (the last prompt token); return the first in-flight sample."""
        cur = self.dec.start(seed)
        self.dec.commit(cur)
        return cur

    @staticmethod
    def resume(token: int) -> Sampled:
        """A known current token (a round's successor) as the next step's current token."""
        return Sampled(mx.array([token], dtype=mx.int32), None)

    def read(self, cur: Sampled) -> int:
        token = self.dec.read(cur)
        if self._first:
            self.on_first_token()
            self._first = False
        return token

    def is_last(self) -> bool:
        """Whether the current token is certainly the last one (budget or context end): the
        step emits it without feeding it."""
        return bool(self.max_tokens and self.ledger.used + 1 >= self.max_tokens) or (
            self.dec.position + 1 >= self.context_length
        )

    def step(self, cur: Sampled) -> LoopStep:
        """Emit ``cur``, dispatching the forward that feeds it first unless it is the last."""
        dec, ledger = self.dec, self.ledger
        nxt = None if self.is_last() else dec.advance(cur)
        token = self.read(cur)
        step = self.emitter.push(token, self.logprob_entry(cur))
        ledger.emit(token, step.forced, counted=step.keep)
        if not step.keep:
            if nxt is not None:
                dec.unfeed(nxt)
            return LoopStep(Outcome(step.reason or "stop", self.fed, token))
        if nxt is None:
            return LoopStep(Outcome(step.reason or "length", self.fed, token))
        ledger.commit([token])
        dec.commit(nxt)
        if step.finished:
            return LoopStep(Outcome(step.reason or "stop", self.fed, dec.read(nxt)))
        if step.forced:
            # The in-flight successor assumed no close marker; feed the marker instead.
            nxt = dec.feed_forced(step.forced)
            ledger.commit(step.forced)
            dec.commit(nxt)
        return LoopStep(None, nxt)


def decode_plain(loop: PlainLoop, seed: int, cancelled: Callable[[], bool]) -> Outcome:
    """Pipelined plain decoding from ``seed`` until the emitter, budget or a cancel ends it."""
    cur = loop.start(seed)
    while True:
        if cancelled():
            return Outcome("cancelled", loop.fed, loop.dec.read(cur))
        step = loop.step(cur)
        if step.outcome is not None:
            return step.outcome
        cur = step.next
