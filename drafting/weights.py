"""Weight files and the check between a file's tensors and a module's parameters.

One implementation for the target loader (``runner.loader``, ``runner.gguf``) and the MTP head
loader (``drafting.load``, ``runner.heads``). It lives in ``drafting`` because ``drafting``
may not import ``runner`` while ``runner`` may import ``drafting``. Every failure is a typed
``protocol.errors.LoadError`` naming the file and the tensor; a caller that must report one
class for everything (the head loader: ``DraftHeadError``) passes it as ``error``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from protocol.errors import (
    CorruptModelFile,
    LoadError,
    MissingTensor,
    ModelFileMissing,
    TensorShapeMismatch,
)

ErrorClass = type[LoadError]


def read_json(path: str, *, error: ErrorClass | None = None) -> dict:
    """A JSON object from ``path`` (missing file, bad JSON or a non-object are errors)."""
    if not os.path.isfile(path):
        raise (error or ModelFileMissing)(f"{os.path.basename(path)} not found", path=path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise (error or CorruptModelFile)(f"cannot parse JSON: {exc}", path=path) from None
    if not isinstance(data, dict):
        raise (error or CorruptModelFile)("expected a JSON object", path=path)
    return data


def read_safetensors(path: str, *, error: ErrorClass | None = None) -> dict[str, mx.array]:
    if not os.path.isfile(path):
        raise (error or ModelFileMissing)(f"{os.path.basename(path)} not found", path=path)
    try:
        return mx.load(path, format="safetensors")
    except Exception as exc:  # mlx raises RuntimeError/ValueError with terse messages
        raise (error or CorruptModelFile)(f"cannot read safetensors ({exc})", path=path) from None


def dequantize(weights: dict[str, mx.array], group_size: int, bits: int | None = None) -> None:
    """Replace every affine-quantized ``X.weight``/``X.scales``/``X.biases`` triple by a dense
    ``X.weight``, in place. ``bits`` None: each tensor's own, from its packed width."""
    for name in [k for k in weights if k.endswith(".scales")]:
        base = name[: -len(".scales")]
        packed, scales = weights[base + ".weight"], weights.pop(name)
        biases = weights.pop(base + ".biases", None)
        layer_bits = bits or (packed.shape[-1] * 32) // (scales.shape[-1] * group_size)
        weights[base + ".weight"] = mx.dequantize(
            packed, scales, biases, group_size=group_size, bits=layer_bits
        )


def check_and_load(
    module: nn.Module,
    weights: Mapping[str, mx.array],
    *,
    path: str | None,
    dtype: mx.Dtype,
    sources: Mapping[str, str] | None = None,
    file_name: Callable[[str], str] = lambda name: name,
    transform: Callable[[str, mx.array], mx.array] | None = None,
    refuse_extras: bool = False,
    floats_only: bool = False,
    error: ErrorClass | None = None,
) -> dict[str, mx.array]:
    """Check ``weights`` against ``module``'s parameters, cast floats to ``dtype`` and load
    them (evaluated); return the tensors the module does not use.

    Errors name the tensor as the file spells it (``file_name`` maps a parameter name) and the
    file it came from (``sources`` per tensor, else ``path``). ``refuse_extras``: an unused
    tensor is an error (a head whose bias would otherwise be dropped drafts garbage).
    ``transform`` rewrites a tensor after the checks (e.g. a norm shift).
    """
    sources = sources or {}
    expected = dict(tree_flatten(module.parameters()))
    for name, param in expected.items():
        if name not in weights:
            raise (error or MissingTensor)(
                "required tensor is missing", path=path, tensor=file_name(name)
            )
        got = weights[name]
        if tuple(got.shape) != tuple(param.shape):
            raise (error or TensorShapeMismatch)(
                f"expected shape {tuple(param.shape)}, found {tuple(got.shape)}",
                path=sources.get(name, path),
                tensor=file_name(name),
            )
        if floats_only and not mx.issubdtype(got.dtype, mx.floating):
            raise (error or CorruptModelFile)(
                f"expected a floating-point tensor, found {got.dtype}",
                path=sources.get(name, path),
                tensor=file_name(name),
            )
    extras = {k: v for k, v in weights.items() if k not in expected}
    if refuse_extras and extras:
        name = next(iter(extras))
        raise (error or CorruptModelFile)(
            "unexpected tensor for this layout",
            path=sources.get(name, path),
            tensor=file_name(name),
        )
    loaded = []
    for name in expected:
        w = weights[name]
        if transform is not None:
            w = transform(name, w)
        loaded.append((name, w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w))
    module.load_weights(loaded, strict=True)
    mx.eval(module.parameters())
    return extras
