"""The depth controller (drafting/depth.py) on simulated rounds with an injected clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from drafting.depth import (
    MAX_DRAFT_DEPTH,
    PROBE_FIRST,
    PROBE_MAX,
    PROBE_ROUNDS,
    DepthController,
    FixedDepth,
)
from runner.cli import build_parser


def flat(depth: int) -> float:
    return 0.210 + 0.0026 * depth


def steep(depth: int) -> float:
    return 0.030 + 0.019 * depth


class Sim:
    """Rounds whose wall time is ``cost(depth)`` and whose drafts are accepted position by
    position with probability ``rate`` (seeded)."""

    def __init__(self, cost, rate, *, max_depth=8, seed=0):
        self.now = 0.0
        self.speed = 1.0  # the machine's slowness: every round's time is multiplied by it
        self.cost, self.rate = cost, rate
        self.rng = np.random.default_rng(seed)
        self.controller = DepthController(max_depth, clock=lambda: self.now)
        self.session = self.controller.for_request()
        self.depths: list[int] = []

    def round(self, stall: float = 1.0) -> int:
        depth = self.session.depth
        self.depths.append(depth)
        self.session.round_started(depth)
        self.now += self.cost(depth) * stall * self.speed
        accepted = 0
        while accepted < depth and self.rng.random() < self.rate:
            accepted += 1
        self.session.round_finished(depth, accepted)
        return depth

    def run(self, rounds: int) -> list[int]:
        return [self.round() for _ in range(rounds)]


def test_flat_cost_selects_deep():
    sim = Sim(flat, 0.9)
    sim.run(3000)
    assert sim.controller.selected() >= 5
    assert np.mean(np.array(sim.depths[-500:]) >= 5) > 0.9


def test_steep_cost_selects_shallow():
    sim = Sim(steep, 0.9)  # the same acceptance as the flat case: only the cost differs
    sim.run(3000)
    recent = np.array(sim.depths[-1000:])
    assert np.mean(recent <= 4) > 0.95
    assert np.mean(recent >= 1) > 0.8  # drafting still pays at depth 1-2


def test_poor_acceptance_on_steep_cost_parks_at_a_measured_depth_zero():
    sim = Sim(steep, 0.4)
    sim.run(3000)
    state = sim.controller.state()
    assert sim.controller.selected() == 0
    assert state["cost_ms"][0] == pytest.approx(30.0)  # depth 0 was timed for real
    assert np.mean(np.array(sim.depths[-1000:]) == 0) > 0.95


def test_a_three_times_stall_does_not_unpark():
    # Acceptance 0.25: clearly parked (depth 1 would need 0.63), whatever the EWMA's noise.
    sim = Sim(steep, 0.25)
    sim.run(3000)
    while sim.depths[-1] != 0 or sim.session.depth != 0:
        sim.round()
    before = sim.controller.cost(0)
    sim.round(stall=3.0)  # its sample lands when the next round starts
    sim.round()
    assert sim.controller.cost(0) == pytest.approx(before * (1 + 0.3 * 0.25))
    assert sim.controller.selected() == 0
    assert sim.run(50).count(0) >= 45


def test_probes_back_off_to_the_cap_and_snap_back_when_drafting_pays():
    sim = Sim(steep, 0.3, max_depth=4)
    intervals = []
    for _ in range(4000):
        sim.round()
        intervals.append(sim.controller.state()["probe_interval"])
    assert sim.controller.selected() == 0
    assert intervals[-1] == PROBE_MAX
    seen = sorted(set(intervals))
    doublings = (PROBE_MAX // PROBE_FIRST).bit_length()
    assert seen == [PROBE_FIRST * 2**i for i in range(doublings)]  # 4, 8, ..., cap
    late = [i for i, d in enumerate(sim.depths) if d == 1 and i > 2000]
    starts = [i for i in late if i - 1 not in late]
    assert all(i + PROBE_ROUNDS - 1 in late for i in starts)  # each probe lasts its rounds
    assert np.diff(starts).min() >= PROBE_MAX  # probes come one interval apart
    sim.rate = 1.0  # drafting becomes worthwhile; only probes can notice
    for _ in range(20 * PROBE_MAX):
        sim.round()
        if sim.controller.selected() > 0:
            break
    assert sim.controller.selected() >= 1
    assert sim.controller.state()["probe_interval"] == PROBE_FIRST


def test_a_new_request_probes_again_soon():
    """Probes backed off to the cap while parked start over at each request: a head parked by
    one kind of text gets tried early on the next request's, whose acceptance may differ."""
    sim = Sim(steep, 0.3, max_depth=4)
    sim.run(3000)
    assert sim.controller.selected() == 0
    assert sim.controller.state()["probe_interval"] == PROBE_MAX
    sim.session = sim.controller.for_request()  # the next request
    assert sim.controller.state()["probe_interval"] == PROBE_FIRST
    assert 1 in sim.run(2 * PROBE_FIRST)  # a probe within its first rounds
    sim.rate = 0.95  # this request's text suits the head
    for _ in range(PROBE_MAX):
        sim.round()
        if sim.controller.selected() > 0:
            break
    assert sim.controller.selected() >= 1
    parked = Sim(steep, 0.3, max_depth=4)  # a request that ends in the middle of a probe
    parked.run(3000)
    while parked.round() == 0:
        pass
    parked.session = parked.controller.for_request()
    assert parked.controller.state()["probe_interval"] == PROBE_FIRST
    useless = Sim(steep, 0.0, max_depth=4)  # a random head: no request makes it draft
    useless.run(3000)
    assert useless.controller.state()["probe_interval"] == PROBE_MAX
    useless.session = useless.controller.for_request()
    assert useless.controller.state()["probe_interval"] == PROBE_MAX


def test_a_new_request_keeps_a_drafting_controllers_probe_interval():
    """A controller that drafts keeps measuring the acceptance of the positions it drafts, so
    a new request ends an unfinished probe but does not restart the probes: each one is
    rounds at a depth judged worse."""
    sim = Sim(steep, 0.9, max_depth=4)
    sim.run(3000)
    assert sim.controller.selected() >= 1
    interval = sim.controller.state()["probe_interval"]
    assert interval > PROBE_FIRST
    while not sim.controller._probing:  # stop in the middle of a probe
        sim.round()
    sim.session = sim.controller.for_request()
    assert sim.controller.state()["probe_interval"] == interval
    assert not sim.controller._probing
    selected = sim.controller.selected()
    assert sim.run(PROBE_FIRST * 2) == [selected] * (PROBE_FIRST * 2)


def test_a_parked_controller_remeasures_the_cost_of_drafting_on_probes():
    # Depth 1 looks expensive at first (warm-up), then gets cheaper than its acceptance
    # needs; only the timed second round of each probe can tell the parked controller.
    sim = Sim(steep, 0.45, max_depth=1)
    sim.cost = lambda depth: 0.030 if depth == 0 else 0.060
    sim.run(400)
    assert sim.controller.selected() == 0
    sim.cost = lambda depth: 0.030 if depth == 0 else 0.036  # break-even acceptance 0.2
    for _ in range(40 * PROBE_MAX):
        sim.round()
        if sim.controller.selected() == 1:
            break
    assert sim.controller.selected() == 1
    assert sim.controller.cost(1) < 0.045


def smollm2(depth: int) -> float:
    """Round costs measured on SmolLM2-135M: depth 1/2/3 cost 1.21/1.45/1.92 plain steps."""
    return 0.080 * [1.0, 1.21, 1.45, 1.92][min(depth, 3)] * (1 + 0.25 * max(depth - 3, 0))


def test_a_machine_slowing_down_does_not_park_a_head_that_pays():
    # Timing depth 1 in a slow spell against a depth 0 timed in a fast one would park the
    # head: the costs are relative to a speed that the selected depth's rounds keep current.
    sim = Sim(smollm2, 0.5, max_depth=4)
    sim.run(600)
    assert sim.controller.selected() >= 1
    for speed in (1.4, 0.8, 1.25):
        sim.speed = speed
        sim.run(400)
        late = np.array(sim.depths[-300:])
        assert np.mean(late >= 1) > 0.9, speed
        assert sim.controller.cost(0) == pytest.approx(0.080 * speed, rel=0.1)


def test_shallower_probes_notice_plain_decoding_becoming_the_better_choice():
    sim = Sim(smollm2, 0.5, max_depth=2)
    sim.run(600)
    assert sim.controller.selected() >= 1
    assert 0 in sim.depths[-300:]  # the selected depth is probed from below too
    sim.cost = lambda depth: 0.060 if depth == 0 else smollm2(depth)  # now plain pays
    for _ in range(40 * PROBE_MAX):
        sim.round()
        if sim.controller.selected() == 0:
            break
    assert sim.controller.selected() == 0
    assert sim.controller.cost(0) < 0.078  # re-measured: it was 0.080 at the selected depth


def test_the_selected_depth_changes_only_for_a_clear_gain():
    controller = DepthController(max_depth=1)
    controller.record_cost(0, 0.100)
    controller.record_cost(1, 0.148)  # depth 1 pays once position 1 is accepted > 48%

    def settle(rate: float) -> int:
        for i in range(400):  # evenly spread outcomes, so the EWMA sits at ``rate``
            controller.observe(1, int((i + 1) * rate) - int(i * rate))
        controller.next()
        return controller.state()["selected"]

    assert settle(0.50) == 0  # depth 1 would be 1.4% faster: not worth a change
    assert settle(0.60) == 1  # 8% faster
    assert settle(0.46) == 1  # depth 0 would be 1.4% faster
    assert settle(0.36) == 0  # 9% faster


def test_acceptance_ewma_follows_drift():
    controller = DepthController(max_depth=2)
    for i in range(60):
        controller.observe(1, 1 if i % 10 != 0 else 0)  # 90% accepted
    assert controller.acceptance(1) == pytest.approx(0.9, abs=0.1)
    for i in range(60):
        controller.observe(1, 1 if i % 10 < 3 else 0)  # 30% accepted
    assert controller.acceptance(1) == pytest.approx(0.3, abs=0.1)


def test_positions_past_an_accepted_eos_are_unjudged():
    controller = DepthController(max_depth=4)
    controller.observe(2, 2)  # EOS accepted at position 2 of 4 drafts
    assert controller.state()["samples"] == [1, 1, 0, 0]
    controller.observe(4, 2)  # an ordinary rejection at position 3
    assert controller.state()["samples"] == [2, 2, 1, 0]
    for _ in range(20):
        controller.observe(2, 2)
    assert controller.state()["samples"] == [22, 22, 1, 0]
    # position 3 stays untrusted, so it borrows position 2's rate, untouched by the EOS rounds
    assert controller.acceptance(3) == controller.acceptance(2) == 1.0


def test_untrusted_positions_borrow_the_deepest_trusted_rate():
    controller = DepthController(max_depth=4)
    assert controller.acceptance(3) == 1.0  # nothing trusted: optimistic
    for i in range(10):
        controller.observe(2, 2 if i % 2 else 1)  # position 1 always, position 2 half
    assert controller.frontier() == 2 and controller.limit() == 3
    assert controller.acceptance(4) == controller.acceptance(2) < 1.0
    assert controller.expected_committed(2) == pytest.approx(
        1 + controller.acceptance(1) * (1 + controller.acceptance(2))
    )


def test_cost_interpolates_between_sampled_depths_and_is_flat_beyond():
    controller = DepthController(max_depth=8)
    assert controller.cost(0) is None
    controller.record_cost(1, 0.10)
    controller.record_cost(5, 0.30)
    assert controller.cost(3) == pytest.approx(0.20)
    assert controller.cost(0) == pytest.approx(0.10)
    assert controller.cost(8) == pytest.approx(0.30)


def test_cost_samples_are_clamped_and_transitions_dropped():
    now = [0.0]
    controller = DepthController(max_depth=4, clock=lambda: now[0])
    rounds = [(0, 1.0), (0, 1.0), (0, 3.0), (2, 9.0), (2, 5.0), (2, 2.0), (2, 2.0), (2, 2.0)]
    rounds += [(2, 0.5), (2, 0)]
    for depth, seconds in rounds:
        controller.round_started(depth)
        now[0] += seconds
    # depth 0: one sample (the first round had no predecessor, the third is followed by a
    # change of depth: 3.0 dropped); the first depth-2 round follows a change (9.0, dropped);
    # the next four seed by their median (5.0 is a warm-up outlier), then 0.5 is clamped to
    # 2.0 * 0.75
    state = controller.state()
    assert state["cost_ms"][0] == pytest.approx(1000.0)
    assert state["cost_ms"][2] == pytest.approx(1000 * (2.0 + 0.3 * (1.5 - 2.0)))


def test_acceptance_is_the_plain_mean_until_the_ewma_window_fills():
    controller = DepthController(max_depth=1)
    outcomes = [0, 1, 1, 0, 1, 1, 1, 0, 1, 1]
    for i, accepted in enumerate(outcomes):
        controller.observe(1, accepted)
        assert controller._rate[1] == pytest.approx(np.mean(outcomes[: i + 1]))
    assert controller.acceptance(1) == pytest.approx(0.7)


def test_state_persists_across_requests_and_the_gap_is_not_a_cost():
    sim = Sim(flat, 0.9)
    sim.run(400)
    depth = sim.controller.scheduled
    assert depth > 0
    costs = dict(sim.controller.state()["cost_ms"])
    sim.now += 1000.0  # prefill of the next request, idle time, ...
    sim.session = sim.controller.for_request()
    assert sim.session.depth == depth  # the next request starts where the last one stopped
    sim.round()
    sim.round()
    after = sim.controller.state()["cost_ms"]
    assert all(after[d] < 2 * costs[d] for d in costs)


def test_speculative_false_pins_depth_zero_and_leaves_the_controller_alone():
    sim = Sim(flat, 0.9)
    sim.run(300)
    before = sim.controller.state()
    session = sim.controller.for_request(speculative=False)
    assert not session.enabled and session.depth == 0
    session.round_started(0)
    sim.now += 5.0
    session.round_started(0)
    session.round_finished(3, 3)
    assert sim.controller.state() == before


def test_max_depth_bounds_the_choice():
    sim = Sim(flat, 1.0, max_depth=3)
    sim.run(1000)
    assert max(sim.depths) <= 3
    assert sim.controller.selected() == 3
    assert not DepthController(max_depth=0).for_request().enabled


def test_state_is_plain_json():
    sim = Sim(steep, 0.7)
    sim.run(200)
    state = sim.controller.state()
    assert set(state) >= {"depth", "cost_ms", "acceptance", "probe_interval"}
    assert json.loads(json.dumps(state))["probe_interval"] == state["probe_interval"]


def test_fixed_depth_is_constant():
    fixed = FixedDepth(3)
    fixed.round_finished(3, 0)
    assert fixed.enabled and fixed.depth == 3
    assert not FixedDepth(0).enabled


def test_no_depth_source_goes_past_the_ceiling():
    assert DepthController(max_depth=MAX_DRAFT_DEPTH).state()["max_depth"] == MAX_DRAFT_DEPTH
    assert FixedDepth(MAX_DRAFT_DEPTH).depth == MAX_DRAFT_DEPTH
    too_deep = MAX_DRAFT_DEPTH + 1
    with pytest.raises(ValueError, match=f"max_depth {too_deep} .* ceiling {MAX_DRAFT_DEPTH}"):
        DepthController(max_depth=too_deep)
    with pytest.raises(ValueError, match=f"depth {too_deep} .* ceiling {MAX_DRAFT_DEPTH}"):
        FixedDepth(too_deep)


@pytest.mark.parametrize("flag", ["--max-draft", "--draft-depth"])
def test_the_cli_refuses_depths_past_the_ceiling(flag, capsys):
    dest = flag[2:].replace("-", "_")
    assert getattr(build_parser().parse_args([flag, str(MAX_DRAFT_DEPTH)]), dest) == MAX_DRAFT_DEPTH
    assert getattr(build_parser().parse_args([flag, "0"]), dest) == 0  # 0: no speculation
    for bad, why in ((MAX_DRAFT_DEPTH + 1, f"at most {MAX_DRAFT_DEPTH}"), (-1, "at least 0")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([flag, str(bad)])
        assert f"argument {flag}: must be {why}" in capsys.readouterr().err


def test_the_ceiling_fits_every_verify_path():
    """A round at the ceiling verifies MAX_DRAFT_DEPTH + 1 rows: still compiled, still the
    native few-row product and the row layout, and within a rotating cache's slack."""
    from cache.window import RotatingKVCache
    from runner import native
    from runner.models.layers import MAX_ROWS_LEFT
    from runner.models.llama import COMPILED_MAX_ROWS

    rows = MAX_DRAFT_DEPTH + 1
    assert min(COMPILED_MAX_ROWS, native.SMALL_ROWS, MAX_ROWS_LEFT) >= rows
    assert RotatingKVCache(4).slack >= rows


def test_a_useless_head_is_never_drafted_deeper_than_one():
    sim = Sim(steep, 0.0)
    sim.run(2000)
    assert max(sim.depths) == 1  # position 1 never pays: no depth-2 cost seeding, no probes
    assert 2 not in sim.controller.state()["cost_ms"]
    # Position 1 is trusted to be useless: probes are single rounds, one per interval.
    late = sim.depths[-1000:]
    assert late.count(1) <= 1000 // PROBE_MAX + 1
    assert all(late[i + 1] == 0 for i, d in enumerate(late[:-1]) if d == 1)
