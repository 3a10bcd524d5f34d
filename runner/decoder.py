"""The pipelined plain decoder and the one decode loop.

The plain decoder keeps one forward in flight: the forward that feeds token n is dispatched
(``mx.async_eval``) before token n is read on the host, so detokenizing, frame writing and
Python overhead overlap the model. Token n's own successor is the next in-flight result.

Ledgers: a token is *fed* when its forward is dispatched; its effects are *reported*
(penalty history, draft session) and it is *committed* in the request's ``cache.ledger.Ledger``
only once it is known to stay. An EOS dispatched before it was read is rewound away.

``DecodeLoop`` is a request's decode loop as steps: a pipelined plain step, or a round of a
``Drafter`` (``drafting.rounds.RoundDriver``) while it does not park. Every emitted token,
whichever path emits it, is judged by ``Ledger.judge``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from cache.ledger import Ledger, Outcome, Verdict
from drafting.logprobs import LogprobRows
from drafting.mlx_ops import dispatch_layer
from drafting.rounds import RoundError
from runner.constraint import masked
from runner.prefill import CommitHook, takes_layer_hook

log = logging.getLogger("mtp_runner.decoder")


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

    ``start(last_prompt)`` feeds the last prompt token and returns the in-flight sample for
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
        ``emitted``: the fed tokens are generated ones (not the last prompt token)."""
        return logits

    def start(self, last_prompt: int) -> Sampled:
        """Feed the last prompt token (already in the penalty history with the prompt)."""
        return self._feed(mx.array([last_prompt], dtype=mx.int32), append=False)

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
        if emitted:  # generated tokens the grammar has not seen (not the last prompt token)
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
        self.ledger.budget = max_tokens or None  # 0: no budget
        self.context_length = context_length
        self.logprob_entry = logprob_entry
        self.on_first_token = on_first_token
        self._first = True

    @property
    def fed(self) -> list[int]:
        """The generated tokens the caches hold (the ledger's committed tokens)."""
        return self.ledger.committed

    def start(self, last_prompt: int) -> Sampled:
        """Feed the last prompt token; return the first in-flight sample."""
        cur = self.dec.start(last_prompt)
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

    def context_full(self) -> bool:
        """Whether the current token takes the context's last position."""
        return self.dec.position + 1 >= self.context_length

    def is_last(self) -> bool:
        """Whether the current token is certainly the last one (budget or context end): the
        step emits it without feeding it."""
        remaining = self.ledger.remaining()
        return (remaining is not None and remaining <= 1) or self.context_full()

    def emit(self, cur: Sampled, context_full: bool) -> tuple[int, Verdict]:
        """Read ``cur``, hand it to the emitter and judge it (``Ledger.judge``);
        ``context_full`` as ``context_full()`` said before ``cur``'s forward was dispatched."""
        token = self.read(cur)
        step = self.emitter.push(token, self.logprob_entry(cur))
        return token, self.ledger.judge(token, step, context_full=context_full)

    def step(self, cur: Sampled) -> LoopStep:
        """Emit ``cur``, dispatching the forward that feeds it first unless it is the last."""
        dec, ledger = self.dec, self.ledger
        context_full = self.context_full()
        nxt = None if self.is_last() else dec.advance(cur)
        token, verdict = self.emit(cur, context_full)
        if not verdict.fed or nxt is None:  # an EOS (its forward undone), or the last token
            if nxt is not None:
                dec.unfeed(nxt)
            return LoopStep(Outcome(verdict.end, self.fed, token))
        ledger.commit([token])
        dec.commit(nxt)
        if verdict.end is not None:
            return LoopStep(Outcome(verdict.end, self.fed, dec.read(nxt)))
        if verdict.forced:
            # The in-flight successor assumed no close marker; feed the marker instead.
            nxt = dec.feed_forced(verdict.forced)
            ledger.commit(verdict.forced)
            dec.commit(nxt)
        return LoopStep(None, nxt)


class Drafter(Protocol):
    """What the decode loop needs from a drafter (``drafting.rounds.RoundDriver``; a second
    drafter implements the same three calls)."""

    def plan(self) -> DraftPlan:
        """The next round's plan; ``parked`` means a plain step instead of a round."""

    def round(self, x: int, plan: DraftPlan | None = None) -> RoundOutcome:
        """One round at the current token ``x`` (emits it and whatever it accepts) as ``plan``
        (the plan just asked) says; raises ``drafting.rounds.RoundError`` when the request
        cannot go on."""

    def warm_round(self, last: int) -> RoundOutcome | None:
        """The first round, feeding the prompt's last token with drafts (None: no draft, or a
        failure before anything was committed; the token is then fed plainly)."""

    def parked_round(self) -> None:
        """Account one plain step taken while parked (it wrote its token to the ledger)."""


class DraftPlan(Protocol):
    parked: bool


class RoundOutcome(Protocol):
    reason: str  # "continue", "stop", "length" or "cancel"
    next: int | None  # the successor when the round continues

    @property
    def finished(self) -> bool: ...


class DecodeLoop:
    """One request's decode loop as steps. ``cur`` is always the current token: sampled, not
    yet emitted, not yet fed; lazy while the plain loop has it in flight. Resuming a drafter
    needs no extra forward: a round starts from the plain loop's in-flight sample. Between
    steps a scheduler may advance ``cur`` itself with plain steps (:meth:`stepped`), e.g. in a
    forward shared with other requests; the drafter's session follows those too."""

    def __init__(
        self,
        plain: PlainLoop,
        cur: Sampled,
        cancelled: Callable[[], bool],
        drafter: Drafter | None = None,
        logprobs: LogprobRows | None = None,
    ) -> None:
        self.plain = plain
        self.cur = cur
        self.cancelled = cancelled
        self.drafter = drafter
        self.logprobs = logprobs

    def cancel_check(self) -> Outcome | None:
        """The outcome of a cancel seen before a step, else None."""
        if self.cancelled():
            plain = self.plain
            return Outcome("cancelled", plain.fed, plain.dec.read(self.cur))
        return None

    def stepped(self, step: LoopStep) -> Outcome | None:
        """Take the result of a plain step run on ``cur``."""
        if step.outcome is not None:
            return step.outcome
        self.cur = step.next
        return None

    def step(self) -> Outcome | None:
        """One plain step or one round; the outcome once generation ended."""
        if (outcome := self.cancel_check()) is not None:
            return outcome
        plain, drafter = self.plain, self.drafter
        plan = drafter.plan() if drafter is not None else None
        if plan is None or plan.parked:
            step = plain.step(self.cur)  # one pipelined plain step, a depth-0 round
            if drafter is not None:
                drafter.parked_round()
            return self.stepped(step)
        x = plain.read(self.cur)
        self._hand_over_logprobs(x)
        try:
            end = drafter.round(x, plan)  # reading x changed nothing the plan depends on
        except RoundError as error:
            return self._failed(error)
        return self._ended(end)

    def settled(self, settle: Callable[[], RoundOutcome | None]) -> Outcome | None:
        """Take a round a scheduler ran inside a shared forward (``settle``, the drafter's
        rest of it): None while generation goes on (``cur`` its successor), else the
        outcome."""
        try:
            end = settle()
        except RoundError as error:
            return self._failed(error)
        if end is None:  # only a warm round gives none: a scheduler never shares one
            raise RuntimeError("a shared round ended without a successor")
        return self._ended(end)

    def warm(self, last_prompt: int) -> tuple[bool, Outcome | None]:
        """Start with a warm round (``Drafter.warm_round``): ``(False, None)`` when it did not
        run (feed the last prompt token plainly, then set ``cur``); else ``(True, outcome)``,
        outcome None while generation goes on from ``cur``."""
        try:
            end = self.drafter.warm_round(last_prompt)
        except RoundError as error:
            return True, self._failed(error)
        if end is None:
            return False, None
        return True, self._ended(end)

    def _failed(self, error: RoundError) -> Outcome:
        if not error.reusable:
            raise error
        # The caches hold exactly the committed prefix: end this request only.
        log.error("speculative round failed: %s", error)
        return Outcome("error", self.plain.fed, None, error=str(error))

    def _ended(self, end: RoundOutcome) -> Outcome | None:
        """After a round: None while generation goes on (``cur`` its successor), else the
        outcome."""
        plain = self.plain
        if not end.finished:
            self.cur = plain.resume(end.next)
            return None
        ledger = plain.ledger
        final = None
        if len(ledger.emitted) > len(ledger.committed):
            final = ledger.emitted[len(ledger.committed)]
        return Outcome("cancelled" if end.reason == "cancel" else end.reason, plain.fed, final)

    def _hand_over_logprobs(self, x: int) -> None:
        """A plain step decided x and the round emits it: hand its logprob row over."""
        if self.logprobs is not None and self.cur.logprobs is not None:
            chosen, ids, values = self.cur.logprobs
            position = self.plain.dec.position
            self.logprobs.put(position, [x], [chosen.item()], [ids.tolist()], [values.tolist()])
