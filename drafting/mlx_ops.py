"""The MLX implementation of the round driver's seam (``drafting.rounds.RoundOps``).

It drives any target with the ``runner.models`` interface (``hidden(ids, caches)``,
``unembed(hidden)``) over its caches, the request's draft session and its sampler, and keeps
the sampler's penalty history in step with what the target caches hold: ``x`` enters it when
a round feeds it, the retained drafts when the round rewinds to them.

**Recurrent layers** (``cache.recurrent.RecurrentCache``, the Gated DeltaNet layers of a
hybrid) cannot rewind by moving an offset: they return only to states they hold. Before every
verify feed of ``[x, d1..dk]`` at ``entry`` each of them is asked to keep the states at
``entry + 1 .. entry + k + 1``, which the same forward computes (``runner.models.gated_delta``'s
``states_at``), and every feed keeps the state it started from. So reconcile's rewind to
``entry + 1 + r`` (any acceptance, an accepted EOS, a forced ``</think>`` cut, the verify-host
salvage at ``entry + 1``) and the restore of the entry (the feed's start) land on held states:
no second forward, no replay on a rejection, and ``capture`` stays a position.

**Sliding windows** (``cache.window.RotatingKVCache``) need no preflight before a round: a
rewind only moves an offset, and every append keeps the window before its first row whatever
its length, so after a verify feed at any depth every rollback of the round (the entry,
``entry + 1 + r``) is still one the cache can undo (``tests/test_window_cache.py`` checks it
at the depth ceiling). A rewind to a position some windowed cache (sliding or recurrent) can
no longer resume at is a ``TargetError`` before any cache moves, not a failure at the next
append.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NoReturn

import mlx.core as mx

from drafting.accept import matched_decision
from drafting.logprobs import LogprobRows
from drafting.seam import HeadError, HostError, Replay, TargetError, Verification
from drafting.session import DraftSession, Proposal

log = logging.getLogger("mtp_runner.drafting")


def dispatch_layer(index: int, x: mx.array) -> None:
    """``on_layer`` hook of a decode or verify forward: start evaluating each layer as soon as
    its graph is built. MLX lets only a bounded number of tasks be in flight, so one
    ``async_eval`` at the end of a forward waits while most of it computes, and the graph of
    the next layers is built after the previous ones ran; dispatching layer by layer overlaps
    building with computing (the values are the same: only when they are computed changes)."""
    mx.async_eval(x)


class MlxRoundOps:
    """``RoundOps`` over a target model, its caches, a draft session and the request's
    sampler. Attention caches roll back by offset and recurrent ones to the states each verify
    feed keeps (module docstring), so ``capture`` is a position."""

    def __init__(
        self,
        model,
        caches: list,
        draft: DraftSession | None,
        sampler,
        logprobs: LogprobRows | None = None,
        constraint=None,
        forced_drafts: bool = True,
    ) -> None:
        self.model = model
        self.caches = caches
        # Layers that hold only certain states: told what to keep before each verify feed.
        self._recurrent = [c for c in caches if c.keeps_states]
        # Layers that resume only where they hold a window (or a state): asked before a rewind.
        self._windowed = [c for c in caches if c.windowed]
        self.draft = draft
        self.sampler = sampler
        self.logprobs = logprobs  # filled from every deciding row when the request asks
        # Constrained output (``runner.constraint.Constraint``): the matcher follows every fed
        # token, as the penalty history does; drafts and verify rows are masked by it.
        self.constraint = constraint
        # A token the grammar forces (the only one its mask allows) is drafted as it is,
        # whatever the head would draw: the target's masked draw can be nothing else, so it
        # is always accepted. False drafts it from the head's masked logits like any other.
        self.forced_drafts = forced_drafts
        # Models whose caches rewind to any offset of a feed start each verify layer as it is
        # built (``runner.prefill.takes_layer_hook``): a failed feed rewinds as before.
        self._layer_hook = (
            {"on_layer": dispatch_layer} if getattr(model, "takes_layer_hook", False) else {}
        )
        self._x_at: int | None = None  # position of the current x once it is in the history
        self._verified: tuple[int, list[int]] | None = None  # (entry position, drafts)
        self._head_proposal: Proposal | None = None  # the last head step's, until verified

    # -- state ------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self.caches[0].offset

    @property
    def head_alive(self) -> bool:
        return self.draft is not None and not self.draft.discarded

    @property
    def head_ready(self) -> bool:
        return self.head_alive and self.draft.primed

    @property
    def draft_source(self) -> str:
        return "head" if self.draft is None else self.draft.source

    @property
    def head_pairs(self) -> int:
        return self.draft.offset + self.draft.pending

    def capture(self) -> int:
        return self.position

    def restore(self, state: int) -> None:
        # The entry is where the verify feed started, a state every recurrent layer keeps.
        self.rewind(state)

    def rewind(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise TargetError(f"cannot rewind the target from {self.position} to {position}")
        for c in self._windowed:  # all of them before any cache moves
            if not c.can_rewind(position):
                if c.keeps_states:
                    raise TargetError(
                        f"a recurrent layer at {c.offset} holds no state at {position} (held: "
                        f"{c.rewind_points()})"
                    )
                raise TargetError(
                    f"a sliding-window layer at {c.offset} no longer holds the window before "
                    f"{position}"
                )
        for c in self.caches:
            c.rewind(position)
        if self._verified is not None:
            entry, drafts = self._verified
            self._verified = None
            retained = drafts[: max(position - entry - 1, 0)]
            if retained:
                self._history(retained)

    def _history(self, tokens: list[int]) -> None:
        """``tokens`` stay in the caches: into the penalty history and through the matcher."""
        self.sampler.append(tokens)
        if self.constraint is not None:
            for token in tokens:
                self.constraint.consume(token)

    def _feed_x(self, x: int) -> None:
        """Put x (about to be fed at ``position``) in the penalty history, once."""
        if self._x_at != self.position:
            self._history([x])
            self._x_at = self.position

    # -- head -------------------------------------------------------------------------------

    def head_step(self, current: int, k: int):
        self._feed_x(current)  # d1 is penalised with x in the window, like the target's row
        constrain, consumed = self._draft_constraint()
        try:
            proposal = self.draft.propose(
                current, k, self.sampler, slot=self.position + 1, constrain=constrain
            )
        except Exception as exc:  # the drafts are lazy: none was made yet (drafted 0)
            raise HeadError(f"draft head failed: {exc}") from exc
        finally:
            if consumed:  # the matcher back at x, where the verify feed starts
                self.constraint.rollback(consumed[0])
        if proposal is None:
            raise HostError("draft head was not ready to propose")
        self._head_proposal = proposal
        # Start the head's forward now: it computes while the verify feed's graph is built
        # instead of after the feed's first layer is (that layer takes the drafts). A draft
        # that fails to evaluate is left to the verify feed, which evaluates it again and
        # tells the head's failure from the target's (DRAFT_EVAL_FAILED).
        try:
            mx.async_eval(proposal.tokens)
        except Exception:  # reported by the verify feed
            pass
        return proposal

    def _draft_constraint(self):
        """The head's masks along its own draft chain (each draft read as it is drawn, the
        matcher advanced by it) and the count it advanced, to roll back."""
        if self.constraint is None:
            return None, []
        constraint, consumed = self.constraint, [0]

        def constrain(step: int, previous):
            if step:
                if consumed[0] < step - 1 or not constraint.allows(int(previous.item())):
                    return None, None  # off the grammar: the verify rejects it anyway
                consumed[0] += 1
            allowed, only = constraint.mask_or_only()
            return allowed, only if self.forced_drafts else None

        return constrain, consumed

    def _verify_masks(self, drafts: list[int], rows: int) -> mx.array:
        """The matcher's mask for each verify row: row i after x and the first i drafts. Rows
        past a draft the grammar refuses cannot be accepted; they repeat the last mask."""
        constraint = self.constraint
        masks = [constraint.mask()]
        consumed = 0
        try:
            for d in drafts:
                if not constraint.allows(d):
                    break
                consumed += 1
                masks.append(constraint.mask())
        finally:
            constraint.rollback(consumed)
        masks += [masks[-1]] * (rows - len(masks))
        return mx.stack(masks[:rows])

    def head_commit(self, tokens: Sequence[int], rows) -> None:
        try:
            self.draft.committed(list(tokens), rows[: len(tokens)], self.position - len(tokens))
        except Exception as exc:
            raise HeadError(f"draft commit failed: {exc}") from exc

    def head_rewind(self, pairs: int) -> None:
        # Speculative draft entries above the verified pairs (a proposal's chain, a prepared
        # feed's candidates) are dropped by the next flush or by a report they do not match;
        # the verified ones never go beyond what the driver asks to keep.
        if self.head_pairs < pairs:
            raise HeadError(f"draft KV holds {self.head_pairs} pairs, {pairs} asked")

    def head_discard(self) -> None:
        if self.draft is not None:
            self.draft.discard()

    def fed_prompt(self, last: int) -> None:
        self._x_at = self.position  # _feed_x: already in the history (and the matcher)

    def fixed_proposal(self, drafts: Sequence[int]) -> Proposal:
        return Proposal(tokens=mx.array(list(drafts), dtype=mx.int32), slot=self.position + 1)

    # -- target -----------------------------------------------------------------------------

    def verify_feed(self, current: int, proposal) -> Verification:
        ids, entry = self.verify_ids(current, proposal)
        try:
            hidden = self.model.hidden(ids[None], self.caches, **self._layer_hook)[0]
        except Exception as exc:  # building the graph failed: the caches rewind to entry
            self._feed_failed(entry, proposal, exc)
        return self.verify_rows(current, proposal, entry, hidden)

    # A verify feed inside a forward shared with other requests (``runner.batch``) runs in
    # two parts around it: ``verify_ids`` before (the tokens to feed at ``position``),
    # ``verify_rows`` on this request's hidden rows of its output.
    def verify_ids(self, current: int, proposal) -> tuple[mx.array, int]:
        """The int32 ``[1 + k]`` tokens of a verify feed of [current, d1..dk] at the entry
        position (returned too); current enters the history, every recurrent layer is told
        which states the feed must keep."""
        self._feed_x(current)
        entry = self.position
        ids = mx.array([current], dtype=mx.int32)
        if proposal is not None:
            ids = mx.concatenate([ids, proposal.tokens.astype(mx.int32)])
        for c in self._recurrent:  # the state after every prefix of the feed
            c.keep(range(entry + 1, entry + ids.shape[0] + 1))
        return ids, entry

    def verify_rows(
        self, current: int, proposal, entry: int, hidden: mx.array, logits: mx.array | None = None
    ) -> Verification:
        """The verification of a feed of ``verify_ids`` at ``entry`` from its hidden rows
        ``[1 + k, D]`` and their logits (lazy; computed here when None): the target's draws,
        the decisions, one sync."""
        try:
            if logits is None:
                logits = self.model.unembed(hidden)
            drafts = mx.zeros((0,), dtype=mx.int32)
            if proposal is not None:
                drafts = proposal.tokens.astype(mx.int32)
            if self.constraint is not None:
                # The masks are computed on the CPU while the forward runs.
                mx.async_eval(logits, hidden, drafts, [c.state for c in self.caches])
                masks = self._verify_masks(drafts.tolist(), logits.shape[0])
                logits = mx.where(masks, logits, mx.array(-mx.inf, logits.dtype))
            # The target's own draw at every slot of the feed: row i's token goes to entry + 1 + i.
            target = self.sampler.tokens(logits, drafts, slot=entry + 1)
            decision_accept, successors = matched_decision(target, drafts)
            rows = self._logprob_rows(logits, successors)
            outputs = (drafts, decision_accept, successors, hidden, rows)
            prepare = proposal is not None and proposal is self._head_proposal
            if prepare:  # dispatched before the head's forward, so the sync waits for them only
                mx.async_eval(*outputs, [c.state for c in self.caches])
        except Exception as exc:
            self._feed_failed(entry, proposal, exc)
        if prepare:
            self._prepare_head(current, hidden, successors, entry)
        self._head_proposal = None
        try:
            mx.eval(*outputs, [c.state for c in self.caches])
        except Exception as exc:
            self._feed_failed(entry, proposal, exc)
        drafted = drafts.tolist()
        self._verified = (entry, drafted)
        successors = [int(s) for s in successors.tolist()]
        self._keep_logprobs(entry + 1, successors, rows)
        return Verification(
            drafts=drafted,
            accept=[bool(a) for a in decision_accept.tolist()],
            successors=successors,
            rows=hidden,
        )

    def _feed_failed(self, entry: int, proposal, exc: Exception) -> NoReturn:
        """A verify feed failed: the caches rewind to ``entry``; raises the head's failure
        when the lazy drafts fail to evaluate (layers start as they are built, so they may
        have run and failed inside the feed), else the target's."""
        self.rewind_quietly(entry)
        if proposal is not None and self._proposal_fails(proposal):
            raise HeadError(f"draft evaluation failed: {exc}") from exc
        raise TargetError(f"verify forward failed: {exc}") from exc

    def _prepare_head(self, current: int, hidden: mx.array, draws: mx.array, entry: int) -> None:
        """Queue the head's forward over the pairs this feed may commit behind the feed
        (``DraftSession.prepare``), built while the feed computes. The feed's outputs were
        dispatched first, so its sync does not wait for this forward. A head that fails here
        fails again where the round asks it for drafts, which handles it.

        Only a feed of the head's own drafts prepares: the next round is then most likely the
        head's again. After a suffix draft or a parked step the head's pairs pend and flush in
        batches, as before: a forward a round over rows most of which a long suffix draft
        rejects would cost a head that is not drafting more than it saves."""
        prepare = getattr(self.draft, "prepare", None)
        if prepare is None or not self.head_ready:
            return
        try:
            prepare(current, hidden, draws, entry)
        except Exception:
            log.debug("the head's prepared forward failed; it drafts from a flush", exc_info=True)
            self.draft.forget_prepared()

    def replay_feed(self, tokens: Sequence[int], successor: bool) -> Replay:
        # tokens[0] is the current x when it already entered the history at this position.
        fresh = list(tokens[1:]) if self._x_at == self.position else list(tokens)
        if fresh:
            self._history(fresh)
        slot = self.position + len(tokens)  # where the successor goes
        try:
            ids = mx.array(list(tokens), dtype=mx.int32)
            hidden = self.model.hidden(ids[None], self.caches)[0]
            nxt, rows = None, ()
            if successor:
                logits = self.model.unembed(hidden[-1:])
                if self.constraint is not None:
                    mask = self.constraint.mask()
                    logits = mx.where(mask, logits, mx.array(-mx.inf, logits.dtype))
                nxt = self.sampler.tokens(logits, slot=slot)
                rows = self._logprob_rows(logits, nxt)
            successors = [nxt] if nxt is not None else []
            mx.eval(hidden, [c.state for c in self.caches], *successors, rows)
        except Exception as exc:
            raise TargetError(f"replay forward failed: {exc}") from exc
        if nxt is None:
            return Replay(successor=None, rows=hidden)
        token = int(nxt.reshape(-1)[0].item())
        self._keep_logprobs(slot, [token], rows)
        return Replay(successor=token, rows=hidden)

    def _logprob_rows(self, logits: mx.array, tokens: mx.array) -> tuple:
        """The target's log-probabilities of every deciding row (lazy), when asked."""
        if self.logprobs is None:
            return ()
        return self.sampler.logprob_rows(logits, tokens, self.logprobs.top_n)

    def _keep_logprobs(self, first_slot: int, tokens: list[int], rows: tuple) -> None:
        if self.logprobs is not None:
            chosen, ids, values = (r.tolist() for r in rows)
            self.logprobs.put(first_slot, tokens, chosen, ids, values)

    def rewind_quietly(self, position: int) -> None:
        for c in self.caches:
            if c.offset > position:
                c.rewind(position)

    @staticmethod
    def _proposal_fails(proposal) -> bool:
        try:
            mx.eval(proposal.tokens)
        except Exception:
            return True
        return False
