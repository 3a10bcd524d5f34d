"""The depth controller on simulated rounds: how close it comes to the best fixed depth.

A benchmark of decisions, not of MLX: each round's wall time is ``relative cost of its depth x
the machine's speed x noise``, with the relative costs measured on SmolLM2-135M on this CPU
(a depth 1/2/3 round costs 1.21/1.45/1.92 plain steps), a speed that swings sinusoidally
(this shared machine's drifts) and log-normal per-round noise; each draft is accepted with the
prompt's rate (conditional acceptance, the same at every position). A run is 30 prompts of 128
tokens, one controller across them, as in a server. The speed column is tokens per second
relative to plain decoding on the same rounds' speeds. Usage:

    python scripts/bench/sim_depth.py [--seeds 30] [--noise 0.15] [--set NAME=VALUE ...]

``--set`` overrides a constant of ``drafting.depth`` (e.g. ``SWITCH_MARGIN=0``) to compare
tunings.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc  # noqa: E402

sys.path.insert(0, bc.ROOT)
from drafting import depth as depth_module  # noqa: E402

RELATIVE_COST = [1.0, 1.21, 1.45, 1.92]  # plain steps per round at depth 0..3 (measured)
STEP_SECONDS = 0.080
PROMPTS, TOKENS = 30, 128

SCENARIOS = {
    "mixed 0.30-0.65": (0.30, 0.65),
    "0.50": (0.50, 0.50),
    "0.30": (0.30, 0.30),
    "useless (0.0)": (0.0, 0.0),
}


def relative_cost(depth: int) -> float:
    if depth < len(RELATIVE_COST):
        return RELATIVE_COST[depth]
    return RELATIVE_COST[-1] + 0.4 * (depth - len(RELATIVE_COST) + 1)


def simulate(policy: str, rates: tuple[float, float], seed: int, noise: float, swing: float):
    """Speed relative to plain decoding for one run of PROMPTS requests."""
    rng = np.random.default_rng(seed)
    clock = [0.0]
    controller = depth_module.DepthController(clock=lambda: clock[0])
    spec_seconds = plain_seconds = 0.0
    rounds = 0
    mean_noise = math.exp(noise**2 / 2)  # plain steps are as noisy on average
    for _ in range(PROMPTS):
        rate = rng.uniform(*rates)
        if policy == "adaptive":
            view = controller.for_request()
        else:
            view = depth_module.FixedDepth(int(policy.split()[-1]))
        clock[0] += 5.0  # prefill and idle time between requests: not a round
        done = 0
        while done < TOKENS:
            depth = view.depth
            view.round_started(depth)
            speed = 1.0 + swing * math.sin(2 * math.pi * rounds / 400)
            seconds = STEP_SECONDS * relative_cost(depth) * speed * math.exp(rng.normal(0, noise))
            clock[0] += seconds
            spec_seconds += seconds
            accepted = 0
            while accepted < depth and rng.random() < rate:
                accepted += 1
            done += accepted + 1
            plain_seconds += (accepted + 1) * STEP_SECONDS * speed * mean_noise
            view.round_finished(depth, accepted)
            rounds += 1
    return plain_seconds / spec_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--noise", type=float, default=0.15, help="per-round log-normal sigma")
    parser.add_argument("--swing", type=float, default=0.2, help="speed swing (+-fraction)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    for item in args.set:
        name, value = item.split("=", 1)
        if not hasattr(depth_module, name):
            parser.error(f"drafting.depth has no constant {name}")
        setattr(depth_module, name, type(getattr(depth_module, name))(float(value)))

    policies = ["adaptive", "fixed 0", "fixed 1", "fixed 2", "fixed 3"]
    results: dict = {}
    rows = []
    for scenario, rates in SCENARIOS.items():
        results[scenario] = {}
        row = [scenario]
        for policy in policies:
            speeds = [
                simulate(policy, rates, seed, args.noise, args.swing) for seed in range(args.seeds)
            ]
            results[scenario][policy] = {
                "mean": statistics.fmean(speeds),
                "stdev": statistics.pstdev(speeds),
            }
            row.append(f"{statistics.fmean(speeds):.3f}")
        rows.append(row)
    print(bc.markdown_table(["acceptance", *policies], rows))
    config = {"seeds": args.seeds, "noise": args.noise, "swing": args.swing, "set": args.set}
    print(bc.write_json("sim_depth.json", {"config": config, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
