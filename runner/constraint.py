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
from typing import Any

import mlx.core as mx
import numpy as np

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
    """A constraint that starts once a reasoning span closes (a prompt that opened ``<think>``):
    until the generated text holds ``</think>`` every token is allowed and goes by the matcher;
    the grammar takes the tokens after the one that completes the marker (whitespace may lead
    the JSON). The same interface as :class:`Constraint`; ``rollback`` may cross the marker
    back into the span."""

    def __init__(self, inner: Constraint, decode, close_marker: str) -> None:
        self.inner = inner
        self.decode = decode  # token ids -> text
        self.close = close_marker
        self.vocab_size = inner.vocab_size
        self._span: list[int] = []  # tokens consumed inside the span
        self._active = False  # the marker is complete: the grammar has the tokens since
        self._inner = 0  # tokens the matcher consumed since then
        self._any = mx.ones((inner.vocab_size,), dtype=mx.bool_)

    @property
    def active(self) -> bool:
        return self._active

    def activate(self) -> None:
        """The span is closed already (a zero think budget fed the marker after the prompt)."""
        self._active = True

    def mask(self) -> mx.array:
        return self.inner.mask() if self._active else self._any

    def mask_or_only(self) -> tuple[mx.array, int | None]:
        return self.inner.mask_or_only() if self._active else (self._any, None)

    def consume(self, token: int) -> None:
        if self._active:
            self.inner.consume(token)
            self._inner += 1
            return
        self._span.append(int(token))
        # The marker is a few tokens long: the tail of the span is enough to find it.
        self._active = self.close in self.decode(self._span[-16:])

    def allows(self, token: int) -> bool:
        if not self._active:
            self.consume(token)
            return True
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
            del self._span[len(self._span) - rest :]
            self._active = self.close in self.decode(self._span[-16:])

    def error(self) -> str:
        return self.inner.error()


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with every token outside ``allowed`` at -inf."""
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an install without the dependency: refuse, never ignore
        raise FormatError("constrained output needs the llguidance package") from None
    return llguidance
