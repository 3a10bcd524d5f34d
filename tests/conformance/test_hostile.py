"""A hostile host through real pipes: repeated signals, control lines behind huge prompts,
cancels during a long prefill, and the protocol doing exactly what it documents."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest
import pytest_asyncio

from tests.conformance.harness import RunnerProcess, ids_of, text_of, unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def completion(request_id: str, prompt: str = "Once upon a time", **options) -> dict:
    return {
        "type": "completion",
        "id": request_id,
        "prompt": prompt,
        "options": {"temperature": 0, **options},
    }


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_during_shutdown_is_ignored_never_fatal(spawn, signum):
    for attempt in range(3):
        runner = await spawn()
        running = unique_id("running")
        await runner.send(completion(running, num_predict=100000))
        await runner.reply(running)  # decoding is under way
        runner.signal(signum)
        await asyncio.sleep(0.01 * attempt)  # the second one lands at a few points of the exit
        try:
            runner.signal(signum)
        except ProcessLookupError:
            pass  # it has already exited
        late = unique_id("late")
        try:
            await runner.send(completion(late, num_predict=2))
        except (BrokenPipeError, ConnectionResetError):
            late = None  # already gone: nothing was accepted
        assert await runner.wait_exit(timeout=20) == 0, runner.stderr_tail()
        assert b"Traceback" not in runner.stderr and b"KeyboardInterrupt" not in runner.stderr
        done = [f for f in runner.frames if f.get("id") == running and f["type"] == "done"]
        assert [d["done_reason"] for d in done] == ["cancelled"]
        if late is not None:
            # A completion after a shutdown signal is refused, never accepted and cancelled.
            answers = [f for f in runner.frames if f.get("id") == late]
            assert [(f["type"], f.get("code")) for f in answers] in ([], [("error", "overloaded")])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def default_runner(default_model):
    cmd = [sys.executable, "-m", "runner", "--model", default_model, "--no-prefix-cache"]
    runner = await RunnerProcess.start(cmd)
    yield runner
    await runner.stop()
    assert not runner.violations, runner.violations[:5]


async def test_control_lines_are_not_held_behind_tokenization(default_runner, default_loaded):
    runner = default_runner
    bound = default_loaded.tokenizer.max_token_bytes * (runner.ready["context_length"] - 2)
    # Short enough in bytes to pass the byte-length check, so it is tokenized (that takes a
    # while), and far too many tokens for the context.
    words = "lorem ipsum dolor sit amet, "
    slow = unique_id("slow")
    await runner.send(completion(slow, prompt=words * (bound // len(words) - 1)))
    await runner.send({"type": "status", "id": "behind"})
    await runner.send({"type": "cancel", "id": "nobody"})
    order = []
    for _ in range(3):
        frame = await runner.take(lambda f: f.get("id") in (slow, "behind", "nobody"), timeout=60)
        order.append((frame["id"], frame["type"], frame.get("code")))
    # The status and the cancel were answered while the prompt was still being tokenized.
    assert order[-1] == (slow, "error", "context_overflow"), order
    assert {o[0] for o in order[:2]} == {"behind", "nobody"}


async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(spawn):
    runner = await spawn()
    huge = unique_id("huge")
    await runner.send(completion(huge, prompt="x" * (8 << 20)))
    sent = time.monotonic()
    await runner.send({"type": "status", "id": "after-huge"})
    error = await runner.reply(huge, timeout=30)
    assert error["type"] == "error" and error["code"] == "context_overflow"
    assert "at least" in error["message"]  # refused by its byte length, not its tokens
    status = await runner.reply("after-huge", timeout=30)
    assert status["type"] == "status" and status["active"] is None
    assert time.monotonic() - sent < 5.0  # tokenizing 8 MB would take far longer
    # The runner serves normally afterwards.
    rid = unique_id("after")
    await runner.send(completion(rid, num_predict=3))
    _, done = await runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")


async def test_status_never_names_a_completion_whose_done_was_written(spawn):
    runner = await spawn()
    for i in range(10):
        rid = unique_id("short")
        await runner.send(completion(rid, prompt=f"count {i}", num_predict=2))
        await runner.completion(rid)
        sid = unique_id("status")
        await runner.send({"type": "status", "id": sid})
        status = await runner.reply(sid)
        assert status["active"] != rid and status["queue_length"] == 0


async def test_zero_think_budget_closes_before_any_token(spawn):
    runner = await spawn()
    rid = unique_id("think0")
    prompt = CHAT.format("Think about it.") + "<think>"
    await runner.send({**completion(rid, prompt=prompt, num_predict=6), "think_budget": 0})
    tokens, done = await runner.completion(rid)
    assert text_of(tokens).startswith("</think>")
    assert done["eval_tokens"] == len(ids_of(tokens)) - len(ids_of(tokens[:1]))


async def test_missing_fields_and_deep_arrays_say_what_the_documentation_says(spawn):
    runner = await spawn()
    await runner.send('{"type":"completion","prompt":"x"}')
    await runner.send(b"[" * 100000 + b"]" * 100000 + b"\n")
    await runner.send('{"type":"tokenize","id":"t","text":"\\ud800"}')
    errors = await runner.before_fence(lambda f: f["type"] == "error")
    assert [(e["code"], e["message"].split(":")[0]) for e in errors[:2]] == [
        ("bad_request", "id"),
        ("bad_json", "JSON nested too deeply"),
    ]
    assert errors[2]["code"] == "bad_json" and "lone UTF-16 surrogate" in errors[2]["message"]


async def test_cancel_during_a_long_prefill_lands_at_once(default_runner):
    runner = default_runner
    if True:
        prompt = CHAT.format(" ".join(f"item {i} is on the list." for i in range(150)))
        # The whole prefill of this prompt, for scale.
        full = unique_id("full")
        started = time.monotonic()
        await runner.send(completion(full, prompt=prompt, num_predict=1))
        _, done = await runner.completion(full, timeout=300)
        prefill_s = time.monotonic() - started
        assert done["prompt_tokens"] > 1000  # several prefill chunks
        latencies = []
        for delay in (0.3, 0.5 * prefill_s):
            rid = unique_id("cancelled")
            await runner.send(completion(rid, prompt=prompt + f" {delay}", num_predict=1))
            await asyncio.sleep(delay)
            sent = time.monotonic()
            await runner.send({"type": "cancel", "id": rid})
            _, done = await runner.completion(rid, timeout=300)
            latencies.append(time.monotonic() - sent)
            assert done["done_reason"] == "cancelled" and done["eval_tokens"] == 0
        # A cancel waits for at most a fraction of a prefill chunk, not the whole prefill.
        assert max(latencies) < min(1.0, 0.25 * prefill_s), (latencies, prefill_s)
