"""A deterministic fake of the round driver's seam (``drafting.rounds.RoundOps``) and a
scripted emitter.

The fake's outputs are pure functions of the fed token sequence, so they do not depend on how
tokens were batched into feeds: the target's "hidden" after a prefix is
``("target", len, digest)``, its next-token distribution a function of the decode suffix, and
the draft head's hiddens are tagged ``"head"`` so a pair built from them can never pass for one
built from a target hidden. Draws go through the request's sampler keyed by slot and acceptance
through ``drafting.accept.matched_decision`` on MLX arrays, exactly as the real seam does.
Every operation is logged in order; any operation can be armed to fail on its n-th
call with one of the seam's error classes.

``recurrent=True`` adds a recurrent layer (a real ``cache.recurrent.RecurrentCache`` whose
state is a digest of the prefix it has seen): it keeps the states a verify feed asks for, as
``drafting.mlx_ops`` does, and rewinds or restores only to states it holds, so a driver that
rolled back anywhere else fails with a ``TargetError``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cache.recurrent import RecurrentCache
from drafting.accept import matched_decision
from drafting.depth import FixedDepth
from drafting.rounds import (
    HeadError,
    HostError,
    Replay,
    RoundDriver,
    RoundEnd,
    TargetError,
    Verification,
)
from runner.emit import Step
from runner.sampler import Sampler, SamplingParams

Seq = Sequence[int]
TokenFn = Callable[[Seq], int]
ProbsFn = Callable[[Seq], np.ndarray]

FAULT_KINDS = ("target", "head", "host", "host-bare")


def _digest(tokens: Seq) -> int:
    value = 7
    for t in tokens:
        value = (value * 31 + int(t) + 1) % 1_000_003
    return value


def target_hidden(prefix: Seq) -> tuple:
    """The target's hidden after ``prefix`` (a pure function of it)."""
    return ("target", len(prefix), _digest(prefix))


def recurrent_state(prefix: Seq) -> tuple[mx.array, mx.array]:
    """The fake recurrent layer's (conv, state) after ``prefix`` (a pure function of it)."""
    return mx.array([len(prefix)]), mx.array([_digest(prefix)])


def head_hidden(pairs: int, seq: Seq) -> tuple:
    return ("head", pairs, _digest(seq))


def hash_token(seq: Seq, vocab: int, salt: int = 17) -> int:
    h = salt
    for t in seq:
        h = (h * 6_364_136_223_846_793_005 + int(t) + 1_442_695_040_888_963_407) % (1 << 64)
    return (h >> 33) % vocab


def default_draft(vocab: int) -> TokenFn:
    """The target's token, perturbed at every third position so acceptance depths vary."""

    def draft(seq: Seq) -> int:
        token = hash_token(seq, vocab)
        return (token + 1) % vocab if len(seq) % 3 == 2 else token

    return draft


def scripted(first: int, chain: Sequence[int], fallback: TokenFn) -> TokenFn:
    """After the decode suffix ``[first] + chain[:i]`` the next token is ``chain[i]``."""
    want = [first, *chain]

    def token(seq: Seq) -> int:
        n = len(seq)
        if n <= len(chain) and list(seq) == want[:n]:
            return chain[n - 1]
        return fallback(seq)

    return token


def one_hot(vocab: int, token: int) -> np.ndarray:
    row = np.zeros(vocab, dtype=np.float32)
    row[token] = 1.0
    return row


def expected_pairs(fed: Seq) -> list[tuple]:
    """Draft-KV pairs for a target holding ``fed``: slot S = (token S+1, target hidden at S)."""
    return [(fed[s + 1], target_hidden(fed[: s + 1])) for s in range(len(fed) - 1)]


@dataclass
class FakeProposal:
    drafts: list[int]


@dataclass
class FakeRows:
    hiddens: list[tuple]


class _LoggedSampler:
    """Forwards draws to the request's sampler and logs the slots of the noised ones."""

    def __init__(self, inner, log: list) -> None:
        self.inner = inner
        self.greedy = bool(getattr(inner, "greedy", False))
        self._log = log

    def tokens(self, logits: mx.array, chain=None, *, slot: int) -> mx.array:
        rows = logits.reshape(-1, logits.shape[-1]).shape[0]
        if not self.greedy:
            self._log.append(("rng", "draw", slot, rows))
        return self.inner.tokens(logits, chain, slot=slot)


class GreedyDraws:
    """A sampler for greedy requests: the argmax of every row, never a noised draw."""

    greedy = True

    def tokens(self, logits: mx.array, chain=None, *, slot: int) -> mx.array:
        return mx.argmax(logits.reshape(-1, logits.shape[-1]), axis=-1).astype(mx.int32)


class FakeOps:
    """The fake seam. ``target``/``draft`` map a decode suffix (tokens after the prompt, up to
    the row's token) to the next token; ``target_probs``/``draft_probs`` give full rows for
    sampled tests (default: one-hot at the token function)."""

    def __init__(
        self,
        prompt: Seq,
        *,
        vocab: int = 16,
        sampler=None,
        head: bool = True,
        primed: bool = True,
        target: TokenFn | None = None,
        draft: TokenFn | None = None,
        target_probs: ProbsFn | None = None,
        draft_probs: ProbsFn | None = None,
        recurrent: bool = False,
    ) -> None:
        self.prompt = list(prompt)
        self.vocab = vocab
        self.fed = list(prompt)
        self.log: list[tuple] = []
        self.sampler = _LoggedSampler(sampler if sampler is not None else GreedyDraws(), self.log)
        # the defaults see the prompt too, so different prompts give different answers
        prompted = default_draft(vocab)
        self.target = target or (lambda seq: hash_token([*self.prompt, *seq], vocab))
        self.draft = draft or (lambda seq: prompted([*self.prompt, *seq]))
        self.target_probs = target_probs
        self.draft_probs = draft_probs
        self.pairs: list[tuple] | None = expected_pairs(self.fed) if head and primed else None
        if head and not primed:
            self.pairs = []
        self.frontier = target_hidden(self.fed) if head and primed else None
        self.poisoned = False  # a failed forward left half-written caches; only restore heals
        self._faults: dict[str, tuple[int, str]] = {}
        self.head_fault_at = 0  # drafts an armed head_step makes before its fault fires
        self.calls: Counter[str] = Counter()
        self.recurrent: RecurrentCache | None = None
        if recurrent:  # the prompt's prefill
            self.recurrent = RecurrentCache()
            self._recur([], self.prompt)

    # -- test controls ---------------------------------------------------------------------------

    def arm(self, op: str, nth: int, kind: str) -> None:
        """Fail the ``nth`` (0-based) call of ``op`` with ``kind`` (see FAULT_KINDS); ``op`` is
        a seam method name, or "draft_eval" for the proposal's evaluation inside verify_feed.
        A head_step fault fires at draft step ``head_fault_at`` (0: before the first draft)."""
        assert kind in FAULT_KINDS, kind
        self._faults[op] = (nth, kind)

    def _fault(self, op: str) -> str | None:
        n = self.calls[op]
        self.calls[op] += 1
        armed = self._faults.get(op)
        return armed[1] if armed is not None and armed[0] == n else None

    @property
    def decode(self) -> list[int]:
        return self.fed[len(self.prompt) :]

    def events(self, name: str) -> list[tuple]:
        return [e for e in self.log if e[0] == name]

    def ops_log(self) -> list[tuple]:
        """The log without RNG entries."""
        return [e for e in self.log if e[0] != "rng"]

    # -- distributions ---------------------------------------------------------------------------

    def _target_row(self, seq: Seq) -> np.ndarray:
        if self.target_probs is not None:
            return np.asarray(self.target_probs(seq), dtype=np.float32)
        return one_hot(self.vocab, self.target(seq))

    def _draft_row(self, seq: Seq) -> np.ndarray:
        if self.draft_probs is not None:
            return np.asarray(self.draft_probs(seq), dtype=np.float32)
        return one_hot(self.vocab, self.draft(seq))

    def _pick(self, row: np.ndarray, slot: int) -> int:
        """The request's draw from the distribution ``row`` for cache slot ``slot``."""
        if self.sampler.greedy:
            return int(np.argmax(row))
        with np.errstate(divide="ignore"):
            logits = mx.array(np.log(row))[None]
        return int(self.sampler.tokens(logits, slot=slot).item())

    def _feed(self, tokens: Seq) -> FakeRows:
        if self.poisoned:
            raise AssertionError("fed caches that a failed forward left half-written")
        rows, before = [], list(self.fed)
        for t in tokens:
            self.fed.append(int(t))
            rows.append(target_hidden(self.fed))
        if self.recurrent is not None:
            self._recur(before, list(tokens))
        return FakeRows(rows)

    def _recur(self, before: list[int], tokens: list[int]) -> None:
        """Advance the recurrent layer over ``tokens``, handing back the states it wants."""
        cache = self.recurrent
        assert cache.offset == len(before), (cache.offset, len(before))
        states = {r: recurrent_state(before + tokens[:r]) for r in cache.wanted(len(tokens))}
        cache.update(*recurrent_state(before + tokens), len(tokens), states)

    def _recur_rewind(self, position: int) -> None:
        if self.recurrent is not None:
            try:
                self.recurrent.rewind(position)
            except ValueError as exc:
                raise TargetError(f"fake recurrent layer: {exc}") from exc

    # -- the seam ----------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return len(self.fed)

    @property
    def head_alive(self) -> bool:
        return self.pairs is not None

    @property
    def head_ready(self) -> bool:
        return self.pairs is not None and self.frontier is not None

    @property
    def draft_source(self) -> str:
        return "head"

    @property
    def head_pairs(self) -> int:
        return len(self.pairs) if self.pairs is not None else 0

    def capture(self) -> object:
        self.log.append(("capture",))
        return tuple(self.fed)

    def restore(self, state: object) -> None:
        self.log.append(("restore",))
        if self._fault("restore"):
            raise TargetError("fake restore fault")
        self._recur_rewind(len(state))
        self.fed = list(state)
        self.poisoned = False

    def rewind(self, position: int) -> None:
        self.log.append(("rewind", position))
        if self._fault("rewind") or self.poisoned:
            raise TargetError("fake rewind fault")
        if not len(self.prompt) <= position <= len(self.fed):
            raise TargetError(f"rewind to {position} out of range")
        self._recur_rewind(position)
        del self.fed[position:]

    def head_step(self, current: int, k: int) -> FakeProposal:
        self.log.append(("head_step", current, k))
        kind = self._fault("head_step")
        if kind in ("target", "head") and self.head_fault_at == 0:
            raise HeadError("fake head forward fault")
        assert self.head_ready, "head_step on a head that is not ready"
        seq = [*self.decode, current]
        prev = self.frontier
        drafts = []
        for i in range(k):
            if kind in ("target", "head") and i == self.head_fault_at:
                raise HeadError("fake head forward fault", drafted=i)
            self.pairs.append((seq[-1], prev))  # speculative entry, above the committed pairs
            if kind in ("host", "host-bare") and i == self.head_fault_at:
                raise HostError("fake head host fault", drafted=i)
            prev = head_hidden(len(self.pairs), seq)
            token = self._pick(self._draft_row(seq), self.position + 1 + i)
            drafts.append(token)
            seq.append(token)
        return FakeProposal(drafts)

    def fed_prompt(self, last: int) -> None:
        self.log.append(("fed_prompt", last))

    def fixed_proposal(self, drafts: Sequence[int]) -> FakeProposal:
        self.log.append(("fixed_proposal", list(drafts)))
        return FakeProposal(list(drafts))

    def verify_feed(self, current: int, proposal: FakeProposal | None) -> Verification:
        drafts = proposal.drafts if proposal is not None else []
        tokens = [current, *drafts]
        self.log.append(("verify", tokens))
        kind = self._fault("verify_feed")
        eval_failed = proposal is not None and self._fault("draft_eval") is not None
        if self.recurrent is not None:  # as drafting.mlx_ops: every prefix of the feed
            entry = self.position
            self.recurrent.keep(range(entry + 1, entry + len(tokens) + 1))
        if kind in ("target", "head"):
            self._feed(tokens[:1])
            self.poisoned = True
            raise TargetError("fake target forward fault")
        if eval_failed:
            self._feed(tokens)
            self.poisoned = True
            raise HeadError("fake draft evaluation fault")
        seq, entry = list(self.decode), self.position
        rows = self._feed(tokens)
        target = [
            self._pick(self._target_row([*seq, *tokens[: i + 1]]), entry + 1 + i)
            for i in range(len(tokens))
        ]
        decision = matched_decision(mx.array(target), mx.array(drafts, dtype=mx.int32))
        mx.eval(decision)
        accept = [bool(a) for a in decision.accept.tolist()]
        successors = [int(s) for s in decision.successors.tolist()]
        if kind is not None:
            first = drafts[0] if drafts and accept[0] else successors[0]
            raise HostError("fake verify host fault", first if kind == "host" else None)
        return Verification(list(drafts), accept, successors, rows)

    def replay_feed(self, tokens: Sequence[int], successor: bool) -> Replay:
        self.log.append(("replay", list(tokens), successor))
        kind = self._fault("replay_feed")
        if kind in ("target", "head"):
            self._feed(tokens[:1])
            self.poisoned = True
            raise TargetError("fake replay fault")
        rows = self._feed(tokens)
        drawn = self._pick(self._target_row(self.decode), self.position) if successor else None
        if kind is not None:
            raise HostError("fake replay host fault", drawn if kind == "host" else None)
        return Replay(drawn, rows)

    def head_commit(self, tokens: Sequence[int], rows: FakeRows) -> None:
        self.log.append(("head_commit", list(tokens)))
        kind = self._fault("head_commit")
        if kind == "host" or kind == "host-bare":
            raise HostError("fake head commit host fault")
        if kind is not None:
            raise HeadError("fake head commit fault")
        assert self.pairs is not None, "head_commit on a discarded head"
        for i, t in enumerate(tokens):
            if self.frontier is not None:
                self.pairs.append((int(t), self.frontier))
            self.frontier = rows.hiddens[i]

    def head_rewind(self, pairs: int) -> None:
        self.log.append(("head_rewind", pairs))
        if self._fault("head_rewind"):
            raise HostError("fake head rewind fault")
        assert self.pairs is not None and pairs <= len(self.pairs), "head rewind out of range"
        del self.pairs[pairs:]

    def head_discard(self) -> None:
        self.log.append(("head_discard",))
        self.pairs = None
        self.frontier = None


class ScriptedEmitter:
    """The emitter contract (``runner.emit.Emitter.push -> Step``) with scripted triggers.

    EOS ends with "stop" without keep; ``stop_at`` lists push indices whose token completes a
    stop string ("stop", keep); ``max_tokens`` counts non-EOS tokens ("length" on the last);
    the think budget forces ``close`` on the content token that exhausts it (budget 0 fires on
    the first) unless the model closed the span itself; ``fail_at`` raises on that push."""

    def __init__(
        self,
        *,
        eos: Sequence[int] = (2,),
        max_tokens: int = 0,
        stop_at: Sequence[int] = (),
        think_budget: int | None = None,
        close: Sequence[int] = (4,),
        fail_at: int | None = None,
    ) -> None:
        self.eos = set(eos)
        self.max_tokens = max_tokens
        self.stop_at = set(stop_at)
        self.think_budget = think_budget
        self.close = list(close)
        self.fail_at = fail_at
        self.pushed: list[int] = []
        self.generated = 0
        self._content = 0
        self._think_done = False

    def push(self, token: int) -> Step:
        if self.fail_at == len(self.pushed):
            raise RuntimeError("scripted emitter failure")
        index = len(self.pushed)
        self.pushed.append(int(token))
        if token in self.eos:
            return Step(finished=True, reason="stop", keep=False)
        self.generated += 1
        if index in self.stop_at:
            return Step(finished=True, reason="stop")
        if self.max_tokens and self.generated >= self.max_tokens:
            return Step(finished=True, reason="length")
        forced: list[int] = []
        if self.think_budget is not None and not self._think_done:
            if token in self.close:
                self._think_done = True
            else:
                self._content += 1
                if self._content >= max(self.think_budget, 1):
                    self._think_done = True
                    forced = list(self.close)
        return Step(forced=forced)


# -- helpers for driver tests ---------------------------------------------------------------


def seeded_sampler(seed: int, vocab: int) -> Sampler:
    """The real sampler at temperature 1 with no filters: draws straight from given rows."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0, seed=seed)
    return Sampler(params, history=[], vocab_size=vocab, context_length=4096)


def spread(seed: int, vocab: int, banned: Sequence[int] = (2,)) -> ProbsFn:
    """A full-support distribution function of the decode suffix, zero on ``banned``."""

    def probs(seq: Seq) -> np.ndarray:
        rng = np.random.default_rng([seed, *seq])
        row = rng.dirichlet(np.full(vocab, 0.7)).astype(np.float32)
        row[list(banned)] = 0.0
        return row / row.sum()

    return probs


def check_state(ops: FakeOps, driver: RoundDriver) -> None:
    """The round-entry invariant: the caches hold exactly the committed prefix, committed is a
    prefix of emitted, and a live primed head holds one target-hidden pair per committed token
    but the last."""
    assert ops.fed == ops.prompt + driver.committed
    assert driver.emitted[: len(driver.committed)] == driver.committed
    if ops.head_alive and ops.frontier is not None:
        assert ops.pairs == expected_pairs(ops.fed)
        assert ops.frontier == target_hidden(ops.fed)
    assert not ops.poisoned
    if ops.recurrent is not None:  # the recurrent layer holds the state of exactly that prefix
        conv, state = recurrent_state(ops.fed)
        assert ops.recurrent.offset == len(ops.fed)
        assert ops.recurrent.conv.item() == conv.item()
        assert ops.recurrent.recurrent.item() == state.item()


def tiny_tokenizer():
    """The tiny checkpoints' trained BPE tokenizer (EOS 2, ``</think>`` 4)."""
    from tokenizers import Tokenizer as HFTokenizer

    from runner.tokenizer import Tokenizer
    from tests.checkpoints import tokenizer_json

    return Tokenizer(
        HFTokenizer.from_str(tokenizer_json()), bos_id=None, eos_ids=[2], add_bos=False
    )


def emitter_frames(tokenizer, prompt: Seq, first: int, depth: int, *, stop=(), max_tokens=24):
    """One request through the real ``runner.emit.Emitter`` (think budget 3, the template
    opened ``<think>``) on a fake seam over the tokenizer's vocabulary: every frame the host
    sees, the end, the committed tokens and the draft pairs."""
    from runner.emit import Emitter

    sent = []
    emitter = Emitter(
        tokenizer,
        stop=stop,
        max_tokens=max_tokens,
        think_budget=3,
        prompt_open_think=True,
        send=lambda content, ids, logprobs: sent.append((content, list(ids))),
    )
    ops = FakeOps(prompt, vocab=tokenizer.vocab_size)
    driver = RoundDriver(
        ops, emitter.push, lambda: False, depth=FixedDepth(depth), budget=max_tokens
    )
    end = run_rounds(driver, first)
    emitter.finish()
    check_state(ops, driver)
    return sent, end, driver.committed, ops.pairs


def run_rounds(driver: RoundDriver, first: int) -> RoundEnd:
    """Rounds from ``first`` until generation ends (a zero budget emits nothing): the whole
    decode of a request on the round driver alone."""
    if driver.remaining() == 0:
        return RoundEnd("length")
    end = RoundEnd("continue", first)
    while not end.finished:
        end = driver.round(end.next)
    return end
