"""Prefill: a prompt fed to the caches in chunks, as resumable work.

Every prompt goes in through ``ChunkedPrefill``: the lone path runs it whole (``run()``), the
scheduler a chunk a step at full speed (``run(inf)``), or a few layers of the current chunk
between shared decode forwards (``run(budget_s)``). Chunks end at the same offsets
(``chunk_ends``) however the work is cut, so the caches hold the same bits. A cancel rewinds
an unfinished chunk: the caches always rest at the end of the last whole chunk, and
``on_commit`` (the draft session's ``committed``) only ever sees whole chunks.

Cancels are polled before each chunk and, in chunks of at least ``POLL_ROWS`` rows of a model
that takes a layer hook, after each layer and between the query blocks of its blocked
attention, so a cancel lands within a layer's linear products instead of a whole chunk. Each
layer runs the BLAS on every core or on the decode count, as ``THREADS`` chose by timing.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from runner import blas
from runner.models.attention import between_blocks

# Called with (tokens [L] int32 array, hiddens [L, D], position of tokens[0]) for every run of
# tokens whose state the target caches keep: the draft session's `committed`.
CommitHook = Callable[[mx.array, mx.array, int], None]

# Chunks of at least this many rows are evaluated piecewise with a cancel poll after each
# layer and each query block of its attention; shorter chunks are polled only ahead of each
# chunk (one call of ``cancelled`` per chunk).
POLL_ROWS = 64
# While a prefill runs MLX may keep this many bytes of freed buffers for reuse (its default
# is small on the CPU): the blocked attention's score tiles have fixed shapes, and a buffer
# handed back to the system comes back as fresh pages to fault in on the next tile. The old
# limit returns when prefill ends; the engine clears the cache after every request.
PREFILL_BUFFER_CACHE = 1 << 30


class Cancelled(Exception):
    """Raised by a prefill when the request was cancelled; ``args[0]`` is the offset the
    caches were left at (the end of the last whole chunk)."""


class _CancelledInChunk(Exception):
    """A cancel seen between the layers of a chunk (``_LayerPoll``): the chunk is rewound."""


def chunk_ends(start: int, end: int, chunk: int, opening: int = 0) -> list[int]:
    """Absolute offsets where prefill chunks of at most ``chunk`` tokens end; with
    ``opening``, a chunk also ends there wherever the prompt crosses it.

    Chunks need not end at prefix-cache snapshot points: KV snapshots are ranges of the live
    buffers, taken when the request closes. The engine's prefill ends a chunk at
    ``ROW_BY_ROW`` (``opening``): a feed of at most that many rows attends row by row, each
    row as a one-token step computes it, and a longer one in blocks, whose rows differ in
    their last bits. So the first positions of every sequence are computed one way, and a
    prompt that resumes a cached prefix of them (the chat template's opening, which every
    prompt shares) computes the bits it would compute cold: otherwise the opening takes the
    bits of whichever prompt put it in the cache, and a short prompt's greedy answer can
    depend on whether a long one ran before it."""
    ends = []
    if start < opening < end:
        ends = [*range(start + chunk, opening, chunk), opening]
        start = opening
    return [*ends, *range(start + chunk, end, chunk), end]


def takes_layer_hook(model) -> bool:
    """A model's ``takes_layer_hook`` capability: its ``hidden`` accepts ``on_layer`` and its
    caches rewind to any offset of the last feed (``KVCache``, ``RotatingKVCache``), so long
    chunks are evaluated and polled layer by layer. An object that does not declare it is
    fed a chunk at a time."""
    return bool(getattr(model, "takes_layer_hook", False))


def cache_of_layer(model) -> Callable[[int], int]:
    """Where layer i's cache sits in the model's ``make_caches`` list: the model's own
    ``cache_of_layer`` (layers sharing another's keys and values keep none, so the list can be
    shorter than the layers), else the identity."""
    return getattr(model, "cache_of_layer", None) or (lambda index: index)


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
    it), so the choice moves speed only. Only where the runner sets MKL's thread counts.

    A model fed a whole chunk at a time (no layer hook: a recurrent state cannot drop half a
    chunk) probes with a whole chunk instead, its seconds per row against those of recent
    chunks of a like size run the chosen way (``chunk_probe`` / ``chunk_done``)."""

    PROBE_LAYER = 1
    MARGIN = 0.85
    MAX_INTERVAL = 16
    # Chunk probes: chunks shorter than this are not timed (fixed costs dominate them), and a
    # probe is compared only with recent chunks of at least half and at most twice its rows.
    CHUNK_ROWS = 64
    CHUNKS_KEPT = 4

    def __init__(self) -> None:
        self.wide = True
        self.interval = 1
        self.countdown = 1  # chunks until the next probe
        self.recent: list[tuple[int, float]] = []  # (rows, seconds per row) run the chosen way

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
            self.recent.clear()  # timed the other way
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)
        self.countdown = self.interval

    def _like(self, rows: int) -> list[float]:
        return [per_row for n, per_row in self.recent if rows <= 2 * n and n <= 2 * rows]

    def chunk_probe(self, rows: int) -> bool:
        """Whether a whole chunk of ``rows`` rows runs the other way (a probe): due, long
        enough to time, and with a recent chunk of a like size to compare it with."""
        counts = blas.thread_counts()
        if counts is None or counts[0] == counts[1] or rows < self.CHUNK_ROWS:
            return False
        return self.countdown <= 1 and bool(self._like(rows))

    def chunk_done(self, rows: int, seconds: float, probed: bool) -> None:
        """Record a whole chunk's time: a probe settles the choice, a chunk run the chosen
        way becomes a reference and counts down to the next probe."""
        if rows < self.CHUNK_ROWS:
            return
        if probed:
            self.settle(seconds / rows, self._like(rows))
            return
        self.recent = [*self.recent, (rows, seconds / rows)][-self.CHUNKS_KEPT :]
        self.countdown = max(self.countdown - 1, 1)


THREADS = ThreadChoice()


def chosen_threads() -> contextlib.AbstractContextManager:
    """Every core while ``THREADS`` says so, else the decode count."""
    return blas.wide() if THREADS.wide else contextlib.nullcontext()


class _LayerPoll:
    """``on_layer`` hook of one chunk, a context for its forward: evaluates every layer (and
    every query block of a blocked attention, ``attention.between_blocks``) as soon as it is
    built, polls for a cancel after each, times the layers, and runs each wide or not as
    ``THREADS`` says (layer ``probe`` the other way)."""

    def __init__(
        self, model, caches: list, cancelled: Callable[[], bool], probe: int | None
    ) -> None:
        self.caches = caches
        self.cache_of = cache_of_layer(model)
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
        mx.eval(x, self.caches[self.cache_of(index)].state)
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


class _OpenChunk:
    """A chunk begun layer by layer (``model.layer_outputs``): its ids, the layers still to
    run, the last layer's output and a fused head's streams so far."""

    def __init__(self, model, ids: mx.array, caches: list) -> None:
        self.ids = ids
        self.layers = model.layer_outputs(ids[None], caches)
        self.last: mx.array | None = None
        self.streams: list[mx.array] = []


class ChunkedPrefill:
    """One prompt's prefill over one set of caches, resumable between scheduler steps.

    ``position`` is where the caches rest (the end of the last whole chunk), ``pending`` the
    tokens still to feed, ``opening`` a position where a chunk ends too (``chunk_ends``).
    ``run`` raises ``Cancelled`` with the caches rewound to
    ``position``; ``rewind`` drops a chunk begun layer by layer (a cancel seen between
    steps)."""

    def __init__(
        self,
        model,
        caches: list,
        tokens: Sequence[int],
        position: int,
        *,
        chunk: int,
        cancelled: Callable[[], bool] = lambda: False,
        on_commit: CommitHook | None = None,
        opening: int = 0,
    ) -> None:
        self.model = model
        self.caches = caches
        self.pending = list(tokens)
        self.position = position
        self.cancelled = cancelled
        self.on_commit = on_commit
        self._ends = chunk_ends(position, position + len(self.pending), chunk, opening)
        self._open: _OpenChunk | None = None
        # Seconds of budget given and not yet spent, for a model fed whole chunks (``run``).
        self._credit = 0.0

    @property
    def done(self) -> bool:
        return not self.pending

    def run(self, budget_s: float | None = None) -> bool:
        """Feed some of the prompt: all of it (``budget_s`` None), one whole chunk (``inf``),
        else layers of the current chunk until about ``budget_s`` seconds went by (at least
        one layer). A model fed whole chunks (a split model: the other ranks take a chunk as
        one exchange) runs a chunk once the budgets given since the last one add up to what
        that one took, so the streams it interleaves with keep about the same share of time
        on average (each chunk still holds them up while it runs). True once every token is
        in."""
        if budget_s is not None and budget_s != float("inf"):
            if takes_layer_hook(self.model):
                self._run_layers(budget_s)
                return self.done
            self._credit += budget_s
            if self._credit < 0:
                if self.cancelled():  # no chunk this time: the cancel is seen all the same
                    raise Cancelled(self.position)
                return self.done
            started = time.perf_counter()
            self._chunks(one=True)
            self._credit -= time.perf_counter() - started
            return self.done
        self._credit = 0.0  # at full speed: no debt carried into later shared forwards
        self._chunks(one=budget_s is not None)
        return self.done

    def _chunks(self, one: bool) -> None:
        """Whole chunks: ``one``, or every one left."""
        if self._open is not None:  # a chunk begun layer by layer: finish it first
            self._run_layers(float("inf"), whole_chunk=True)
            if one:
                return
        with _buffer_cache(PREFILL_BUFFER_CACHE):
            while self.pending:
                self._whole_chunk()
                if one:
                    break

    def rewind(self) -> None:
        """Drop the chunk begun layer by layer: the layers run so far appended it."""
        for c in self.caches:
            if c.offset > self.position:
                c.rewind(self.position)
        self._open = None

    def _next_ids(self) -> mx.array:
        end = next(e for e in self._ends if e > self.position)
        return mx.array(self.pending[: end - self.position], dtype=mx.int32)

    def _whole_chunk(self) -> None:
        """The next chunk in one call: evaluated a layer at a time with cancel polls when it
        is long enough and the model takes the hook, else as one graph."""
        if self.cancelled():
            raise Cancelled(self.position)
        model, caches = self.model, self.caches
        ids = self._next_ids()
        try:
            if takes_layer_hook(model) and ids.shape[0] >= POLL_ROWS:
                poll = _LayerPoll(model, caches, self.cancelled, THREADS.next_probe(len(caches)))
                with poll, between_blocks(poll.block):
                    hidden = model.hidden(ids[None], caches, on_layer=poll)
                mx.eval(hidden, [c.state for c in caches])
                poll.settle()
            else:
                rows = ids.shape[0]
                probe = THREADS.chunk_probe(rows)
                started = time.perf_counter()
                with blas.wide() if THREADS.wide != probe else contextlib.nullcontext():
                    hidden = model.hidden(ids[None], caches)
                    mx.eval(hidden, [c.state for c in caches])
                THREADS.chunk_done(rows, time.perf_counter() - started, probe)
        except _CancelledInChunk:
            self.rewind()
            raise Cancelled(self.position) from None
        self._commit(ids, hidden[0])

    def _run_layers(self, budget_s: float, whole_chunk: bool = False) -> None:
        """Layers of the next chunk, evaluated one by one until the budget is spent; a chunk
        ends at the offset a whole-chunk prefill would end it (``chunk_ends``)."""
        model, caches = self.model, self.caches
        cache_of = cache_of_layer(model)
        start = time.perf_counter()
        while self.pending:
            if self._open is None:
                if self.cancelled():
                    raise Cancelled(self.position)
                self._open = _OpenChunk(model, self._next_ids(), caches)
            chunk = self._open
            with chosen_threads():
                for index, x in chunk.layers:
                    mark = time.perf_counter()
                    mx.eval(x, caches[cache_of(index)].state)
                    chunk.last = x
                    if index in model.draft_stream_layers:  # a fused head's stream
                        chunk.streams.append(x)
                    if self.cancelled():
                        self.rewind()
                        raise Cancelled(self.position)
                    # Stop before a layer that would overrun the budget (at least one ran).
                    now = time.perf_counter()
                    if not whole_chunk and now + (now - mark) - start > budget_s:
                        return
            hidden = model.draft_rows(chunk.last, chunk.streams)
            mx.eval(hidden)
            self._open = None
            self._commit(chunk.ids, hidden[0])
            if whole_chunk or time.perf_counter() - start >= budget_s:
                return

    def _commit(self, ids: mx.array, hidden: mx.array) -> None:
        """A whole chunk is in: hand the draft session its rows and move on."""
        if self.on_commit is not None:
            self.on_commit(ids, hidden, self.position)
        self.position += ids.shape[0]
        self.pending = self.pending[ids.shape[0] :]


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
    return the new offset. A cancelled prefill raises ``Cancelled`` and keeps the chunks it
    finished (``ChunkedPrefill``)."""
    work = ChunkedPrefill(
        model, caches, tokens, position, chunk=chunk, cancelled=cancelled, on_commit=on_commit
    )
    work.run()
    return work.position
