"""The scheduler: every completion runs through it, up to N at once, one row each in a shared
forward (``--parallel 1``: one at a time, the same loop).

Decode is memory-bound: a forward over a few rows reads the weights once, so it costs little
more than a forward over one (``runner.native``'s panel product reads each weight once for
all rows). The scheduler gives every active stream a cache slot of its own (the prefix cache
restores into it and indexes it as for a single request) and each ``step`` does one of:

- nothing decodes yet: the oldest admitted prompt prefills at full speed, a chunk a step;
- one stream decodes and no prompt waits: that stream takes a step of its own, a speculative
  round when its head drafts (a round verifies several rows of one sequence, which pays only
  while the forward is not shared);
- otherwise one shared forward feeds every decoding stream its current token
  (``Model.hidden_rows``), with the suffix drafter's draft after it for a stream whose text
  was seen before, and then the oldest waiting prompt prefills a few layers of its current
  chunk, for about as long as that forward took, so the streams keep about half their rate
  while it is admitted and the newcomer's first token is not held back behind whole chunks
  (a model split across ranks takes whole chunks, one after enough shared forwards to keep
  the same shares on average: ``runner.prefill``).

**Drafts in a shared forward.** A stream's draft adds its rows to a forward every stream
waits for, so it pays when its expected extra tokens beat what those rows cost the others:
``SharedCost`` learns a row's seconds against the plain shared step's from the steps' own
times, and the suffix model's acceptance gives each draft length's expected tokens
(``SuffixModel.shared_length``). The forward takes at most ``--shared-draft-rows`` rows in
all (the model's compiled row counts at most: past them a forward costs about twice as
much), shared out in an order that turns every step. The head does not draft there: a head
step per stream would run one after another, and its drafts' acceptance does not pay for
their rows at these costs. Each speculating stream verifies its own rows after the forward
(``Stream.settle``: one sync, its acceptance, emission and rollback its own); the plain
rows' samples are dispatched first.

Fairness: admission is first come, first served (the server hands streams over in arrival
order while a slot is free) and every decoding stream gets a row in every shared forward, so
no stream starves. The draft cache follows every committed row, so a stream left alone
speculates with its head again with no extra forward. A failure in one stream's own work
(its round included) ends that stream only; a failure of the shared forward ends the
streams in it (their slots start over), never the runner.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from runner import device
from runner.stream import Row

log = logging.getLogger("mtp_runner.batch")

Emit = Callable[[object], None]


class ScheduledStream(Protocol):
    """What the scheduler needs of a stream (``runner.stream.Stream``; the model-free engine's
    streams implement the part a lone stream uses)."""

    slot: Any
    finished: bool

    @property
    def prefilling(self) -> bool: ...

    @property
    def speculates(self) -> bool: ...

    def cancel_if_asked(self) -> bool: ...

    def prefill(self, budget_s: float | None = None) -> bool: ...

    def step(self) -> bool: ...

    def alone_again(self) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class ServedEngine(Protocol):
    """The engine the server, the scheduler and its streams use (``runner.engine.Engine``,
    ``runner.noop_engine.NoopEngine``)."""

    info: Any  # model, context_length, vocab_size, mtp, mtp_detail, blas
    slots: Sequence[Any]  # one per completion decoded at once
    model: Any  # hidden_rows and unembed for shared forwards (several slots only)

    def precheck(self, request) -> None: ...

    def prepare(self, request) -> Any: ...

    def tokenize_request(self, request) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def status(self) -> dict: ...

    def open_stream(
        self,
        req: Any,
        emit: Emit,
        cancelled: Callable[[], bool],
        slot: Any,
        on_close: Callable[[Any], None],
    ) -> ScheduledStream: ...


# The tokens of the other streams one verify row is taken to cost before any is timed (a
# row reads no weight the others do not, but its arithmetic is its own, while the step yields
# a token a stream), and how many rows' worth of evidence that prior is.
ROW_COST_PRIOR = 0.5
PRIOR_ROWS = 8
COST_ALPHA = 0.1  # weight of a new plain step's time in its running estimate
COST_CLAMP = 0.5  # one step moves that estimate by at most this share of itself
ROW_DECAY = 0.98  # per timed step with extra rows: the rows' evidence fades over ~50 of them


class SharedCost:
    """What a verify row costs a shared forward, learned from the steps' times: the step of
    one row per stream (per stream count), and the seconds extra rows add over it, summed
    over the steps that had them (a ratio of sums: single steps are too noisy to difference).
    A draft that adds k rows to a step of N streams taking T seconds costs every stream in
    it, so it pays when its expected extra tokens beat ``k * row_seconds * N / T``
    (``row_cost``)."""

    def __init__(self) -> None:
        self.step: dict[int, float] = {}  # streams -> seconds of a step of one row each
        self._extra_rows = 0.0
        self._extra_seconds = 0.0

    def observe(self, streams: int, rows: int, seconds: float) -> None:
        """A shared step of ``streams`` streams feeding ``rows`` rows took ``seconds``."""
        if streams < 1 or rows < streams or seconds <= 0:
            return
        step = self.step.get(streams)
        if rows == streams:
            if step is None:
                self.step[streams] = seconds
            else:  # one stall moves the estimate by at most COST_CLAMP of itself
                change = min(max(seconds / step - 1.0, -COST_CLAMP), COST_CLAMP)
                self.step[streams] = step * (1.0 + COST_ALPHA * change)
        elif step is not None:
            self._extra_rows = ROW_DECAY * self._extra_rows + rows - streams
            self._extra_seconds = ROW_DECAY * self._extra_seconds + max(seconds - step, 0.0)

    def row_cost(self, streams: int) -> float:
        """Tokens of the step's own rate one more row costs: the prior, moved by the timed
        extra rows once the plain step of this many streams is known."""
        step = self.step.get(streams)
        if step is None:
            return ROW_COST_PRIOR
        prior_seconds = PRIOR_ROWS * ROW_COST_PRIOR * step / streams
        row_seconds = (self._extra_seconds + prior_seconds) / (self._extra_rows + PRIOR_ROWS)
        return row_seconds * streams / step


class Scheduler:
    """The active streams of one engine and the step that advances them."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine
        self.streams: list = []  # in admission order
        self.free: list = list(engine.slots)
        self.shared_s = 0.0  # how long the last shared forward took, the prefill's budget
        self._was_shared = False
        self.shared_steps = 0
        self.shared_rounds = 0  # speculative rounds verified inside shared forwards
        # Rounds inside shared forwards: the most rows they feed with drafts (0: one a stream).
        self.draft_rows: int = getattr(engine, "shared_draft_rows", 0)
        self.cost = SharedCost()
        self._rows = (0, 0)  # (streams, rows) the last shared forward fed
        self._timing: tuple[float, int, int] | None = None  # (start, streams, rows) of it

    @property
    def room(self) -> int:
        return len(self.free)

    @property
    def active(self) -> bool:
        return bool(self.streams)

    def admit(self, req, emit: Emit, cancelled: Callable[[], bool]) -> ScheduledStream:
        """Start ``req`` on a free slot (raises when none is free, or when the prefix cache
        fails it: the slot is then free again)."""
        if not self.free:
            raise RuntimeError("no free cache slot")
        slot = self.free.pop(0)
        try:
            stream = self.engine.open_stream(req, emit, cancelled, slot, self._closing)
        except Exception:
            self.free.insert(0, slot)
            raise
        self.streams.append(stream)
        return stream

    def run(self, req, emit: Emit, cancelled: Callable[[], bool]) -> None:
        """Serve one completion to its done frame (nothing else admitted meanwhile)."""
        self.admit(req, emit, cancelled)
        while self.active:
            self.step()

    def step(self) -> list:
        """Advance the active streams once; returns those that finished (done frame sent)."""
        # Prompts waiting for their turn see their cancels; the oldest prefills this step and
        # polls for one itself.
        for s in [s for s in self.streams if s.prefilling][1:]:
            self._guard(s, s.cancel_if_asked)
        decoding = [s for s in self.streams if not s.prefilling and not s.finished]
        waiting = [s for s in self.streams if s.prefilling]
        if not decoding:
            self._timing = None
            if waiting:  # a chunk a step, so the others' cancels and admissions come between
                self._guard(waiting[0], lambda: waiting[0].prefill(budget_s=float("inf")))
        elif len(decoding) == 1 and not waiting:
            self._timing = None
            stream = decoding[0]
            if self._was_shared:
                stream.alone_again()
            self._was_shared = False
            self._guard(stream, stream.step)
        else:
            self._shared_step(decoding, waiting)
        return self._collect()

    def fail_all(self, exc: BaseException) -> list:
        """A failure outside every stream's own guard: every active stream ends with it (its
        error and done frames, its slot reset); the scheduler is empty after."""
        for s in self.streams:
            if not s.finished:
                try:
                    s.fail(exc)
                except Exception:  # the done frame at least (Stream.finish sends it last)
                    log.exception("stream %s failed to end", s.req.id)
                    s.finished = True
        return self._collect()

    def _closing(self, stream) -> None:
        """Before a stream's done frame: with nothing else running, return freed buffers to
        the system so a long-lived runner stays flat in memory."""
        if all(s.finished or s is stream for s in self.streams):
            device.release_memory()

    def _collect(self) -> list:
        done = [s for s in self.streams if s.finished]
        for stream in done:
            self.streams.remove(stream)
            self.free.append(stream.slot)
        self.free.sort(key=lambda slot: slot.index)
        return done

    @staticmethod
    def _guard(stream, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as exc:  # one request's failure never takes the runner down
            stream.fail(exc)

    # ------------------------------------------------------------------ the shared forward
    def _shared_step(self, decoding: list, waiting: list) -> None:
        """One shared forward, then the oldest waiting prompt prefills a few layers of its
        chunk for about as long as that forward took."""
        start = time.perf_counter()
        if self._timing is not None:  # the step before, to this one's start
            before, streams, rows = self._timing
            self.cost.observe(streams, rows, start - before)
        self._shared_forward(decoding)
        # A step that also prefills is not a decode step's time.
        self._timing = None if waiting else (start, *self._rows)
        if waiting:
            # Wait for the forward here, so that its time is the prefill's budget and the
            # prefill's own clock starts on an idle stream.
            live = [s for s in decoding if s.in_flight() is not None]
            try:
                mx.eval([s.in_flight() for s in live])
            except Exception as exc:  # the shared forward failed: the streams in it end
                for s in live:
                    s.fail(exc)
        self.shared_s = time.perf_counter() - start
        self._was_shared = True
        self.shared_steps += 1
        if waiting:
            self._guard(waiting[0], lambda: waiting[0].prefill(budget_s=self.shared_s))

    def _shared_forward(self, streams: list) -> None:
        """Each stream's current token is emitted (it was computed by the previous forward),
        then one forward feeds every stream that goes on its token (its last prompt token,
        for a stream whose prompt just went in), with the suffix drafter's draft after it
        where that pays (``SharedCost``). Emitting before the feed, not while the forward
        runs as a lone stream's pipelined step does, sends each token a step earlier and
        leaves nothing to unfeed when a token ends its stream; the host work it puts ahead
        of the forward is small next to a forward over several rows."""
        row_cost = self.cost.row_cost(len(streams)) if self.draft_rows else None
        # The drafts share the rows the forward may take beyond one a stream, asked in an
        # order that turns every step so that no stream takes them first for good.
        spare = max(self.draft_rows - len(streams), 0)
        turn = self.shared_steps % len(streams)
        rows: list[tuple[Any, Row]] = []
        for s in streams[turn:] + streams[:turn]:
            try:
                row = s.row(row_cost, spare)
                if row is not None:
                    rows.append((s, row))
                    spare -= row.tokens.shape[0] - 1
            except Exception as exc:
                s.fail(exc)
        self._rows = (len(rows), sum(row.tokens.shape[0] for _, row in rows))
        self.shared_rounds += sum(row.round is not None for _, row in rows)
        results = self._forward(rows)
        # Plain rows first: their samples are dispatched; a round's settling syncs.
        for (s, row), result in zip(rows, results, strict=True):
            if result is not None and row.round is None:
                self._guard(s, lambda s=s, row=row, sampled=result: s.take(row, sampled))
        for (s, row), result in zip(rows, results, strict=True):
            if result is not None and row.round is not None:
                self._guard(s, lambda s=s, row=row, rows=result: s.settle(row, *rows))

    def _forward(self, rows: list[tuple[Any, Row]]) -> list:
        """The shared forward and each plain row's sample (lazy, dispatched), each round's
        hidden rows and logits; None for a row whose sample failed. A failure of the
        forward itself fails every row in it."""
        if not rows:
            return []
        model = self.engine.model
        counts = [row.tokens.shape[0] for _, row in rows]
        try:
            tokens = mx.concatenate([row.tokens for _, row in rows])
            caches = [s.slot.caches for s, _ in rows]
            hidden = model.hidden_rows(tokens, caches, counts)
            logits = model.unembed(hidden)
            mx.async_eval(hidden, logits, [s.cache_state() for s, _ in rows])
        except Exception as exc:
            for s, _ in rows:
                s.fail(exc)
            return [None] * len(rows)
        results, pending = [], []
        starts = [0, *itertools.accumulate(counts)][:-1]
        for (s, row), start, n in zip(rows, starts, counts, strict=True):
            if row.round is not None:
                results.append((hidden[start : start + n], logits[start : start + n]))
                continue
            try:
                sampled = s.sample(row, hidden[start : start + 1], logits[start])
                pending += [sampled.token, *(sampled.logprobs or ())]
                results.append(sampled)
            except Exception as exc:
                s.fail(exc)
                results.append(None)
        try:
            mx.async_eval(pending)
        except Exception as exc:
            for (s, row), result in zip(rows, results, strict=True):
                if result is not None and row.round is None:
                    s.fail(exc)
            kept = zip(rows, results, strict=True)
            return [r if row.round is not None else None for (_, row), r in kept]
        return results
