"""Typed load errors: each names the file (and tensor) at fault, never a bare traceback."""

from __future__ import annotations


class LoadError(Exception):
    """Base class for every failure to load a model, tokenizer or draft head."""

    code = "load_error"

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        detail = []
        if tensor:
            detail.append(f"tensor {tensor!r}")
        if path:
            detail.append(f"file {path}")
        super().__init__(message + (f" [{'; '.join(detail)}]" if detail else ""))


class ModelFileMissing(LoadError):
    code = "model_file_missing"


class CorruptModelFile(LoadError):
    code = "corrupt_model_file"


class UnsupportedArchitecture(LoadError):
    code = "unsupported_architecture"


class TensorShapeMismatch(LoadError):
    code = "tensor_shape_mismatch"


class MissingTensor(LoadError):
    code = "missing_tensor"


class TokenizerMissing(LoadError):
    code = "tokenizer_missing"


class UnsupportedTokenizer(LoadError):
    code = "unsupported_tokenizer"


class DraftHeadError(LoadError):
    code = "draft_head_error"
