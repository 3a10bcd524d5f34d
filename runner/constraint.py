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
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return mx.array(allowed)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"format: the grammar refused token {token} ({self.error()})")

    def error(self) -> str:
        return self.matcher.get_error() or "no error recorded"


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with every token outside ``allowed`` at -inf."""
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an install without the dependency: refuse, never ignore
        raise FormatError("constrained output needs the llguidance package") from None
    return llguidance
