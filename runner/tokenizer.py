"""Tokenizer wrapper (encode with the model's BOS rule, decode) and a streaming detokenizer.

Decoding works on bytes: every token id maps to the exact bytes it stands for, so a stream of
ids turns into text by concatenating bytes and releasing only complete UTF-8. ``decode`` uses
the same table, so streamed text always equals the text of the whole sequence.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence

import tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _uses_byte_level(spec: dict) -> bool:
    def walk(node: object) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(spec.get("decoder")) or walk(spec.get("pre_tokenizer"))


def _length_preserving(normalizer: dict | None) -> bool:
    """Whether a normalizer never shortens the text (so the byte-length bound holds):
    none at all, or prepends and literal replacements that do not shrink."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_length_preserving(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        return literal is not None and len(content.encode()) >= len(literal.encode())
    return False


GIL_FREE_CHARS = 4096  # texts at least this long are tokenized without holding the GIL


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's BOS/EOS rules and a token-to-bytes table."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        vocab_size: int | None = None,
    ) -> None:
        self.hf = hf
        self.bos_id = bos_id
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos and bos_id is not None)
        self.vocab_size = max(vocab_size or 0, hf.get_vocab_size(with_added_tokens=True))
        self._bytes = self._build_byte_table()
        self.max_token_bytes = max((len(b) for b in self._bytes), default=0)
        self.length_preserving = _length_preserving(json.loads(hf.to_str()).get("normalizer"))

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on ``len(encode(text))`` from the byte length alone (each token
        covers at most ``max_token_bytes`` of the text), or None when a normalizer may
        shrink the text first."""
        if not self.length_preserving or self.max_token_bytes <= 0:
            return None
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    def _build_byte_table(self) -> list[bytes]:
        spec = json.loads(self.hf.to_str())
        byte_level = _uses_byte_level(spec)
        decode_char = {c: b for b, c in bytes_to_unicode().items()}
        special = {tok.content for tok in self.hf.get_added_tokens_decoder().values()}
        table = [b""] * self.vocab_size
        for piece, idx in self.hf.get_vocab(with_added_tokens=True).items():
            if idx >= self.vocab_size:
                continue
            if piece in special:
                table[idx] = piece.encode("utf-8")
            elif byte_level:
                try:
                    table[idx] = bytes(decode_char[c] for c in piece)
                except KeyError:
                    table[idx] = piece.encode("utf-8")
            else:
                m = _BYTE_FALLBACK.match(piece)
                if m:
                    table[idx] = bytes([int(m.group(1), 16)])
                else:
                    table[idx] = piece.replace("\u2581", " ").encode("utf-8")
        return table

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``. Long texts go through ``encode_batch``, which releases the
        GIL while it works (``encode`` holds it for the whole call, so a long prompt's
        tokenizing on the preparation thread would stall the reader's answers to control
        lines); same ids, a little more overhead, so short texts keep ``encode``."""
        if len(text) >= GIL_FREE_CHARS:
            ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def token_bytes(self, token: int) -> bytes:
        if 0 <= token < len(self._bytes):
            return self._bytes[token]
        return b""

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def piece(self, token: int) -> str:
        """The text of one token alone (logprob listings)."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Turns a stream of token ids into text, releasing only complete UTF-8 characters.

    Bytes of an unfinished character are held until the token that completes them arrives;
    ``finish`` flushes whatever is left (invalid or cut-off bytes become U+FFFD), so no byte
    is ever lost or emitted twice.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._table = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._utf8.decode(self._table(token))

    def add_bytes(self, data: bytes) -> str:
        return self._utf8.decode(data)

    @property
    def pending(self) -> bytes:
        """Bytes held back because they do not yet form a complete character."""
        return self._utf8.getstate()[0]

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)
