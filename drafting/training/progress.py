"""A progress bar on stderr: done / total, rate and time left, redrawn in place on a
terminal and printed as a line every ``every`` seconds otherwise (logs, pipes)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``update(n)`` after each piece of work; ``note`` sets a trailing status (a loss)."""

    def __init__(
        self,
        label: str,
        total: float,
        unit: str,
        *,
        stream: TextIO | None = None,
        every: float = 30.0,
        width: int = 24,
    ) -> None:
        self.label, self.total, self.unit = label, max(float(total), 0.0), unit
        self.stream = stream or sys.stderr
        self.every, self.width = every, width
        self.done, self.status = 0.0, ""
        self.start = self._last = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * self.width)
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = _clock(left) if left == left else "?"
        text = (
            f"{self.label} [{bar:<{self.width}}] {self.done:.0f}/{self.total:.0f} {self.unit} "
            f"{rate:.1f} {self.unit}/s, {_clock(elapsed)} elapsed, {eta} left"
        )
        return text + (f"  {self.status}" if self.status else "")

    def update(self, n: float = 1.0, status: str | None = None) -> None:
        self.done += n
        if status is not None:
            self.status = status
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line())
            self.stream.flush()
        elif now - self._last >= self.every:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        """The final line (always printed)."""
        print(("\r\x1b[K" if self.tty else "") + self.line(), file=self.stream, flush=True)


def log(message: str, stream: TextIO | None = None) -> None:
    """A line of the run's log on stderr (a bar being redrawn there resumes on the next)."""
    out = stream or sys.stderr
    clear = "\r\x1b[K" if getattr(out, "isatty", lambda: False)() else ""
    print(clear + message, file=out, flush=True)
