"""The speculative round driver, behind a narrow seam of model operations.

Design note
-----------
Decoding with a draft head runs in rounds. A round starts at the current token ``x``: sampled,
not yet emitted, not yet fed. Entry invariant: the target caches hold exactly the committed
prefix; the draft KV holds one pair per committed token but the last (the frontier pair, the
last committed hidden with ``x``, is still open). The driver never touches arrays: all model
work goes through ``RoundOps`` (the real MLX implementation is ``drafting.mlx_ops``; tests use
a deterministic fake), which answers a verify feed with host ints after one sync.

The request's ``cache.ledger.Ledger`` (shared with the plain decoding loop) holds the two
token lists: ``emitted`` (every token handed to the emitter, plus forced close markers) and
``committed`` (the generated tokens the target caches hold). Committed is always a prefix of
emitted: a token that ends generation without ``keep`` (EOS) and a cancelled token are emitted
and never committed.

Transitions of one round, in order (the names are used in comments and tests):

EMIT_X       push x to the emitter. An emitter exception leaves everything at entry.
EOS_AT_X     the step finishes and may not keep x: end, zero forwards.
CANCEL_AT_X  ``cancelled()`` after x: end, zero forwards.
CLOSE_AT_X   the step forces close markers C (think budget; the emitter already streamed
             them): one replay feed of [x] + C, commit, head commit, successor from the
             replay's last row. Close markers do not use the token budget; when x was the
             last token allowed, the replay evaluates no logits and the request ends.
FINAL_SLOT   x is the last token allowed (driver budget, or the step finishes keeping x): one
             replay feed of [x] without logits, commit, head commit, end. No draft, no
             successor.
TARGET_ONLY  depth 0 (parked, disabled, head not ready): verify feed of [x] alone, commit,
             head commit, successor = row 0. Counted as a depth-0 round.
SPECULATE    capture the entry; head step (k lazy drafts); verify feed [x, d1..dk] (one sync:
             drafts, accept decisions, a successor for every acceptance depth); a = leading
             accepts; emit d1..da one by one; RECONCILE: rewind the target to entry + 1 + r,
             rewind the head to its entry pairs and commit [x, d1..dr] from the verified target
             rows; then the successor for depth a when the run was not cut.
             Cuts while emitting d_i: EOS or cancel (r = i - 1, end); stop or length keeping d_i
             (r = i, end); close markers C (r = i, then CLOSE_AT_DRAFT: replay C, successor from
             its last row); emitter exception (r = i - 1, head discarded, error).

SUFFIX       as SPECULATE with the suffix drafter's k drafts (``drafting.suffix``) in place
             of the head step: no head forward; RECONCILE commits the run to the head as
             after any round. Chosen when the plan says the text occurred before and the
             draft's expected rate beats the head's at its depth; the head's depth
             controller sees no such round (``round_elsewhere``), the suffix model learns
             its acceptance.

SHARED       a round inside a forward shared with other requests (``shared_round``, then
             ``settle`` once that forward computed): the shared step emitted and judged x
             as a plain step does, and it goes on; SUFFIX from x, when the draft's expected
             extra tokens beat what its rows cost every request in the forward; the head
             does not draft there (a head step per request would serialise).

WARM         the request's first round (``warm_round``): x is the prompt's last token, not
             yet fed, never emitted (``fed_prompt``: it is in the penalty history and the
             matcher already). The head drafts from the prefill's frontier, the suffix
             drafter continues the prompt; SPECULATE without EMIT_X, committing only the
             drafts. With no draft, or a head-step, draft-evaluation or verify-host failure,
             nothing stays fed and the caller feeds x plainly (None).

Failure rows (the ``OpError`` classes of the seam: invalid target state, head failure, host
failure after the caches were mutated):

HEAD_STEP_FAILED   HeadError (or TargetError) from the head step: discard the head, TARGET_ONLY.
                   HostError: rewind the head to its entry pairs, TARGET_ONLY with the pair
                   commit, so speculation resumes next round. Either way the drafts the step
                   proposed before failing (the error's ``drafted``) count as drafted.
DRAFT_EVAL_FAILED  the verify feed raises HeadError (the lazy drafts failed inside the fused
                   evaluation): restore the entry state, discard the head, TARGET_ONLY.
VERIFY_HOST        HostError after the verify forward (also a verification of the wrong
                   length): rewind to entry + 1 (x committed), discard the head;
                   successor = the salvage, else error (caches reusable).
TARGET_FAILED      TargetError from a feed, restore or rewind: error, caches not reusable.
HEAD_COMMIT_FAILED any error while rewinding or committing the head: discard it, go on.
REPLAY_HOST        HostError from a replay feed: its tokens count as fed, discard the head;
                   successor = the salvage when one was wanted, else error (caches reusable).

Nothing a head does can fail a request. Every draw is keyed by the slot its token occupies
(``drafting.accept``): the head step draws each draft for its slot, the verify feed draws the
target's token for every slot of the feed in its one sync, a replay draws its successor's
slot; the driver itself never draws, and the order of the calls does not matter.

Parking: ``plan()`` is the decision point. Depth 0 (the controller's choice, a disabled
request, a head that is not ready) makes the round target-only; the decode loop may run
the pipelined plain decoder instead (writing the same ledger) and account each of its steps
with ``parked_round()``.
Since the head sees every committed forward, resuming needs no extra forward: the next
``round(x)`` with the plain decoder's in-flight sample speculates right away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cache.ledger import EmitterStep, Ledger, Verdict
from drafting.accept import accepted_count
from drafting.depth import MAX_DRAFT_DEPTH
from drafting.seam import (  # noqa: F401  (the seam's names, importable from here too)
    DepthSource,
    HeadError,
    HostError,
    OpError,
    Replay,
    RoundOps,
    SuffixSource,
    TargetError,
    Verification,
)
from drafting.stats import SpecStats


@dataclass(frozen=True)
class RoundEnd:
    """How a round ended: ``reason`` "continue" (``next`` is sampled, unfed, unemitted),
    "stop" (EOS or stop string), "length" (budget) or "cancel"."""

    reason: str
    next: int | None = None

    @property
    def finished(self) -> bool:
        return self.reason != "continue"


@dataclass(frozen=True)
class RoundPlan:
    """The park/resume decision for the next round: ``depth`` head drafts (0 = none) and
    why: "speculate", "disabled", "no-head", "depth-0" or "last-token"; ``suffix``: the text
    being written occurred before, so the round asks the suffix drafter too (with no head
    depth, the round is the suffix drafter's or target-only)."""

    depth: int
    why: str
    suffix: bool = False

    @property
    def parked(self) -> bool:
        return self.depth == 0 and not self.suffix


class RoundError(Exception):
    """The request cannot go on. ``reusable`` says whether the target caches still hold exactly
    the committed prefix (an exact-prefix exit) or must be thrown away."""

    def __init__(self, cause: BaseException, *, reusable: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.reusable = reusable


def _continue(token: int) -> RoundEnd:
    return RoundEnd("continue", int(token))


@dataclass
class _Emission:
    """How the accepted drafts went out: ``retained`` of them stay in the caches, ``judged``
    positions count for the depth controller, ``emitted`` reached the host as generated
    tokens (the statistics count those), ``end`` is the reason when the run ended the
    request, ``forced`` close markers to feed next, ``failure`` an emitter exception."""

    retained: int
    judged: int
    emitted: int
    end: str | None = None
    forced: list[int] = field(default_factory=list)
    failure: BaseException | None = None


@dataclass
class OpenRound:
    """A speculative round opened up to its verify feed: the current token, the k drafts
    (``draft``, a suffix draft, or the head's ``proposal``), whether it is the warm round,
    and the entry: the target's position, the head's pairs and the captured state."""

    x: int
    k: int
    draft: object | None
    warm: bool
    position: int
    pairs: int
    entry: object
    source: str  # the drafter the statistics count it under
    proposal: object = None


# -- the driver ------------------------------------------------------------------------------


class RoundDriver:
    """Runs decode rounds for one request; see the module docstring for the transitions.

    ``emit(token) -> Step`` is the request's emitter, ``cancelled()`` the cancel mark, ``depth``
    the request's depth session, ``budget`` how many tokens the request may emit in all (None =
    unlimited; forced close markers do not count; it becomes the ledger's), ``ledger`` the
    request's token ledger, which judges every emitted token (``Ledger.judge``).
    """

    def __init__(
        self,
        ops: RoundOps,
        emit: Callable[[int], EmitterStep],
        cancelled: Callable[[], bool],
        *,
        depth: DepthSource,
        budget: int | None = None,
        stats: SpecStats | None = None,
        ledger: Ledger | None = None,
        suffix: SuffixSource | None = None,
    ) -> None:
        self.ops = ops
        self._emit = emit
        self._cancelled = cancelled
        self._depth = depth
        self.suffix = suffix
        self.stats = stats if stats is not None else SpecStats()
        self.ledger = ledger if ledger is not None else Ledger()
        if budget is not None:
            self.ledger.budget = budget

    @property
    def budget(self) -> int | None:
        return self.ledger.budget

    @property
    def emitted(self) -> list[int]:
        return self.ledger.emitted

    @property
    def committed(self) -> list[int]:
        return self.ledger.committed

    @property
    def used(self) -> int:
        """Tokens counted against the budget."""
        return self.ledger.used

    # -- decisions ----------------------------------------------------------------------------

    def remaining(self) -> int | None:
        """Tokens the budget still allows, the next round's x included (None = unlimited)."""
        return self.ledger.remaining()

    def plan(self) -> RoundPlan:
        """Depth of the next round, or why it is parked; ``suffix`` when the suffix drafter
        expects a draft worth a round."""
        if not self._depth.enabled:
            return RoundPlan(0, "disabled")
        head = self._head_plan()
        if head.why == "last-token" or self.suffix is None or not self.suffix.expects_copy():
            return head
        return RoundPlan(head.depth, head.why, suffix=True)

    def _head_plan(self) -> RoundPlan:
        if not self.ops.head_ready:
            return RoundPlan(0, "no-head")
        want = self._depth.depth
        remaining = self.remaining()
        if remaining is not None and remaining <= 1:
            return RoundPlan(0, "last-token")
        if want <= 0:
            return RoundPlan(0, "depth-0")
        k = want if remaining is None else min(want, remaining - 1)
        return RoundPlan(k, "speculate")

    def _suffix_draft(self, x: int, plan: RoundPlan, *, indexed: bool = False):
        """The suffix drafter's draft after x when it beats the head's round (and plain
        decoding: the drafter offers only drafts that do), else None. ``indexed``: x is the
        index's last token already (the prompt's last, in a warm round)."""
        if not plan.suffix:
            return None
        remaining = self.remaining()
        limit = MAX_DRAFT_DEPTH if remaining is None else min(MAX_DRAFT_DEPTH, remaining - 1)
        draft, rate = self.suffix.draft(x, limit, indexed=indexed)
        if draft is None or plan.depth == 0:
            return draft
        head_rate = self._depth.head_rate(plan.depth)
        return draft if head_rate is None or rate > head_rate else None

    # -- entry points -------------------------------------------------------------------------

    def round(self, x: int, plan: RoundPlan | None = None) -> RoundEnd:
        """One round at the current token ``x``; ``plan``: what :meth:`plan` said just before
        (the decode loop asks it to choose between a plain step and a round), else asked here.
        Raises RoundError when the request must end."""
        plan = plan if plan is not None else self.plan()
        draft = self._suffix_draft(x, plan)
        if draft is not None:
            self._depth.round_elsewhere()
            self.suffix.started("suffix", len(draft.tokens) + 1)
        else:
            self._depth.round_started(plan.depth)
            if self.suffix is not None:
                self.suffix.started("head" if plan.depth else "target")
        try:
            return self._round(x, plan, draft)
        finally:
            self._note_depth()

    def warm_round(self, last: int) -> RoundEnd | None:
        """WARM: the request's first round feeds the prompt's last token with the first drafts
        (the head's from the prefill's frontier, or the suffix drafter's continuation of the
        prompt), so generation starts without a forward of its own. None when no drafter has
        a draft for it, or one failed before the verify forward committed anything: the
        caches are as they were and the caller feeds the token plainly."""
        remaining = self.remaining()
        if not self._depth.enabled or (remaining is not None and remaining < 2):
            return None
        head = self._head_plan()
        plan = RoundPlan(head.depth, head.why, suffix=self.suffix is not None)
        draft = self._suffix_draft(last, plan, indexed=True)
        if draft is None and plan.depth == 0:
            return None
        self._depth.round_elsewhere()  # the first round's time is not a steady round's
        self.ops.fed_prompt(last)
        k = len(draft.tokens) if draft is not None else plan.depth
        try:
            return self._speculate(last, k, draft, warm=True)
        finally:
            self._note_depth()

    def pause(self) -> None:
        """Time not spent in this request's rounds follows (shared forwards): no cost sample of
        either drafter may span it."""
        self._depth.round_elsewhere()
        if self.suffix is not None:
            self.suffix.pause()

    def parked_round(self) -> None:
        """Account one step of the plain decoder while parked (it wrote its token to the shared
        ledger): a measured depth-0 round."""
        self._depth.round_started(0)
        if self.suffix is not None:
            self.suffix.started("plain")
        self.stats.record_parked()
        self._depth.round_finished(0, 0)
        self._note_depth()

    def _note_depth(self) -> None:
        """The head's depth for the next round, for the statistics (0 without a live head)."""
        self.stats.final_depth = self._depth.depth if self.ops.head_alive else 0

    # -- the round at x -----------------------------------------------------------------------

    def _round(self, x: int, plan: RoundPlan, draft) -> RoundEnd:
        verdict = self._push(x)  # EMIT_X: an exception propagates with nothing mutated
        if not verdict.fed:  # EOS_AT_X
            return RoundEnd(verdict.end)
        if self._cancelled():  # CANCEL_AT_X
            return RoundEnd("cancel")
        if verdict.forced:  # CLOSE_AT_X
            return self._replay([x, *verdict.forced], end=verdict.end)
        if verdict.end is not None:  # FINAL_SLOT
            return self._replay([x], end=verdict.end)
        if draft is not None:
            return self._speculate(x, len(draft.tokens), draft)
        if plan.depth == 0:
            self.stats.record_parked()
            end = self._target_only(x)
            self._depth.round_finished(0, 0)
            return end
        return self._speculate(x, plan.depth)

    def _push(self, token: int) -> Verdict:
        """Emit ``token`` and judge it (``Ledger.judge``); an emitter failure is a RoundError
        with nothing recorded."""
        try:
            step = self._emit(token)
        except Exception as error:
            raise RoundError(error, reusable=True) from error
        return self.ledger.judge(token, step)

    # -- target-only and replay -----------------------------------------------------------

    def _target_only(self, x: int) -> RoundEnd:
        """TARGET_ONLY: feed x alone; the successor comes from its row."""
        try:
            verified = self.ops.verify_feed(x, None)
        except (TargetError, HeadError) as error:
            raise RoundError(error, reusable=False) from error
        except HostError as error:
            self._commit([x])
            self._discard_head()  # x's hidden is lost: its pair cannot be written
            if error.salvage is None:
                raise RoundError(error, reusable=True) from error
            return _continue(error.salvage)
        self._commit([x])
        self._head_commit([x], verified.rows)
        return _continue(verified.successors[0])

    def _replay(self, tokens: list[int], *, end: str | None) -> RoundEnd:
        """FINAL_SLOT and forced close: feed ``tokens`` at the frontier; continue with the last
        row's successor unless the request ends (``end``), in which case no logits are used."""
        want = end is None
        try:
            replay = self.ops.replay_feed(tokens, successor=want)
        except (TargetError, HeadError) as error:
            raise RoundError(error, reusable=False) from error
        except HostError as error:  # REPLAY_HOST
            self._commit(tokens)
            self._discard_head()
            if end is not None:
                return RoundEnd(end)
            if error.salvage is None:
                raise RoundError(error, reusable=True) from error
            return _continue(error.salvage)
        self._commit(tokens)
        self._head_commit(tokens, replay.rows)
        if end is not None:
            return RoundEnd(end)
        if replay.successor is None:
            raise RoundError(ValueError("replay feed returned no successor"), reusable=True)
        return _continue(replay.successor)

    # -- the speculative round ----------------------------------------------------------------

    def _speculate(self, x: int, k: int, draft=None, *, warm: bool = False) -> RoundEnd | None:
        """SPECULATE with the head's k drafts, or with ``draft`` (a suffix draft of k tokens:
        no head step; the head still follows the committed run). ``warm``: x is the prompt's
        last token (WARM): never emitted nor committed as generated; where a round would fall
        back to target-only, None with the caches at the entry (the caller feeds x plainly)."""
        opened = self._open(x, k, draft, warm)
        if not isinstance(opened, OpenRound):  # the head step failed
            return opened
        return self.settle(opened, lambda: self.ops.verify_feed(x, opened.proposal))

    def _open(self, x: int, k: int, draft, warm: bool) -> OpenRound | RoundEnd | None:
        """A speculative round up to its verify feed: the entry captured and the proposal
        made (HEAD_STEP_FAILED: what the round ends with instead)."""
        entry_pairs = self.ops.head_pairs if self.ops.head_alive else 0
        source = self.ops.draft_source if draft is None else "suffix"
        position, entry = self.ops.position, self.ops.capture()
        opened = OpenRound(x, k, draft, warm, position, entry_pairs, entry, source)
        if draft is not None:
            opened.proposal = self.ops.fixed_proposal(draft.tokens)
        else:
            try:
                opened.proposal = self.ops.head_step(x, k)
            except OpError as error:  # HEAD_STEP_FAILED
                # The drafts it proposed before failing count, as a round failing later.
                self.stats.record_drafted(min(max(error.drafted, 0), k), opened.source)
                if isinstance(error, HostError):  # host side: drop its entries and resume
                    self._head_rewind(entry_pairs)
                else:  # the head is gone for this request
                    self._discard_head()
                return None if warm else self._target_only(x)
        self.stats.record_drafted(k, opened.source)  # proposed, whatever happens next
        return opened

    def shared_round(self, x: int, row_cost: float, limit: int) -> OpenRound | None:
        """SHARED: x was emitted and judged by a step shared with other requests and goes
        on; the opening of a round that feeds [x, d1..dk] in that forward with the suffix
        drafter's draft after x (at most ``limit`` tokens), when its expected extra tokens
        beat ``row_cost`` tokens a row (the step's own rate, which the rows slow for every
        request in it), else None (x is fed as a plain row). The forward's caller settles
        it (:meth:`settle`) with the verification of this request's rows."""
        if self.suffix is None or not self._depth.enabled or limit < 1:
            return None
        remaining = self.remaining()
        limit = min(limit, MAX_DRAFT_DEPTH if remaining is None else remaining)
        if limit < 1:
            return None
        draft = self.suffix.shared_draft(x, limit, row_cost)
        if draft is None:
            return None
        self._depth.round_elsewhere()
        opened = self._open(x, len(draft.tokens), draft, False)
        return opened if isinstance(opened, OpenRound) else None

    def settle(self, opened: OpenRound, verify: Callable[[], Verification]) -> RoundEnd | None:
        """The rest of a round opened by :meth:`_open` (or :meth:`shared_round`): ``verify``
        runs its verify feed, then acceptance, emission and RECONCILE."""
        x, k, draft, warm = opened.x, opened.k, opened.draft, opened.warm
        entry_position, entry_pairs, source = opened.position, opened.pairs, opened.source
        try:
            verified = verify()
            self._check(verified, k)
        except HeadError:  # DRAFT_EVAL_FAILED
            self._restore(opened.entry)
            self._discard_head()
            return None if warm else self._target_only(x)
        except TargetError as error:  # TARGET_FAILED
            raise RoundError(error, reusable=False) from error
        except HostError as error:  # VERIFY_HOST
            if warm:  # back to the entry: x is fed plainly next
                self._rewind(entry_position)
                self._discard_head()
                return None
            self._rewind(entry_position + 1)
            self._commit([x])
            self._discard_head()
            if error.salvage is None:
                raise RoundError(error, reusable=True) from error
            return _continue(error.salvage)

        accepted = accepted_count(verified.accept)
        emitted = self._emit_drafts(verified.drafts[:accepted], k)
        # Drafts cut by a cancel, the budget or a stop never reached the host: not counted.
        self.stats.record_round(emitted.emitted, source)
        if draft is None:
            self._depth.round_finished(emitted.judged, min(accepted, emitted.judged))
        else:
            self.suffix.model.observe(draft.bucket, emitted.judged, min(accepted, emitted.judged))

        # RECONCILE: the target keeps [x, d1..dr]; the head gets the same run from target rows.
        run = [x, *verified.drafts[: emitted.retained]]
        self._rewind(entry_position + len(run))
        self._commit(run[1:] if warm else run)
        if emitted.failure is not None:
            self._discard_head()
            raise RoundError(emitted.failure, reusable=True) from emitted.failure
        if self._head_rewind(entry_pairs):
            self._head_commit(run, verified.rows)
        if emitted.forced:  # CLOSE_AT_DRAFT
            return self._replay(emitted.forced, end=emitted.end)
        if emitted.end is not None:
            return RoundEnd(emitted.end)
        return _continue(verified.successors[accepted])

    def _emit_drafts(self, accepted: list[int], k: int) -> _Emission:
        """Emit the accepted drafts in order until one of them ends the run."""
        for i, token in enumerate(accepted):
            try:
                verdict = self._push(token)
            except RoundError as error:
                return _Emission(i, k, i, failure=error.cause)
            if not verdict.fed:
                # Positions after an accepted EOS carry no verdict for the controller.
                return _Emission(i, i + 1, i, end=verdict.end)
            if self._cancelled():
                return _Emission(i, k, i + 1, end="cancel")
            if verdict.forced or verdict.end is not None:
                return _Emission(i + 1, k, i + 1, end=verdict.end, forced=list(verdict.forced))
        return _Emission(len(accepted), k, len(accepted))

    @staticmethod
    def _check(verified: Verification, k: int) -> None:
        if (
            len(verified.drafts) != k
            or len(verified.accept) != k
            or len(verified.successors) != k + 1
        ):
            raise HostError(
                f"verification of {k} drafts came back with {len(verified.drafts)} drafts, "
                f"{len(verified.accept)} decisions, {len(verified.successors)} successors"
            )

    # -- ledgers and head bookkeeping ---------------------------------------------------------

    def _commit(self, tokens: Sequence[int]) -> None:
        self.ledger.commit(tokens)

    def _rewind(self, position: int) -> None:
        try:
            self.ops.rewind(position)
        except OpError as error:
            raise RoundError(error, reusable=False) from error

    def _restore(self, state: object) -> None:
        try:
            self.ops.restore(state)
        except OpError as error:
            raise RoundError(error, reusable=False) from error

    def _discard_head(self) -> None:
        if self.ops.head_alive:
            self.ops.head_discard()

    def _head_rewind(self, pairs: int) -> bool:
        """HEAD_COMMIT_FAILED covers this too: a failing rewind discards the head."""
        if not self.ops.head_alive:
            return False
        try:
            self.ops.head_rewind(pairs)
        except OpError:
            self._discard_head()
            return False
        return True

    def _head_commit(self, tokens: Sequence[int], rows: object) -> bool:
        if not self.ops.head_alive:
            return False
        try:
            self.ops.head_commit(tokens, rows)
        except OpError:  # HEAD_COMMIT_FAILED
            self._discard_head()
            return False
        return True
