"""End to end on the default model through real pipes: greedy output with speculation equals
the output without, for 20 prompts. Uses the shipped MTP head when the package has one,
otherwise a random head written as a sidecar (speculation must be lossless either way)."""

from __future__ import annotations

import sys

import pytest

from tests.conformance.harness import RunnerProcess, ids_of, unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for better sleep.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Translate 'good morning, my friend' into Spanish.",
    "Summarize the plot of Romeo and Juliet.",
    "List the planets of the solar system in order.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "How do I make a cup of green tea?",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "Write a JavaScript function that adds two numbers.",
    "What is photosynthesis?",
    "Name five fruits that are red.",
    "Explain recursion to a child.",
    "What causes earthquakes?",
    "Write a limerick about a programmer.",
]


async def test_greedy_with_speculation_equals_without(default_model, head_args):
    cmd = [sys.executable, "-m", "runner", "--model", default_model, "--draft-depth", "3"]
    runner = await RunnerProcess.start([*cmd, *head_args])
    try:
        assert runner.ready["mtp"], runner.ready["mtp_detail"]
        rounds = accepted = 0
        for question in PROMPTS:
            outputs = {}
            for speculative in (True, False):
                rid = unique_id("spec" if speculative else "plain")
                await runner.send(
                    {
                        "type": "completion",
                        "id": rid,
                        "prompt": CHAT.format(question),
                        "speculative": speculative,
                        "options": {"temperature": 0, "num_predict": 16},
                    }
                )
                tokens, done = await runner.completion(rid, timeout=300)
                outputs[speculative] = (ids_of(tokens), done["done_reason"], done["eval_tokens"])
                if speculative:
                    rounds += done["speculation"]["rounds"]
                    accepted += done["speculation"]["accepted"]
                else:
                    assert done["speculation"]["rounds"] == 0
            assert outputs[True] == outputs[False], question
        assert rounds >= len(PROMPTS)  # speculation really ran
        if not head_args:  # the shipped head: its drafts are accepted, so commits span rows
            assert accepted >= rounds // 4, (accepted, rounds)
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:5]
