"""The prefix cache stays within its byte budget, seen from the host through `status` frames,
and the runner's resident memory stays flat over a long stream of distinct prompts."""

from __future__ import annotations

import random

import pytest

from tests.conformance.harness import unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

BUDGET = 256 * 1024


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def test_small_budget_holds_and_memory_stays_flat(spawn, own_runner, conformance_model):
    if not own_runner or conformance_model is None:
        pytest.skip("needs this runner's --cache-bytes on a real model")
    runner = await spawn("--cache-bytes", str(BUDGET))
    rng = random.Random(3)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    # Prompts of 20-60 words; fewer where a small checkpoint's context cannot hold them.
    longest = min(60, max(9, runner.ready["context_length"] // 16))
    rss = []
    for i in range(80):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(longest // 3, longest)))
        rid = unique_id("budget")
        await runner.send(
            {
                "type": "completion",
                "id": rid,
                "prompt": f"{i} {prompt}",
                "options": {"temperature": 0, "num_predict": 6},
            }
        )
        _, done = await runner.completion(rid)
        assert done["done_reason"] in ("stop", "length")
        sid = unique_id("status")
        await runner.send({"type": "status", "id": sid})
        status = await runner.reply(sid)
        assert status["cache_bytes"] <= BUDGET, status
        rss.append(rss_bytes(runner.proc.pid))
    assert status["cache_entries"] >= 1
    # After warm-up, resident memory does not grow with the number of prompts served.
    warm = max(rss[20:30])
    assert max(rss[60:]) <= warm + 8 * 1024 * 1024, (warm, max(rss[60:]))
