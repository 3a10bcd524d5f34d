"""Every request type and the per-request error codes, through one runner's real pipes."""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.conftest import FAULT_ID
from tests.conformance.harness import ids_of, text_of, unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0}
# Logprobs are of the raw distribution; without penalties greedy picks its best token.
NO_PENALTY = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def completion(request_id: str, prompt: str = PROMPT, **fields) -> dict:
    options = fields.pop("options", {})
    return {
        "type": "completion",
        "id": request_id,
        "prompt": prompt,
        "options": {**GREEDY, **options},
        **fields,
    }


def long_completion(request_id: str) -> dict:
    """Runs until cancelled or the context is full: seconds even on the tiny checkpoint.

    Without speculation: a random checkpoint's greedy text loops, and drafts copied from the
    loop fill the whole context in a few rounds, before a test has cancelled it.
    """
    request = completion(request_id, "Once upon a time", options={"num_predict": 100000})
    return {**request, "speculative": False}


async def cancel_and_finish(runner, request_id: str) -> dict:
    await runner.send({"type": "cancel", "id": request_id})
    _, done = await runner.completion(request_id)
    return done


async def test_ready_describes_the_model(shared_runner):
    ready = shared_runner.ready
    assert ready["protocol_version"] == 1
    assert ready["context_length"] > 0 and ready["vocab_size"] > 0
    assert isinstance(ready["mtp"], bool) and isinstance(ready["mtp_detail"], str)
    assert ready["model"] and ready["blas"]


async def test_completion_streams_tokens_then_one_done(shared_runner):
    rid = unique_id()
    await shared_runner.send(completion(rid, options={"num_predict": 8}))
    tokens, done = await shared_runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")
    assert done["eval_tokens"] == len(ids_of(tokens))
    assert 1 <= done["eval_tokens"] <= 8
    if done["done_reason"] == "length":
        assert done["eval_tokens"] == 8
    await shared_runner.send({"type": "tokenize", "id": rid + "-tok", "text": PROMPT})
    prompt_ids = (await shared_runner.reply(rid + "-tok"))["tokens"]
    assert done["prompt_tokens"] == len(prompt_ids)
    assert 0 <= done["prompt_cached_tokens"] <= done["prompt_tokens"]
    assert done["prompt_eval_ns"] >= 0 and done["eval_ns"] >= 0
    spec = done["speculation"]
    assert spec["accepted"] <= spec["drafted"]
    # A histogram over rounds (drafting/stats.py): entry a counts rounds that accepted a drafts.
    per_depth = spec["accepted_per_depth"]
    assert sum(per_depth) == spec["rounds"]
    assert sum(a * n for a, n in enumerate(per_depth)) == spec["accepted"]


async def test_tokens_input_generates_what_the_prompt_does(shared_runner):
    tok = unique_id("tok")
    await shared_runner.send({"type": "tokenize", "id": tok, "text": PROMPT})
    prompt_ids = (await shared_runner.reply(tok))["tokens"]
    by_text, by_ids = unique_id(), unique_id()
    await shared_runner.send(completion(by_text, options={"num_predict": 12}))
    await shared_runner.send(
        {
            "type": "completion",
            "id": by_ids,
            "tokens": prompt_ids,
            "options": {"temperature": 0, "num_predict": 12},
        }
    )
    text_frames, _ = await shared_runner.completion(by_text)
    id_frames, _ = await shared_runner.completion(by_ids)
    assert ids_of(id_frames) == ids_of(text_frames)
    assert text_of(id_frames) == text_of(text_frames)


async def test_tokenize_then_detokenize_round_trips(shared_runner):
    text = "Hello, world! café 日本語 😀"
    tok, detok = unique_id("tok"), unique_id("detok")
    await shared_runner.send({"type": "tokenize", "id": tok, "text": text})
    frame = await shared_runner.reply(tok)
    assert frame["type"] == "tokens" and len(frame["tokens"]) > 0
    await shared_runner.send({"type": "detokenize", "id": detok, "tokens": frame["tokens"]})
    back = await shared_runner.reply(detok)
    assert back == {"type": "text", "id": detok, "text": text}


async def test_detokenize_rejects_ids_outside_the_vocabulary(shared_runner):
    rid = unique_id()
    vocab = shared_runner.ready["vocab_size"]
    await shared_runner.send({"type": "detokenize", "id": rid, "tokens": [0, vocab]})
    frame = await shared_runner.reply(rid)
    assert frame["type"] == "error" and frame["code"] == "bad_request"
    assert "tokens" in frame["message"]


async def test_status_is_answered_while_a_completion_runs(shared_runner):
    rid, status = unique_id("long"), unique_id("status")
    await shared_runner.send(long_completion(rid))
    await shared_runner.reply(rid)  # first token: it is running
    await shared_runner.send({"type": "status", "id": status})
    seq_status, frame = await shared_runner.take_seq(lambda f: f.get("id") == status)
    assert frame["type"] == "status"
    assert frame["active"] == rid and frame["queue_length"] == 0
    for key in ("cache_entries", "cache_bytes", "memory_bytes", "speculation_depth"):
        assert frame[key] >= 0
    assert isinstance(frame["speculation"], dict)
    done = await cancel_and_finish(shared_runner, rid)
    assert done["done_reason"] == "cancelled"


async def test_cancel_of_a_queued_completion_sends_its_done_at_once(shared_runner):
    # Long completions until one has to wait (--parallel runs several at once).
    running = []
    while len(running) < 9:
        rid = unique_id("running")
        await shared_runner.send(long_completion(rid))
        running.append(rid)
        if not await becomes_active(shared_runner, rid):
            break
    queued = unique_id("queued")
    await shared_runner.send(completion(queued))
    await shared_runner.send({"type": "cancel", "id": queued})
    tokens, done = await shared_runner.completion(queued, timeout=10)
    assert tokens == [] and done["done_reason"] == "cancelled"
    assert done["prompt_tokens"] == 0 and done["eval_tokens"] == 0
    # The running completions were not disturbed by the queued one's cancel.
    assert shared_runner.proc.returncode is None
    # Every cancel goes out before any done is read: reading one completion's thousands of
    # token frames takes seconds, long enough for the others to fill the context.
    for rid in running:
        await shared_runner.send({"type": "cancel", "id": rid})
    for rid in running:
        _, done = await shared_runner.completion(rid)
        assert done["done_reason"] == "cancelled"


async def becomes_active(runner, request_id: str, seconds: float = 3.0) -> bool:
    """Whether ``status`` names ``request_id`` as running within ``seconds``."""
    for _ in range(int(seconds / 0.1)):
        fence = unique_id("status")
        await runner.send({"type": "status", "id": fence})
        status = await runner.reply(fence)
        if request_id in status.get("active_ids", [status["active"]]):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_cancel_of_an_unknown_id_is_an_error(shared_runner):
    rid = unique_id("nobody")
    await shared_runner.send({"type": "cancel", "id": rid})
    frame = await shared_runner.reply(rid)
    assert frame["type"] == "error" and frame["code"] == "unknown_id"


async def test_duplicate_id_is_refused_and_the_original_continues(shared_runner):
    rid = unique_id("dup")
    await shared_runner.send(long_completion(rid))
    await shared_runner.reply(rid)
    await shared_runner.send(completion(rid))
    frame = await shared_runner.take(lambda f: f.get("id") == rid and f["type"] == "error")
    assert frame["code"] == "duplicate_id"
    done = await cancel_and_finish(shared_runner, rid)
    assert done["done_reason"] == "cancelled"
    # Once the done frame is out, the id is free again.
    await shared_runner.send(completion(rid, options={"num_predict": 2}))
    _, done = await shared_runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")


async def test_full_queue_refuses_with_overloaded(shared_runner):
    running = unique_id("running")
    await shared_runner.send(long_completion(running))
    await shared_runner.reply(running)
    flood = [unique_id("flood") for _ in range(150)]
    for rid in flood:
        await shared_runner.send(completion(rid))
    errors = await shared_runner.before_fence(lambda f: f["id"] in flood and f["type"] == "error")
    assert errors, "150 queued completions never hit the queue limit"
    assert {e["code"] for e in errors} == {"overloaded"}
    refused = {e["id"] for e in errors}
    accepted = [rid for rid in flood if rid not in refused]
    assert accepted, "nothing was queued"
    for rid in accepted:
        await shared_runner.send({"type": "cancel", "id": rid})
    for rid in accepted:
        _, done = await shared_runner.completion(rid)
        assert done["done_reason"] == "cancelled"
    await cancel_and_finish(shared_runner, running)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ('"options": {"top_p": 1.5}', "options.top_p"),
        ('"options": {"temperature": -0.1}', "options.temperature"),
        ('"options": {"temperature": 1e400}', "options.temperature"),
        ('"options": {"top_k": "forty"}', "options.top_k"),
        ('"options": {"min_p": 2}', "options.min_p"),
        ('"options": {"repeat_penalty": 0}', "options.repeat_penalty"),
        ('"options": {"repeat_last_n": -2}', "options.repeat_last_n"),
        ('"options": {"num_predict": -5}', "options.num_predict"),
        ('"options": {"stop": [' + ", ".join(['"a"'] * 17) + "]}", "options.stop"),
        ('"options": {"stop": ["ok", ""]}', "options.stop[1]"),
        ('"options": [1]', "options"),
        ('"top_logprobs": 21', "top_logprobs"),
        ('"think_budget": -1', "think_budget"),
        ('"speculative": "yes"', "speculative"),
        ('"logprobs": 1', "logprobs"),
        ('"tokens": [1, 2]', "tokens"),
    ],
)
async def test_bad_fields_are_refused_naming_the_field(shared_runner, fields, named):
    rid = unique_id("bad")
    await shared_runner.send(f'{{"type": "completion", "id": "{rid}", "prompt": "hi", {fields}}}')
    frame = await shared_runner.reply(rid)
    assert frame["type"] == "error" and frame["code"] == "bad_request", frame
    assert named in frame["message"]
    # A refused request gets no done frame: the next frame for the id answers the next request.
    await shared_runner.send({"type": "status", "id": rid})
    assert (await shared_runner.reply(rid))["type"] == "status"


async def test_bad_token_ids_are_refused(shared_runner):
    for tokens in ("[-1]", "[]", '["a"]', "[1e3]", "[99999999999999999999]"):
        rid = unique_id("bad")
        await shared_runner.send(f'{{"type": "completion", "id": "{rid}", "tokens": {tokens}}}')
        frame = await shared_runner.reply(rid)
        assert frame["type"] == "error" and frame["code"] == "bad_request", (tokens, frame)
        assert "tokens" in frame["message"]


async def test_token_ids_outside_the_vocabulary_are_refused(shared_runner):
    rid = unique_id("bad")
    vocab = shared_runner.ready["vocab_size"]
    await shared_runner.send({"type": "completion", "id": rid, "tokens": [1, vocab]})
    frame = await shared_runner.reply(rid)
    assert frame["type"] == "error" and frame["code"] == "bad_request"
    assert "tokens" in frame["message"]


async def test_bad_field_in_other_requests_is_refused(shared_runner):
    rid = unique_id()
    await shared_runner.send({"type": "tokenize", "id": rid, "text": 5})
    frame = await shared_runner.reply(rid)
    assert frame["code"] == "bad_request" and "text" in frame["message"]


async def test_unknown_options_and_fields_are_ignored(shared_runner):
    rid = unique_id()
    ollama_options = {
        "num_ctx": 4096,
        "num_batch": 512,
        "num_gpu": -1,
        "mirostat": 0,
        "typical_p": 1.0,
        "num_keep": 4,
        "use_mmap": True,
        "seed": -1,
        "stop": ["\n\n\n"],
        "num_predict": 4,
        "temperature": 0,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.0,
        "repeat_penalty": 1.1,
        "repeat_last_n": 64,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    request = completion(rid, options=ollama_options, stream=True, format=None, images=[])
    await shared_runner.send(request)
    tokens, done = await shared_runner.completion(rid)
    assert done["done_reason"] in ("stop", "length") and done["eval_tokens"] <= 4


async def test_speculative_and_think_budget_are_accepted(shared_runner):
    plain, spec = unique_id("plain"), unique_id("spec")
    await shared_runner.send(completion(plain, speculative=False, options={"num_predict": 10}))
    await shared_runner.send(completion(spec, think_budget=0, options={"num_predict": 10}))
    plain_tokens, plain_done = await shared_runner.completion(plain)
    _, spec_done = await shared_runner.completion(spec)
    assert plain_done["speculation"]["drafted"] == 0  # speculation off: nothing drafted
    assert spec_done["done_reason"] in ("stop", "length")
    assert plain_tokens


async def test_logprobs_ride_on_token_frames(shared_runner):
    if shared_runner.ready["model"] == "noop":
        pytest.skip("the no-op model has no distributions")
    rid = unique_id()
    await shared_runner.send(
        completion(rid, logprobs=True, top_logprobs=3, options={"num_predict": 5, **NO_PENALTY})
    )
    tokens, _ = await shared_runner.completion(rid)
    entries = [entry for frame in tokens for entry in frame["logprobs"]]
    assert len(entries) == len(ids_of(tokens))
    for entry, token in zip(entries, ids_of(tokens), strict=True):
        assert entry["id"] == token and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        tops = [top["logprob"] for top in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert abs(entry["logprob"] - tops[0]) < 1e-4


async def test_unknown_or_missing_type_is_unknown_type(shared_runner):
    lines = ['{"type": "summon", "id": "x"}', '{"id": "x"}', "[1, 2]", '"completion"', "42"]
    for line in lines:
        await shared_runner.send(line)
    errors = await shared_runner.null_errors_before_fence()
    # The first two carry a readable id; the rest are not objects.
    x_errors = [await shared_runner.reply("x") for _ in range(2)]
    assert [e["code"] for e in x_errors] == ["unknown_type", "unknown_type"]
    assert [e["code"] for e in errors] == ["unknown_type"] * 3


async def test_malformed_json_is_bad_json(shared_runner):
    lines = [b'{"type": "status", "id": ', b"\xff\xfe{}", b"", b"   ", b"{'type': 'status'}"]
    for line in lines:
        await shared_runner.send(line + b"\n")
    errors = await shared_runner.null_errors_before_fence()
    assert [e["code"] for e in errors] == ["bad_json"] * len(lines)


async def test_prompt_longer_than_the_context_is_context_overflow(shared_runner):
    rid = unique_id()
    ctx = shared_runner.ready["context_length"]
    tok = unique_id("tok")
    await shared_runner.send({"type": "tokenize", "id": tok, "text": "a"})
    one = (await shared_runner.reply(tok))["tokens"][0]
    await shared_runner.send({"type": "completion", "id": rid, "tokens": [one] * (ctx + 5)})
    frame = await shared_runner.reply(rid)
    assert frame["type"] == "error" and frame["code"] == "context_overflow"
    assert str(ctx + 5) in frame["message"] and str(ctx) in frame["message"]


async def test_failure_inside_generation_is_internal_then_done_error(shared_runner, own_runner):
    if not own_runner:
        pytest.skip("needs this runner's --inject-fault seam")
    await shared_runner.send(completion(FAULT_ID, options={"num_predict": 50}))
    frames = []
    while not frames or frames[-1]["type"] != "done":
        frames.append(await shared_runner.reply(FAULT_ID))
    errors = [f for f in frames if f["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "internal"
    assert frames[-1]["done_reason"] == "error"
    # The runner keeps serving, and the same prompt still completes normally.
    rid = unique_id()
    await shared_runner.send(completion(rid, options={"num_predict": 5}))
    _, done = await shared_runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")
