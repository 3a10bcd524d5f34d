"""One completion from admission to its done frame, as steps a scheduler can interleave.

A ``Stream`` owns what a request owns: its cache slot's session on the prefix cache, its
speculation session (the draft session on the slot's draft cache), sampler, emitter, ledger
and decode loop. Its life has two phases: *prefill* (``prefill``: the prompt in chunks, all at
once or a few layers at a time between other requests' decode steps) and *decode*: steps of
its own (``step``: a plain step or a speculative round) or rows of a forward shared with other
streams (``runner.batch``). ``finish`` closes every session on every exit path and sends the
one done frame.

Prefill chunks end at the same offsets however they are interleaved, and a shared forward's
rows compute what a forward of their own computes (``Model.hidden_rows``), so a stream's
output does not depend on what else runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from cache.ledger import Ledger, Outcome
from cache.session import CacheSession
from drafting.logprobs import LogprobEntry, LogprobRows
from drafting.speculation import Decoding, SpeculationSession
from drafting.stats import SpecStats
from protocol import frames as pf
from protocol.errors import CodedError, error_frame
from runner import blas
from runner.decoder import (
    THREADS,
    Cancelled,
    ConstrainedDecoder,
    PlainDecoder,
    PlainLoop,
    Sampled,
    chunk_ends,
    prefill,
)
from runner.emit import Emitter
from runner.sampler import Sampler

log = logging.getLogger("mtp_runner.stream")

Emit = Callable[[object], None]


@dataclass
class Slot:
    """One set of caches a stream decodes into: the target's layers, then the draft cache
    (when the model has a head); ``index`` names it to the prefix cache."""

    index: int
    caches: list
    draft: object | None = None

    @property
    def all(self) -> list:
        return [*self.caches] + ([self.draft] if self.draft is not None else [])


class Stream:
    """A request's state between scheduler steps; see the module docstring."""

    def __init__(self, engine, req, emit: Emit, cancelled: Callable[[], bool], slot: Slot):
        self.engine = engine
        self.req = req
        self.emit = emit
        self.cancelled = cancelled
        self.slot = slot
        self.start_ns = time.perf_counter_ns()
        self.first_token_ns: int | None = None
        self.ledger = Ledger()
        self.outcome = Outcome("error")
        self.finished = False
        self.decoding: Decoding | None = None
        self.seed: int | None = None  # the last prompt token, until it is fed
        self.loop: PlainLoop | None = None
        self._layers: Iterator | None = None  # the chunk being prefilled layer by layer
        self._streams: list[mx.array] = []  # its fused-head streams so far
        self.session: CacheSession | None = engine.prefix.begin(req.prompt, slot.index)
        self.cached = self.session.cached
        self.spec: SpeculationSession | None = None
        if engine.speculation is not None:
            self.spec = engine.speculation.open(engine.model.unembed, slot.draft)
        self.stats = self.spec.stats if self.spec is not None else SpecStats()
        self.emitter = Emitter(
            engine.tokenizer,
            stop=req.stop,
            max_tokens=req.max_tokens,
            think_budget=req.think_budget,
            send=self._send,
            prompt_open_think=engine._opens_think(req.prompt),
        )
        # A zero think budget on a span the prompt opened closes it before the first token:
        # the close marker is fed after the prompt, as if the prompt had ended with it.
        forced = self.emitter.force_at_start()
        self.ledger.force(forced)
        if forced and hasattr(req.constraint, "activate"):
            req.constraint.activate()  # the span closed before the first token
        self.sequence = [*req.prompt, *forced]
        feed = [*self.session.remaining, *forced]
        self.pending = feed[:-1]  # prompt tokens still to prefill
        self.position = self.session.cached
        self.last_prompt = feed[-1]
        self._ends = chunk_ends(self.position, self.position + len(self.pending), engine.chunk)

    # ------------------------------------------------------------------ phases
    @property
    def prefilling(self) -> bool:
        return self.loop is None and not self.finished

    @property
    def speculates(self) -> bool:
        return self.decoding is not None and self.decoding.driver is not None

    def prefill(self, budget_s: float | None = None) -> bool:
        """Prefill some of the prompt: all of it (``budget_s`` None), one chunk (``inf``),
        else layers of the current chunk until about ``budget_s`` seconds went by (at least
        one layer). True once the prompt is in (the stream then decodes). A cancel ends the
        stream."""
        try:
            if budget_s is None:
                self._prefill_all()
            elif budget_s == float("inf"):  # one whole chunk
                self._prefill_all(one_chunk=True)
            else:
                self._prefill_layers(budget_s)
        except Cancelled:
            self._cancelled_in_prefill()
            return False
        if self.pending:
            return False
        self._start_decoding()
        return True

    def cancel_if_asked(self) -> bool:
        """A prompt waiting for its turn: end it now if it was cancelled (True)."""
        if self.finished or not self.prefilling or not self.cancelled():
            return False
        if self._layers is not None:
            self._rewind_chunk()
        self._cancelled_in_prefill()
        return True

    def _prefill_all(self, one_chunk: bool = False) -> None:
        if self._layers is not None:  # a chunk begun layer by layer: finish it first
            self._prefill_layers(float("inf"), whole_chunk=True)
            if one_chunk:
                return
        if self.pending:
            on_commit = self.spec.on_commit if self.spec is not None else None
            engine = self.engine
            end = next(e for e in self._ends if e > self.position) if one_chunk else None
            tokens = self.pending if end is None else self.pending[: end - self.position]
            prefill(
                engine.model,
                self.slot.caches,
                tokens,
                self.position,
                chunk=engine.chunk,
                cancelled=self.cancelled,
                on_commit=on_commit,
            )
            self.position += len(tokens)
            self.pending = self.pending[len(tokens) :]

    def _prefill_layers(self, budget_s: float, whole_chunk: bool = False) -> None:
        """Layers of the next chunk, evaluated one by one until the budget is spent; a chunk
        ends at the offset a whole-chunk prefill would end it (``chunk_ends``)."""
        model, caches = self.engine.model, self.slot.caches
        start = time.perf_counter()
        while self.pending:
            if self._layers is None:
                if self.cancelled():
                    raise Cancelled(self.position)
                end = next(e for e in self._ends if e > self.position)
                self._chunk = mx.array(self.pending[: end - self.position], dtype=mx.int32)
                self._layers = model.layer_outputs(self._chunk[None], caches)
                self._x, self._streams = None, []
            with blas.wide() if THREADS.wide else contextlib.nullcontext():
                for index, x in self._layers:
                    mark = time.perf_counter()
                    mx.eval(x, caches[index].state)
                    self._x = x
                    if index in model.draft_stream_layers:  # a fused head's stream
                        self._streams.append(x)
                    if self.cancelled():
                        self._rewind_chunk()
                        raise Cancelled(self.position)
                    # Stop before a layer that would overrun the budget (at least one ran).
                    now = time.perf_counter()
                    if not whole_chunk and now + (now - mark) - start > budget_s:
                        return
            self._commit_chunk()
            if whole_chunk or time.perf_counter() - start >= budget_s:
                return

    def _commit_chunk(self) -> None:
        model, ids = self.engine.model, self._chunk
        hidden = model.draft_rows(self._x, self._streams)
        mx.eval(hidden)
        if self.spec is not None:
            self.spec.on_commit(ids, hidden[0], self.position)
        self.position += ids.shape[0]
        self.pending = self.pending[ids.shape[0] :]
        self._layers = self._chunk = self._x = None
        self._streams = []

    def _rewind_chunk(self) -> None:
        for c in self.slot.caches:  # the layers evaluated so far appended this chunk
            if c.offset > self.position:
                c.rewind(self.position)
        self._layers = self._chunk = self._x = None

    def _cancelled_in_prefill(self) -> None:
        # Keep what prefill finished; level the draft cache with the next token.
        offset = self.slot.caches[0].offset
        fed = self.sequence[len(self.req.prompt) : offset]
        outcome = Outcome("cancelled", fed=fed, final=self.sequence[offset])
        self.emitter.finish()
        self.finish(self.spec.finish(outcome) if self.spec is not None else outcome)

    def _start_decoding(self) -> None:
        req, engine = self.req, self.engine
        self.sampler = Sampler(
            req.params,
            history=self.sequence,
            vocab_size=engine.info.vocab_size,
            context_length=engine.info.context_length,
        )
        self.rows = LogprobRows(req.top_logprobs) if req.logprobs else None
        kind, extra = PlainDecoder, {}
        if req.constraint is not None:  # the same matcher masks plain steps and rounds
            kind, extra = ConstrainedDecoder, {"constraint": req.constraint}
        on_commit = self.spec.on_commit if self.spec is not None else None
        self.decoder = kind(
            engine.model,
            self.slot.caches,
            self.sampler,
            top_logprobs=req.top_logprobs if req.logprobs else None,
            on_commit=on_commit,
            **extra,
        )
        self.loop = PlainLoop(
            self.decoder,
            self.emitter,
            self.ledger,
            max_tokens=req.max_tokens,
            context_length=engine.info.context_length,
            logprob_entry=self._logprob_entry,
            on_first_token=self._first_token,
        )
        self.seed = self.last_prompt

    def started(self, cur: Sampled) -> None:
        """The seed was fed (by a forward of its own or a shared one): ``cur`` is the first
        in-flight sample."""
        self.seed = None
        self.decoder.commit(cur)
        if self.spec is None:
            self.decoding = Decoding(self.loop, cur, self.cancelled)
            return
        self.decoding = self.spec.decoding(
            self.loop,
            cur,
            self.cancelled,
            model=self.engine.model,
            caches=self.slot.caches,
            sampler=self.sampler,
            emit=self._push,
            budget=self.req.max_tokens,
            speculate=self.req.speculative,
            logprobs=self.rows,
            constraint=self.req.constraint,
        )

    def step(self) -> bool:
        """One step of its own (the first feeds the seed); True once the stream finished."""
        if self.seed is not None:
            self.started(self.decoder.start(self.seed))
            return False
        outcome = self.decoding.step()
        if outcome is not None:
            self.end(outcome)
            return True
        return False

    def end(self, outcome: Outcome) -> None:
        self.emitter.finish()
        self.finish(outcome)

    # ------------------------------------------------------------------ frames
    def _send(self, content: str, ids: list[int], logprobs: list | None) -> None:
        self.emit(pf.Token(id=self.req.id, content=content, tokens=list(ids), logprobs=logprobs))

    def _first_token(self) -> None:
        self.first_token_ns = time.perf_counter_ns()

    def _slot_of_emitted(self) -> int:
        return len(self.req.prompt) + len(self.ledger.emitted)

    def _logprob_entry(self, sampled: Sampled) -> pf.TokenLogprob | None:
        """A plain step's entry: its own row, or the round's row it resumed from."""
        if self.rows is None:
            return None
        frame = self.engine._logprob_frame
        token = int(sampled.token.item())
        if sampled.logprobs is None:
            return frame(self.rows.take(self._slot_of_emitted(), token))
        chosen, top_ids, top_lps = sampled.logprobs
        return frame(LogprobEntry(token, float(chosen.item()), top_ids.tolist(), top_lps.tolist()))

    def _push(self, token: int):
        """The round driver's emission: the entry from the verify row that decided it."""
        entry = None
        if self.rows is not None:
            entry = self.engine._logprob_frame(self.rows.take(self._slot_of_emitted(), token))
        return self.emitter.push(token, entry)

    # ------------------------------------------------------------------ the end
    def fail(self, exc: BaseException) -> None:
        """Generation failed: an error frame, the slot's caches and the prefix cache reset
        (they cannot be trusted after a failure mid-forward), then the done frame."""
        log.error("generation failed for %s", self.req.id, exc_info=exc)
        if self.finished:
            return
        self.emit(error_frame(self.req.id, exc))
        if self.spec is not None:
            self.spec.draft.discard()
            self.spec = None
        self.session = None
        self.engine._invalidate_caches(self.slot)
        self.finish(Outcome("error"))

    def finish(self, outcome: Outcome) -> None:
        """Close the sessions and send the done frame (once)."""
        if self.finished:
            return
        self.finished = True
        self.outcome = outcome
        try:
            if outcome.error is not None:
                self.emit(CodedError(outcome.error).frame(self.req.id))
            if self.spec is not None:
                self.spec.__exit__(None, None, None)
            if self.session is not None:
                self.engine._close_session(self.session, outcome, self.slot)
        finally:
            self._done()

    def _done(self) -> None:
        self.engine.stream_closed(self)
        t_end = time.perf_counter_ns()
        t_prefill = self.first_token_ns or t_end
        self.emit(
            pf.Done(
                id=self.req.id,
                done_reason=self.outcome.reason,
                prompt_tokens=len(self.req.prompt),
                prompt_cached_tokens=self.cached,
                prompt_eval_ns=t_prefill - self.start_ns,
                eval_tokens=self.ledger.used,
                eval_ns=t_end - t_prefill,
                speculation=pf.Speculation(**self.stats.as_dict()),
            )
        )
