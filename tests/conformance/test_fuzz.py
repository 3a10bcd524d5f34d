"""1,000 malformed lines (fixed seed), then a valid completion: one error per line, no exit."""

from __future__ import annotations

import json
import random

import pytest

SEED = 20240601
N_LINES = 1000

VALID = {
    "type": "completion",
    "id": "fuzz-valid",
    "prompt": "Once upon a time",
    "options": {"temperature": 0, "num_predict": 4, "stop": ["\n\n"]},
    "logprobs": False,
}

# Values that are wrong for each field, whatever else the line holds.
WRONG = {
    ("options", "temperature"): ["hot", -1, True, [0.5], {"v": 1}],
    ("options", "top_k"): [-3, 1.5, "40", 10**40],
    ("options", "top_p"): [1.01, -0.5, "0.9", 1e300],
    ("options", "min_p"): [7, -0.01, "x"],
    ("options", "num_predict"): [-2, 3.5, "10", 10**30],
    ("options", "stop"): ["stop", [""], [1, 2], ["a"] * 30],
    ("options", "repeat_penalty"): [0, -1.5, "1.1"],
    ("options", "repeat_last_n"): [-7, "64", 2.5],
    ("options", "seed"): [1.5, "42", 10**30],
    ("options", "presence_penalty"): ["none", [1]],
    (None, "prompt"): [5, ["a"], {"t": 1}, True],
    (None, "tokens"): [[-1], ["a"], [1.5], "1 2", [2**40]],
    (None, "logprobs"): ["yes", 1, [True]],
    (None, "top_logprobs"): [21, -1, 2.5, "3"],
    (None, "speculative"): ["false", 0],
    (None, "think_budget"): [-1, "10", 0.5],
    (None, "options"): [5, "fast", [1, 2]],
    (None, "id"): [7, None, ["x"], "", "x" * 300],
}


def _rid(rng: random.Random) -> str:
    return f"fz-{rng.getrandbits(32):08x}"


def _truncated(rng: random.Random) -> bytes:
    text = json.dumps({**VALID, "id": _rid(rng)}).encode()
    return text[: rng.randrange(1, len(text) - 1)]


def _wrong_type(rng: random.Random) -> bytes:
    request = json.loads(json.dumps(VALID))
    request["id"] = _rid(rng)
    section, name = rng.choice(sorted(WRONG, key=str))
    value = rng.choice(WRONG[(section, name)])
    (request[section] if section else request)[name] = value
    return json.dumps(request).encode()


def _huge_number(rng: random.Random) -> bytes:
    field = rng.choice(["temperature", "top_k", "top_p", "seed", "num_predict"])
    number = rng.choice(["1e999", "-1e999", "9" * 400, "-" + "9" * 400])
    return (
        f'{{"type": "completion", "id": "{_rid(rng)}", "prompt": "x", '
        f'"options": {{"{field}": {number}}}}}'
    ).encode()


def _invalid_utf8(rng: random.Random) -> bytes:
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80"])
    text = json.dumps({**VALID, "id": _rid(rng), "prompt": "PLACE"}).encode()
    return text.replace(b"PLACE", b"ok" + bad + b"ok")


def _empty(rng: random.Random) -> bytes:
    return rng.choice([b"", b" ", b"\t", b"\r", b"   \t "])


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([5000, 20000, 100000])
    nested = b"[" * depth + b"]" * depth
    if rng.random() < 0.5:
        return nested
    return b'{"type": "completion", "id": "deep", "prompt": "x", "extra": ' + nested + b"}"


def _unknown_type(rng: random.Random) -> bytes:
    kind = rng.choice(["generate", "Completion", "", "chat", "completion ", "load"])
    value = rng.choice([json.dumps(kind), "null", "3", "[]", '{"a": 1}'])
    return f'{{"type": {value}, "id": "{_rid(rng)}"}}'.encode()


def _non_object(rng: random.Random) -> bytes:
    return rng.choice([b"null", b"true", b"17", b'"completion"', b"[1, 2, 3]", b"[]", b"-0.5"])


def _garbage(rng: random.Random) -> bytes:
    data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    data = data.replace(b"\n", b"")
    # Random bytes could spell valid JSON (a bare number): make sure they cannot.
    return b"}" + data


KINDS = [
    _truncated,
    _wrong_type,
    _huge_number,
    _invalid_utf8,
    _empty,
    _deep,
    _unknown_type,
    _non_object,
    _garbage,
]


def malformed_lines(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    lines = [KINDS[i % len(KINDS)](rng) for i in range(n)]
    rng.shuffle(lines)
    assert all(b"\n" not in line for line in lines)
    return lines


@pytest.mark.asyncio(loop_scope="module")
async def test_every_malformed_line_gets_one_error_and_the_runner_lives(spawn):
    runner = await spawn()
    lines = malformed_lines(N_LINES, SEED)
    for start in range(0, len(lines), 100):
        await runner.send(b"".join(line + b"\n" for line in lines[start : start + 100]))
    errors = await runner.before_fence(lambda f: f["type"] == "error", timeout=120)
    assert len(errors) == N_LINES
    codes = {e["code"] for e in errors}
    assert codes <= {"bad_json", "unknown_type", "bad_request"}
    assert codes == {"bad_json", "unknown_type", "bad_request"}
    assert not runner.inbox, f"frames besides the errors: {runner.inbox[:3]}"
    await runner.send(VALID)
    tokens, done = await runner.completion("fuzz-valid")
    assert done["done_reason"] in ("stop", "length") and tokens
    assert runner.proc.returncode is None


def test_fuzz_corpus_is_fixed_and_varied():
    first, second = malformed_lines(200, SEED), malformed_lines(200, SEED)
    assert first == second
    assert len(set(first)) > 100


@pytest.mark.asyncio(loop_scope="module")
async def test_fuzz_with_four_streams_active_leaves_their_output_unchanged(spawn, own_runner):
    """The malformed lines while four long greedy completions decode together (--parallel 4,
    the default): every line still gets its one error, and each completion streams exactly
    the tokens it streams alone."""
    if not own_runner:
        pytest.skip("runs this runner's default --parallel")
    runner = await spawn("--parallel", "4")

    def request(rid: str, i: int, n: int) -> dict:
        options = {"temperature": 0, "num_predict": n, "repeat_penalty": 1.0}
        return {"type": "completion", "id": rid, "prompt": f"Story {i} begins", "options": options}

    alone = []
    for i in range(4):
        await runner.send(request(f"solo{i}", i, 3000))
        tokens, _ = await runner.completion(f"solo{i}", timeout=120)
        alone.append([t for f in tokens for t in f["tokens"]])
    for i in range(4):
        await runner.send(request(f"busy{i}", i, 3000))
    await runner.send({"type": "status", "id": "st"})
    status = await runner.reply("st", timeout=60)
    lines = malformed_lines(300, SEED + 1)
    await runner.send(b"".join(line + b"\n" for line in lines))
    # Requests that fail at admission: a token outside the vocabulary, a prompt past the context.
    context = runner.ready["context_length"]
    await runner.send({"type": "completion", "id": "bad-tokens", "tokens": [10**6]})
    await runner.send({"type": "completion", "id": "too-long", "tokens": [1] * (context + 5)})
    # (the vocabulary check runs where completions are tokenized, after the reader's fence)
    refusals = [await runner.reply(rid, timeout=60) for rid in ("bad-tokens", "too-long")]
    errors = await runner.before_fence(lambda f: f["type"] == "error", timeout=120)
    await runner.send({"type": "status", "id": "st2"})
    during = await runner.reply("st2", timeout=60)
    assert len(errors) == 300
    assert [(f["type"], f["code"]) for f in refusals] == [
        ("error", "bad_request"),
        ("error", "context_overflow"),
    ]
    outputs = []
    for i in range(4):
        tokens, done = await runner.completion(f"busy{i}", timeout=300)
        outputs.append([t for f in tokens for t in f["tokens"]])
        assert done["done_reason"] in ("stop", "length")
    assert len(status["active_ids"]) + status["queue_length"] == 4
    assert len(during["active_ids"]) == 4, during  # all four decoded through the fuzz
    assert outputs == alone
