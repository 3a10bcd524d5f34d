"""Rank 0's bound on every wait for the other ranks.

MLX's distributed ``recv`` blocks until its data comes. When a peer process dies the ring
backend fails the pending operations ("connection to a peer was lost"), but a rank that hangs
(or is stopped) would leave rank 0 waiting for good. So rank 0 marks every exchange with the
other ranks (``exchange``), and a watchdog thread ends the process when a rank it started has
exited, or when one exchange has waited longer than the reply timeout. Ending it goes through
one ``Fatal`` hook (error frames for everything accepted, the other ranks stopped, exit 1),
reached from the watchdog thread or from the main thread when an exchange raises.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

log = logging.getLogger("mtp_runner.distributed")

POLL_S = 0.05  # how often the watchdog looks at the ranks and the open exchange


class Fatal:
    """The process's one way out when a rank is lost: ``handler(message)`` runs once (the
    first caller's message) and must not return; a second caller waits for the exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handler: Callable[[str], None] | None = None

    def __call__(self, message: str) -> NoReturn:
        with self._lock:  # held for good: the handler ends the process
            log.error("%s", message)
            if self.handler is not None:
                self.handler(message)
            raise SystemExit(1)


class Watchdog:
    """Watches the ranks this process started (``children``: (rank, process) pairs) and
    the time the open exchange has waited; calls ``fatal`` with what went wrong."""

    def __init__(
        self,
        children: Sequence[tuple[int, subprocess.Popen]],
        fatal: Fatal,
        timeout_s: float,
    ) -> None:
        self.children = list(children)
        self.fatal = fatal
        self.timeout_s = timeout_s
        self._open: tuple[str, float] | None = None  # (what, since) of the exchange waiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (a clean shutdown: the ranks are about to exit)."""
        self._stop.set()

    @contextlib.contextmanager
    def exchange(self, what: str, timed: bool = True) -> Iterator[None]:
        """Mark a wait for the other ranks (``timed``: bounded by the reply timeout; loading
        is bounded only by the ranks staying alive); an MLX error inside it (a peer's
        connection lost) ends the process, naming a rank that exited when one did. So does
        any other failure inside it: the ranks may have seen part of the exchange."""
        self._open = (what, time.monotonic()) if timed else None
        try:
            yield
        except Exception as exc:
            dead = self.dead_rank(wait_s=1.0)
            self.fatal(dead or f"lost the other ranks during {what}: {exc}")
        finally:
            self._open = None

    def dead_rank(self, wait_s: float = 0.0) -> str | None:
        """A sentence naming the ranks this process started that have exited (those killed
        by a signal first: the others may only have followed them), else None, waiting up to
        ``wait_s`` for one to exit (the socket error can come before the exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(rank, proc, proc.poll()) for rank, proc in self.children]
            dead = sorted(
                (code >= 0, rank, proc, code) for rank, proc, code in dead if code is not None
            )
            if dead:
                return (
                    "; ".join(_exit(rank, proc, code) for _, rank, proc, code in dead)
                    + "; stopping"
                )
            if time.monotonic() >= deadline or self._stop.wait(POLL_S):
                return None

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            dead = self.dead_rank()
            if dead is not None:
                self.fatal(dead)
            opened = self._open
            if opened is not None and time.monotonic() - opened[1] > self.timeout_s:
                self.fatal(
                    f"no reply from the other ranks within {self.timeout_s:g}s during "
                    f"{opened[0]}; stopping"
                )


def _exit(rank: int, proc: subprocess.Popen, code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"rank {rank} (pid {proc.pid}) {how}"
