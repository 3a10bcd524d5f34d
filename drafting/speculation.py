"""Speculation as one per-model object, and the per-request session it opens.

``Speculation`` owns what lives as long as the loaded model: the MTP head, its draft KV cache
(one more cache slot of the prefix cache) and the depth controller, which learns acceptance
and round costs across requests. ``open`` starts a request's ``RequestSpeculation`` before
prefill: the draft session that sees every committed forward (so speculation can start or
resume at any step without an extra forward), the request's counters, and the request's
drafter (``RoundDriver``), which ``runner.decoder.DecodeLoop`` drives between pipelined plain
steps. The session closes on
every exit path (``with``): the draft cache then rests level with the target, or the head is
discarded when the request failed.

Nothing a head does can fail a request: every call into the draft session is guarded, and a
failure discards the head for the rest of the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from cache.kv import KVCache
from cache.ledger import Ledger, Outcome
from drafting.assistant import AssistantSession
from drafting.depth import DepthController, FixedDepth
from drafting.head import MTPHead
from drafting.logprobs import LogprobRows
from drafting.mlx_ops import MlxRoundOps
from drafting.rounds import RoundDriver
from drafting.session import DraftSession
from drafting.stats import SpecStats
from drafting.suffix import SuffixDrafter, SuffixModel

log = logging.getLogger("mtp_runner.speculation")


class Speculation:
    """The MTP head of one loaded target, its draft cache and its depth controller.

    ``fixed_depth`` drafts that many tokens every round instead of the adaptive depth
    (benchmarks, tests); ``max_depth`` bounds the adaptive one. ``request_head`` wraps the head
    for each request (the runner's fault seam arms a failing head with it; None: the head).
    ``forced_drafts`` False makes a constrained round draft a grammar-forced token by the head
    instead of as it is (a benchmark's comparison).
    """

    def __init__(
        self,
        head: MTPHead | None,
        *,
        max_depth: int,
        fixed_depth: int | None = None,
        request_head: Callable[[MTPHead], Any] | None = None,
        forced_drafts: bool = True,
        suffix: bool = True,
        assistant: Any = None,
        recent_tokens: int = 0,
    ) -> None:
        self.head = head
        # A drafter over the target's own caches instead of a head (``session()`` gives a
        # request's ``drafting.assistant.AssistantSession``); it keeps no draft cache.
        self.assistant = assistant
        self.cache = KVCache() if head is not None else None
        self.depth = DepthController(max_depth=max_depth)
        self.fixed_depth = fixed_depth
        self.request_head = request_head
        self.forced_drafts = forced_drafts
        # Drafting from the text already seen (drafting.suffix); None: the head alone.
        self.suffix = SuffixModel(recent_tokens) if suffix else None

    @property
    def sources(self) -> list[str]:
        """The drafters in use, for the ``ready`` frame."""
        drafters = (("head", self.head), ("assistant", self.assistant), ("suffix", self.suffix))
        return [name for name, on in drafters if on is not None]

    def open(
        self, unembed: Callable[[mx.array], mx.array], cache: KVCache | None = None
    ) -> RequestSpeculation:
        """A request's session, opened before prefill (``unembed``: the target's output head;
        ``cache``: the draft cache of the request's cache slot, by default the model's own)."""
        draft = None
        if self.head is not None:
            head = self.head if self.request_head is None else self.request_head(self.head)
            draft = DraftSession(head, self.cache if cache is None else cache, unembed)
        elif self.assistant is not None:
            draft = self.assistant.session()
        return RequestSpeculation(self, draft)

    def status(self) -> dict:
        """Plain values for the ``status`` frame."""
        state = self.depth.state()
        if self.suffix is not None:
            state["suffix"] = self.suffix.state()
        return {"speculation_depth": self.depth.scheduled, "speculation": state}


class RequestSpeculation:
    """One request's speculation; use as a context manager so it closes on every exit path."""

    def __init__(self, owner: Speculation, draft: DraftSession | None) -> None:
        self.owner = owner
        self.draft = draft  # None: no head (the suffix drafter alone)
        self.stats = SpecStats()
        self.final: int | None = None  # the token after the last fed one, once known
        # For prefill and the plain decoder: the head sees every committed forward.
        self.on_commit = guarded(draft, "committed") if draft is not None else None
        self.ledger: Ledger | None = None  # the decode loop's, once it asked for a drafter
        self.prompt: Sequence[int] = ()

    def __enter__(self) -> RequestSpeculation:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        suffix = self.owner.suffix
        if suffix is not None and self.ledger is not None and suffix.recent.limit:
            # What the request generated drafts for later requests (drafting.suffix), however
            # it ended: the committed tokens are the model's own output either way.
            try:
                suffix.recent.add(self.ledger.committed, self.prompt)
            except Exception:  # an index for speed only: never the request's failure
                log.exception("indexing the request's output for later drafts failed")
        if self.draft is None:
            return
        if kind is not None:
            self.draft.discard()  # the caches are being thrown away
            return
        if self.final is not None:
            guarded(self.draft, "settle")(self.final)
        guarded(self.draft, "close")()

    def discard(self) -> None:
        """The request failed: the draft cache is not trusted any more."""
        if self.draft is not None:
            self.draft.discard()

    def finish(self, outcome: Outcome) -> Outcome:
        """Remember how generation ended: closing completes the last pair with
        ``outcome.final`` so the draft cache rests level with the target."""
        self.final = outcome.final
        return outcome

    def drafter(
        self,
        ledger: Ledger,
        cancelled: Callable[[], bool],
        *,
        model,
        caches: list,
        sampler,
        emit: Callable[[int], Any],
        speculate: bool = True,
        logprobs: LogprobRows | None = None,
        constraint=None,
        prompt: Sequence[int] = (),
    ) -> RoundDriver:
        """The request's drafter for ``runner.decoder.DecodeLoop``: speculative rounds on the
        request's ``ledger`` (which holds its budget), parking whenever the depth is 0;
        ``speculate`` False parks for good (the draft cache still follows every committed
        forward). ``logprobs`` receives the target's rows of every round for the emitter to
        take. ``constraint`` (constrained output) masks the drafts and the verify rows and
        follows every token the rounds feed. ``prompt``: the request's prompt tokens, which
        with the ledger's committed tokens are the text the suffix drafter looks in."""
        owner = self.owner
        self.ledger, self.prompt = ledger, prompt
        fixed = owner.fixed_depth
        if fixed is not None:
            depth = FixedDepth(fixed if speculate else 0)
        else:
            depth = owner.depth.for_request(speculative=speculate)
        suffix = None
        if owner.suffix is not None and speculate:
            suffix = SuffixDrafter(
                owner.suffix, list(prompt), lambda: ledger.committed, fixed=fixed or None
            )
        if isinstance(self.draft, AssistantSession):
            self.draft.bind(caches)  # it drafts over the request's target caches
        ops = MlxRoundOps(
            model, caches, self.draft, sampler, logprobs, constraint, owner.forced_drafts
        )
        return RoundDriver(
            ops, emit, cancelled, depth=depth, stats=self.stats, ledger=ledger, suffix=suffix
        )


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
