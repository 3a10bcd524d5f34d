"""Build a head for a target and write it as a sidecar directory (Qwen3-Next naming).

    DIR/config.json       architecture, naming, target shape, draft vocab size, training record
    DIR/mtp.safetensors   mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight,
                          mtp.layers.0.<decoder layer>, mtp.norm.weight (float16),
                          mtp.draft_vocab (int32 [Vd])

The format is drafting/load.py's (its ``write_sidecar`` writes, runner.heads reads).
"""

from __future__ import annotations

import mlx.core as mx

from drafting.head import HeadConfig, MTPHead
from drafting.load import sidecar_target, write_sidecar

from .target import Target


def build_head(
    target: Target, draft_vocab: list[int] | None, feature_layers: list[int] | None = None
) -> MTPHead:
    """A head for ``target`` initialised from its last decoder layer and final norm (a MoE
    last layer's MLP from its first expert: the head's block stays dense); ``feature_layers``:
    the streams it fuses with the final hidden (none by default)."""
    model = target.model
    layer = target.head_layer()
    config = HeadConfig(
        hidden_size=model.args.hidden_size,
        rms_norm_eps=model.args.rms_norm_eps,
        feature_layers=list(feature_layers or []),
    )
    head = MTPHead(config, layer, model.embed, model.output_weight)
    head.norm.weight = mx.array(model.model.norm.weight)
    head.set_draft_vocab(draft_vocab)
    mx.eval(head.parameters())
    return head


def match_residual_scale(head: MTPHead, target: Target, tokens: list[int]) -> float:
    """Scale ``fc`` so its outputs have the RMS of the residual stream the copied last layer
    sees in the target (about 29 vs 0.6 for SmolLM2 with the default init). At the default
    scale the layer's own attention and MLP outputs swamp fc's signal on the residual path,
    and Adam's fixed step is a large relative change on such small weights."""
    model = target.model
    ids = mx.array([tokens])
    hidden = model.hidden(ids, model.make_caches())
    e = head.pre_fc_norm_embedding(model.embed(ids[:, 1:]))
    h = head.pre_fc_norm_hidden(hidden[:, :-1])
    x0 = head.fc(mx.concatenate([e, h], axis=-1))
    have = float(mx.sqrt(mx.mean(mx.square(x0))).item())
    want = target.last_layer_input_rms(tokens)
    factor = want / max(have, 1e-6)
    head.fc.weight = head.fc.weight * factor
    mx.eval(head.fc.weight)
    return factor


def write_head(out_dir: str, head: MTPHead, target: Target, training: dict) -> None:
    """Write ``head`` as a float16 sidecar in the Qwen3-Next naming (drafting.load's format)."""
    write_sidecar(
        out_dir,
        head,
        naming="qwen3_next",
        target=sidecar_target(target.model.args),
        training=training,
        dtype=mx.float16,
    )
