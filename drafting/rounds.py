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
from typing import Protocol

from cache.ledger import EmitterStep, Ledger, Verdict
from drafting.accept import accepted_count
from drafting.stats import SpecStats

# -- the seam ---------------------------------------------------------------------------------


class OpError(Exception):
    """A seam operation failed; the subclass says what state it left behind.

    ``drafted``: from ``head_step``, the drafts it had proposed before it failed (a head that
    drafts step by step may fail at step i > 0); the statistics count them."""

    def __init__(self, *args: object, drafted: int = 0) -> None:
        super().__init__(*args)
        self.drafted = drafted


class TargetError(OpError):
    """A target forward, restore or rewind failed part-way: the caches are not reusable."""


class HeadError(OpError):
    """The draft head failed (its forward, or its lazy drafts inside the fused evaluation)."""


class HostError(OpError):
    """Host-side failure after every cache mutation of the call completed.

    ``salvage`` is a token distributed exactly as the successor of the first fed token (verify
    feed) or of the last fed token (replay feed asked for a successor), when the host data
    survived; None otherwise."""

    def __init__(
        self, message: str = "host failure", salvage: int | None = None, *, drafted: int = 0
    ) -> None:
        super().__init__(message, drafted=drafted)
        self.salvage = salvage


@dataclass
class Verification:
    """Host data of one verify feed of [x, d1..dk] (k = 0 for a target-only feed)."""

    drafts: list[int]  # d1..dk
    accept: list[bool]  # accept[i]: d_{i+1} passed verification
    successors: list[int]  # successors[i]: next token when exactly i drafts are accepted
    rows: object = None  # opaque: the verified target hiddens, handed back to head_commit


@dataclass
class Replay:
    """Host data of one replay feed."""

    successor: int | None  # drawn from the last row when asked, else None
    rows: object = None  # opaque: the fed tokens' target hiddens


class RoundOps(Protocol):
    """Model operations behind the driver. Positions are absolute target offsets; head pairs
    count draft-KV slots (slot S pairs token S+1 with the target hidden at S)."""

    @property
    def position(self) -> int:
        """Tokens the target caches hold."""

    @property
    def head_alive(self) -> bool:
        """A draft head exists and has not been discarded."""

    @property
    def head_ready(self) -> bool:
        """Alive and primed (a frontier hidden exists), so it can draft."""

    @property
    def head_pairs(self) -> int:
        """Pairs in the draft KV, speculative entries included."""

    def capture(self) -> object:
        """Entry state of the target caches, enough for ``restore``."""

    def restore(self, state: object) -> None:
        """Back to a captured state (also undoes a failed fused forward). TargetError."""

    def rewind(self, position: int) -> None:
        """Truncate the target caches to ``position``. TargetError when out of range."""

    def head_step(self, current: int, k: int) -> object:
        """Draft k tokens after ``current`` from the frontier; returns an opaque, lazily
        computed proposal that ``verify_feed`` evaluates with the target. HeadError, HostError
        (``drafted``: how many drafts it proposed before it failed)."""

    def verify_feed(self, current: int, proposal: object | None) -> Verification:
        """Feed [current, d1..dk] in one forward and sync once. HeadError (the proposal failed
        to evaluate; the target may be half-mutated), TargetError, HostError."""

    def replay_feed(self, tokens: Sequence[int], successor: bool) -> Replay:
        """Feed tokens whose logits are not needed, except the last row's successor draw
        when ``successor``. TargetError, HostError."""

    def head_commit(self, tokens: Sequence[int], rows: object) -> None:
        """Commit pairs for ``tokens`` (fed at the current frontier) using the first
        ``len(tokens)`` target hidden rows of ``rows``; the first token pairs with the frontier
        hidden, and the new frontier hidden is the last row used. HeadError, HostError."""

    def head_rewind(self, pairs: int) -> None:
        """Drop draft-KV entries above ``pairs`` that were not committed from target hiddens.
        After ``head_rewind(n)`` and ``head_commit(t, rows)`` the head holds n + len(t) pairs."""

    def head_discard(self) -> None:
        """Stop drafting for the rest of the request; the draft KV is no longer trusted."""


# -- what the driver talks to besides the seam -----------------------------------------------


class DepthSource(Protocol):
    """``drafting.depth.RequestDepth`` or ``FixedDepth``."""

    @property
    def enabled(self) -> bool: ...

    @property
    def depth(self) -> int: ...

    def round_started(self, depth: int) -> None: ...

    def round_finished(self, judged: int, accepted: int) -> None: ...


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
    """The park/resume decision for the next round: ``depth`` drafts (0 = target-only) and
    why: "speculate", "disabled", "no-head", "depth-0" or "last-token"."""

    depth: int
    why: str

    @property
    def parked(self) -> bool:
        return self.depth == 0


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
    ) -> None:
        self.ops = ops
        self._emit = emit
        self._cancelled = cancelled
        self._depth = depth
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
        """Depth of the next round, or why it is parked."""
        if not self._depth.enabled:
            return RoundPlan(0, "disabled")
        if not self.ops.head_ready:
            return RoundPlan(0, "no-head")
        want = self._depth.depth
        if want <= 0:
            return RoundPlan(0, "depth-0")
        remaining = self.remaining()
        k = want if remaining is None else min(want, remaining - 1)
        if k <= 0:
            return RoundPlan(0, "last-token")
        return RoundPlan(k, "speculate")

    # -- entry points -------------------------------------------------------------------------

    def round(self, x: int) -> RoundEnd:
        """One round at the current token ``x``. Raises RoundError when the request must end."""
        plan = self.plan()
        self._depth.round_started(plan.depth)
        try:
            return self._round(x, plan)
        finally:
            self.stats.final_depth = self._depth.depth

    def parked_round(self) -> None:
        """Account one step of the plain decoder while parked (it wrote its token to the shared
        ledger): a measured depth-0 round."""
        self._depth.round_started(0)
        self.stats.record_parked()
        self._depth.round_finished(0, 0)
        self.stats.final_depth = self._depth.depth

    # -- the round at x -----------------------------------------------------------------------

    def _round(self, x: int, plan: RoundPlan) -> RoundEnd:
        verdict = self._push(x)  # EMIT_X: an exception propagates with nothing mutated
        if not verdict.fed:  # EOS_AT_X
            return RoundEnd(verdict.end)
        if self._cancelled():  # CANCEL_AT_X
            return RoundEnd("cancel")
        if verdict.forced:  # CLOSE_AT_X
            return self._replay([x, *verdict.forced], end=verdict.end)
        if verdict.end is not None:  # FINAL_SLOT
            return self._replay([x], end=verdict.end)
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

    def _speculate(self, x: int, k: int) -> RoundEnd:
        entry_position = self.ops.position
        entry_pairs = self.ops.head_pairs
        entry = self.ops.capture()

        try:
            proposal = self.ops.head_step(x, k)
        except OpError as error:  # HEAD_STEP_FAILED
            # The drafts it proposed before failing count, as those of a round failing later.
            self.stats.record_drafted(min(max(error.drafted, 0), k))
            if isinstance(error, HostError):  # host side: drop the step's entries and resume
                self._head_rewind(entry_pairs)
            else:  # the head is gone for this request
                self._discard_head()
            return self._target_only(x)
        self.stats.record_drafted(k)  # proposed, whatever happens to the round from here

        try:
            verified = self.ops.verify_feed(x, proposal)
            self._check(verified, k)
        except HeadError:  # DRAFT_EVAL_FAILED
            self._restore(entry)
            self._discard_head()
            return self._target_only(x)
        except TargetError as error:  # TARGET_FAILED
            raise RoundError(error, reusable=False) from error
        except HostError as error:  # VERIFY_HOST
            self._rewind(entry_position + 1)
            self._commit([x])
            self._discard_head()
            if error.salvage is None:
                raise RoundError(error, reusable=True) from error
            return _continue(error.salvage)

        accepted = accepted_count(verified.accept)
        emitted = self._emit_drafts(verified.drafts[:accepted], k)
        # Drafts cut by a cancel, the budget or a stop never reached the host: not counted.
        self.stats.record_round(emitted.emitted)
        self._depth.round_finished(emitted.judged, min(accepted, emitted.judged))

        # RECONCILE: the target keeps [x, d1..dr]; the head gets the same run from target rows.
        run = [x, *verified.drafts[: emitted.retained]]
        self._rewind(entry_position + len(run))
        self._commit(run)
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
