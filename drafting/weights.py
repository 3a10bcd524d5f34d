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
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from protocol.errors import (
    CorruptModelFile,
    LoadError,
    MissingTensor,
    ModelFileMissing,
    TensorShapeMismatch,
    UnsupportedArchitecture,
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


AFFINE = "affine"
# The affine widths MLX packs (6 and 3 bits straddle the uint32 words).
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
_QUANT_KEYS = ("group_size", "bits", "mode")


@dataclass(frozen=True)
class QuantSpec:
    """One module's affine quantization; None fields are inferred from the tensors' shapes."""

    group_size: int | None = None
    bits: int | None = None


@dataclass
class Quantization:
    """mlx-lm's ``quantization`` dict: top-level ``group_size`` / ``bits`` / ``mode`` plus
    per-module entries keyed by module path (``"model.layers.1.mlp.down_proj": {"group_size":
    64, "bits": 8, "mode": "affine"}``, or ``false`` for a module left dense), as
    ``mlx_lm.utils.load_model`` reads it: a named module uses its entry; any other module whose
    ``scales`` are present was packed with the widths its shapes give (mlx-lm's
    ``infer_quant_config``), which are the top-level ones unless mlx-lm chose otherwise."""

    default: QuantSpec
    layers: dict[str, QuantSpec | None] = field(default_factory=dict)
    key: str = "quantization"

    @classmethod
    def from_config(
        cls, config: Mapping, *, path: str | None, error: ErrorClass | None = None
    ) -> Quantization | None:
        """The quantization a config declares (None: none). Only MLX's affine mode is
        implemented: any other ``mode`` (mxfp4, nvfp4, mxfp8) and a Hugging Face
        ``quantization_config`` of another method (GPTQ, AWQ, FP8, bitsandbytes, ...) are
        refused, naming the key."""
        sections = [config]
        nested = config.get("text_config")
        if isinstance(nested, Mapping):
            sections.append(nested)
        for section in sections:
            for key in ("quantization", "quantization_config"):
                quant = section.get(key)
                if not quant:
                    continue
                prefix = "" if section is config else "text_config."
                if not isinstance(quant, Mapping):
                    raise (error or CorruptModelFile)(
                        f"bad config key {prefix}{key}: expected an object", path=path
                    )
                return cls._parse(quant, f"{prefix}{key}", path, error)
        return None

    @classmethod
    def _parse(cls, quant: Mapping, key: str, path: str | None, error) -> Quantization:
        method = quant.get("quant_method")
        if method is not None:
            raise (error or UnsupportedArchitecture)(
                f"unsupported config key {key}.quant_method = {method!r}: only MLX affine "
                "quantization (mlx_lm.convert) is implemented",
                path=path,
            )

        def spec(entry: Mapping, where: str) -> QuantSpec:
            mode = entry.get("mode", AFFINE)
            if mode != AFFINE:
                raise (error or UnsupportedArchitecture)(
                    f"unsupported config key {where}.mode = {mode!r}: only affine "
                    "quantization is implemented",
                    path=path,
                )
            for name in ("group_size", "bits"):
                value = entry.get(name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                    raise (error or CorruptModelFile)(
                        f"bad config key {where}.{name}: expected an integer, found {value!r}",
                        path=path,
                    )
            bits = entry.get("bits")
            if bits is not None and bits not in AFFINE_BITS:
                raise (error or UnsupportedArchitecture)(
                    f"unsupported config key {where}.bits = {bits!r}: affine widths are "
                    f"{', '.join(map(str, AFFINE_BITS))}",
                    path=path,
                )
            extra = sorted(k for k in entry if k not in _QUANT_KEYS)
            if extra:
                raise (error or UnsupportedArchitecture)(
                    f"unsupported config key {where}.{extra[0]} = {entry[extra[0]]!r}: not "
                    "part of MLX's affine quantization",
                    path=path,
                )
            return QuantSpec(entry.get("group_size"), bits)

        top = {k: v for k, v in quant.items() if not isinstance(v, Mapping | bool)}
        layers: dict[str, QuantSpec | None] = {}
        for name, entry in quant.items():
            if entry is False:  # left dense (True would mean the defaults: nothing to note)
                layers[name] = None
            elif isinstance(entry, Mapping):
                layers[name] = spec(entry, f"{key}.{name}")
        return cls(spec(top, key), layers, key)

    def renamed(self, rename: Callable[[str], str]) -> Quantization:
        """The same settings with module paths renamed as the loader renames tensors."""
        return Quantization(self.default, {rename(k): v for k, v in self.layers.items()}, self.key)


def quantized_modules(
    weights: Mapping[str, mx.array],
    quantization: Quantization | None = None,
    *,
    in_dims: Mapping[str, int] | None = None,
    path: str | None = None,
    sources: Mapping[str, str] | None = None,
    error: ErrorClass | None = None,
) -> dict[str, tuple[int, int]]:
    """``module path -> (group_size, bits)`` of every affine-quantized triple in ``weights``
    (``X.weight`` uint32, ``X.scales``, ``X.biases``), checked against the config's settings
    and, where ``in_dims`` gives a module's input width, against the model. Errors name the
    tensor and its file."""
    quantization = quantization or Quantization(QuantSpec())
    fail = _failure(sources or {}, path, error)
    out: dict[str, tuple[int, int]] = {}
    for name in [k for k in weights if k.endswith(".scales")]:
        base = name[: -len(".scales")]
        packed, scales = _checked_triple(weights, base, quantization, fail)
        in_dim = (in_dims or {}).get(base)
        out[base] = _affine_widths(base, packed, scales, quantization, in_dim, fail)
    return out


# fail(message, tensor, cls=CorruptModelFile) -> the error to raise, naming the tensor's file.
Failure = Callable[..., LoadError]


def _failure(sources: Mapping[str, str], path: str | None, error: ErrorClass | None) -> Failure:
    """The errors of one check: ``error`` when given, else the class the check names."""

    def fail(message: str, tensor: str, cls: ErrorClass = CorruptModelFile) -> LoadError:
        return (error or cls)(message, path=sources.get(tensor, path), tensor=tensor)

    return fail


def _checked_triple(
    weights: Mapping[str, mx.array], base: str, quantization: Quantization, fail: Failure
) -> tuple[mx.array, mx.array]:
    """The packed weight and scales of module ``base``, once the triple is complete, affine
    (floating scales, uint32 weights) and of matching shapes."""
    name = base + ".scales"
    packed, scales = weights.get(base + ".weight"), weights[name]
    biases = weights.get(base + ".biases")
    if packed is None:
        raise fail("quantization scales without their packed weight", name, MissingTensor)
    if base in quantization.layers and quantization.layers[base] is None:
        raise fail(f"{quantization.key} lists {base!r} as not quantized; it has scales", name)
    if scales.dtype == mx.uint8:
        raise fail(
            "uint8 scales (an mxfp4 / nvfp4 / mxfp8 layout): only affine quantization is "
            "implemented",
            name,
            UnsupportedArchitecture,
        )
    if not mx.issubdtype(scales.dtype, mx.floating):
        raise fail(f"quantization scales must be floating-point, found {scales.dtype}", name)
    if packed.dtype != mx.uint32:
        raise fail(f"packed weights are uint32, found {packed.dtype}", base + ".weight")
    if biases is None:
        raise fail("affine quantization needs biases; missing", base + ".biases", MissingTensor)
    if packed.ndim < 2 or scales.shape[:-1] != packed.shape[:-1]:
        raise fail(
            f"scales {tuple(scales.shape)} do not match the packed weight {tuple(packed.shape)}",
            name,
            TensorShapeMismatch,
        )
    if biases.shape != scales.shape:
        raise fail(
            f"biases {tuple(biases.shape)} do not match the scales {tuple(scales.shape)}",
            base + ".biases",
            TensorShapeMismatch,
        )
    return packed, scales


def _affine_widths(
    base: str,
    packed: mx.array,
    scales: mx.array,
    quantization: Quantization,
    in_dim: int | None,
    fail: Failure,
) -> tuple[int, int]:
    """``(group_size, bits)`` of module ``base``: the config's for a module it names, else
    the widths the shapes give against the model's input width ``in_dim`` (mlx-lm's
    ``infer_quant_config``), else the config's default; checked to fill the packed weight
    and to hold ``in_dim`` inputs."""
    named = quantization.layers.get(base)
    spec = named or quantization.default
    width, groups = packed.shape[-1] * 32, scales.shape[-1]
    if named is None and in_dim is not None:
        group_size, bits = in_dim // groups, width // in_dim
    else:
        group_size = spec.group_size or 64
        bits = spec.bits or width // (groups * group_size)
    stored_in = groups * group_size
    described = f"{bits}-bit, group {group_size}"
    if bits not in AFFINE_BITS or stored_in * bits != width:
        raise fail(
            f"packed weight {tuple(packed.shape)} with scales {tuple(scales.shape)} is not "
            f"{described} affine quantization" + (f" ({quantization.key})" if named else ""),
            base + ".weight",
            TensorShapeMismatch,
        )
    if in_dim is not None and stored_in != in_dim:
        raise fail(
            f"{described} quantization holds {stored_in} inputs, the model expects {in_dim}",
            base + ".weight",
            TensorShapeMismatch,
        )
    return group_size, bits


def dequantize(
    weights: dict[str, mx.array],
    group_size: int | None = None,
    bits: int | None = None,
    *,
    quantization: Quantization | None = None,
    specs: Mapping[str, tuple[int, int]] | None = None,
    in_dims: Mapping[str, int] | None = None,
    path: str | None = None,
    sources: Mapping[str, str] | None = None,
    error: ErrorClass | None = None,
) -> None:
    """Replace every affine-quantized ``X.weight``/``X.scales``/``X.biases`` triple by a dense
    float32 ``X.weight``, in place: ``q * float32(scale) + float32(bias)``, the exact float32
    values whatever dtype the scales are stored in. Each module's group size and bits come from
    ``quantization`` (per-module overrides included) or ``group_size`` / ``bits`` (None: from
    the packed widths); see :func:`quantized_modules`, whose checks name the tensor and file.
    ``specs`` (what :func:`quantized_modules` returned) dequantizes just those modules."""
    if specs is None:
        if quantization is None:
            quantization = Quantization(QuantSpec(group_size, bits))
        specs = quantized_modules(
            weights, quantization, in_dims=in_dims, path=path, sources=sources, error=error
        )
    for base, (group, layer_bits) in specs.items():
        packed = weights[base + ".weight"]
        scales = weights.pop(base + ".scales").astype(mx.float32)
        biases = weights.pop(base + ".biases").astype(mx.float32)
        try:
            dense = mx.dequantize(packed, scales, biases, group_size=group, bits=layer_bits)
        except (ValueError, RuntimeError) as exc:
            raise (error or CorruptModelFile)(
                f"cannot dequantize ({layer_bits}-bit, group {group}): {exc}",
                path=(sources or {}).get(base + ".weight", path),
                tensor=base + ".weight",
            ) from None
        weights[base + ".weight"] = dense


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
