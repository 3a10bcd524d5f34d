"""The depth controller: how many tokens to draft per speculative round.

One controller lives per loaded model and keeps its state across requests. It picks the depth
N that maximises expected committed tokens per second,

    EV(N) = (1 + sum_{k=1..N} prod_{i<=k} a_i) / cost(N),

from two measured models:

- acceptance: per draft position i >= 1, an EWMA (alpha 0.05) of P(draft i accepted | drafts
  1..i-1 accepted), bias-corrected: until it has 10 samples it is their plain mean (one early
  outcome must not set the rate to 0 or 1). A position is trusted after 10 samples; an
  untrusted position borrows the deepest trusted rate below it (1.0 when there is none:
  optimistic, so deeper depths get tried). Positions after an accepted EOS are not judged.
- cost: a round's wall time, from its start to the start of the next round, recorded only
  when the rounds before and after it have the same depth (a change of depth costs extra on
  both sides: the pipelined plain loop drains and refills, the draft cache catches up). It is
  modelled as ``speed * relative(depth)``: a shared machine's speed swings within a minute,
  so costs timed at different moments must not be compared directly (a depth-1 cost
  timed in a slow spell against a depth-0 cost timed in a fast one parks a useful head).
  Rounds at the selected depth move only ``speed``; rounds at any other depth (probes, cost
  seeding) move only their own ``relative`` cost, against the speed the rounds just before
  them measured, so every relative cost comes from a comparison close in time. The first 4
  samples of a depth are combined by their median (the first rounds at a new shape include
  warm-up), later ones by an EWMA (alpha 0.3) whose innovation is clamped to +-25% so one
  host stall cannot flip the choice. Between sampled depths the relative cost is
  interpolated linearly, beyond them it is flat.

Depth 0 (plain decoding) is a real option, measured like any other, so speculation never
settles on being slower than plain decoding. The search stops one position past the deepest
trusted position (not at all when that position's rate is under 0.1) and at ``max_depth``
(``--max-draft``, at most ``MAX_DRAFT_DEPTH``). The selected depth changes only for a rate 3%
better than its own: the estimates are noisy, and every change of depth costs rounds on both
sides. Every so often the controller probes a depth next to its choice for five rounds (the
middle three are timed: a parked controller would otherwise never re-measure the cost of
drafting), one deeper and one shallower in turn (parked, always deeper); the interval starts at
4 rounds and doubles after each probe that did not change the choice, up to 256, and snaps back
to 4 when the choice changes and when a request starts while parked (the acceptance learned
on earlier requests' text need not hold for this one's), unless position 1 is trusted to be
useless. A probe of a position whose trusted rate is under 0.1 lasts one round: it only
watches for the head starting to work (such a rate cannot pay for any cost a depth-1 round
can have), so a useless head costs one drafted round per interval, not five. A depth in range
that has no cost sample yet is drafted before anything else (cost seeding).

The constants were tuned with ``scripts/bench/sim_depth.py`` (simulated rounds with measured
relative costs, per-round noise, a drifting speed and per-prompt acceptance).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

COST_ALPHA = 0.3
ACCEPT_ALPHA = 0.05
TRUSTED_AFTER = 10  # acceptance samples before a position's rate is believed
COST_CLAMP = 0.25  # largest relative move of a cost EWMA per sample
COST_SEED_SAMPLES = 4  # samples combined by their median before the EWMA takes over
PROBE_FIRST = 4
PROBE_MAX = 256  # a useless head then costs one drafted round per 256
EXTEND_ABOVE = 0.1  # look one position past the frontier only above this acceptance
PROBE_ROUNDS = 5  # rounds per probe; the first and last are not timed (changes of depth)
CHEAP_PROBE_ROUNDS = 1  # rounds per probe of a position trusted to be under EXTEND_ABOVE
DEFAULT_MAX_DEPTH = 8
# The hard ceiling on any draft depth (``--max-draft``, ``--draft-depth``): a round verifies
# ``[x, d1..dk]``, k + 1 rows, and 16 rows is the most the verify paths are built for: the
# compiled blocks (``runner.models.llama.COMPILED_MAX_ROWS``), the native few-row product
# (``runner.native.SMALL_ROWS``), the row layout (``runner.models.layers.MAX_ROWS_LEFT``) and
# a rotating cache's default slack (``cache.window.RotatingKVCache``). tests/test_depth.py
# checks those stay at least MAX_DRAFT_DEPTH + 1.
MAX_DRAFT_DEPTH = 15
# Rows a forward shared by several requests may feed in all, drafts included, by default
# (``runner.batch``; a model caps it at the row counts its compiled blocks serve).
SHARED_DRAFT_ROWS = MAX_DRAFT_DEPTH + 1
SWITCH_MARGIN = 0.03  # leave the selected depth only for a rate this much better


class DepthController:
    """Per-model depth choice; see the module docstring. ``clock`` returns seconds."""

    def __init__(
        self,
        max_depth: int = DEFAULT_MAX_DEPTH,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_depth = checked_depth(max_depth, "max_depth")
        self._clock = clock
        self._lock = threading.Lock()  # status() reads from other threads
        self._speed: float | None = None  # seconds per unit of relative cost
        self._relative: dict[int, float] = {}  # per depth, in units of the speed
        self._unit: int | None = None  # the depth whose first samples set the speed
        self._cost_seed: dict[int, list[float]] = {}
        # index i = draft position i (index 0 unused)
        self._rate = [0.0] * (self.max_depth + 1)
        self._seen = [0] * (self.max_depth + 1)
        self.scheduled = 0
        self._selected = 0
        self._probe_interval = PROBE_FIRST
        self._probe_since = 0
        self._probing = False
        self._probe_left = 0
        self._probe_shallower = False  # direction of the next probe
        self._round_start: float | None = None
        self._round_depth: int | None = None
        self._before_depth: int | None = None

    # -- per-request plumbing -----------------------------------------------------------------

    def for_request(self, speculative: bool = True) -> RequestDepth:
        """The per-request view; ``speculative=False`` pins depth 0."""
        return RequestDepth(self if speculative and self.max_depth > 0 else None)

    def begin_request(self) -> None:
        """Forget the round clock: the gap between requests is not a round's cost."""
        with self._lock:
            self._forget_round_clock()

    def _forget_round_clock(self) -> None:
        self._round_start = self._round_depth = self._before_depth = None

    def new_request(self) -> None:
        """A request starts: forget the round clock, end a probe the last request left
        unfinished, and, while parked, probe again soon. A parked controller sees no
        acceptance at all, and the acceptance learned on earlier requests need not hold for
        this one's text (a head parked by code edits drafts well in chat): probes that backed
        off to ``PROBE_MAX`` rounds would leave most of the request to the earlier estimate.
        A drafting controller keeps its interval: its own rounds keep measuring the
        acceptance of the positions it drafts, and each probe is rounds at a depth it judged
        worse (at the head's sampled acceptance, restarting the probes at every request cost
        more than they found on short requests). Not for a head trusted to be useless (its
        first position under ``EXTEND_ABOVE``): no text makes a random head draft well, and
        each probe breaks the pipelined plain loop (the trade-off: a real head that some text
        drove that low waits for the backed-off probes)."""
        with self._lock:
            self._forget_round_clock()
            useless = self._seen[1] >= TRUSTED_AFTER and self._rate[1] < EXTEND_ABOVE
            if not useless:
                if self._probing:  # the next round is the selected depth's again
                    self._probing, self._probe_left = False, 0
                    self.scheduled = self._selected
                if self._selected == 0:
                    self._probe_interval = PROBE_FIRST

    def round_elsewhere(self) -> None:
        """Another drafter's round runs now: no cost sample may span it."""
        self.begin_request()

    def head_rate(self, depth: int) -> float | None:
        """Expected committed tokens at ``depth`` per plain step's time (None until the
        costs of depth 0 and ``depth`` are known)."""
        with self._lock:
            plain, cost = self.cost(0), self.cost(depth)
            if plain is None or cost is None or 0 not in self._relative or cost <= 0:
                return None
            return self.expected_committed(depth) * plain / cost

    # -- measurements -------------------------------------------------------------------------

    def round_started(self, depth: int) -> None:
        """A round of ``depth`` drafts starts now; closes the previous round's cost sample
        (kept when the rounds on both sides of it had its depth)."""
        now = self._clock()
        with self._lock:
            same = self._round_depth == self._before_depth == depth
            if self._round_start is not None and same:
                self._add_cost(self._round_depth, now - self._round_start)
            self._before_depth = self._round_depth
            self._round_depth = depth
            self._round_start = now

    def record_cost(self, depth: int, seconds: float) -> None:
        """Feed one round-cost sample directly (tests, benchmarks)."""
        with self._lock:
            self._add_cost(depth, seconds)

    def _add_cost(self, depth: int, seconds: float) -> None:
        if self._unit is None:
            self._unit = depth  # the first depth timed: its seeds set the speed
        seed = self._cost_seed.setdefault(depth, [])
        if len(seed) < COST_SEED_SAMPLES:
            if depth == self._unit:
                seed.append(seconds)
                self._speed, self._relative[depth] = _lower_median(seed), 1.0
            else:
                seed.append(seconds / self._speed)
                self._relative[depth] = _lower_median(seed)
            return
        # Innovation of this sample against the model, clamped so one stall moves little.
        error = seconds / (self._speed * self._relative[depth]) - 1.0
        step = 1.0 + COST_ALPHA * min(max(error, -COST_CLAMP), COST_CLAMP)
        if depth == self._selected:
            self._speed *= step  # the bulk of the rounds: they track the machine
        else:
            self._relative[depth] *= step  # a probe, compared with the rounds just before

    def observe(self, judged: int, accepted: int) -> None:
        """Acceptance of one round: ``judged`` positions had a verdict (the drafts, or up to an
        accepted EOS), the first ``accepted`` of them were accepted."""
        with self._lock:
            for i in range(1, min(judged, self.max_depth) + 1):
                if accepted < i - 1:
                    break  # never reached: an earlier draft was rejected
                outcome = 1.0 if accepted >= i else 0.0
                self._seen[i] += 1
                alpha = max(ACCEPT_ALPHA, 1.0 / self._seen[i])  # the mean until 1/n < alpha
                self._rate[i] += alpha * (outcome - self._rate[i])

    # -- the model ----------------------------------------------------------------------------

    def acceptance(self, position: int) -> float:
        """Trusted acceptance at ``position`` (>= 1), borrowing from shallower positions."""
        for i in range(min(position, self.max_depth), 0, -1):
            if self._seen[i] >= TRUSTED_AFTER:
                return self._rate[i]
        return 1.0

    def frontier(self) -> int:
        """Deepest position i such that positions 1..i are all trusted."""
        depth = 0
        while depth < self.max_depth and self._seen[depth + 1] >= TRUSTED_AFTER:
            depth += 1
        return depth

    def limit(self) -> int:
        """Deepest depth worth considering: one past the trusted frontier, unless drafts at
        the frontier are almost never accepted (then a deeper one cannot pay)."""
        frontier = self.frontier()
        if frontier > 0 and self._rate[frontier] < EXTEND_ABOVE:
            return frontier
        return min(frontier + 1, self.max_depth)

    def cost(self, depth: int) -> float | None:
        """Round cost at ``depth`` at the machine's current speed: sampled, interpolated, or
        flat beyond the sampled range."""
        if self._speed is None:
            return None
        return self._speed * self._relative_cost(depth)

    def _relative_cost(self, depth: int) -> float:
        rel = self._relative
        if depth in rel:
            return rel[depth]
        sampled = sorted(rel)
        if depth < sampled[0]:
            return rel[sampled[0]]
        if depth > sampled[-1]:
            return rel[sampled[-1]]
        hi = next(d for d in sampled if d > depth)
        lo = max(d for d in sampled if d < depth)
        t = (depth - lo) / (hi - lo)
        return rel[lo] + t * (rel[hi] - rel[lo])

    def expected_committed(self, depth: int) -> float:
        total, run = 1.0, 1.0
        for i in range(1, depth + 1):
            run *= self.acceptance(i)
            total += run
        return total

    def rate(self, depth: int) -> float:
        """Expected committed tokens per second at ``depth`` (0 when the cost is unknown)."""
        cost = self.cost(depth)
        return self.expected_committed(depth) / cost if cost and cost > 0 else 0.0

    def selected(self) -> int:
        """The depth with the best rate in [0, limit]; 0 until two depths have costs."""
        if len(self._relative) < 2:
            return 0
        limit = self.limit()
        best, best_rate = 0, self.rate(0)
        for depth in range(1, limit + 1):
            r = self.rate(depth)
            if r > best_rate:  # strict: ties keep the shallower depth
                best, best_rate = depth, r
        current = self._selected
        if current <= limit and best_rate < self.rate(current) * (1 + SWITCH_MARGIN):
            return current  # within the noise of the estimates: switching costs rounds
        return best

    # -- the decision -------------------------------------------------------------------------

    def next(self) -> int:
        """Choose the depth of the next round (called once per finished round)."""
        with self._lock:
            sel = self.selected()
            if sel != self._selected:
                self._selected = sel
                self._probe_interval = PROBE_FIRST
                self._probe_since = 0
                self._probing, self._probe_left = False, 0
            elif self._probe_left > 0:  # the probe's next round, at the same depth
                self._probe_left -= 1
                return self.scheduled
            elif self._probing:
                self._probe_interval = min(2 * self._probe_interval, PROBE_MAX)
            self._probing = False
            limit = self.limit()
            choice = sel
            self._probe_since += 1
            if self._probe_since >= self._probe_interval:
                self._probe_since = 0
                shallower = self._probe_shallower and sel > 0
                self._probe_shallower = not shallower and sel > 0
                probe = sel - 1 if shallower else min(sel + 1, limit)
                if probe != sel:
                    choice = probe
                    self._probing = True
                    useless = self._seen[probe] >= TRUSTED_AFTER and (
                        self._rate[probe] < EXTEND_ABOVE
                    )
                    self._probe_left = (CHEAP_PROBE_ROUNDS if useless else PROBE_ROUNDS) - 1
            if not self._probing:
                unsampled = [d for d in range(limit + 1) if d not in self._relative]
                if unsampled:
                    choice = unsampled[0]
            self.scheduled = choice
            return choice

    def state(self) -> dict:
        """Plain values for the ``status`` frame."""
        with self._lock:
            return {
                "depth": self.scheduled,
                "selected": self._selected,
                "max_depth": self.max_depth,
                "cost_ms": {d: round(self.cost(d) * 1000.0, 3) for d in sorted(self._relative)},
                "acceptance": [
                    round(self._rate[i], 4) if self._seen[i] >= TRUSTED_AFTER else None
                    for i in range(1, self.max_depth + 1)
                ],
                "samples": list(self._seen[1:]),
                "probe_interval": self._probe_interval,
            }


def checked_depth(depth: int, name: str) -> int:
    """``depth`` as an int, at least 0 (a negative one means none); ValueError above
    ``MAX_DRAFT_DEPTH``, the deepest round the verify paths serve."""
    depth = int(depth)
    if depth > MAX_DRAFT_DEPTH:
        raise ValueError(f"{name} {depth} is above the draft depth ceiling {MAX_DRAFT_DEPTH}")
    return max(depth, 0)


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


class RequestDepth:
    """One request's view of the controller; a disabled one always says depth 0."""

    def __init__(self, controller: DepthController | None) -> None:
        self.controller = controller
        if controller is not None:
            controller.new_request()

    @property
    def enabled(self) -> bool:
        return self.controller is not None

    @property
    def depth(self) -> int:
        return self.controller.scheduled if self.controller is not None else 0

    def round_started(self, depth: int) -> None:
        if self.controller is not None:
            self.controller.round_started(depth)

    def round_finished(self, judged: int, accepted: int) -> None:
        if self.controller is None:
            return
        if judged > 0:
            self.controller.observe(judged, accepted)
        self.controller.next()

    def round_elsewhere(self) -> None:
        if self.controller is not None:
            self.controller.round_elsewhere()

    def head_rate(self, depth: int) -> float | None:
        return self.controller.head_rate(depth) if self.controller is not None else None


class FixedDepth:
    """A constant depth with the request interface (tests, benchmarks, ``--draft-depth``)."""

    def __init__(self, depth: int) -> None:
        self._depth = checked_depth(depth, "depth")

    @property
    def enabled(self) -> bool:
        return self._depth > 0

    @property
    def depth(self) -> int:
        return self._depth

    def round_started(self, depth: int) -> None:
        pass

    def round_finished(self, judged: int, accepted: int) -> None:
        pass

    def round_elsewhere(self) -> None:
        pass

    def head_rate(self, depth: int) -> float | None:
        return None  # fixed lengths: a suffix draft, when there is one, takes the round
