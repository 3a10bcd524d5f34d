"""Continuous batching: up to N completions decode at once, one row each in a shared forward.

Decode is memory-bound: a forward over a few rows reads the weights once, so it costs little
more than a forward over one (``runner.native``'s panel product reads each weight once for
all rows). The scheduler gives every active stream a cache slot of its own (the prefix cache
restores into it and indexes it as for a single request) and each ``step`` does one of:

- nothing decodes yet: the oldest admitted prompt prefills at full speed, a chunk a step;
- one stream decodes and no prompt waits: that stream takes a step of its own, a speculative
  round when its head drafts (a round verifies several rows of one sequence, which pays only
  while the forward is not shared);
- otherwise one shared forward feeds every decoding stream its current token
  (``Model.hidden_rows``), and then the oldest waiting prompt prefills a few layers of its
  current chunk, for about as long as that forward took, so the streams keep about half
  their rate while it is admitted and the newcomer's first token is not held back behind
  whole chunks.

Fairness: admission is first come, first served (the server hands streams over in arrival
order while a slot is free) and every decoding stream gets a row in every shared forward, so
no stream starves. Speculation parks while the forward is shared; the draft cache still
follows every committed row, so a stream left alone resumes speculating with no extra
forward. A failure in one stream's own work ends that stream only; a failure of the shared
forward ends the streams in it (their slots start over), never the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx

from cache.ledger import Outcome
from runner.stream import Slot, Stream

log = logging.getLogger("mtp_runner.batch")

Emit = Callable[[object], None]


class Scheduler:
    """The active streams of one engine and the step that advances them."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.streams: list[Stream] = []  # in admission order
        self.free: list[Slot] = list(engine.slots)
        self.shared_s = 0.0  # how long the last shared forward took, the prefill's budget
        self._was_shared = False
        self.shared_steps = 0

    @property
    def room(self) -> int:
        return len(self.free)

    @property
    def active(self) -> bool:
        return bool(self.streams)

    def admit(self, req, emit: Emit, cancelled: Callable[[], bool]) -> Stream:
        """Start ``req`` on a free slot (raises when none is free, or when the prefix cache
        fails it: the slot is then free again)."""
        if not self.free:
            raise RuntimeError("no free cache slot")
        slot = self.free.pop(0)
        try:
            stream = self.engine.open_stream(req, emit, cancelled, slot)
        except Exception:
            self.free.insert(0, slot)
            raise
        self.streams.append(stream)
        return stream

    def step(self) -> list[Stream]:
        """Advance the active streams once; returns those that finished (done frame sent)."""
        for s in self.streams:  # prompts still waiting for their turn see their cancels
            if s.prefilling:
                self._guard(s, s.cancel_if_asked)
        decoding = [s for s in self.streams if not s.prefilling and not s.finished]
        waiting = [s for s in self.streams if s.prefilling]
        if not decoding:
            if waiting:  # a chunk a step, so the others' cancels and admissions come between
                self._guard(waiting[0], lambda: waiting[0].prefill(budget_s=float("inf")))
        elif len(decoding) == 1 and not waiting:
            stream = decoding[0]
            if self._was_shared and stream.speculates:
                # The round clock saw shared forwards: not a round's cost.
                self.engine.speculation.depth.begin_request()
            self._was_shared = False
            self._guard(stream, stream.step)
        else:
            start = time.perf_counter()
            self._shared_step(decoding)
            if waiting:
                # Wait for the forward here, so that its time is the prefill's budget and the
                # prefill's own clock starts on an idle stream.
                live = [s for s in decoding if s.decoding and not s.finished]
                try:
                    mx.eval([s.decoding.cur.token for s in live])
                except Exception as exc:  # the shared forward failed: the streams in it end
                    for s in live:
                        s.fail(exc)
            self.shared_s = time.perf_counter() - start
            self._was_shared = True
            self.shared_steps += 1
            if waiting:
                self._guard(waiting[0], lambda: waiting[0].prefill(budget_s=self.shared_s))
        return self._collect()

    def fail_all(self, exc: BaseException) -> list[Stream]:
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

    def _collect(self) -> list[Stream]:
        done = [s for s in self.streams if s.finished]
        for stream in done:
            self.streams.remove(stream)
            self.free.append(stream.slot)
        self.free.sort(key=lambda slot: slot.index)
        return done

    @staticmethod
    def _guard(stream: Stream, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as exc:  # one request's failure never takes the runner down
            stream.fail(exc)

    # ------------------------------------------------------------------ the shared forward
    def _shared_step(self, streams: list[Stream]) -> None:
        """Each stream's current token is emitted (it was computed by the previous forward),
        then one forward feeds every stream that goes on its token (its seed, for a stream
        whose prompt just went in). Emitting before the feed, not while the forward runs as
        a lone stream's pipelined step does, sends each token a step earlier and leaves
        nothing to unfeed when a token ends its stream; the host work it puts ahead of the
        forward is small next to a forward over several rows."""
        rows: list[tuple[Stream, mx.array, int, bool]] = []
        for s in streams:
            try:
                if s.seed is not None:
                    seed = mx.array([s.seed], dtype=mx.int32)
                    rows.append((s, *s.decoder.row_feed(seed, append=False), True))
                    continue
                token = self._emit_current(s)
                if token is not None:
                    fed = mx.array([token], dtype=mx.int32)
                    rows.append((s, *s.decoder.row_feed(fed, append=True), False))
            except Exception as exc:
                s.fail(exc)
        samples = self._forward(rows)
        for (s, _, _, seeded), sampled in zip(rows, samples, strict=True):
            if sampled is None:
                continue
            try:
                if seeded:
                    s.started(sampled)
                    continue
                s.ledger.commit([s.decoding.cur_token])
                s.decoder.commit(sampled)
                s.decoding.cur = sampled
            except Exception as exc:
                s.fail(exc)

    @staticmethod
    def _emit_current(s: Stream) -> int | None:
        """Emit ``s``'s current token as a plain step would; the token to feed when the stream
        goes on (None: it ended, or fed its own forward for forced close markers)."""
        decoding, loop = s.decoding, s.loop
        outcome = decoding.cancel_check()
        if outcome is not None:
            s.end(outcome)
            return None
        last = loop.is_last()
        cur = decoding.cur
        token = loop.read(cur)
        step = loop.emitter.push(token, loop.logprob_entry(cur))
        loop.ledger.emit(token, step.forced, counted=step.keep)
        if not step.keep:  # EOS: emitted, never fed
            s.end(decoding.ended(Outcome(step.reason or "stop", loop.fed, token)))
        elif last or step.finished:  # the budget, the context or a stop string: not fed
            reason = step.reason or ("length" if last else "stop")
            s.end(decoding.ended(Outcome(reason, loop.fed, token)))
        elif step.forced:
            # A close marker follows the token: the stream feeds both in forwards of its own,
            # one after the other, as a plain step does.
            loop.ledger.commit([token])
            s.decoder.commit(s.decoder.feed_forced([token]))
            nxt = s.decoder.feed_forced(step.forced)
            loop.ledger.commit(step.forced)
            s.decoder.commit(nxt)
            decoding.cur = nxt
        else:
            decoding.cur_token = token
            return token
        return None

    def _forward(self, rows: list[tuple[Stream, mx.array, int, bool]]) -> list:
        """The shared forward and each row's sample (lazy, dispatched); None for a row whose
        sample failed. A failure of the forward itself fails every row in it."""
        if not rows:
            return []
        model = self.engine.model
        try:
            tokens = mx.concatenate([t for _, t, _, _ in rows])
            hidden = model.hidden_rows(tokens, [s.slot.caches for s, _, _, _ in rows])
            logits = model.unembed(hidden)
            mx.async_eval(hidden, logits, [s.decoder.cache_state() for s, _, _, _ in rows])
        except Exception as exc:
            for s, _, _, _ in rows:
                s.fail(exc)
            return [None] * len(rows)
        samples, pending = [], []
        for i, (s, t, position, _) in enumerate(rows):
            try:
                sampled = s.decoder.row_sample(t, hidden[i : i + 1], logits[i], position)
                pending += [sampled.token, *(sampled.logprobs or ())]
                samples.append(sampled)
            except Exception as exc:
                s.fail(exc)
                samples.append(None)
        try:
            mx.async_eval(pending)
        except Exception as exc:
            for (s, _, _, _), sampled in zip(rows, samples, strict=True):
                if sampled is not None:
                    s.fail(exc)
            return [None] * len(rows)
        return samples
