"""Fault injection: the runner process's one test seam.

The tests and the soak must see, through real pipes, what a failing draft head and an
internal error do to a running process. One hidden flag arms those faults,
``--inject-fault KIND=VALUE`` (repeatable), and nothing but this module reads them:

- ``head-call=N``: the draft head raises on its N-th call in every request, as a broken head
  would (speculation discards it and the request goes on target-only);
- ``token-frame=ID``: the second token frame of completion ID raises inside the inference
  loop (the internal-error path: an error frame, a done frame, and the runner serves on).

Unarmed (the default) every hook is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("head-call", "token-frame")


class InjectedFault(RuntimeError):
    """Raised where a fault armed by ``--inject-fault`` fires."""


@dataclass(frozen=True)
class Faults:
    head_call: int | None = None  # the head's call (1-based, per request) that raises
    token_frame_of: str | None = None  # the completion whose second token frame raises

    @classmethod
    def parse(cls, specs: list[str] | None) -> Faults:
        """``KIND=VALUE`` strings (``--inject-fault``); ValueError naming a bad one."""
        values: dict[str, object] = {}
        for spec in specs or ():
            kind, sep, value = spec.partition("=")
            if not sep or kind not in KINDS:
                raise ValueError(f"{spec!r}: expected KIND=VALUE with KIND one of {KINDS}")
            if kind == "head-call":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"{spec!r}: head-call takes a positive call number")
                values["head_call"] = int(value)
            else:
                values["token_frame_of"] = value
        return cls(**values)

    def request_head(self) -> Callable | None:
        """The per-request head wrapper for ``drafting.speculation.Speculation``, or None."""
        if self.head_call is None:
            return None
        return lambda head: FailingHead(head, self.head_call)

    def on_token_frame(self, request_id: str, frames_so_far: int) -> None:
        """Called by the server before it writes a completion's token frame."""
        if self.token_frame_of == request_id and frames_so_far == 2:
            raise InjectedFault("fault injected after the first token (--inject-fault)")


class FailingHead:
    """A head whose ``n``-th forward raises (``head-call``); otherwise the head itself."""

    def __init__(self, head, n: int) -> None:
        self._head, self._left = head, n

    def __call__(self, *args, **kwargs):
        self._left -= 1
        if self._left == 0:
            raise InjectedFault("injected draft head fault")
        return self._head(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._head, name)
