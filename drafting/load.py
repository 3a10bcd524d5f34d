"""MTP head weights from the three real naming schemes, and sidecar head directories.

Every scheme maps onto the one ``MTPHead`` (Qwen3-Next names without the ``mtp.`` prefix):

    qwen3_next  mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.*, norm}
    deepseek    model.layers.{N}.{eh_proj, enorm, hnorm, shared_head.norm, <block>}  (N = depth)
    mimo        model.mtp_layers.0.{input_proj, token_layernorm, hidden_layernorm,
                final_layernorm, <block>}  (concat(hidden, embedding))

A sidecar directory holds ``config.json`` (``"architecture": "mtp_head"``, the naming, the
target it was trained for, the head switches) and ``mtp.safetensors``. This module never
imports ``runner``; every failure is a ``DraftHeadError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from drafting.head import MTPHead
from drafting.weights import check_and_load, read_json, read_safetensors
from protocol.errors import DraftHeadError

NAMINGS = ("qwen3_next", "deepseek", "mimo")
# MiMo is the one family that concatenates (hidden, embedding).
HIDDEN_FIRST = {"qwen3_next": False, "deepseek": False, "mimo": True}
SIDECAR_ARCHITECTURE = "mtp_head"
SIDECAR_CONFIG = "config.json"
SIDECAR_WEIGHTS = "mtp.safetensors"
# The reduced draft vocabulary (int32 [Vd]) rides along in the sidecar's weights file.
DRAFT_VOCAB_TENSOR = "mtp.draft_vocab"

# The head's own (non-block) tensors per scheme: scheme name -> MTPHead name.
_HEAD_PARTS = {
    "deepseek": {
        "eh_proj": "fc",
        "enorm": "pre_fc_norm_embedding",
        "hnorm": "pre_fc_norm_hidden",
        "shared_head.norm": "norm",
    },
    "mimo": {
        "input_proj": "fc",
        "token_layernorm": "pre_fc_norm_embedding",
        "hidden_layernorm": "pre_fc_norm_hidden",
        "final_layernorm": "norm",
    },
}
# The decoder block's tensors sit directly under the layer prefix in DeepSeek and MiMo.
_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def naming_prefix(naming: str, num_hidden_layers: int) -> str:
    """The name prefix every tensor of the head carries under ``naming``."""
    if naming == "qwen3_next":
        return "mtp."
    if naming == "deepseek":
        return f"model.layers.{num_hidden_layers}."
    if naming == "mimo":
        return "model.mtp_layers.0."
    raise DraftHeadError(f"unknown MTP head naming {naming!r} (known: {', '.join(NAMINGS)})")


def head_name(naming: str, local: str) -> str | None:
    """Map a tensor name (prefix removed) to the MTPHead parameter name; None = not the head's
    (DeepSeek's copies of the shared embedding and output head, which the target provides)."""
    if naming == "qwen3_next":
        return local
    for part in _BLOCK_PARTS:
        if local.startswith(part):
            return "layers.0." + local
    for theirs, ours in _HEAD_PARTS[naming].items():
        if local.startswith(theirs + "."):
            return ours + local[len(theirs) :]
    return None


def scheme_name(naming: str, name: str, num_hidden_layers: int) -> str:
    """The inverse of :func:`head_name`: an MTPHead parameter name as ``naming`` spells it."""
    prefix = naming_prefix(naming, num_hidden_layers)
    if naming == "qwen3_next":
        return prefix + name
    if name.startswith("layers.0."):
        return prefix + name[len("layers.0.") :]
    for theirs, ours in _HEAD_PARTS[naming].items():
        if name.startswith(ours + "."):
            return prefix + theirs + name[len(ours) :]
    raise ValueError(f"{name!r} is not an MTPHead parameter")


def detect_naming(names: Iterable[str], num_hidden_layers: int) -> str | None:
    """Which scheme a checkpoint's tensor names use for an inline head, if any.

    Keyed on the fusion projection: a config flag alone does not mean the weights shipped.
    """
    names = set(names)
    for naming, fc in (("qwen3_next", "fc"), ("deepseek", "eh_proj"), ("mimo", "input_proj")):
        if f"{naming_prefix(naming, num_hidden_layers)}{fc}.weight" in names:
            return naming
    return None


def map_weights(
    weights: Mapping[str, mx.array], naming: str, num_hidden_layers: int
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Select and rename the head's tensors; returns (MTPHead name -> array, MTPHead name ->
    the name in the file, for error messages)."""
    prefix = naming_prefix(naming, num_hidden_layers)
    mapped: dict[str, mx.array] = {}
    origin: dict[str, str] = {}
    for key, value in weights.items():
        if not key.startswith(prefix) or key == DRAFT_VOCAB_TENSOR:
            continue
        name = head_name(naming, key[len(prefix) :])
        if name is not None:
            mapped[name] = value
            origin[name] = key
    return mapped, origin


def layer_overrides(mapped: Mapping[str, mx.array]) -> dict:
    """ModelArgs fields of the head's block that its tensors decide rather than the target:
    the MLP width (a head may be narrower than the target's blocks) and the q/k norms."""
    overrides: dict = {"qk_norm": "layers.0.self_attn.q_norm.weight" in mapped}
    gate = mapped.get("layers.0.mlp.gate_proj.weight")
    if gate is not None and gate.ndim == 2:
        overrides["intermediate_size"] = int(gate.shape[0])
    return overrides


def _is_norm(name: str) -> bool:
    """RMSNorm gains: pre_fc_norm_*, norm, input/post_attention_layernorm, q_norm/k_norm."""
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]


def load_head_weights(
    head: MTPHead,
    mapped: Mapping[str, mx.array],
    origin: Mapping[str, str],
    *,
    naming: str,
    num_hidden_layers: int,
    path: str | None,
    dtype: mx.Dtype = mx.float32,
    norm_shift: bool = False,
) -> None:
    """Check every head parameter against ``mapped``, cast floats to ``dtype``, apply the
    zero-centred RMSNorm shift (weight applied as 1 + w) when asked, and load them.

    ``origin`` (from :func:`map_weights`) and the naming spell tensors as the file does."""

    def file_name(name: str) -> str:
        return origin.get(name) or scheme_name(naming, name, num_hidden_layers)

    def shift(name: str, w: mx.array) -> mx.array:
        return w.astype(mx.float32) + 1.0 if norm_shift and _is_norm(name) else w

    check_and_load(
        head,
        mapped,
        path=path,
        dtype=dtype,
        file_name=file_name,
        transform=shift,
        refuse_extras=True,
        floats_only=True,
        error=DraftHeadError,
    )


@dataclass
class Sidecar:
    """A sidecar head directory as read from disk (weights still in the file's naming)."""

    path: str
    naming: str
    target: dict
    weights: dict[str, mx.array]
    hidden_first: bool
    prenorm_hidden: bool
    norm_shift: bool
    draft_vocab: list[int] | None
    config: dict = field(default_factory=dict)
    feature_layers: list[int] = field(default_factory=list)

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, SIDECAR_WEIGHTS)

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, SIDECAR_CONFIG)


def is_sidecar(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, SIDECAR_CONFIG)) and os.path.isfile(
        os.path.join(directory, SIDECAR_WEIGHTS)
    )


def _flag(config: dict, key: str, default: bool, path: str) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise DraftHeadError(f"{key!r} must be true or false, found {value!r}", path)
    return value


def read_sidecar(directory: str) -> Sidecar:
    """Read ``directory/config.json`` and ``directory/mtp.safetensors``; checks the format,
    not the fit to a target (the runner does that against the loaded model)."""
    config_path = os.path.join(directory, SIDECAR_CONFIG)
    config = read_json(config_path, error=DraftHeadError)
    if config.get("architecture") != SIDECAR_ARCHITECTURE:
        raise DraftHeadError(
            f"not an MTP head sidecar: architecture is {config.get('architecture')!r}, "
            f"expected {SIDECAR_ARCHITECTURE!r}",
            config_path,
        )
    naming = config.get("naming")
    if naming not in NAMINGS:
        raise DraftHeadError(
            f"unknown MTP head naming {naming!r} (known: {', '.join(NAMINGS)})", config_path
        )
    target = config.get("target")
    if not isinstance(target, dict) or not all(
        isinstance(target.get(k), int) for k in TARGET_SHAPE_KEYS
    ):
        raise DraftHeadError(
            "'target' must give integer hidden_size, vocab_size and num_hidden_layers",
            config_path,
        )
    weights_path = os.path.join(directory, SIDECAR_WEIGHTS)
    weights = read_safetensors(weights_path, error=DraftHeadError)
    draft_vocab = _read_draft_vocab(weights, config, target["vocab_size"], weights_path)
    layers = config.get("feature_layers", [])
    if (
        not isinstance(layers, list)
        or not all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k < target["num_hidden_layers"]
            for k in layers
        )
        or layers != sorted(set(layers))
    ):
        raise DraftHeadError(
            f"'feature_layers' must list layer counts in 1..{target['num_hidden_layers'] - 1}, "
            f"strictly increasing, found {layers!r}",
            config_path,
        )
    return Sidecar(
        path=directory,
        naming=naming,
        target=target,
        weights=weights,
        hidden_first=_flag(config, "hidden_first", HIDDEN_FIRST[naming], config_path),
        prenorm_hidden=_flag(config, "prenorm_hidden", False, config_path),
        norm_shift=_flag(config, "norm_shift", False, config_path),
        draft_vocab=draft_vocab,
        config=config,
        feature_layers=list(layers),
    )


def _read_draft_vocab(
    weights: Mapping[str, mx.array], config: dict, vocab_size: int, path: str
) -> list[int] | None:
    ids = weights.get(DRAFT_VOCAB_TENSOR)
    declared = config.get("draft_vocab_size")
    if ids is None:
        if declared is not None:
            raise DraftHeadError(
                f"config declares draft_vocab_size {declared} but the tensor is absent",
                path,
                DRAFT_VOCAB_TENSOR,
            )
        return None
    if ids.ndim != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        raise DraftHeadError(
            f"draft vocabulary must be a 1-D integer tensor, found {ids.dtype} {tuple(ids.shape)}",
            path,
            DRAFT_VOCAB_TENSOR,
        )
    if declared is not None and declared != ids.shape[0]:
        raise DraftHeadError(
            f"draft vocabulary has {ids.shape[0]} ids, config says {declared}",
            path,
            DRAFT_VOCAB_TENSOR,
        )
    values = ids.tolist()
    if values and (min(values) < 0 or max(values) >= vocab_size):
        raise DraftHeadError(
            f"draft vocabulary ids must lie in [0, {vocab_size})", path, DRAFT_VOCAB_TENSOR
        )
    return [int(v) for v in values]


# What a head must match in its target (any family with these shapes fits).
TARGET_SHAPE_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers")


def sidecar_target(args) -> dict:
    """The ``target`` block of a sidecar config, from a model's args."""
    return {key: getattr(args, key) for key in ("model_type", *TARGET_SHAPE_KEYS)}


def write_sidecar(
    directory: str,
    head: MTPHead,
    *,
    naming: str,
    target: dict,
    training: dict | None = None,
    dtype: mx.Dtype | None = None,
    norm_shift: bool = False,
) -> str:
    """Write ``head`` (unpacked parameters) as a sidecar directory in the given naming.

    ``target`` needs model_type, hidden_size, vocab_size and num_hidden_layers. ``norm_shift``
    stores the norms zero-centred (w - 1) and says so in the config.
    """
    if naming not in NAMINGS:
        raise ValueError(f"unknown naming {naming!r}")
    os.makedirs(directory, exist_ok=True)
    layers = int(target["num_hidden_layers"])
    tensors: dict[str, mx.array] = {}
    for name, value in tree_flatten(head.parameters()):
        if norm_shift and _is_norm(name):
            value = value - 1.0
        tensors[scheme_name(naming, name, layers)] = value.astype(dtype) if dtype else value
    vocab = head.config.draft_vocab
    if vocab is not None:
        tensors[DRAFT_VOCAB_TENSOR] = mx.array(vocab, dtype=mx.int32)
    mx.save_safetensors(os.path.join(directory, SIDECAR_WEIGHTS), tensors)
    config = {
        "architecture": SIDECAR_ARCHITECTURE,
        "naming": naming,
        "target": dict(target),
        "hidden_first": head.config.hidden_first,
        "prenorm_hidden": head.config.prenorm_hidden,
        "norm_shift": norm_shift,
        "training": training or {},
    }
    if vocab is not None:
        config["draft_vocab_size"] = len(vocab)
    if head.config.feature_layers:
        config["feature_layers"] = list(head.config.feature_layers)
    with open(os.path.join(directory, SIDECAR_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory
