"""Protocol version, error codes and done reasons: the closed vocabularies of the wire."""

from __future__ import annotations

# Bump when a change would break a host that follows docs/PROTOCOL.md.
PROTOCOL_VERSION = 1

# Error codes carried by `error` frames.
BAD_JSON = "bad_json"  # not JSON, invalid UTF-8, empty line, nesting too deep
UNKNOWN_TYPE = "unknown_type"  # not an object, missing or unknown `type`
BAD_REQUEST = "bad_request"  # a field with a wrong type or range; the message names the field
DUPLICATE_ID = "duplicate_id"  # a completion id that is already queued or running
CONTEXT_OVERFLOW = "context_overflow"  # the prompt does not fit the context
LINE_TOO_LONG = "line_too_long"  # a request line over the limit (16 MiB)
OVERLOADED = "overloaded"  # the completion queue is full
UNKNOWN_ID = "unknown_id"  # cancel of an id that is neither queued nor running
INTERNAL = "internal"  # an exception inside generation
LOAD_ERROR = "load_error"  # the model failed to load (the process then exits 1)

ERROR_CODES = (
    BAD_JSON,
    UNKNOWN_TYPE,
    BAD_REQUEST,
    DUPLICATE_ID,
    CONTEXT_OVERFLOW,
    LINE_TOO_LONG,
    OVERLOADED,
    UNKNOWN_ID,
    INTERNAL,
    LOAD_ERROR,
)

# Finer load failures a runner may report instead of `load_error` (protocol/errors.py).
MODEL_FILE_MISSING = "model_file_missing"
CORRUPT_MODEL_FILE = "corrupt_model_file"
UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
TENSOR_SHAPE_MISMATCH = "tensor_shape_mismatch"
MISSING_TENSOR = "missing_tensor"
TOKENIZER_MISSING = "tokenizer_missing"
UNSUPPORTED_TOKENIZER = "unsupported_tokenizer"
DRAFT_HEAD_ERROR = "draft_head_error"
UNSUPPORTED_TENSOR_TYPE = "unsupported_tensor_type"  # e.g. a GGUF IQ* or Q2_K tensor

LOAD_ERROR_CODES = (
    LOAD_ERROR,
    MODEL_FILE_MISSING,
    CORRUPT_MODEL_FILE,
    UNSUPPORTED_ARCHITECTURE,
    TENSOR_SHAPE_MISMATCH,
    MISSING_TENSOR,
    TOKENIZER_MISSING,
    UNSUPPORTED_TOKENIZER,
    DRAFT_HEAD_ERROR,
    UNSUPPORTED_TENSOR_TYPE,
)

DONE_REASONS = ("stop", "length", "cancelled", "error")

MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_IMAGES = 32  # per completion, over all its messages
MAX_ID_CHARS = 256
