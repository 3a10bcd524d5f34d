"""The one base class of every error that reaches the host as an `error` frame, and the typed
load errors (each carries its code from ``protocol.codes``)."""

from __future__ import annotations

from protocol.codes import (
    CORRUPT_MODEL_FILE,
    DRAFT_HEAD_ERROR,
    INTERNAL,
    LOAD_ERROR,
    MISSING_TENSOR,
    MODEL_FILE_MISSING,
    TENSOR_SHAPE_MISMATCH,
    TOKENIZER_MISSING,
    UNSUPPORTED_ARCHITECTURE,
    UNSUPPORTED_TENSOR_TYPE,
    UNSUPPORTED_TOKENIZER,
)
from protocol.frames import Error


class CodedError(Exception):
    """An error with a code from ``protocol.codes``: a class default, or given per instance.

    ``message`` is what the frame carries; ``id`` addresses it to a request when known.
    """

    code: str = INTERNAL

    def __init__(self, message: str, *, code: str | None = None, id: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.id = id

    def frame(self, id: str | None = None) -> Error:
        """This error as an `error` frame, addressed to ``id`` (default: its own)."""
        return Error(id if id is not None else self.id, self.code, self.message)


def error_frame(id: str | None, exc: BaseException) -> Error:
    """Any exception as an `error` frame: its own code when it has one, else `internal`."""
    if isinstance(exc, CodedError):
        return exc.frame(id)
    return Error(id, INTERNAL, f"{type(exc).__name__}: {exc}")


class LoadError(CodedError):
    """A model, tokenizer or draft head that cannot be loaded. The message names the file
    (and the tensor) at fault, so a host sees the culprit, never a bare traceback."""

    code = LOAD_ERROR

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        detail = [f"tensor {tensor!r}"] if tensor else []
        if path:
            detail.append(f"file {path}")
        super().__init__(message + (f" [{'; '.join(detail)}]" if detail else ""))
        self.reason = message  # the message without the file and tensor


class ModelFileMissing(LoadError):
    code = MODEL_FILE_MISSING


class CorruptModelFile(LoadError):
    """Present but unreadable: truncated safetensors, bad JSON, a GGUF the reader refuses."""

    code = CORRUPT_MODEL_FILE


class UnsupportedArchitecture(LoadError):
    code = UNSUPPORTED_ARCHITECTURE


class UnsupportedTensorType(LoadError):
    """A tensor stored in a type the runner cannot compute with (a GGUF IQ*, Q2_K, Q3_K, ...
    tensor); the message names the tensor, its type and the supported types."""

    code = UNSUPPORTED_TENSOR_TYPE


class TensorShapeMismatch(LoadError):
    """A tensor whose shape is not the one the config implies (the message gives both)."""

    code = TENSOR_SHAPE_MISMATCH


class MissingTensor(LoadError):
    code = MISSING_TENSOR


class TokenizerMissing(LoadError):
    """No ``tokenizer.json`` beside the weights (and no tokenizer in a GGUF file's metadata
    is reported as ``UnsupportedTokenizer``)."""

    code = TOKENIZER_MISSING


class UnsupportedTokenizer(LoadError):
    code = UNSUPPORTED_TOKENIZER


class DraftHeadError(LoadError):
    """Any failure to load an MTP head (its loader raises only this class)."""

    code = DRAFT_HEAD_ERROR
