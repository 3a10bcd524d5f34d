"""Process lifecycle through real pipes: startup, end of input, shutdown, signals, load
failures, oversized lines, and the rule that stdout carries frames only."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

import protocol
from tests.conformance.harness import RunnerProcess, own_command, unique_id

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MIB = 1 << 20


def completion(request_id: str, num_predict: int = 6) -> dict:
    return {
        "type": "completion",
        "id": request_id,
        "prompt": "The quick brown fox",
        "options": {"temperature": 0, "num_predict": num_predict},
    }


@in_module_loop
async def test_ready_comes_once_after_progress_only(spawn):
    runner = await spawn()
    first = runner.frames[: runner.frames.index(runner.ready) + 1]
    assert [f["type"] for f in first[:-1]] == ["progress"] * (len(first) - 1)
    for frame in first[:-1]:
        assert 0 <= frame["done"] <= frame["total"] or frame["total"] == 0
    await runner.send({"type": "status", "id": "s"})
    await runner.reply("s")
    assert sum(f["type"] == "ready" for f in runner.frames) == 1


@in_module_loop
async def test_stdout_carries_only_frames_and_stderr_the_logs(spawn, own_runner):
    runner = await spawn()
    await runner.send(completion("a"))
    await runner.send(b"not json\n")
    await runner.send({"type": "tokenize", "id": "t", "text": "print('hi')"})
    await runner.close_stdin()
    assert await runner.wait_exit() == 0
    assert not runner.violations  # every stdout line was exactly one valid frame
    assert {"ready", "token", "done", "error", "tokens"} <= {f["type"] for f in runner.frames}
    if own_runner:
        assert b"exiting with status 0" in runner.stderr


@in_module_loop
async def test_end_of_input_finishes_the_queue_then_exits_zero(spawn):
    runner = await spawn()
    ids = [unique_id("eof") for _ in range(3)]
    for rid in ids:
        await runner.send(completion(rid))
    await runner.close_stdin()
    for rid in ids:
        _, done = await runner.completion(rid)
        assert done["done_reason"] in ("stop", "length")
    assert await runner.wait_exit() == 0


@in_module_loop
async def test_shutdown_finishes_the_queue_and_ignores_later_lines(spawn):
    runner = await spawn()
    rid = unique_id("before")
    await runner.send(completion(rid))
    await runner.send({"type": "shutdown"})
    await runner.send({"type": "status", "id": "after-shutdown"})
    _, done = await runner.completion(rid)
    assert done["done_reason"] in ("stop", "length")
    assert await runner.wait_exit() == 0
    assert not any(f.get("id") == "after-shutdown" for f in runner.frames)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@in_module_loop
async def test_signal_cancels_everything_then_exits_zero(spawn, signum):
    runner = await spawn()
    running, queued = unique_id("running"), unique_id("queued")
    await runner.send(completion(running, num_predict=100000))
    await runner.reply(running)
    # A long budget for the second too: with shared forwards it may already be decoding when
    # the signal lands, and a short answer could finish first.
    await runner.send(completion(queued, num_predict=100000))
    await runner.send({"type": "status", "id": "fence"})
    await runner.reply("fence")  # both are in: one running, one queued or decoding beside it
    runner.signal(signum)
    _, done_queued = await runner.completion(queued, timeout=10)
    _, done_running = await runner.completion(running, timeout=10)
    assert done_queued["done_reason"] == "cancelled"
    assert done_running["done_reason"] == "cancelled"
    assert await runner.wait_exit(timeout=10) == 0


@in_module_loop
async def test_signal_to_an_idle_runner_exits_zero(spawn):
    runner = await spawn()
    runner.signal(signal.SIGTERM)
    assert await runner.wait_exit(timeout=10) == 0


@in_module_loop
async def test_missing_model_is_a_load_error_and_exit_one(spawn, own_runner, tmp_path):
    if not own_runner:
        pytest.skip("needs this runner's --model")
    missing = str(tmp_path / "no-such-model")
    runner = await spawn(wait_ready=False, cmd=own_command(None)[:3] + ["--model", missing])
    assert await runner.wait_exit() == 1
    assert [f["type"] for f in runner.frames if f["type"] != "progress"] == ["error"]
    error = runner.frames[-1]
    assert error["id"] is None and error["code"] in protocol.LOAD_ERROR_CODES
    assert missing in error["message"]
    assert b"Traceback" not in runner.stderr or runner.violations == []


@in_module_loop
async def test_corrupt_model_is_a_load_error(spawn, own_runner, tmp_path):
    if not own_runner:
        pytest.skip("needs this runner's --model")
    (tmp_path / "config.json").write_text("{ this is not json")
    runner = await spawn(wait_ready=False, cmd=own_command(None)[:3] + ["--model", str(tmp_path)])
    assert await runner.wait_exit() == 1
    error = runner.frames[-1]
    assert error["type"] == "error" and error["code"] in protocol.LOAD_ERROR_CODES
    assert str(tmp_path) in error["message"]


async def _send_line_of(runner: RunnerProcess, size: int) -> None:
    """One `status` line of `size` bytes (padded by an unknown field), sent in pieces."""
    head = b'{"type": "status", "id": "huge", "pad": "'
    body = size - len(head) - 2
    await runner.send(head)
    piece = b"a" * MIB
    for _ in range(body // MIB):
        await runner.send(piece)
    await runner.send(b"a" * (body % MIB) + b'"}\n')


@in_module_loop
async def test_line_over_16_mib_is_refused_and_the_next_line_served(spawn):
    runner = await spawn()
    await _send_line_of(runner, 17 * MIB)
    errors = await runner.null_errors_before_fence(timeout=60)
    assert [e["code"] for e in errors] == ["line_too_long"]
    assert not any(f.get("id") == "huge" for f in runner.frames)
    # A line just under the limit is still a request.
    await _send_line_of(runner, 15 * MIB)
    frame = await runner.reply("huge", timeout=60)
    assert frame["type"] == "status"


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


@in_module_loop
async def test_a_100_mib_line_is_never_held_whole(spawn, own_runner):
    if not own_runner or not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc and this runner's process")
    runner = await spawn()
    before = _memory_kib(runner.proc.pid)
    await _send_line_of(runner, 100 * MIB)
    errors = await runner.null_errors_before_fence(timeout=120)
    assert [e["code"] for e in errors] == ["line_too_long"]
    after = _memory_kib(runner.proc.pid)
    # Holding the line would lift the peak by ~100 MiB (more with copies); reading in bounded
    # chunks leaves it within the 16 MiB limit plus slack.
    assert after["VmHWM"] - max(before["VmHWM"], before["VmRSS"]) < 48 * 1024, (before, after)


def test_broken_stdout_makes_the_runner_exit(runner_cmd):
    proc = subprocess.Popen(
        runner_cmd(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        while json.loads(proc.stdout.readline())["type"] == "progress":
            pass
        # The host stops reading mid-completion: the runner must notice and exit, not hang.
        request = completion("orphan", num_predict=100000)
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        proc.stdout.close()
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
