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
        self._openings: Openings | None = None

    def openings(self, pieces) -> Openings:
        """The think-span openings of this vocabulary (``pieces()`` gives every token's text)."""
        with self._lock:
            if self._openings is None:
                self._openings = Openings(pieces, self.vocab_size)
            return self._openings

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
    undecided, by the emitter's rule (``runner.emit.ThinkBudget``): up to 64 bytes of
    whitespace, then ``<think>`` opens a span; a token that is neither commits the reply to
    the grammar. Inside the span every token but EOS is allowed (the answer must come); the
    grammar takes the tokens after the one that completes ``</think>``. The same interface as
    :class:`Constraint`; ``rollback`` may cross back over the marker or the decision, since
    the state is read again from the tokens kept."""

    def __init__(self, inner: Constraint, decode, opening, eos_ids, *, opened: bool) -> None:
        self.inner = inner
        self.decode = decode  # token ids -> text
        self.opening = opening  # (lead bytes, rest) -> tokens that keep the reply on its way
        self.opened = opened
        self.eos = {int(t) for t in eos_ids}
        self.vocab_size = inner.vocab_size
        self._before: list[int] = []  # tokens ahead of the grammar's first
        self._inner = 0  # tokens the matcher consumed
        self._closed_at_start = False
        span = np.ones(inner.vocab_size, dtype=bool)
        span[[t for t in self.eos if t < inner.vocab_size]] = False
        self._span = mx.array(span)

    def activate(self) -> None:
        """The span is closed already (a zero think budget fed the marker after the prompt)."""
        self._closed_at_start = True

    def _mode(self) -> tuple[str, int, str]:
        """("grammar" | "span" | "start", and while undecided the whitespace bytes and the
        part of the marker the reply holds). The decision is in the first tokens (at most
        64 bytes of whitespace and the marker); a close is in the last ones."""
        if self._inner or self._closed_at_start:
            return "grammar", 0, ""
        if not self._before:
            return ("span", 0, "") if self.opened else ("start", 0, "")
        tail = self.decode(self._before[-16:])
        if self.opened:
            return ("grammar", 0, "") if CLOSE in tail else ("span", 0, "")
        lead, rest = split_lead(self.decode(self._before[:80]))
        if not rest.startswith(OPEN):
            return "start", len(lead.encode("utf-8")), rest
        after = rest[len(OPEN) :] if len(self._before) <= 80 else tail
        return ("grammar", 0, "") if CLOSE in after else ("span", 0, "")

    @property
    def active(self) -> bool:
        return self._mode()[0] == "grammar"

    def mask(self) -> mx.array:
        mode, lead, rest = self._mode()
        if mode == "grammar":
            return self.inner.mask()
        if mode == "span":
            return self._span
        opening = self.opening(lead, rest)
        return opening if rest else opening | self.inner.mask()

    def mask_or_only(self) -> tuple[mx.array, int | None]:
        if self._mode()[0] == "grammar":
            return self.inner.mask_or_only()
        return self.mask(), None

    def consume(self, token: int) -> None:
        if self._mode()[0] == "grammar":
            self.inner.consume(token)  # the stop token too, once the grammar is complete
            if int(token) not in self.eos:  # which the matcher does not record
                self._inner += 1
        elif not self.allows(token):
            raise RuntimeError(f"format: the grammar refused token {token} ({self.error()})")

    def allows(self, token: int) -> bool:
        mode, lead, rest = self._mode()
        if mode == "span":
            if int(token) in self.eos:
                return False
            self._before.append(int(token))
            return True
        if mode == "start" and bool(self.opening(lead, rest)[int(token)]):
            self._before.append(int(token))
            return True
        if mode == "start" and rest:  # on its way to the marker: nothing else
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


WHITESPACE = " \t\n\r\x0b\x0c"  # runner.emit's: what may lead the open marker
OPEN_LEAD_BYTES = 64


def split_lead(text: str) -> tuple[str, str]:
    rest = text.lstrip(WHITESPACE)
    return text[: len(text) - len(rest)], rest


class Openings:
    """For one vocabulary, the tokens that keep an undecided reply on its way to ``<think>``:
    whitespace while its lead stays within OPEN_LEAD_BYTES, then the marker's next characters
    (a token may run past the marker's end). Each state's mask is computed once."""

    def __init__(self, pieces, vocab_size: int) -> None:
        self._pieces = pieces  # () -> every token's text
        self.vocab_size = vocab_size
        self._lead: np.ndarray | None = None  # whitespace bytes each token starts with
        self._plain: np.ndarray | None = None  # whitespace only
        self._fits: np.ndarray | None = None  # after its whitespace, on the way to <think>
        self._masks: dict[tuple[int, str], mx.array] = {}
        self._lock = threading.Lock()

    def _tables(self) -> None:
        pieces = self._pieces()[: self.vocab_size]
        lead = np.zeros(self.vocab_size, dtype=np.int64)
        plain = np.zeros(self.vocab_size, dtype=bool)
        fits = np.zeros(self.vocab_size, dtype=bool)
        for t, piece in enumerate(pieces):
            ws, rest = split_lead(piece)
            lead[t] = len(ws.encode("utf-8"))
            plain[t] = bool(piece) and not rest
            fits[t] = bool(rest) and (OPEN.startswith(rest) or rest.startswith(OPEN))
        self._lead, self._plain, self._fits = lead, plain, fits

    def __call__(self, lead: int, rest: str) -> mx.array:
        with self._lock:
            mask = self._masks.get((lead, rest))
            if mask is not None:
                return mask
            if self._lead is None:
                self._tables()
            if not rest:
                room = self._lead + lead <= OPEN_LEAD_BYTES
                allowed = room & (self._plain | self._fits)
            else:
                allowed = np.zeros(self.vocab_size, dtype=bool)
                for t, piece in enumerate(self._pieces()[: self.vocab_size]):
                    text = rest + piece
                    allowed[t] = OPEN.startswith(text) or text.startswith(OPEN)
            mask = self._masks[(lead, rest)] = mx.array(allowed)
            return mask


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with every token outside ``allowed`` at -inf."""
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an install without the dependency: refuse, never ignore
        raise FormatError("constrained output needs the llguidance package") from None
    return llguidance
