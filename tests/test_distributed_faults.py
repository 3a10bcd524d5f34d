"""A model split across ranks (runner.distributed) when things go wrong: a rank that cannot
load, dies, stops answering or is signalled, and the waits of idle ranks; real runners over
MLX's ring backend on loopback."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal

import mlx.core as mx
import pytest

from runner.cli import build_parser
from runner.distributed import inbound
from tests.conformance.harness import RunnerProcess
from tests.test_distributed import LAYERS, REQUESTS, _runner, endless


@pytest.fixture(scope="module")
def deep_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory, deep_checkpoint) -> str:
    """The deep checkpoint without a tensor of its last layer (held by the last rank)."""
    path = tmp_path_factory.mktemp("broken")
    for name in os.listdir(deep_checkpoint):
        source = os.path.join(deep_checkpoint, name)
        if not name.endswith(".safetensors"):
            (path / name).write_bytes(open(source, "rb").read())
    for source in glob.glob(os.path.join(deep_checkpoint, "*.safetensors")):
        tensors = mx.load(source)
        tensors.pop(f"model.layers.{LAYERS - 1}.mlp.down_proj.weight", None)
        mx.save_safetensors(str(path / os.path.basename(source)), tensors)
    return str(path)


async def test_a_rank_that_cannot_load_its_layers_refuses_before_ready(broken_checkpoint):
    runner = await RunnerProcess.start(_runner(broken_checkpoint, "--ranks", "2"), wait_ready=False)
    try:
        error = await runner.take(lambda f: f["type"] in ("error", "ready"), timeout=60)
        assert error["type"] == "error" and error["code"] == "missing_tensor", error
        assert f"model.layers.{LAYERS - 1}.mlp.down_proj.weight" in error["message"]
        assert "rank 1" in error["message"]
        assert await runner.wait_exit(timeout=30) == 1
    finally:
        await runner.stop()
    assert not runner.violations


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of the rank ``parent`` started as ``rank`` (its environment says)."""
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"MLX_RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} among {children}")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the ranks in /proc")
async def test_a_killed_rank_ends_the_request_with_an_error_and_rank_0_exits(deep_checkpoint):
    runner = await RunnerProcess.start(_runner(deep_checkpoint, "--ranks", "3"))
    try:
        victim = _rank_pid(runner.proc.pid, 1)  # the middle of the chain
        await runner.send(
            {
                "type": "completion",
                "id": "long",
                "prompt": "The quick brown fox",
                "options": {"temperature": 0, "num_predict": 1_000_000},
            }
        )
        first = await runner.reply("long")
        assert first["type"] == "token"
        os.kill(victim, signal.SIGKILL)
        error = await runner.take(lambda f: f["type"] == "error" and f["id"] == "long")
        assert f"rank 1 (pid {victim}) was killed by signal 9" in error["message"]
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == "long")
        assert done["done_reason"] == "error"
        assert await runner.wait_exit(timeout=30) == 1
        assert "Traceback" not in runner.stderr.decode(errors="replace")
    finally:
        await runner.stop()
    assert not runner.violations
    assert _gone(victim)


def _gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie of a parent that exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid timeout
   0: 0100007F:1F90 0100007F:C585 01 00000000:00000000 00:00000000 00000000     0        0 41 1
   1: 0100007F:C585 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 42 1
   2: 0100007F:1F90 0100007F:D092 06 00000000:00000000 03:00000B68 00000000     0        0 43 3
   3: 0100007F:1F91 0100007F:D093 01 00000000:00000000 00:00000000 00000000     0        0 44 1
"""


def test_a_rank_finds_the_socket_its_previous_rank_sends_on(tmp_path):
    # Port 0x1F90 = 8080 is ours: the established socket of ours on it, not the peer's end
    # (inode 42, another process's) nor a closed one (43).
    assert inbound.find_socket([TCP], {41: 7, 44: 9}, 8080) == 7
    assert inbound.find_socket([TCP], {42: 7, 43: 8}, 8080) is None
    assert inbound.find_socket([TCP], {44: 9}, 8081) == 9
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:8080"], ["127.0.0.1:8081"]]))
    assert inbound.own_port(str(hosts), 1) == 8081
    hosts.write_text(json.dumps([["127.0.0.1:8080", "127.0.0.1:8090"], ["127.0.0.1:8081"]]))
    assert inbound.own_port(str(hosts), 0) is None  # several connections: MLX's own wait


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the ranks' CPU time")
async def test_waiting_ranks_leave_the_cores_to_the_working_one(deep_checkpoint):
    runner = await RunnerProcess.start(_runner(deep_checkpoint, "--ranks", "3"))
    try:
        others = [_rank_pid(runner.proc.pid, rank) for rank in (1, 2)]
        before = [_cpu_seconds(pid) for pid in others]
        await asyncio.sleep(2.0)  # idle: both wait for rank 0's next command
        used = [_cpu_seconds(pid) - b for pid, b in zip(others, before, strict=True)]
        # MLX's receive alone retries its socket without pause: a core each.
        assert all(seconds < 0.2 for seconds in used), used
        await runner.send({"type": "completion", "id": "w", **REQUESTS[0]})  # still serving
        _, done = await runner.completion("w")
        assert done["done_reason"] == "length"
    finally:
        await runner.stop()


def test_the_parser_knows_the_rank_options():
    args = build_parser().parse_args(["--ranks", "2", "--rank-timeout", "5"])
    assert args.ranks == 2 and args.rank_timeout == 5.0 and not args.distributed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ranks", "1"])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the ranks in /proc")
async def test_a_rank_that_stops_answering_is_given_up_after_the_timeout(deep_checkpoint):
    runner = await RunnerProcess.start(
        _runner(deep_checkpoint, "--ranks", "2", "--rank-timeout", "1")
    )
    try:
        victim = _rank_pid(runner.proc.pid, 1)
        await endless(runner, "stalled", "The quick brown fox")
        os.kill(victim, signal.SIGSTOP)  # alive, but answers nothing: only the bound ends it
        error = await runner.take(lambda f: f["type"] == "error" and f["id"] == "stalled")
        assert "no reply from the other ranks within 1s" in error["message"]
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == "stalled")
        assert done["done_reason"] == "error"
        assert await runner.wait_exit(timeout=30) == 1
    finally:
        await runner.stop()
        if not _gone(victim):  # rank 0 kills the ranks it gives up on; never leave one stopped
            os.kill(victim, signal.SIGKILL)
    assert not runner.violations


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the ranks in /proc")
async def test_sigterm_cancels_the_request_and_every_rank_exits(deep_checkpoint):
    runner = await RunnerProcess.start(_runner(deep_checkpoint, "--ranks", "3"))
    try:
        others = [_rank_pid(runner.proc.pid, rank) for rank in (1, 2)]
        await endless(runner, "long", "The quick brown fox")
        runner.signal(signal.SIGTERM)
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == "long")
        assert done["done_reason"] == "cancelled"
        assert await runner.wait_exit(timeout=30) == 0
    finally:
        await runner.stop()
    assert not runner.violations
    assert all(_gone(pid) for pid in others)  # rank 0 waited for them
