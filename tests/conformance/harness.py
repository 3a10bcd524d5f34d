"""Drive a runner process through its real pipes, the way a host does.

Every stdout line is parsed strictly against the protocol's frame types; a line that is not
exactly one valid frame is recorded as a violation, and the fixtures fail the test on any.
Stderr is drained continuously (a full stderr pipe would stall the runner) and kept for checks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable

import msgspec

import protocol

FRAME_LIMIT = 1 << 28  # tokenize of a large text is one long line
_ids = itertools.count()


def unique_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"


def external_command() -> list[str] | None:
    """The runner under test from MTP_RUNNER_CMD, or None for this repository's runner."""
    cmd = os.environ.get("MTP_RUNNER_CMD")
    return shlex.split(cmd) if cmd else None


def own_command(model: str | None, *extra: str) -> list[str]:
    """This repository's runner on `model` (None: the no-op model).

    MTP_RUNNER_EXTRA_ARGS adds flags to every start (e.g. "--no-prefix-cache --no-draft").
    """
    extra = (*shlex.split(os.environ.get("MTP_RUNNER_EXTRA_ARGS", "")), *extra)
    if model is None:
        return [sys.executable, "-m", "runner", "--noop-model", *extra]
    return [sys.executable, "-m", "runner", "--model", model, *extra]


class RunnerProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.frames: list[dict] = []  # every frame, in arrival order
        self.inbox: list[tuple[int, dict]] = []  # frames not yet taken by a test
        self.violations: list[str] = []
        self.stderr = bytearray()
        self.stdout_closed = False
        self.ready: dict | None = None
        self._arrived = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        ]

    @classmethod
    async def start(cls, cmd: list[str], wait_ready: bool = True, timeout: float = 120):
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=FRAME_LIMIT,
        )
        runner = cls(proc)
        if wait_ready:
            runner.ready = await runner.take(lambda f: f["type"] == "ready", timeout=timeout)
            runner.inbox = [(s, f) for s, f in runner.inbox if f["type"] != "progress"]
        return runner

    async def _read_stdout(self) -> None:
        n = 0
        while line := await self.proc.stdout.readline():
            try:
                protocol.decode_frame(line)
                frame = json.loads(line)
            except (msgspec.DecodeError, ValueError) as exc:
                self.violations.append(f"{line[:200]!r}: {exc}")
                continue
            if not line.endswith(b"\n") or line.count(b"\n") != 1:
                self.violations.append(f"frame not terminated by exactly one newline: {line!r}")
            self.frames.append(frame)
            self.inbox.append((n, frame))
            n += 1
            self._arrived.set()
        self.stdout_closed = True
        self._arrived.set()

    async def _read_stderr(self) -> None:
        while chunk := await self.proc.stderr.read(1 << 16):
            self.stderr += chunk

    # ------------------------------------------------------------------ sending
    async def send(self, request: dict | str | bytes) -> None:
        if isinstance(request, dict):
            data = json.dumps(request).encode() + b"\n"
        elif isinstance(request, str):
            data = request.encode() + b"\n"
        else:
            data = request
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def close_stdin(self) -> None:
        self.proc.stdin.close()
        await self.proc.stdin.wait_closed()

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    # ------------------------------------------------------------------ receiving
    async def take(self, pred: Callable[[dict], bool], timeout: float = 30) -> dict:
        """Remove and return the first frame (received or still to come) matching `pred`."""
        return (await self.take_seq(pred, timeout))[1]

    async def take_seq(self, pred, timeout: float = 30) -> tuple[int, dict]:
        async def wait() -> tuple[int, dict]:
            while True:
                for i, (seq, frame) in enumerate(self.inbox):
                    if pred(frame):
                        del self.inbox[i]
                        return seq, frame
                if self.stdout_closed:
                    raise AssertionError(f"stdout closed; stderr tail: {self.stderr_tail()}")
                self._arrived.clear()
                await self._arrived.wait()

        try:
            return await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"no matching frame within {timeout}s; unclaimed: {self.inbox[-5:]}"
            ) from None

    async def reply(self, request_id: str, timeout: float = 30) -> dict:
        """The next frame addressed to `request_id`."""
        return await self.take(lambda f: f.get("id") == request_id, timeout)

    async def completion(self, request_id: str, timeout: float = 60) -> tuple[list[dict], dict]:
        """All token frames of a completion and its done frame (asserting nothing else came)."""
        tokens: list[dict] = []
        while True:
            frame = await self.reply(request_id, timeout)
            if frame["type"] == "done":
                return tokens, frame
            assert frame["type"] == "token", f"unexpected frame for {request_id}: {frame}"
            tokens.append(frame)

    async def before_fence(self, pred: Callable[[dict], bool], timeout: float = 30) -> list[dict]:
        """Take the frames matching `pred` that arrived before the answer to a fresh `status`.

        The runner answers lines in order, so refusals of the lines sent before the fence
        (error frames) are all among them.
        """
        fence = unique_id("fence")
        await self.send({"type": "status", "id": fence})
        fence_seq, _ = await self.take_seq(lambda f: f.get("id") == fence, timeout)
        mine = [(s, f) for s, f in self.inbox if s < fence_seq and pred(f)]
        taken = {s for s, _ in mine}
        self.inbox = [item for item in self.inbox if item[0] not in taken]
        return [f for _, f in mine]

    async def null_errors_before_fence(self, timeout: float = 30) -> list[dict]:
        """Error frames without an id (unreadable lines) sent before a fence."""
        return await self.before_fence(lambda f: f["type"] == "error" and f["id"] is None)

    async def wait_exit(self, timeout: float = 30) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)
        return rc

    def stderr_tail(self, n: int = 2000) -> str:
        return self.stderr[-n:].decode("utf-8", "replace")

    async def stop(self) -> None:
        """Close stdin and reap the process (killing it if it does not exit)."""
        if self.proc.returncode is None:
            try:
                await self.close_stdin()
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def text_of(token_frames: list[dict]) -> str:
    return "".join(f["content"] for f in token_frames)


def ids_of(token_frames: list[dict]) -> list[int]:
    return [t for f in token_frames for t in f["tokens"]]
