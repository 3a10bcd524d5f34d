"""Speculation as one per-model object, and the per-request session it opens.

``Speculation`` owns what lives as long as the loaded model: the MTP head, its draft KV cache
(one more cache slot of the prefix cache) and the depth controller, which learns acceptance
and round costs across requests. ``open`` starts a request's ``SpeculationSession`` before
prefill: the draft session that sees every committed forward (so speculation can start or
resume at any step without an extra forward), the request's counters, and the decode loop
that moves between speculative rounds and the pipelined plain loop. The session closes on
every exit path (``with``): the draft cache then rests level with the target, or the head is
discarded when the request failed.

Nothing a head does can fail a request: every call into the draft session is guarded, and a
failure discards the head for the rest of the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from cache.kv import KVCache
from cache.ledger import Ledger, Outcome
from drafting.depth import DepthController, FixedDepth
from drafting.head import MTPHead
from drafting.logprobs import LogprobRows
from drafting.mlx_ops import MlxRoundOps
from drafting.rounds import RoundDriver, RoundError
from drafting.session import DraftSession
from drafting.stats import SpecStats

log = logging.getLogger("mtp_runner.speculation")


class PlainLoop(Protocol):
    """What the decode loop needs from ``runner.decoder.PlainLoop``."""

    ledger: Ledger
    dec: Any  # the plain decoder: ``dec.read(cur)`` reads a sample without emitting it

    @property
    def fed(self) -> list[int]: ...

    def start(self, seed: int) -> Any: ...

    def step(self, cur: Any) -> Any: ...  # -> LoopStep(outcome, next)

    def read(self, cur: Any) -> int: ...

    def resume(self, token: int) -> Any: ...


class Speculation:
    """The MTP head of one loaded target, its draft cache and its depth controller.

    ``fixed_depth`` drafts that many tokens every round instead of the adaptive depth
    (benchmarks, tests); ``max_depth`` bounds the adaptive one. ``fault_after`` (a test hook)
    makes the head's n-th call in every request raise, as a failing head would.
    """

    def __init__(
        self,
        head: MTPHead,
        *,
        max_depth: int,
        fixed_depth: int | None = None,
        fault_after: int | None = None,
    ) -> None:
        self.head = head
        self.cache = KVCache()
        self.depth = DepthController(max_depth=max_depth)
        self.fixed_depth = fixed_depth
        self.fault_after = fault_after

    def open(
        self, unembed: Callable[[mx.array], mx.array], cache: KVCache | None = None
    ) -> SpeculationSession:
        """A request's session, opened before prefill (``unembed``: the target's output head;
        ``cache``: the draft cache of the request's cache slot, by default the model's own)."""
        head = self.head if self.fault_after is None else _FailingHead(self.head, self.fault_after)
        draft = DraftSession(head, self.cache if cache is None else cache, unembed)
        return SpeculationSession(self, draft)

    def status(self) -> dict:
        """Plain values for the ``status`` frame."""
        return {"speculation_depth": self.depth.scheduled, "speculation": self.depth.state()}


class SpeculationSession:
    """One request's speculation; use as a context manager so it closes on every exit path."""

    def __init__(self, owner: Speculation, draft: DraftSession) -> None:
        self.owner = owner
        self.draft = draft
        self.stats = SpecStats()
        self.final: int | None = None  # the token after the last fed one, once known
        self.on_commit = guarded(draft, "committed")  # for prefill and the plain decoder

    def __enter__(self) -> SpeculationSession:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.draft.discard()  # the caches are being thrown away
            return
        if self.final is not None:
            guarded(self.draft, "settle")(self.final)
        guarded(self.draft, "close")()

    def finish(self, outcome: Outcome) -> Outcome:
        """Remember how generation ended: closing completes the last pair with
        ``outcome.final`` so the draft cache rests level with the target."""
        self.final = outcome.final
        return outcome

    def decoding(
        self,
        loop: PlainLoop,
        cur: Any,
        cancelled: Callable[[], bool],
        *,
        model,
        caches: list,
        sampler,
        emit: Callable[[int], Any],
        budget: int | None,
        speculate: bool = True,
        logprobs: LogprobRows | None = None,
        constraint=None,
    ) -> Decoding:
        """The decode loop from ``cur`` (the plain loop's first in-flight sample), one
        :meth:`Decoding.step` at a time: speculative rounds, parking in the pipelined plain
        loop whenever the depth is 0; ``speculate`` False parks for good (the draft cache
        still follows every committed forward). ``logprobs`` receives the target's rows of
        every round for the emitter to take. ``constraint`` (constrained output) masks the
        drafts and the verify rows and follows every token the rounds feed."""
        fixed = self.owner.fixed_depth
        if fixed is not None:
            depth = FixedDepth(fixed if speculate else 0)
        else:
            depth = self.owner.depth.session(speculative=speculate)
        ops = MlxRoundOps(model, caches, self.draft, sampler, logprobs, constraint)
        driver = RoundDriver(
            ops,
            emit,
            cancelled,
            depth=depth,
            budget=budget,
            stats=self.stats,
            ledger=loop.ledger,
        )
        return Decoding(loop, cur, cancelled, driver, logprobs, session=self)

    def decode(self, loop: PlainLoop, seed: int, cancelled: Callable[[], bool], **kwargs):
        """:meth:`decoding` from ``seed`` (the last prompt token) until generation ends."""
        return self.decoding(loop, loop.start(seed), cancelled, **kwargs).run()


class Decoding:
    """One request's decode loop as steps. ``cur`` is always the current token: sampled, not
    yet emitted, not yet fed; lazy while the plain loop has it in flight. Resuming speculation
    needs no extra forward: a round starts from the plain loop's in-flight sample. Between
    steps a scheduler may advance ``cur`` itself with plain steps (:meth:`stepped`), e.g. in a
    forward batched with other requests; the draft session follows those too."""

    def __init__(
        self,
        loop: PlainLoop,
        cur: Any,
        cancelled: Callable[[], bool],
        driver: RoundDriver | None = None,
        logprobs: LogprobRows | None = None,
        session: SpeculationSession | None = None,
    ) -> None:
        self.loop = loop
        self.cur = cur
        self.cancelled = cancelled
        self.driver = driver
        self.logprobs = logprobs
        self.session = session
        self.cur_token: int | None = None  # ``cur`` read and emitted, while it is being fed

    def run(self) -> Outcome:
        while (outcome := self.step()) is None:
            pass
        return outcome

    def ended(self, outcome: Outcome) -> Outcome:
        """Generation ended with ``outcome`` (in a step the caller ran itself)."""
        return self.session.finish(outcome) if self.session is not None else outcome

    _end = ended

    def cancel_check(self) -> Outcome | None:
        """The outcome of a cancel seen before a step, else None."""
        if self.cancelled():
            loop = self.loop
            return self._end(Outcome("cancelled", loop.fed, loop.dec.read(self.cur)))
        return None

    def stepped(self, step: Any) -> Outcome | None:
        """Take the result of a plain step the caller ran on ``cur`` (``loop.step``)."""
        if step.outcome is not None:
            return self._end(step.outcome)
        self.cur = step.next
        return None

    def step(self) -> Outcome | None:
        """One plain step or one speculative round; the outcome once generation ended."""
        if (outcome := self.cancel_check()) is not None:
            return outcome
        loop, driver, logprobs = self.loop, self.driver, self.logprobs
        if driver is None or driver.plan().parked:
            step = loop.step(self.cur)  # one pipelined plain step, a depth-0 round
            if driver is not None:
                driver.parked_round()
            return self.stepped(step)
        x = loop.read(self.cur)
        if logprobs is not None and self.cur.logprobs is not None:
            # A plain step decided x: the round emits it, so hand its row over.
            chosen, ids, values = self.cur.logprobs
            logprobs.put(loop.dec.position, [x], [chosen.item()], [ids.tolist()], [values.tolist()])
        try:
            end = driver.round(x)
        except RoundError as error:
            if not error.reusable:
                raise
            # The caches hold exactly the committed prefix: end this request only.
            log.error("speculative round failed: %s", error)
            return self._end(Outcome("error", loop.fed, None, error=str(error)))
        if not end.finished:
            self.cur = loop.resume(end.next)
            return None
        ledger = loop.ledger
        final = None
        if len(ledger.emitted) > len(ledger.committed):
            final = ledger.emitted[len(ledger.committed)]
        reason = "cancelled" if end.reason == "cancel" else end.reason
        return self._end(Outcome(reason, loop.fed, final))


def guarded(draft: DraftSession, method: str) -> Callable:
    """``draft.<method>`` that discards the head instead of failing the request."""

    def call(*args):
        if draft.discarded:
            return
        try:
            getattr(draft, method)(*args)
        except Exception:
            log.exception("draft head failed in %s; continuing without speculation", method)
            draft.discard()

    return call


class _FailingHead:
    """The head with a fault on its ``n``-th forward (``Speculation.fault_after``)."""

    def __init__(self, head: MTPHead, n: int) -> None:
        self._head, self._left = head, n

    def __call__(self, *args, **kwargs):
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("injected draft head fault")
        return self._head(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._head, name)
