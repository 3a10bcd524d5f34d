"""Cancelling a running completion: prompt, and the runner's state stays correct afterwards."""

from __future__ import annotations

import time

import pytest

from tests.conformance.harness import ids_of, text_of, unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Once upon a time there was a little robot"
CANCEL_DEADLINE_S = 2.0


def greedy(request_id: str, prompt: str, num_predict: int) -> dict:
    return {
        "type": "completion",
        "id": request_id,
        "prompt": prompt,
        "options": {"temperature": 0, "num_predict": num_predict},
    }


async def greedy_text(runner, prompt: str, num_predict: int = 24) -> tuple[str, list[int]]:
    rid = unique_id("greedy")
    await runner.send(greedy(rid, prompt, num_predict))
    tokens, done = await runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")
    return text_of(tokens), ids_of(tokens)


async def test_cancel_mid_decode_is_prompt_and_leaves_the_runner_correct(spawn):
    runner = await spawn()
    rid = unique_id("long")
    await runner.send(greedy(rid, PROMPT, 100000))
    received = [await runner.reply(rid) for _ in range(5)]  # decoding is under way
    assert all(f["type"] == "token" for f in received)
    sent_at = time.monotonic()
    await runner.send({"type": "cancel", "id": rid})
    tokens, done = await runner.completion(rid, timeout=CANCEL_DEADLINE_S + 5)
    elapsed = time.monotonic() - sent_at
    assert done["done_reason"] == "cancelled"
    assert elapsed < CANCEL_DEADLINE_S, f"cancel took {elapsed:.2f}s"
    assert done["eval_tokens"] >= len(ids_of(received + tokens))
    # The same prompt afterwards (its prefix now cached) gives what a fresh runner gives.
    after_cancel = await greedy_text(runner, PROMPT)
    fresh = await spawn()
    assert after_cancel == await greedy_text(fresh, PROMPT)


async def test_cancel_during_prefill_then_the_prompt_still_completes_correctly(spawn):
    long_prompt = " ".join(f"step {i}: the robot paints the sky" for i in range(80))
    runner = await spawn("--prefill-chunk", "32")
    if runner.ready["context_length"] < 4096:  # the prompt is ~1-2k tokens, decoding goes on
        pytest.skip(f"needs a long context; this checkpoint's is {runner.ready['context_length']}")
    rid = unique_id("prefill")
    await runner.send(greedy(rid, long_prompt, 100000))
    await runner.send({"type": "cancel", "id": rid})
    _, done = await runner.completion(rid, timeout=30)
    assert done["done_reason"] == "cancelled"
    resumed = await greedy_text(runner, long_prompt, 12)
    fresh = await spawn()
    assert resumed == await greedy_text(fresh, long_prompt, 12)
