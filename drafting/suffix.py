"""Drafting from text already seen: a suffix index over the request's prompt and generated
tokens, proposing the continuation of the longest earlier match of the last tokens.

Agents copy: a rewritten function, a JSON object filled from a document, a quoted passage, a
list repeated with one change. Where the text being written already occurred, the tokens that
followed it then are a draft that costs no forward, and once its first token is accepted the
rest usually is too. The round driver (``drafting.rounds``) asks this drafter each round and
verifies its draft in the same feed a head's draft takes; acceptance is the target's own draw
(``drafting.accept``), so which drafter proposed changes only how many forwards the output
takes, never the output.

**Index** (``SuffixIndex``). The request's tokens (prompt, then every committed token, synced
from the ledger before each lookup) and a map from every pair of consecutive tokens to the
positions that followed it, newest last, at most ``CANDIDATES`` per pair. A lookup takes the
pair ending at the current token, extends each candidate backwards by direct comparison (at
most ``MAX_MATCH`` tokens) and keeps the longest match, the newest on ties; its continuation is
the draft (a continuation that runs into the current token repeats the period, as a loop in
the text would). Where another candidate with as long a match continues differently, the
draft stops there. Appending a token is one map update; a lookup costs at most
``CANDIDATES * MAX_MATCH`` comparisons. Memory: a Python int per token and a list per distinct
pair, about 150-250 bytes per token of distinct text; past ``MAX_INDEXED`` tokens the index
restarts from the newest half, so it stays under ~30 MB per request.

**Recent outputs** (``RecentOutputs``, one per loaded model, off unless asked for). The
generated tokens of the model's last requests (each after its prompt's last
``RECENT_PROMPT`` tokens), the oldest out past the limit, in one ``SuffixIndex`` with a
separator between outputs (no match or draft crosses one), so an agent loop that asks for a
file again, or a client that retries a request, drafts from the earlier answer even when the
new prompt does not hold it. Both indexes are asked; the recent outputs' draft is taken
where it is expected to commit more (the acceptance model below, by match and draft
length). Drafts are verified as any other, so the tokens never depend on what other
requests wrote, only how many forwards they take; but those counts reach every client
(``done.speculation``, and the timing), so a client could tell that another sent the same
prompt: a server of several users' requests should leave it off. Off by default for that
reason.

**Model** (``SuffixModel``, one per loaded model, across requests). Acceptance per
match-length bucket (``BUCKETS``): the first draft's rate and the rate of each further draft
given the one before, EWMAs (bias-corrected at first) from optimistic-enough priors that a
long match gets tried; and the cost of verifying r rows relative to a plain step, a line
fitted to the suffix rounds' timings (``cost_line``). The expected committed tokens of a k-token
draft, ``1 + sum_i P1 c^(i-1)``, over the cost of k + 1 rows is the draft's rate; the driver
takes it when it beats plain decoding and the head's rate at its chosen depth. A bucket's
rates are never taken below a shorter match's that rests on verdicts: a bucket whose
estimate fell below the cost of drafting would otherwise never draft again, whatever its
matches have become.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from drafting.depth import MAX_DRAFT_DEPTH as MAX_DRAFT  # the verify paths' ceiling

CANDIDATES = 8  # newest positions kept per token pair
MAX_MATCH = 64  # longest match looked for, in tokens
MAX_INDEXED = 1 << 17  # tokens indexed per request before restarting from the newest half
# The most tokens of recent outputs indexed across requests (``RecentOutputs``; ~150-250
# bytes each; a rebuild re-indexes half of them), and the shortest output worth indexing.
RECENT_TOKENS = MAX_INDEXED // 2
RECENT_MIN = 8
RECENT_PROMPT = 16  # prompt tokens indexed before each output: a retried request drafts at once
SEPARATOR = -1  # between two outputs in the recent index: no token id equals it
# The draft lengths the rate chooses among: a few verify shapes (each row count is a shape the
# compiled blocks trace and the allocator caches buffers for), dense where drafts are short.
LENGTHS = (1, 2, 3, 4, 6, 8, 11, 15)
# Match-length buckets (lower bounds): a match of 2 tokens is weak evidence, 17 strong.
BUCKETS = (2, 3, 5, 9, 17)
# Priors: the first draft's acceptance per bucket and each further draft's given the one
# before; each bucket's estimate replaces its prior after a few rounds.
FIRST_PRIOR = (0.3, 0.45, 0.6, 0.7, 0.8)
NEXT_PRIOR = 0.85
# Until a bucket has this many further-draft verdicts its further drafts are assumed to pass at
# NEXT_OPTIMISTIC when choosing a length: drafts of one token never teach the rate of a second,
# so an estimate that starts low would keep every draft short.
NEXT_TRUSTED = 10
NEXT_OPTIMISTIC = 0.95
ACCEPT_ALPHA = 0.1
# Verdicts a bucket needs before its estimates bound the longer matches' from below.
FLOOR_SEEN = 8
PLAIN_ALPHA = 0.1
# Cost of r verify rows relative to one plain step: a line a + s (r - 1) fitted by weighted
# least squares to the suffix rounds' timings, older ones fading by COST_DECAY per round, so
# a round of any length moves the whole line (a table per row count would keep an early
# outlier at a length it then never drafts). Two prior points on the line a = ROW_BASE,
# s = ROW_SLOPE keep a weight of PRIOR_WEIGHT each, so rounds of one length leave the slope
# near the prior instead of undetermined.
ROW_BASE = 1.2  # a round is not pipelined as a plain step is: it pays its sync in full
ROW_SLOPE = 0.4
COST_DECAY = 0.97
PLAIN_DECAY = 0.995  # per plain step: round costs fade toward the prior (half-life ~140)
SAMPLE_CLAMP = 1.0  # one timing sample moves an estimate as if within 2x of it
PRIOR_WEIGHT = 0.5
PRIOR_ROWS = (2, 9)


def bucket_of(match: int) -> int:
    """The bucket of a match length (``BUCKETS``' lower bounds)."""
    index = 0
    for i, low in enumerate(BUCKETS):
        if match >= low:
            index = i
    return index


class SuffixIndex:
    """One request's tokens and their pair index (module docstring)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[int, list[int]] = {}
        self._base = 0  # tokens dropped from the front (restarts)
        self.extend(tokens)

    def __len__(self) -> int:
        return self._base + len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt, then committed ones)."""
        seq, after = self.tokens, self._after
        for token in tokens:
            seq.append(int(token))
            n = len(seq)
            if n >= 3:  # the pair ending at n - 2 is followed by position n - 1
                key = (seq[n - 3] << 32) | seq[n - 2]
                places = after.get(key)
                if places is None:
                    after[key] = [n - 1]
                else:
                    places.append(n - 1)
                    if len(places) > CANDIDATES:
                        del places[0]
        if len(seq) > MAX_INDEXED:
            keep = seq[-(MAX_INDEXED // 2) :]
            self._base += len(seq) - len(keep)
            self.tokens, self._after = [], {}
            self.extend(keep)

    def lookup(self, current: int, limit: int, n: int | None = None) -> tuple[list[int], int]:
        """The draft after ``current`` (the token about to be fed: not indexed yet) and its
        match length; ``([], 0)`` when the text has not been seen. ``n``: look up as if only
        the first n tokens were indexed and ``current`` came next (n = len - 1, current =
        the last token: what the index predicts for the token after it)."""
        seq = self.tokens
        n = len(seq) if n is None else n
        if n < 2 or limit < 1:
            return [], 0
        # seq[:n] + [current]: candidate p continues at seq[p]; its pair is seq[p-2], seq[p-1].
        matches = self._matches(seq[n - 1], current, lambda i: seq[n - i], n, n)
        if not matches:
            return [], 0
        return self._best(matches, lambda p, k: self._continuation(p, current, k, n), limit)

    def lookup_context(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The continuation, in this index's text, of the longest match of the last tokens of
        another text (``context``, its last token the one about to be fed), stopping at a
        ``SEPARATOR``; ``([], 0)`` when there is none."""
        if len(context) < 2 or limit < 1:
            return [], 0
        matches = self._matches(
            context[-2], context[-1], lambda i: context[-1 - i], len(context) - 1, len(self.tokens)
        )
        if not matches:
            return [], 0
        return self._best(matches, self._separated, limit)

    def _matches(
        self, before: int, current: int, back: Callable[[int], int], depth: int, end: int
    ) -> list[tuple[int, int]]:
        """``(match, p)`` for each candidate p (at most ``end``) following the pair
        ``(before, current)``: how many tokens match backwards from it, ``back(i)`` being the
        text's i-th token before ``current`` (i <= ``depth``)."""
        seq, out = self.tokens, []
        for p in self._after.get((before << 32) | current, ()):
            if p > end:
                continue
            match = 2
            while (
                match < MAX_MATCH
                and match <= depth
                and p - 1 - match >= 0
                and seq[p - 1 - match] == back(match)
            ):
                match += 1
            out.append((match, p))
        return out

    @staticmethod
    def _best(
        matches: list[tuple[int, int]], continuation: Callable[[int, int], list[int]], limit: int
    ) -> tuple[list[int], int]:
        """The longest match's continuation (the newest on ties), cut where another match as
        long continues differently (draft what they share)."""
        best_match, best = max(matches)
        draft = continuation(best, limit)
        for match, p in matches:
            if match == best_match and p != best:
                other = continuation(p, len(draft))
                same = 0
                while same < len(other) and other[same] == draft[same]:
                    same += 1
                draft = draft[: max(same, 1)]
        return draft, best_match

    def _separated(self, p: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens from position p, stopping at a ``SEPARATOR``."""
        out = []
        for token in self.tokens[p : p + limit]:
            if token == SEPARATOR:
                break
            out.append(token)
        return out

    def _continuation(self, p: int, current: int, limit: int, n: int) -> list[int]:
        """Up to ``limit`` tokens from position p of seq[:n] + [current], repeating the
        period (n + 1 - p tokens) past the end, as a loop in the text continues."""
        seq = self.tokens
        period = n + 1 - p
        out: list[int] = []
        for i in range(limit):
            j = p + i
            if j < n:
                out.append(seq[j])
            elif j == n:
                out.append(current)
            else:
                out.append(out[i - period])
        return out


class RecentOutputs:
    """The recent outputs' index (module docstring); ``limit`` tokens at most (0: off; at
    most ``RECENT_TOKENS``, so the index never restarts). Thread-safe: requests end and
    draft on the decode thread, ``status`` reads the size."""

    def __init__(self, limit: int = 0) -> None:
        if not 0 <= limit <= RECENT_TOKENS:
            raise ValueError(f"recent outputs: {limit} tokens, not within 0..{RECENT_TOKENS}")
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.index = SuffixIndex()

    def add(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Index one request's generated tokens after the last ``RECENT_PROMPT`` of its
        ``prompt`` (the newest ``limit`` tokens of the two). Past ``limit`` in all the oldest
        outputs go until at most half of it is left and the index is rebuilt: one rebuild
        per ``limit / 2`` tokens indexed, not one per request."""
        if len(tokens) < RECENT_MIN or not self.limit:
            return
        text = [*prompt[-RECENT_PROMPT:], *tokens]
        output = [int(t) for t in text[-self.limit :]]
        with self._lock:
            self._outputs.append(output)
            self.tokens += len(output)
            if self.tokens <= self.limit:
                self.index.extend([SEPARATOR, *output])
                return
            while self.tokens > self.limit // 2 and len(self._outputs) > 1:
                self.tokens -= len(self._outputs.popleft())
            index = SuffixIndex()
            for kept in self._outputs:
                index.extend([SEPARATOR, *kept])
            self.index = index

    def lookup(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The continuation of ``context``'s last tokens in a recent output (its match
        length), or ``([], 0)``."""
        with self._lock:
            return self.index.lookup_context(context, limit)


@dataclass(frozen=True)
class SuffixDraft:
    """A draft from the index: its tokens and the bucket of the match they follow."""

    tokens: list[int]
    bucket: int


class SuffixModel:
    """Acceptance per bucket and verify-row costs, shared by a model's requests (module
    docstring). Thread-safe: ``status`` reads it from other threads."""

    def __init__(self, recent_tokens: int = 0) -> None:
        self._lock = threading.Lock()
        self.recent = RecentOutputs(recent_tokens)
        self._first = list(FIRST_PRIOR)
        self._next = [NEXT_PRIOR] * len(BUCKETS)
        self._first_seen = [0] * len(BUCKETS)
        self._next_seen = [0] * len(BUCKETS)
        # Decayed sums of the timed rounds: weight, x, x^2, y, x y (x = rows - 1, y = cost).
        self._sums = [0.0] * 5
        self._rounds_timed = 0
        self._plain: float | None = None  # seconds per plain step

    # -- acceptance -----------------------------------------------------------------------

    def observe(self, bucket: int, judged: int, accepted: int) -> None:
        """One verified suffix round: ``judged`` drafts had a verdict, ``accepted`` leading
        ones passed."""
        if judged < 1:
            return
        with self._lock:
            self._first_seen[bucket] += 1
            alpha = max(ACCEPT_ALPHA, 1.0 / (self._first_seen[bucket] + 1))
            self._first[bucket] += alpha * ((accepted >= 1) - self._first[bucket])
            for i in range(2, judged + 1):
                if accepted < i - 1:
                    break
                self._next_seen[bucket] += 1
                alpha = max(ACCEPT_ALPHA, 1.0 / (self._next_seen[bucket] + 1))
                self._next[bucket] += alpha * ((accepted >= i) - self._next[bucket])

    def expected(self, bucket: int, k: int) -> float:
        """Expected committed tokens of a round drafting k tokens from ``bucket``."""
        first, rest = self._rates(bucket)
        total, run = 1.0, first
        for _ in range(k):
            total += run
            run *= rest
        return total

    def _rates(self, bucket: int) -> tuple[float, float]:
        """``(P1, c)`` of ``bucket``: its estimates, or a shorter match's where that bucket
        has ``FLOOR_SEEN`` verdicts and higher estimates (a longer match holds the shorter
        one, so its draft is at least as likely: two early misses in a bucket that then never
        drafts again cannot shut out the longest matches, the best copies)."""
        first, rest = self._first[bucket], self._next[bucket]
        for lower in range(bucket):
            if self._first_seen[lower] >= FLOOR_SEEN:
                first = max(first, self._first[lower])
            if self._next_seen[lower] >= FLOOR_SEEN:
                rest = max(rest, self._next[lower])
        if self._next_seen[bucket] < NEXT_TRUSTED:
            rest = max(rest, NEXT_OPTIMISTIC)
        return first, rest

    # -- costs ----------------------------------------------------------------------------

    def plain_step(self, seconds: float) -> None:
        with self._lock:
            if self._plain is None:
                self._plain = seconds
            else:  # one stall moves the estimate by at most SAMPLE_CLAMP of itself
                step = min(max(seconds / self._plain - 1.0, -SAMPLE_CLAMP), SAMPLE_CLAMP)
                self._plain *= 1.0 + PLAIN_ALPHA * step
            # The round costs fade toward the prior line while no suffix round is timed, so
            # estimates that stopped all drafting (a slow spell) do not stop it for good.
            self._sums = [PLAIN_DECAY * s for s in self._sums]

    def verify_round(self, rows: int, seconds: float) -> None:
        """A suffix round that fed ``rows`` rows took ``seconds`` (to the next round)."""
        with self._lock:
            if self._plain is None:
                return
            x, y = rows - 1.0, seconds / self._plain
            # A sample far from the line (a host stall, time spent elsewhere) counts as at
            # most a factor SAMPLE_CLAMP + 1 either way of the line's prediction.
            predicted = self.relative_cost(rows)
            y = min(max(y, predicted / (1.0 + SAMPLE_CLAMP)), predicted * (1.0 + SAMPLE_CLAMP))
            self._sums = [COST_DECAY * s for s in self._sums]
            for i, term in enumerate((1.0, x, x * x, y, x * y)):
                self._sums[i] += term
            self._rounds_timed += 1

    def cost_line(self) -> tuple[float, float]:
        """``(a, s)``: a round of r rows costs ``a + s (r - 1)`` plain steps."""
        w, sx, sxx, sy, sxy = self._sums
        for rows in PRIOR_ROWS:
            x, y = rows - 1.0, ROW_BASE + ROW_SLOPE * (rows - 1.0)
            w, sx, sxx = w + PRIOR_WEIGHT, sx + PRIOR_WEIGHT * x, sxx + PRIOR_WEIGHT * x * x
            sy, sxy = sy + PRIOR_WEIGHT * y, sxy + PRIOR_WEIGHT * x * y
        slope = (w * sxy - sx * sy) / (w * sxx - sx * sx)
        slope = min(max(slope, 0.02), 4.0)
        return max((sy - slope * sx) / w, 1.0), slope

    def relative_cost(self, rows: int) -> float:
        """Cost of verifying ``rows`` rows in plain steps (module docstring)."""
        base, slope = self.cost_line()
        return max(base + slope * (rows - 1), 1.0)

    @property
    def plain_seconds(self) -> float | None:
        return self._plain

    def best_length(self, bucket: int, available: int) -> tuple[int, float]:
        """The draft length (at most ``available``) with the best rate, and that rate in
        committed tokens per plain step's time."""
        base, slope = self.cost_line()
        best, best_rate = 0, 1.0
        for k, extra in self._extra_by_length(bucket, available):
            rate = (1.0 + extra) / max(base + slope * k, 1.0)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def shared_length(self, bucket: int, available: int, row_cost: float) -> int:
        """The draft length (at most ``available``, 0: none) whose expected extra tokens
        most exceed ``row_cost`` tokens a row: a draft in a forward shared with other
        requests slows every one of them, so it pays by what it adds to the step, not by
        its own round's rate."""
        best, best_gain = 0, 0.0
        for k, extra in self._extra_by_length(bucket, available):
            if extra - row_cost * k > best_gain:
                best, best_gain = k, extra - row_cost * k
        return best

    def _extra_by_length(self, bucket: int, available: int) -> Iterator[tuple[int, float]]:
        """``(k, expected accepted drafts)`` for each of ``LENGTHS`` up to ``available``.
        Asked before every plain step where the text was seen: the rates are read once and
        the expectation is a running sum over the lengths."""
        first, rest = self._rates(bucket)
        extra, run, summed = 0.0, first, 0
        for k in LENGTHS:
            if k > available:
                return
            for _ in range(k - summed):
                extra += run
                run *= rest
            summed = k
            yield k, extra

    def state(self) -> dict:
        """Plain values for the ``status`` frame."""
        with self._lock:
            return {
                "first": [round(a, 4) for a in self._first],
                "next": [round(a, 4) for a in self._next],
                "rounds": list(self._first_seen),
                "cost_line": [round(v, 3) for v in self.cost_line()],
                "rounds_timed": self._rounds_timed,
                "recent_tokens": self.recent.tokens,
            }


class SuffixDrafter:
    """One request's suffix drafting: its index, kept level with ``prompt`` and then
    ``committed()`` (the generated tokens the caches hold, which only grow), the model's
    estimates, and the round clock that times its rounds and the plain steps between them.
    ``fixed`` drafts that many tokens (at most) whenever the index has a draft, instead of
    the rate's choice (tests, benchmarks)."""

    def __init__(
        self,
        model: SuffixModel,
        prompt: Sequence[int],
        committed: Callable[[], Sequence[int]],
        *,
        fixed: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self._prompt = prompt
        self._committed = committed
        self.index = SuffixIndex()
        self.fixed = fixed
        self._clock = clock
        self._open: tuple[str, int, float] | None = None  # (kind, rows, start) of the last

    def sync(self) -> None:
        """Index the tokens committed since the last call (the prompt first)."""
        done, prompt = len(self.index), self._prompt
        if done < len(prompt):
            self.index.extend(prompt[done:])
            done = len(prompt)
        committed = self._committed()
        if len(committed) > done - len(prompt):
            self.index.extend(committed[done - len(prompt) :])

    def expects_copy(self) -> bool:
        """Whether the token after the last committed one (read later) is likely to have a
        draft worth a round: the index's prediction for it, one token longer, is."""
        self.sync()
        index = self.index
        n = len(index.tokens)
        if n < 3:
            return False
        tokens, match = index.lookup(index.tokens[-1], MAX_DRAFT + 1, n=n - 1)
        if self.model.recent.limit:
            tokens, match = self._longer(tokens, match, index.tokens[-MAX_MATCH:], MAX_DRAFT + 1)
        if len(tokens) < 2:
            return False
        if self.fixed is not None:
            return self.fixed > 0
        return self.model.best_length(bucket_of(match), len(tokens) - 1)[0] > 0

    def draft(
        self, current: int, limit: int, *, indexed: bool = False
    ) -> tuple[SuffixDraft | None, float]:
        """The draft to verify after ``current`` (at most ``limit`` tokens) and its rate, or
        ``(None, 1.0)`` when the index has none worth its rows. ``indexed``: ``current`` is
        the index's last token already (the prompt's last, in a warm round)."""
        tokens, match = self._lookup(current, limit, indexed)
        if not tokens:
            return None, 1.0
        bucket = bucket_of(match)
        if self.fixed is not None:
            k = min(self.fixed, len(tokens))
            return (SuffixDraft(tokens[:k], bucket), float("inf")) if k else (None, 1.0)
        k, rate = self.model.best_length(bucket, len(tokens))
        if k == 0:
            return None, 1.0
        return SuffixDraft(tokens[:k], bucket), rate

    def shared_draft(self, current: int, limit: int, row_cost: float) -> SuffixDraft | None:
        """The draft after ``current`` (at most ``limit`` tokens) for a forward shared with
        other requests, where each row costs ``row_cost`` tokens of theirs
        (``SuffixModel.shared_length``); None when none pays."""
        tokens, match = self._lookup(current, limit, False)
        if not tokens:
            return None
        bucket = bucket_of(match)
        if self.fixed is not None:
            k = min(self.fixed, len(tokens))
        else:
            k = self.model.shared_length(bucket, len(tokens), row_cost)
        return SuffixDraft(tokens[:k], bucket) if k else None

    def _lookup(self, current: int, limit: int, indexed: bool) -> tuple[list[int], int]:
        """The continuation after ``current`` and its match length (``draft`` says what
        ``indexed`` means)."""
        self.sync()
        seq = self.index.tokens
        n = len(seq) - 1 if indexed else len(seq)
        tokens, match = self.index.lookup(current, limit, n=n)
        if self.model.recent.limit:  # off by default: no context copied each round
            context = [*seq[max(n - MAX_MATCH, 0) : n], current]
            tokens, match = self._longer(tokens, match, context, limit)
        return tokens, match

    def _longer(
        self, tokens: list[int], match: int, context: list[int], limit: int
    ) -> tuple[list[int], int]:
        """The request's own draft, or the recent outputs' where it is expected to commit
        more (a longer match, but not a draft cut short by the end of an output)."""
        other, other_match = self.model.recent.lookup(context, limit)
        if not other:
            return tokens, match
        if tokens:
            expected = self.model.expected
            if expected(bucket_of(other_match), len(other)) <= expected(
                bucket_of(match), len(tokens)
            ):
                return tokens, match
        return other, other_match

    # -- the round clock ---------------------------------------------------------------------

    def started(self, kind: str, rows: int = 1) -> None:
        """Mark the clock: a round (``kind`` "suffix", "head" or "target") starts now, or a
        plain step ("plain") just ended (the decode loop accounts it after it ran). So the
        time between two plain marks is a plain step, and the time from a suffix round's
        mark to the next round's its cost; from a round to a plain mark it includes the
        plain step that refills the pipeline, and is not kept."""
        now = self._clock()
        if self._open is not None:
            before, before_rows, start = self._open
            seconds = now - start
            if before == "plain" and kind == "plain":
                self.model.plain_step(seconds)
            elif before == "suffix" and kind != "plain":
                self.model.verify_round(before_rows, seconds)
        self._open = (kind, rows, now)

    def pause(self) -> None:
        """Time not spent decoding follows (a shared forward, the request's end)."""
        self._open = None
