"""One decoder for a request line and one encoder for frames.

The fast path decodes a line straight into the tagged request union. Only when that fails
does a second, cheap pass read `type` and `id` to classify the failure (bad_json,
unknown_type or bad_request) and to address the error frame to the request when possible.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from protocol.codes import BAD_JSON, BAD_REQUEST, UNKNOWN_TYPE
from protocol.errors import CodedError
from protocol.frames import Frame
from protocol.requests import REQUEST_TYPES, Request


class ProtocolError(CodedError):
    """A request line that cannot be served; becomes exactly one `error` frame."""

    def __init__(self, code: str, message: str, id: str | None = None):
        super().__init__(message, code=code, id=id)


class _Envelope(msgspec.Struct):
    # Any-typed so that a wrong type here is still read; every other field is skipped unparsed.
    type: Any = None
    id: Any = None


_REQUEST_DECODER = msgspec.json.Decoder(Request)
_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)
_FRAME_DECODER = msgspec.json.Decoder(Frame)
_ENCODER = msgspec.json.Encoder()
_AT_PATH = re.compile(r"^(?P<what>.*?) - at `\$\.?(?P<path>[^`]*)`$", re.S)
_MISSING = re.compile(
    r"^Object missing required field `(?P<field>[^`]+)`(?: - at `\$\.?(?P<path>[^`]*)`)?$"
)
# A \uXXXX escape preceded by an even number of backslashes (an odd run escapes the "u").
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u([dD][89a-fA-F][0-9a-fA-F]{2})")
_KNOWN_TYPES = ", ".join(sorted(REQUEST_TYPES))


def decode_request(line: bytes) -> Request:
    """Decode one request line (without or with its trailing newline).

    Raises ProtocolError with code bad_json, unknown_type or bad_request.
    """
    if not line.isascii():
        # msgspec does not check UTF-8 inside fields it skips; check the whole line once.
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(BAD_JSON, f"invalid UTF-8 at byte {exc.start}") from None
    try:
        return _REQUEST_DECODER.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _classify(line, exc) from None


def _classify(line: bytes, exc: Exception) -> ProtocolError:
    if not line.strip():
        return ProtocolError(BAD_JSON, "empty line")
    try:
        envelope = _ENVELOPE_DECODER.decode(line)
    except msgspec.ValidationError as env_exc:  # a subclass of DecodeError: test it first
        # Not an object; but a line that is not JSON at all is bad_json whatever its type.
        malformed = _malformed(line)
        if malformed is not None:
            return malformed
        return ProtocolError(UNKNOWN_TYPE, f"a request must be a JSON object: {env_exc}")
    except msgspec.DecodeError as env_exc:
        return ProtocolError(BAD_JSON, _explain_malformed(line, str(env_exc)))
    except RecursionError:
        return ProtocolError(BAD_JSON, "JSON nested too deeply")
    request_id = envelope.id if isinstance(envelope.id, str) and envelope.id else None
    if envelope.type is None:
        return ProtocolError(UNKNOWN_TYPE, "missing field `type`", request_id)
    if not isinstance(envelope.type, str) or envelope.type not in REQUEST_TYPES:
        return ProtocolError(
            UNKNOWN_TYPE,
            f"unknown request type {envelope.type!r} (known: {_KNOWN_TYPES})",
            request_id,
        )
    if isinstance(exc, msgspec.ValidationError):
        return ProtocolError(BAD_REQUEST, _name_field(str(exc)), request_id)
    if isinstance(exc, RecursionError):
        return ProtocolError(BAD_JSON, "JSON nested too deeply", request_id)
    return ProtocolError(BAD_JSON, _explain_malformed(line, str(exc)), request_id)


def _malformed(line: bytes) -> ProtocolError | None:
    """bad_json when ``line`` is not JSON at all (nesting too deep included), else None."""
    try:
        msgspec.json.decode(line)
    except RecursionError:
        return ProtocolError(BAD_JSON, "JSON nested too deeply")
    except msgspec.DecodeError as exc:
        return ProtocolError(BAD_JSON, _explain_malformed(line, str(exc)))
    return None


def _explain_malformed(line: bytes, message: str) -> str:
    """msgspec's message, or a precise one for a lone UTF-16 surrogate escape (which msgspec
    reports as a truncated input or a bad surrogate pair)."""
    for match in _SURROGATE_ESCAPE.finditer(line):
        unit = int(match[1], 16)
        after = line[match.end() : match.end() + 6]
        low_follows = (
            len(after) == 6
            and after[:2] in (b"\\u", b"\\U")
            and after[2:3] in b"dD"
            and after[3:4] in b"cCdDeEfF"
        )
        if unit >= 0xDC00 or not low_follows:
            kind = "low" if unit >= 0xDC00 else "high"
            return (
                f"lone UTF-16 surrogate escape \\u{match[1].decode()} ({kind} half without its "
                f"pair) at byte {match.start(1) - 2}: JSON text must encode valid Unicode"
            )
    return message


def _name_field(message: str) -> str:
    """'Expected `float` >= 0.0 - at `$.options.top_p`' -> 'options.top_p: expected ...';
    'Object missing required field `id`' -> 'id: missing required field'."""
    missing = _MISSING.match(message)
    if missing:
        path = missing["path"]
        where = f"{path}.{missing['field']}" if path else missing["field"]
        return f"{where}: missing required field"
    match = _AT_PATH.match(message)
    if not match:
        return message
    what, path = match["what"], match["path"]
    if what.startswith("Expected"):
        what = "e" + what[1:]
    return f"{path}: {what}" if path else what


def encode_frame(frame: Frame) -> bytes:
    """One frame as one line: compact JSON ending in b"\\n"."""
    return _ENCODER.encode(frame) + b"\n"


def decode_frame(line: bytes | str) -> Frame:
    """Parse a frame line strictly against the frame types (for hosts and tests)."""
    return _FRAME_DECODER.decode(line)
