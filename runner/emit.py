"""Emission: token ids of one request -> ``token`` frames.

Text passes three stages per token: the streaming detokenizer (only complete UTF-8 leaves it),
the reasoning-budget filter (forced ``</think>`` and the dropped duplicate close), and the
stop-string hold (text that could still become a stop string waits). Whatever survives is sent
together with the ids whose characters it contains.

Rules pinned by tests:
- EOS: ends with reason "stop", keep False; its text is never streamed and it is not counted.
- ``max_tokens`` > 0: the token that reaches the count is streamed and ends with "length".
- Stop strings match on decoded text. Generation ends at the first token after which any stop
  string occurs; the earliest occurrence wins; it and everything after it are dropped.
- When generation ends without a stop match (EOS, length, ``finish``), held text is released;
  bytes of a cut-off character come out as U+FFFD, as ``Tokenizer.decode`` renders them.
- Forced close ids are appended to ``emitted`` (the host sees their text) but are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol import frames as pf

if TYPE_CHECKING:
    from drafting.logprobs import LogprobEntry
    from runner.tokenizer import Tokenizer

OPEN_MARKER = "<think>"
CLOSE_MARKER = "</think>"
_WHITESPACE = " \t\n\r\x0b\x0c"
_OPEN_LEAD_BYTES = 64  # whitespace allowed before the open marker for it to count
_DUPLICATE_LEAD_BYTES = 8  # whitespace allowed before a duplicate close that gets dropped

Send = Callable[[str, list[int], list | None], None]


@dataclass
class Step:
    """What the decoder does after one pushed token."""

    finished: bool = False  # generation ends at this token
    reason: str | None = None  # "stop" (EOS or stop string) | "length" (max_tokens)
    keep: bool = True  # may the token's state stay in the caches (False for EOS)
    forced: list[int] = field(default_factory=list)  # close-marker ids to feed right after it


def _split_lead(text: str) -> tuple[str, str]:
    """(leading whitespace, rest) of ``text``."""
    rest = text.lstrip(_WHITESPACE)
    return text[: len(text) - len(rest)], rest


def _lead_bytes(lead: str) -> int:
    return len(lead.encode("utf-8"))


class ThinkBudget:
    """Counts content tokens inside a reply-prefix ``<think>`` span; says when to force close.

    States: "prefix" (waiting to see whether the reply opens with the marker), "open",
    "done" (no span, the model closed it, or the budget fired: it fires at most once).
    The N-th token inside the span exhausts a budget of N; a budget of 0 fires on the token
    that completes the open marker (or, for a span the prompt opened, before the first token:
    :meth:`Emitter.force_at_start`). While the span's text ends with a partial close marker
    the firing waits for the next token.
    """

    def __init__(self, budget: int, *, prompt_open: bool = False) -> None:
        self.budget = max(int(budget), 0)
        self.state = "open" if prompt_open else "prefix"
        self.fired = False
        self._prefix = ""  # reply text seen while deciding whether it opens a span
        self._tail = ""  # last characters inside the span, to catch a close split over tokens
        self._count = 0

    def observe(self, text: str) -> bool:
        """Feed one model token's text; True when this token exhausts the budget."""
        if self.state == "prefix":
            self._prefix += text
            lead, rest = _split_lead(self._prefix)
            if _lead_bytes(lead) > _OPEN_LEAD_BYTES:
                self.state = "done"
            elif rest.startswith(OPEN_MARKER):
                self.state = "open"
                if self.budget == 0:
                    return self._fire()
                after = rest[len(OPEN_MARKER) :]
                # The marker itself costs nothing; text after it in the same token does.
                return bool(after) and self._inside(after)
            elif not OPEN_MARKER.startswith(rest):
                self.state = "done"
            return False
        if self.state == "open":
            return self._inside(text)
        return False

    def _inside(self, text: str) -> bool:
        seen = self._tail + text
        if CLOSE_MARKER in seen:
            self.state = "done"
            return False
        self._tail = seen[-(len(CLOSE_MARKER) - 1) :]
        self._count += 1
        # A close marker split over tokens may be on its way: wait for it to complete or not.
        closing = any(self._tail.endswith(CLOSE_MARKER[:n]) for n in range(1, len(CLOSE_MARKER)))
        if self._count >= max(self.budget, 1) and not closing:
            return self._fire()
        return False

    def fires_at_start(self) -> bool:
        """A budget of 0 on a span the prompt opened: close it before the first token."""
        return self.state == "open" and self.budget == 0 and not self._count and self._fire()

    def _fire(self) -> bool:
        self.state = "done"
        self.fired = True
        return True


class DuplicateCloseFilter:
    """After a forced close, drops one close marker the model repeats right away.

    Text is held while it is at most 8 bytes of whitespace optionally followed by a prefix of
    the marker; a completed marker is removed (the whitespace stays), anything else is
    released unchanged and the filter retires.
    """

    def __init__(self) -> None:
        self.active = True
        self._held = ""

    def feed(self, text: str) -> tuple[str, int | None]:
        """-> (text to release, offset in the held text where a dropped marker began)."""
        if not self.active:
            return text, None
        self._held += text
        lead, rest = _split_lead(self._held)
        if _lead_bytes(lead) > _DUPLICATE_LEAD_BYTES:
            return self.flush(), None
        if rest.startswith(CLOSE_MARKER):
            self.active = False
            self._held = ""
            return lead + rest[len(CLOSE_MARKER) :], len(lead)
        if CLOSE_MARKER.startswith(rest):
            return "", None
        return self.flush(), None

    def flush(self) -> str:
        self.active = False
        text, self._held = self._held, ""
        return text


@dataclass
class _Pending:
    """A token waiting to ride with the first frame whose content reaches its text."""

    token: int
    logprob: object
    start: int  # absolute character offset of its text in the emitted stream
    visible: bool = True


class Emitter:
    """Turns one request's token ids into ``send(content, ids, logprobs)`` calls."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        max_tokens: int = 0,
        think_budget: int | None = None,
        send: Send,
        eos_ids: Iterable[int] | None = None,
        prompt_open_think: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer()
        self._send = send
        self._stops = [s for s in stop if s]
        self._max_tokens = max(int(max_tokens), 0)
        self._eos = frozenset(tokenizer.eos_ids if eos_ids is None else (int(i) for i in eos_ids))
        self._think = (
            ThinkBudget(think_budget, prompt_open=prompt_open_think)
            if think_budget is not None
            else None
        )
        self._dedup: DuplicateCloseFilter | None = None
        # Tokens whose text the duplicate filter holds: (entry, offset in its text, length).
        self._dedup_tokens: list[tuple[_Pending, int, int]] = []
        self._dedup_size = 0
        self._out = ""  # text produced but not yet sent
        self._sent = 0  # characters sent so far
        self._pending: list[_Pending] = []
        self._done = False
        self.generated = 0
        self.emitted: list[int] = []

    # -- public -----------------------------------------------------------------------------

    def push(self, token: int, logprob: object = None) -> Step:
        """Account for one generated token; returns what the decoder must do next.

        Raises RuntimeError once a step has finished (the decoder must stop pushing).
        """
        if self._done:
            raise RuntimeError("push() after the emitter finished")
        token = int(token)
        self.emitted.append(token)
        if token in self._eos:
            self._end()
            return Step(finished=True, reason="stop", keep=False)
        self.generated += 1
        raw = self._detok.add(token)
        fire = self._think.observe(raw) if self._think is not None else False
        self._add_model_text(_Pending(token, logprob, 0), raw)
        if self._cut_at_stop():
            return Step(finished=True, reason="stop")
        if self._max_tokens and self.generated >= self._max_tokens:
            self._end()
            return Step(finished=True, reason="length")
        forced: list[int] = []
        if fire:
            forced = self._force_close()
            if self._cut_at_stop():
                return Step(finished=True, reason="stop", forced=forced)
        self._release(final=False)
        return Step(forced=forced)

    def force_at_start(self) -> list[int]:
        """Close-marker ids to feed before the first generated token (a zero think budget
        on a span the prompt opened), already sent as text; usually none."""
        if self._think is None or not self._think.fires_at_start():
            return []
        forced = self._force_close()
        self._release(final=False)
        return forced

    def finish(self) -> None:
        """Generation ended for another reason than a stop match: release held text."""
        if not self._done:
            self._end()

    # -- text flow --------------------------------------------------------------------------

    def _add_model_text(self, entry: _Pending, text: str) -> None:
        if self._dedup is None or not self._dedup.active:
            self._append(entry, text)
            return
        self._dedup_tokens.append((entry, self._dedup_size, len(text)))
        self._dedup_size += len(text)
        released, dropped_at = self._dedup.feed(text)
        if not self._dedup.active:
            self._resolve_dedup(released, dropped_at)

    def _resolve_dedup(self, released: str, dropped_at: int | None) -> None:
        """Place the tokens held by the duplicate filter into the released text."""
        base = self._sent + len(self._out)
        width = len(CLOSE_MARKER)
        for entry, offset, length in self._dedup_tokens:
            if dropped_at is not None and offset >= dropped_at:
                # Text wholly inside the dropped marker never reaches the host.
                if length and offset + length <= dropped_at + width:
                    entry.visible = False
                offset = dropped_at if offset < dropped_at + width else offset - width
            entry.start = base + offset
            self._pending.append(entry)
        self._dedup_tokens = []
        self._dedup_size = 0
        self._out += released

    def _append(self, entry: _Pending, text: str) -> None:
        entry.start = self._sent + len(self._out)
        self._pending.append(entry)
        self._out += text

    def _force_close(self) -> list[int]:
        forced = list(self._tokenizer.encode(CLOSE_MARKER, add_bos=False))
        for token in forced:
            self.emitted.append(token)
            self._append(_Pending(token, None, 0), self._detok.add(token))
        self._dedup = DuplicateCloseFilter()
        return forced

    def _cut_at_stop(self) -> bool:
        """If a stop string occurs in the unsent text, send what precedes it and finish."""
        found = [i for i in (self._out.find(s) for s in self._stops) if i >= 0]
        if not found:
            return False
        self._emit(self._out[: min(found)])
        self._pending.clear()
        self._out = ""
        self._done = True
        return True

    def _end(self) -> None:
        """Release everything still held (dedup buffer, partial bytes, stop-prefix text)."""
        if self._dedup is not None and self._dedup.active:
            self._resolve_dedup(self._dedup.flush(), None)
        self._out += self._detok.finish()
        if not self._cut_at_stop():
            self._release(final=True)
        self._done = True

    def _held_suffix(self) -> int:
        """Length of the longest tail of the unsent text that starts some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._out)), best, -1):
                if self._out.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _release(self, *, final: bool) -> None:
        keep = 0 if final else self._held_suffix()
        self._emit(self._out[: len(self._out) - keep])

    def _emit(self, content: str) -> None:
        """Send ``content`` (the head of the unsent text) with the ids whose text it reaches."""
        if not content:
            return
        end = self._sent + len(content)
        riding = [p for p in self._pending if p.start < end]
        self._pending = [p for p in self._pending if p.start >= end]
        self._out = self._out[len(content) :]
        self._sent = end
        shown = [p for p in riding if p.visible]
        ids = [p.token for p in shown]
        logprobs = [p.logprob for p in shown]
        self._send(content, ids, logprobs if any(lp is not None for lp in logprobs) else None)


def logprob_frame(tokenizer: Tokenizer, entry: LogprobEntry) -> pf.TokenLogprob:
    """One token's logprob entry for a frame, with each token's text and UTF-8 bytes (a byte
    piece's text alone is U+FFFD; its bytes let a host rebuild the text)."""
    token_bytes = tokenizer.token_bytes
    piece = tokenizer.piece
    return pf.TokenLogprob(
        token=piece(entry.token),
        id=entry.token,
        logprob=entry.logprob,
        bytes=list(token_bytes(entry.token)),
        top_logprobs=[
            pf.TopLogprob(token=piece(i), id=i, logprob=lp, bytes=list(token_bytes(i)))
            for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ],
    )
