"""Find and build the MTP draft head for a loaded target (the runner's side of drafting.load:
the head's decoder layer comes from the target's family).

Where a head comes from, in order: an explicit ``--draft DIR`` sidecar; a head inside the
target checkpoint (``LoadedModel.extra_weights``, any of the three namings); a sidecar next to
the model (``<model dir>/mtp/`` or ``<file>.mtp/`` beside a GGUF); the head shipped for the
embedded default model. No head means no speculation, with the reason in the description.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import mlx.core as mx

from drafting.head import HeadConfig, MTPHead
from drafting.load import (
    HIDDEN_FIRST,
    TARGET_SHAPE_KEYS,
    Sidecar,
    detect_naming,
    is_sidecar,
    layer_overrides,
    load_head_weights,
    map_weights,
    read_sidecar,
)
from drafting.weights import dequantize
from protocol.errors import DraftHeadError
from runner import default_model
from runner.loader import LoadedModel, input_widths
from runner.models import head_layer
from runner.models.layers import Linear

log = logging.getLogger("mtp_runner.heads")

# Targets whose checkpoints store RMSNorm gains zero-centred (applied as 1 + w); an inline
# head there follows the same convention. The top-level and the text model_type both count (a
# Qwen3.5 save is "qwen3_5" around "qwen3_5_text", a text-only save "qwen3_5_text"). A family
# that knows its checkpoint's layout says so instead (``Model.head_norm_shift``, e.g.
# runner.models.qwen3_5: an mlx conversion stores every gain shifted already).
_ZERO_CENTRED_NORM_TYPES = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# The target hidden an inline head conditions on: post-final-norm, the tensor the target's own
# output head scores. Source: vLLM's qwen3_next_mtp.py and qwen3_5_mtp.py hand the MTP model
# the hidden states Qwen3NextModel / Qwen3_5Model.forward return, which end in
# ``hidden_states, _ = self.norm(hidden_states, residual)``, and the head applies its own
# pre_fc_norm_hidden on top (transformers 5.24 and mlx-lm 0.32 drop ``mtp.*`` and run no
# head). The engine feeds the draft session post-norm hiddens (``Model.hidden``).
INLINE_PRENORM_HIDDEN = False
# Config keys that declare an inline MTP head: Qwen3.5's and Qwen3-Next / DeepSeek's.
_DECLARED_MTP_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def load_draft_head(
    loaded: LoadedModel, draft_path: str | None = None
) -> tuple[MTPHead | None, str]:
    """The target's MTP head (or None) and a one-line description or reason for none.

    An explicit ``draft_path`` that cannot be loaded raises ``DraftHeadError``; a head found
    on its own that cannot be loaded is reported in the reason and the target runs alone.
    """
    if draft_path:
        path = _sidecar_dir(os.path.expanduser(draft_path))
        head = load_sidecar_head(loaded, path)
        return head, describe(head, f"sidecar {path}")
    try:
        head = load_embedded_head(loaded)
    except DraftHeadError as exc:
        return None, f"the checkpoint's MTP head is not usable: {exc}"
    if head is not None:
        return head, describe(head, f"inline in {loaded.path}")
    declared = declared_mtp(loaded)
    looked = []
    for path in sidecar_candidates(loaded):
        looked.append(path)
        if not is_sidecar(path):
            continue
        try:
            head = load_sidecar_head(loaded, path)
        except DraftHeadError as exc:
            log.warning("draft head %s not usable: %s", path, exc)
            return None, f"draft head {path} is not usable: {exc}"
        return head, describe(head, f"sidecar {path}")
    where = ", ".join(looked) or "any sidecar path"
    if declared is not None:
        key, layers = declared
        return None, (
            f"the checkpoint declares an MTP head ({key} {layers}) whose weights were stripped "
            f"(no mtp.* tensors; conversions often drop them), and there is no sidecar at {where}"
        )
    return None, f"no MTP head in the checkpoint or at {where}"


def declared_mtp(loaded: LoadedModel) -> tuple[str, int] | None:
    """(config key, layers) when the checkpoint's config declares an inline MTP head."""
    config = loaded.config
    for cfg in (config.get("text_config"), config):
        if not isinstance(cfg, dict):
            continue
        for key in _DECLARED_MTP_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return key, value
    return None


def _norm_shift(loaded: LoadedModel) -> bool:
    """Whether an inline head's zero-centred gains need the ``1 + w`` shift (exactly once)."""
    decided = loaded.model.head_norm_shift
    if decided is not None:
        return bool(decided)
    types = {str(loaded.config.get("model_type", "")), loaded.model.args.model_type}
    return bool(types & set(_ZERO_CENTRED_NORM_TYPES))


def describe(head: MTPHead, source: str) -> str:
    config = head.config
    parts = [f"mtp head ({config.extra.get('naming', '?')} naming) from {source}"]
    if config.draft_vocab is not None:
        parts.append(f"draft vocab {len(config.draft_vocab)}")
    if config.prenorm_hidden:
        parts.append("pre-norm hidden")
    if config.feature_layers:
        parts.append(f"fuses the streams after layers {config.feature_layers} and the final")
    return ", ".join(parts)


def sidecar_candidates(loaded: LoadedModel) -> list[str]:
    """Directories searched for a sidecar head when none is given."""
    path = os.path.normpath(loaded.path)
    if os.path.isdir(path):
        found = [os.path.join(path, "mtp")]
    else:
        found = [path + ".mtp"]
    if os.path.basename(path) == default_model.FILENAME:
        found.append(default_model.HEAD_DIR)
    return found


def _sidecar_dir(path: str) -> str:
    # Accept the weights file itself as well as its directory.
    return os.path.dirname(path) if os.path.isfile(path) else path


def load_embedded_head(
    loaded: LoadedModel, *, prenorm_hidden: bool = INLINE_PRENORM_HIDDEN
) -> MTPHead | None:
    """The head inside the target checkpoint, if its tensors are there; ``prenorm_hidden``:
    which target hidden it conditions on (see ``INLINE_PRENORM_HIDDEN``)."""
    args = loaded.model.args
    naming = detect_naming(loaded.extra_weights, args.num_hidden_layers)
    if naming is None:
        return None
    config = HeadConfig(
        hidden_size=args.hidden_size,
        rms_norm_eps=args.rms_norm_eps,
        hidden_first=HIDDEN_FIRST[naming],
        prenorm_hidden=prenorm_hidden,
        extra={"naming": naming, "source": loaded.path},
    )
    return _build(loaded, loaded.extra_weights, naming, config, loaded.path, _norm_shift(loaded))


def load_sidecar_head(loaded: LoadedModel, directory: str) -> MTPHead:
    """Load a sidecar directory; checks it was made for a target of this shape (and, for a
    fused-feature head, one whose forward provides the streams it fuses)."""
    sidecar = read_sidecar(directory)
    _check_target(loaded, sidecar)
    if sidecar.feature_layers and not loaded.model.serves_draft_features:
        family = type(loaded.model).__module__.rsplit(".", 1)[-1]
        raise DraftHeadError(
            f"the head fuses the streams after layers {sidecar.feature_layers}, which the "
            f"{family} forward does not provide",
            path=sidecar.config_path,
        )
    args = loaded.model.args
    config = HeadConfig(
        hidden_size=args.hidden_size,
        rms_norm_eps=args.rms_norm_eps,
        hidden_first=sidecar.hidden_first,
        prenorm_hidden=sidecar.prenorm_hidden,
        draft_vocab=sidecar.draft_vocab,
        feature_layers=sidecar.feature_layers,
        extra={
            "naming": sidecar.naming,
            "source": directory,
            "training": sidecar.config.get("training", {}),
        },
    )
    return _build(
        loaded,
        sidecar.weights,
        sidecar.naming,
        config,
        sidecar.weights_path,
        sidecar.norm_shift,
        layers=sidecar.target["num_hidden_layers"],
    )


def _check_target(loaded: LoadedModel, sidecar: Sidecar) -> None:
    args = loaded.model.args
    for key in TARGET_SHAPE_KEYS:
        value = getattr(args, key)
        if sidecar.target[key] != value:
            raise DraftHeadError(
                f"head was made for a target with {key} {sidecar.target[key]}, "
                f"this model has {value}",
                path=sidecar.config_path,
            )


def _layer_overrides(mapped: dict[str, mx.array]) -> dict:
    """``drafting.load.layer_overrides`` plus the MLP width of a fused ``gate_up_proj`` block
    (Phi-3's family)."""
    overrides = layer_overrides(mapped)
    gate_up = mapped.get("layers.0.mlp.gate_up_proj.weight")
    if gate_up is not None and gate_up.ndim == 2 and "intermediate_size" not in overrides:
        overrides["intermediate_size"] = int(gate_up.shape[0]) // 2
    return overrides


def _build(
    loaded: LoadedModel,
    weights: dict[str, mx.array],
    naming: str,
    config: HeadConfig,
    path: str,
    norm_shift: bool,
    layers: int | None = None,
) -> MTPHead:
    """Build the head's block from the target's family (its ``head_layer``) and load the
    mapped weights (in the Hugging Face layout, like the target: ``runner.device.tune`` lays
    out both)."""
    model = loaded.model
    layers = layers or model.args.num_hidden_layers
    mapped, origin = map_weights(weights, naming, layers)
    args = dataclasses.replace(model.args, **_layer_overrides(mapped))
    head = MTPHead(config, head_layer(model, args), model.embed, model.output_weight, linear=Linear)
    if any(name.endswith(".scales") for name in mapped):
        mapped = _dequantized(mapped, origin, input_widths(head), path)
    load_head_weights(
        head,
        mapped,
        origin,
        naming=naming,
        num_hidden_layers=layers,
        path=path,
        dtype=loaded.dtype,
        norm_shift=norm_shift,
    )
    return head


def _dequantized(
    mapped: dict[str, mx.array], origin: dict[str, str], widths: dict[str, int], path: str
) -> dict[str, mx.array]:
    """The head's tensors with every affine triple dequantized, each by its own shapes against
    the head's input widths (a sidecar need not share the target's recipe); faults name the
    tensor as the file spells it."""
    raw = {origin[name]: value for name, value in mapped.items()}
    file_widths = {
        origin[module + ".weight"].rpartition(".")[0]: width
        for module, width in widths.items()
        if module + ".weight" in origin
    }
    dequantize(raw, in_dims=file_widths, path=path, error=DraftHeadError)
    head_name = {file: name for name, file in origin.items()}
    return {head_name[file]: value for file, value in raw.items()}
