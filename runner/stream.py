"""One completion from admission to its done frame, as steps a scheduler can interleave.

A ``Stream`` owns what a request owns: its cache slot's session on the prefix cache, its
request speculation (the draft session on the slot's draft cache), sampler, emitter, ledger
and decode loop. Its life has two phases: *prefill* (``prefill``: the prompt in chunks, all at
once or a few layers at a time between other requests' decode steps, ``runner.prefill``) and
*decode*: steps of its own (``step``: a plain step or a drafter's round, ``DecodeLoop``) or
rows of a forward shared with other streams (``row`` before it, ``sample`` and ``take`` after
it; ``runner.batch``). ``finish`` closes every session on every exit path and sends the one
done frame.

Prefill chunks end at the same offsets however they are interleaved, and a shared forward's
rows compute what a forward of their own computes (``Model.hidden_rows``), so a stream's
output does not depend on what else runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from cache.ledger import Ledger, Outcome
from cache.session import CacheSession
from drafting.logprobs import LogprobEntry, LogprobRows
from drafting.rounds import OpenRound
from drafting.speculation import RequestSpeculation
from drafting.stats import SpecStats
from protocol import frames as pf
from protocol.errors import CodedError, error_frame
from runner.cache_slot import CacheSlot
from runner.constraint import AfterThinking
from runner.decoder import ConstrainedDecoder, DecodeLoop, PlainDecoder, PlainLoop, Sampled
from runner.emit import Emitter, logprob_frame
from runner.prefill import Cancelled, ChunkedPrefill
from runner.prepare import Prepared
from runner.sampler import Sampler

log = logging.getLogger("mtp_runner.stream")

Emit = Callable[[object], None]


@dataclass
class Row:
    """A stream's rows of a shared forward: ``tokens`` fed at ``position``; ``token`` the
    emitted token they start with, None when they feed the last prompt token; ``round``
    the speculative round whose verify feed they are (``tokens`` the token and its drafts),
    None for a plain row."""

    tokens: mx.array
    position: int
    token: int | None
    round: OpenRound | None = None


class Stream:
    """A request's state between scheduler steps; see the module docstring. ``on_close`` runs
    once, right before the done frame."""

    def __init__(
        self,
        engine,
        req: Prepared,
        emit: Emit,
        cancelled: Callable[[], bool],
        slot: CacheSlot,
        on_close: Callable[[Stream], None] = lambda stream: None,
    ) -> None:
        self.engine = engine
        self.req = req
        self.emit = emit
        self.cancelled = cancelled
        self.slot = slot
        self.on_close = on_close
        self.start_ns = time.perf_counter_ns()
        self.first_token_ns: int | None = None
        self.ledger = Ledger()
        self.outcome = Outcome("error")
        self.finished = False
        self.decode: DecodeLoop | None = None
        self.plain: PlainLoop | None = None
        # A prompt with images: the layout every forward over the slot's caches reads
        # (runner.images), and image rows keyed by the image in the prefix cache.
        self.images = engine.image_layout(req)
        keys = self.images.key_tokens(req.prompt) if self.images is not None else None
        self.session: CacheSession | None = slot.begin(req.prompt, keys)
        self.cached = self.session.cached
        self.from_disk = self.session.from_disk
        self.spec: RequestSpeculation | None = None
        if engine.speculation is not None:
            self.spec = engine.speculation.open(engine.model.unembed, slot.draft)
        if self.images is not None:
            if slot.draft is not None:
                self.images.reads("draft")  # the head embeds image rows in its deferred flush
            for cache in slot.all:
                cache.layout = self.images
        self.stats = self.spec.stats if self.spec is not None else SpecStats()
        self.emitter = Emitter(
            engine.tokenizer,
            stop=req.stop,
            max_tokens=req.max_tokens,
            think_budget=req.think_budget,
            send=self._send,
            prompt_open_think=req.opens_think,
        )
        # A zero think budget on a span the prompt opened closes it before the first token:
        # the close marker is fed after the prompt, as if the prompt had ended with it.
        forced = self.emitter.force_at_start()
        self.ledger.force(forced)
        if forced and isinstance(req.constraint, AfterThinking):
            req.constraint.activate()  # the span closed before the first token
        self.sequence = [*req.prompt, *forced]
        feed = [*self.session.remaining, *forced]
        self.unfed_prompt: int | None = None  # the last prompt token, until it is fed
        self._last_prompt = feed[-1]
        on_commit = self.spec.on_commit if self.spec is not None else None
        self.prefilling_work = ChunkedPrefill(
            engine.model,
            slot.caches,
            feed[:-1],
            self.session.cached,
            chunk=engine.chunk,
            cancelled=cancelled,
            on_commit=on_commit,
            opening=engine.opening,  # every prompt's opening rows computed one way
        )

    # ------------------------------------------------------------------ prefill
    @property
    def prefilling(self) -> bool:
        return self.plain is None and not self.finished

    @property
    def speculates(self) -> bool:
        return self.decode is not None and self.decode.drafter is not None

    def prefill(self, budget_s: float | None = None) -> bool:
        """Prefill some of the prompt (``ChunkedPrefill.run``: all of it, one chunk, or
        layers within ``budget_s``). True once the prompt is in (the stream then decodes).
        A cancel ends the stream."""
        try:
            done = self.prefilling_work.run(budget_s)
        except Cancelled:
            self._cancelled_in_prefill()
            return False
        if done:
            self._start_decoding()
        return done

    def cancel_if_asked(self) -> bool:
        """A prompt waiting for its turn: end it now if it was cancelled (True)."""
        if self.finished or not self.prefilling or not self.cancelled():
            return False
        self.prefilling_work.rewind()
        self._cancelled_in_prefill()
        return True

    def _cancelled_in_prefill(self) -> None:
        # Keep what prefill finished; level the draft cache with the next token.
        offset = self.slot.caches[0].offset
        fed = self.sequence[len(self.req.prompt) : offset]
        self.end(Outcome("cancelled", fed=fed, final=self.sequence[offset]))

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
        self.plain = PlainLoop(
            self.decoder,
            self.emitter,
            self.ledger,
            max_tokens=req.max_tokens,
            context_length=engine.info.context_length,
            logprob_entry=self._logprob_entry,
            on_first_token=self._first_token,
        )
        self.unfed_prompt = self._last_prompt

    def _started(self, cur: Sampled, drafter=None) -> None:
        """The last prompt token was fed (by a forward of its own or a shared one): ``cur`` is
        the first in-flight sample."""
        self.unfed_prompt = None
        self.decoder.commit(cur)
        if drafter is None:
            drafter = self._drafter()
        self.decode = DecodeLoop(self.plain, cur, self.cancelled, drafter, self.rows)

    def _drafter(self):
        """The request's drafter (``drafting.rounds.RoundDriver``), None without speculation."""
        if self.spec is None:
            return None
        return self.spec.drafter(
            self.ledger,
            self.cancelled,
            model=self.engine.model,
            caches=self.slot.caches,
            sampler=self.sampler,
            emit=self._push,
            speculate=self.req.speculative,
            logprobs=self.rows,
            constraint=self.req.constraint,
            prompt=self.req.prompt,
        )

    def _warm_start(self) -> bool:
        """Feed the last prompt token with the first drafts (a warm round) when a drafter has
        any; False when it fed nothing (the caller feeds the token plainly)."""
        if self.spec is None or not self.req.speculative or self.cancelled():
            return False
        loop = DecodeLoop(self.plain, None, self.cancelled, self._drafter(), self.rows)
        ran, outcome = loop.warm(self.unfed_prompt)
        if not ran:
            self._started(self.decoder.start(self.unfed_prompt), loop.drafter)
            return True
        self.unfed_prompt = None
        self.decode = loop
        if outcome is not None:
            self.end(outcome)
        return True

    # ------------------------------------------------------------------ decode alone
    def step(self) -> bool:
        """One step of its own (the first feeds the last prompt token); True once the stream
        finished."""
        if self.unfed_prompt is not None:
            if not self._warm_start():
                self._started(self.decoder.start(self.unfed_prompt))
            return self.finished
        outcome = self.decode.step()
        if outcome is not None:
            self.end(outcome)
            return True
        return False

    def alone_again(self) -> None:
        """The stream decodes alone after shared forwards: the drafters' round clocks saw
        shared forwards, which are not a round's cost."""
        if self.speculates:
            self.spec.owner.depth.begin_request()
            self.decode.drafter.pause()

    # ------------------------------------------------------------------ rows of a shared forward
    def row(self, row_cost: float | None = None, spare: int = 0) -> Row | None:
        """Before a shared forward: the current token is emitted (the previous forward
        computed it) and the row that feeds it, or the last prompt token, is recorded as fed.
        With ``row_cost`` (tokens of the other streams a row costs) the token's row carries
        the suffix drafter's draft after it, at most ``spare`` tokens, when that pays
        (``RoundDriver.shared_round``). None when the stream ended, or fed forced close
        markers in forwards of its own."""
        if self.unfed_prompt is not None:
            last = mx.array([self.unfed_prompt], dtype=mx.int32)
            return Row(*self.decoder.row_feed(last, append=False), token=None)
        if self.speculates:  # shared forwards are no round's cost
            self.decode.drafter.pause()
        token = self._emit_current()
        if token is None:
            return None
        if self.speculates and row_cost is not None:
            driver = self.decode.drafter
            # Room for the drafts and their successor before the context's end.
            room = self.engine.info.context_length - self.decoder.position - 2
            opened = driver.shared_round(token, row_cost, min(room, spare))
            if opened is not None:
                return Row(*driver.ops.verify_ids(token, opened.proposal), token, opened)
        fed = mx.array([token], dtype=mx.int32)
        return Row(*self.decoder.row_feed(fed, append=True), token=token)

    def sample(self, row: Row, hidden: mx.array, logits: mx.array) -> Sampled:
        """The sample after a plain ``row`` from its row of the shared forward (lazy)."""
        return self.decoder.row_sample(row.tokens, hidden, logits, row.position)

    def settle(self, row: Row, hidden: mx.array, logits: mx.array) -> None:
        """After the shared forward: the round of a speculative ``row`` verified from its
        rows (one sync), its accepted drafts emitted, the caches rewound to what it keeps."""
        driver, opened = self.decode.drafter, row.round

        def verify():
            return driver.ops.verify_rows(row.token, opened.proposal, row.position, hidden, logits)

        outcome = self.decode.settled(lambda: driver.settle(opened, verify))
        if outcome is not None:
            self.end(outcome)

    def take(self, row: Row, sampled: Sampled) -> None:
        """After the shared forward: ``row`` stays in the caches, ``sampled`` is current."""
        if row.token is None:
            self._started(sampled)
            return
        self.ledger.commit([row.token])
        self.decoder.commit(sampled)
        self.decode.cur = sampled

    def in_flight(self) -> mx.array | None:
        """The current token while it is being computed, for a scheduler that waits for it."""
        if self.finished or self.decode is None:
            return None
        return self.decode.cur.token

    def cache_state(self) -> list:
        return self.decoder.cache_state()

    def _emit_current(self) -> int | None:
        """Emit the current token as a plain step would; the token to feed when the stream
        goes on (None: it ended, or fed its own forwards for forced close markers)."""
        outcome = self.decode.cancel_check()
        if outcome is not None:
            self.end(outcome)
            return None
        token, verdict = self.plain.emit(self.decode.cur, self.plain.context_full())
        if not verdict.fed or verdict.end is not None:  # EOS, the budget, the context, a stop
            self.end(Outcome(verdict.end, self.plain.fed, token))
            return None
        if verdict.forced:
            # A close marker follows the token: the stream feeds both in forwards of its own,
            # one after the other, as a plain step does.
            self.ledger.commit([token])
            self.decoder.commit(self.decoder.feed_forced([token]))
            nxt = self.decoder.feed_forced(verdict.forced)
            self.ledger.commit(verdict.forced)
            self.decoder.commit(nxt)
            self.decode.cur = nxt
            return None
        return token

    # ------------------------------------------------------------------ frames
    def _send(self, content: str, ids: list[int], logprobs: list | None) -> None:
        self.emit(pf.Token(id=self.req.id, content=content, tokens=list(ids), logprobs=logprobs))

    def _first_token(self) -> None:
        if self.first_token_ns is None:
            self.first_token_ns = time.perf_counter_ns()

    def _position_of_emitted(self) -> int:
        return len(self.req.prompt) + len(self.ledger.emitted)

    def _logprob_entry(self, sampled: Sampled) -> pf.TokenLogprob | None:
        """A plain step's entry: its own row, or the round's row it resumed from."""
        if self.rows is None:
            return None
        tokenizer = self.engine.tokenizer
        token = int(sampled.token.item())
        if sampled.logprobs is None:
            return logprob_frame(tokenizer, self.rows.take(self._position_of_emitted(), token))
        chosen, top_ids, top_lps = sampled.logprobs
        entry = LogprobEntry(token, float(chosen.item()), top_ids.tolist(), top_lps.tolist())
        return logprob_frame(tokenizer, entry)

    def _push(self, token: int):
        """The round driver's emission: the entry from the verify row that decided it."""
        self._first_token()  # a warm round emits the first token
        entry = None
        if self.rows is not None:
            taken = self.rows.take(self._position_of_emitted(), token)
            entry = logprob_frame(self.engine.tokenizer, taken)
        return self.emitter.push(token, entry)

    # ------------------------------------------------------------------ the end
    def end(self, outcome: Outcome) -> None:
        """Generation ended with ``outcome``: held text goes out, then ``finish``."""
        self.emitter.finish()
        self.finish(outcome)

    def fail(self, exc: BaseException) -> None:
        """Generation failed: an error frame, the slot's caches and the prefix cache reset
        (they cannot be trusted after a failure mid-forward), then the done frame."""
        log.error("generation failed for %s", self.req.id, exc_info=exc)
        if self.finished:
            return
        self.emit(error_frame(self.req.id, exc))
        if self.spec is not None:
            self.spec.discard()
            self.spec = None
        self.session = None
        self.slot.invalidate()
        self.finish(Outcome("error"))

    def finish(self, outcome: Outcome) -> None:
        """Close the sessions and send the done frame (once). The request speculation settles
        the last pair with ``outcome.final``, so the draft cache rests level with the target."""
        if self.finished:
            return
        self.finished = True
        self.outcome = outcome
        try:
            if outcome.error is not None:
                self.emit(CodedError(outcome.error).frame(self.req.id))
            if self.spec is not None:
                self.spec.finish(outcome)
                self.spec.__exit__(None, None, None)
            if self.session is not None:
                self.slot.close(self.session, outcome)
        finally:
            self._drop_images()
            self._done()

    def _drop_images(self) -> None:
        """The slot's caches serve text again; the images' memory goes."""
        if self.images is None:
            return
        for cache in self.slot.all:
            cache.layout = None
        self.images.release()

    def _done(self) -> None:
        self.on_close(self)
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
                speculation=speculation_frame(self.stats.as_dict()),
                prompt_disk_tokens=self.from_disk,
            )
        )


def speculation_frame(counts: dict) -> pf.Speculation:
    """The ``done`` frame's speculation counters from ``SpecStats.as_dict``."""
    sources = {name: pf.SourceCounts(**c) for name, c in counts.get("sources", {}).items()}
    return pf.Speculation(**{**counts, "sources": sources})
