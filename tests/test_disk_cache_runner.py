"""The prefix cache's disk tier through real runner processes and pipes: restarts, a runner
killed with SIGKILL in the middle of a write, damaged files, another model's cache, a full
disk, two runners on one directory. Every answer is compared with the same request on a
runner without any prefix cache (greedy: token ids and logprobs)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import pytest
import pytest_asyncio

import cache.disk_format as fmt
from tests.conformance.harness import RunnerProcess, own_command, unique_id

pytestmark = pytest.mark.asyncio(loop_scope="module")

HYBRID = "tests/fixtures/reference/hybrid/qwen3_5_vl"


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


async def complete(runner: RunnerProcess, ids: list[int], n: int = 10) -> tuple[list, dict]:
    """((token id, logprob) pairs, done frame) of a greedy completion."""
    rid = unique_id("disk")
    options = {"temperature": 0, "num_predict": n}
    await runner.send(
        {"type": "completion", "id": rid, "tokens": ids, "options": options, "logprobs": True}
    )
    frames, done = await runner.completion(rid, timeout=120)
    assert done["done_reason"] in ("stop", "length"), (done, runner.stderr_tail())
    return [(e["id"], e["logprob"]) for f in frames for e in f["logprobs"]], done


async def status(runner: RunnerProcess) -> dict:
    sid = unique_id("status")
    await runner.send({"type": "status", "id": sid})
    return await runner.reply(sid)


async def start(model: str, *flags: str) -> RunnerProcess:
    return await RunnerProcess.start(own_command(model, *flags), timeout=180)


async def finish(runner: RunnerProcess) -> str:
    """Close stdin and wait for a clean exit (the queued writes are on disk by then)."""
    await runner.close_stdin()
    assert await runner.wait_exit(60) == 0, runner.stderr_tail()
    assert not runner.violations, runner.violations[:3]
    return runner.stderr.decode(errors="replace")


def ids_of(pairs: list) -> list[int]:
    return [t for t, _ in pairs]


def same(a: list, b: list) -> bool:
    """The same tokens; the first token's logprob (right after the restore) to the bit: a
    prompt restored from disk against the same prompt served cold, or from memory."""
    return ids_of(a) == ids_of(b) and a[0] == b[0]


@pytest.fixture(scope="module")
def llama(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(llama):
    """answer(ids, model=llama) -> (pairs, done) from runners without a prefix cache."""
    runners: dict[str, RunnerProcess] = {}

    async def answer(ids: list[int], model: str = llama):
        if model not in runners:
            runners[model] = await start(model, "--no-prefix-cache")
        return (await complete(runners[model], ids))[0]

    yield answer
    for runner in runners.values():
        await runner.stop()


# ---------------------------------------------------------------------------- restarts
@pytest.mark.parametrize("model", ["llama", "hybrid"])
async def test_a_restarted_runner_restores_from_disk(model, llama, reference, tmp_path):
    path = llama if model == "llama" else HYBRID
    first, reply = tokens(1, 150), tokens(2, 12)
    runner = await start(path, "--cache-dir", str(tmp_path))
    answer, done = await complete(runner, first)
    assert done["prompt_disk_tokens"] == 0
    second = first + [t for t, _ in answer] + reply
    await complete(runner, second)
    warm, done = await complete(runner, second)  # all of it from memory now
    assert done["prompt_cached_tokens"] == len(second) - 1
    await finish(runner)

    runner = await start(path, "--cache-dir", str(tmp_path))
    assert (await status(runner))["disk_segments"] >= 2
    again, done = await complete(runner, second)
    assert done["prompt_disk_tokens"] == done["prompt_cached_tokens"] == len(second) - 1
    assert same(again, warm)  # the bits memory gave
    assert ids_of(again) == ids_of(await reference(second, path))
    again, done = await complete(runner, first)
    assert done["prompt_cached_tokens"] > 0 and same(again, answer)
    await finish(runner)


# ---------------------------------------------------------------------------- faults
@pytest.mark.parametrize("stage", ["segment", "renamed", "index"])
async def test_a_runner_killed_mid_write_leaves_nothing_trusted(stage, llama, reference, tmp_path):
    kept, lost = tokens(10, 120), tokens(11, 120)
    runner = await start(llama, "--cache-dir", str(tmp_path))
    await complete(runner, kept)
    await finish(runner)

    runner = await start(llama, "--cache-dir", str(tmp_path), "--cache-dir-fault", f"kill:{stage}")
    rid = unique_id("killed")
    await runner.send({"type": "completion", "id": rid, "tokens": lost, "options": {"seed": 1}})
    assert await runner.wait_exit(60) == -signal.SIGKILL

    runner = await start(llama, "--cache-dir", str(tmp_path))
    log = runner.stderr
    pairs, done = await complete(runner, lost)
    assert done["prompt_disk_tokens"] == 0 and same(pairs, await reference(lost))
    pairs, done = await complete(runner, kept)  # the earlier index still stands
    assert done["prompt_disk_tokens"] == len(kept) - 1 and same(pairs, await reference(kept))
    said = log.decode(errors="replace")
    if stage in ("segment", "index"):
        assert "left by an interrupted write" in said
    if stage in ("renamed", "index"):
        assert "segment file(s) that no valid index entry lists" in said
    await finish(runner)


def damage(directory: str, how: str) -> None:
    (sub,) = [d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d))]
    names = sorted(n for n in os.listdir(os.path.join(directory, sub)) if n.startswith("seg-"))
    path = os.path.join(directory, sub, names[0])
    data = bytearray(open(path, "rb").read())
    if how == "truncated":
        data = data[: len(data) - 1000]
    else:
        data[len(data) // 2] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["truncated", "flipped"])
async def test_a_damaged_segment_is_skipped_and_said(how, llama, reference, tmp_path):
    ids = tokens(20, 200)
    runner = await start(llama, "--cache-dir", str(tmp_path))
    await complete(runner, ids)
    await finish(runner)
    damage(str(tmp_path), how)

    runner = await start(llama, "--cache-dir", str(tmp_path))
    pairs, done = await complete(runner, ids)
    assert done["prompt_disk_tokens"] == 0 and same(pairs, await reference(ids))
    assert (await status(runner))["disk_skipped"] == 1
    said = await finish(runner)
    assert "truncated" in said if how == "truncated" else "fails its checksum" in said


async def test_another_models_cache_is_left_alone_or_skipped(
    llama, checkpoint_factory, reference, tmp_path
):
    other = checkpoint_factory("llama", seed=1)  # the same shapes, other weights
    ids = tokens(30, 150)
    runner = await start(llama, "--cache-dir", str(tmp_path))
    await complete(runner, ids)
    await finish(runner)
    (mine,) = os.listdir(tmp_path)

    runner = await start(other, "--cache-dir", str(tmp_path))
    pairs, done = await complete(runner, ids)
    assert done["prompt_disk_tokens"] == 0 and same(pairs, await reference(ids, other))
    said = await finish(runner)
    assert "other models or settings: left alone" in said
    (theirs,) = set(os.listdir(tmp_path)) - {mine}

    # The first model's files moved under the other's name: refused by their fingerprint.
    shutil.rmtree(tmp_path / theirs)
    shutil.copytree(tmp_path / mine, tmp_path / theirs)
    runner = await start(other, "--cache-dir", str(tmp_path))
    pairs, done = await complete(runner, ids)
    assert done["prompt_disk_tokens"] == 0 and same(pairs, await reference(ids, other))
    assert (await status(runner))["disk_skipped"] >= 1
    said = await finish(runner)
    assert "belongs to another model" in said


async def test_a_full_disk_serves_on_and_says_so(llama, reference, tmp_path):
    ids = tokens(40, 150)
    runner = await start(llama, "--cache-dir", str(tmp_path), "--cache-dir-fault", "full:segment")
    pairs, _ = await complete(runner, ids)
    assert same(pairs, await reference(ids))
    assert (await status(runner))["disk_segments"] == 0
    said = await finish(runner)
    assert "disk full" in said
    runner = await start(llama, "--cache-dir", str(tmp_path))
    pairs, done = await complete(runner, ids)
    assert done["prompt_disk_tokens"] == 0 and same(pairs, await reference(ids))
    await finish(runner)
    (sub,) = os.listdir(tmp_path)
    listed = fmt.decode_index((tmp_path / sub / fmt.INDEX).read_bytes())["segments"]
    assert len(listed) == 1


async def test_two_runners_on_one_directory(llama, checkpoint_factory, tmp_path):
    first = await start(llama, "--cache-dir", str(tmp_path))
    second = await RunnerProcess.start(
        own_command(llama, "--cache-dir", str(tmp_path)), wait_ready=False
    )
    error = await second.take(lambda f: f["type"] == "error", timeout=120)
    assert error["code"] == "load_error" and "in use by another runner" in error["message"]
    assert str(first.proc.pid) in error["message"]
    assert await second.wait_exit(30) == 1
    # Another model shares the directory: its own subdirectory, its own lock.
    other = await start(checkpoint_factory("llama", seed=1), "--cache-dir", str(tmp_path))
    await complete(other, tokens(50, 80))
    await complete(first, tokens(50, 80))
    await finish(other)
    await finish(first)
    for sub in os.listdir(tmp_path):
        body = json.loads((tmp_path / sub / fmt.INDEX).read_bytes())["body"]
        assert body["fingerprint"] == sub and len(body["segments"]) == 1
