"""Constrained output (``format``): JSON, or JSON matching a schema, enforced token by token.

A completion's ``format`` compiles (llguidance, from the model's own ``tokenizer.json``) into
the request's matcher when the request is prepared, so a schema it cannot take is a
``bad_request`` naming ``format`` before anything runs. While decoding, the matcher follows
every emitted token; the next token's allowed set is a mask over the vocabulary, computed on
the CPU while the forward that produces its logits runs, and applied to the logits ahead of
penalties and sampling (a masked logit is -inf, so no sampler filter can bring it back). When
the grammar is complete only EOS stays allowed, so generation ends with ``done_reason: "stop"``.

Whitespace between JSON items is allowed, as the model would write it (indented JSON is what
instruction-tuned models produce; forbidding it pushes them off their distribution), but at
most 16 characters of it at a time, so a small model cannot spend its budget on it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

OPEN, CLOSE = "<think>", "</think>"  # the reasoning span's markers (runner.emit's)
# Ollama's JSON mode: any JSON object.
ANY_OBJECT = {"type": "object"}
_COMPILE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


class FormatError(ValueError):
    """``format`` cannot be enforced (why, for a bad_request naming the field)."""


class Grammars:
    """Compiles ``format`` values for one tokenizer; the llguidance tokenizer is built once,
    on first use (any thread)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        self._spec = (tokenizer_json, vocab_size, sorted(eos_ids))
        self._tokenizer = None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self._openings: dict[str, mx.array] = {}

    def opening(self, pieces) -> Callable[[str], mx.array]:
        """``opening_mask`` for this vocabulary, each lead computed once (``pieces()`` gives
        every token's text)."""

        def starts(lead: str) -> mx.array:
            with self._lock:
                mask = self._openings.get(lead)
                if mask is None:
                    mask = opening_mask(pieces(), lead, self.vocab_size)
                    self._openings[lead] = mask
                return mask

        return starts

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                text, vocab, eos = self._spec
                try:
                    self._tokenizer = llg.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
                except Exception as exc:
                    message = f"the model's tokenizer cannot drive a grammar ({exc})"
                    raise FormatError(message) from None
            return self._tokenizer

    def compile(self, fmt: str | dict[str, Any]) -> Constraint:
        """One completion's matcher for a ``format`` value (``"json"`` or a JSON Schema
        object). Building the matcher compiles the grammar, once: a grammar it cannot take
        leaves the matcher in its error state, which is the refusal's reason."""
        llg = _llguidance()
        schema = ANY_OBJECT if fmt == "json" else fmt
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), _COMPILE)
        except ValueError as exc:
            raise FormatError(f"not a usable JSON Schema ({exc})") from None
        matcher = llg.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise FormatError(f"the schema cannot be enforced: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One completion's matcher: ``mask()`` for the next token, ``consume(token)`` after it."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def mask(self) -> mx.array:
        """The allowed next tokens, bool ``[V]``."""
        return mx.array(self._allowed())

    def mask_or_only(self) -> tuple[mx.array, int | None]:
        """The mask, and the one token it allows when it allows exactly one (the grammar forces
        it: a draft of it is certain to be the target's own draw)."""
        allowed = self._allowed()
        hits = np.flatnonzero(allowed)
        return mx.array(allowed), (int(hits[0]) if hits.size == 1 else None)

    def _allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"format: the grammar refused token {token} ({self.error()})")

    # Speculation: drafts are checked against the grammar and the matcher goes back after.
    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (consumes it when it may)."""
        return self.matcher.try_consume_tokens([int(token)]) == 1

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens consumed."""
        if count and not self.matcher.rollback(count):
            raise RuntimeError(f"format: the matcher cannot roll back {count} tokens")

    def error(self) -> str:
        return self.matcher.get_error() or "no error recorded"


class AfterThinking:
    """A constraint that lets a reasoning span through as free text and starts after it.

    ``opened``: the prompt opened ``<think>``, so the span is open from the first token.
    Otherwise (a think budget on a model that may open the span itself) the reply starts
    undecided: a token may be whitespace or the next characters of ``<think>``, or begin the
    grammar's text, and the first that is neither whitespace nor part of the marker commits
    the reply to the grammar (with no span). Inside the span every token is allowed; the
    grammar takes the tokens after the one that completes ``</think>``. The same interface as
    :class:`Constraint`; ``rollback`` may cross back over the marker or the decision, since
    the state is read again from the tokens kept."""

    def __init__(self, inner: Constraint, decode, starts, *, opened: bool) -> None:
        self.inner = inner
        self.decode = decode  # token ids -> text
        self.starts = starts  # lead text -> the tokens that keep it on its way to <think>
        self.opened = opened
        self.vocab_size = inner.vocab_size
        self._before: list[int] = []  # tokens ahead of the grammar's first
        self._inner = 0  # tokens the matcher consumed
        self._closed_at_start = False
        self._any = mx.ones((inner.vocab_size,), dtype=mx.bool_)

    def activate(self) -> None:
        """The span is closed already (a zero think budget fed the marker after the prompt)."""
        self._closed_at_start = True

    def _mode(self) -> tuple[str, str]:
        """("grammar" | "span" | "start", the reply's text so far while it is undecided).
        The markers are a few tokens long: the first and the last tokens kept say it all."""
        if self._inner or self._closed_at_start:
            return "grammar", ""
        if not self._before:
            return ("span", "") if self.opened else ("start", "")
        tail = self.decode(self._before[-16:])
        if self.opened:
            return ("grammar", "") if CLOSE in tail else ("span", "")
        lead = self.decode(self._before[:24]).lstrip()
        if not lead.startswith(OPEN):
            return "start", lead
        after = lead[len(OPEN) :] if len(self._before) <= 24 else tail
        return ("grammar", "") if CLOSE in after else ("span", "")

    @property
    def active(self) -> bool:
        return self._mode()[0] == "grammar"

    def mask(self) -> mx.array:
        mode, lead = self._mode()
        if mode == "grammar":
            return self.inner.mask()
        if mode == "span":
            return self._any
        opening = self.starts(lead)
        return opening if lead else opening | self.inner.mask()

    def mask_or_only(self) -> tuple[mx.array, int | None]:
        if self._mode()[0] == "grammar":
            return self.inner.mask_or_only()
        return self.mask(), None

    def consume(self, token: int) -> None:
        if self._mode()[0] == "grammar":
            self.inner.consume(token)  # the stop token too, once the grammar is complete
            self._inner += 1
        elif not self.allows(token):
            raise RuntimeError(f"format: the grammar refused token {token} ({self.error()})")

    def allows(self, token: int) -> bool:
        mode, lead = self._mode()
        if mode == "span" or (mode == "start" and bool(self.starts(lead)[int(token)])):
            self._before.append(int(token))
            return True
        if mode == "start" and lead:  # on its way to the marker: nothing else
            return False
        if self.inner.allows(token):
            self._inner += 1
            return True
        return False

    def rollback(self, count: int) -> None:
        inner = min(count, self._inner)
        self.inner.rollback(inner)
        self._inner -= inner
        rest = count - inner
        if rest:
            del self._before[len(self._before) - rest :]

    def error(self) -> str:
        return self.inner.error()


def opening_mask(pieces: list[str], lead: str, vocab_size: int) -> mx.array:
    """The tokens that keep a reply whose text so far is ``lead`` (leading whitespace
    stripped) on its way to ``<think>``: whitespace while nothing else came, then the marker's
    next characters (a token may run past its end)."""
    allowed = np.zeros(vocab_size, dtype=bool)
    for t, piece in enumerate(pieces[:vocab_size]):
        text = lead + piece if lead else piece.lstrip()
        if not text:
            allowed[t] = not lead and bool(piece)
        else:
            allowed[t] = OPEN.startswith(text) or text.startswith(OPEN)
    return mx.array(allowed)


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with every token outside ``allowed`` at -inf."""
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an install without the dependency: refuse, never ignore
        raise FormatError("constrained output needs the llguidance package") from None
    return llguidance
