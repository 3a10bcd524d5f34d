"""Build a head for a target and write it as a sidecar directory (Qwen3-Next naming).

    DIR/config.json       architecture, naming, target shape, draft vocab size, training record
    DIR/mtp.safetensors   mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight,
                          mtp.layers.0.<decoder layer>, mtp.norm.weight (float16),
                          mtp.draft_vocab (int32 [Vd])

The format is drafting/load.py's (its ``write_sidecar`` writes, runner.heads reads).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from drafting.head import HeadConfig, MTPHead
from drafting.load import sidecar_target, write_sidecar
from runner.models.layers import dense_weight
from runner.models.llama import MLP, DecoderLayer
from runner.models.moe import SparseMoE


def _copy_layer(dst: nn.Module, src: nn.Module) -> None:
    """Copy a decoder layer's weights (dense, Hugging Face layout) into a fresh one."""
    src_modules = dict(src.named_modules())
    for name, module in dst.named_modules():
        other = src_modules[name]
        if isinstance(module, nn.Linear):
            module.weight = mx.array(dense_weight(other))
            if "bias" in module:
                module.bias = mx.array(other.bias)
        elif isinstance(module, nn.RMSNorm):
            module.weight = mx.array(other.weight)


def _dense_stand_in_from(mlp: SparseMoE, args) -> MLP:
    """A dense MLP (``args``' width: the experts') holding a MoE block's first routed expert."""
    dense = MLP(args)
    switch = mlp.switch_mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dense, name).weight = mx.array(getattr(switch, name).dense()[0])
    return dense


def build_head(model, draft_vocab: list[int] | None) -> MTPHead:
    """A head for ``model`` initialised from its last decoder layer and final norm (a MoE last
    layer's MLP from its first expert: the head's block stays dense)."""
    args, last = model.args, model.layers[-1]
    if isinstance(last.mlp, SparseMoE):
        args = dataclasses.replace(args, intermediate_size=last.mlp.settings.intermediate_size)
        layer = DecoderLayer(args)
        layer.mlp = _dense_stand_in_from(last.mlp, args)
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            _copy_layer(getattr(layer, name), getattr(last, name))
    else:
        layer = DecoderLayer(args)
        _copy_layer(layer, last)
    config = HeadConfig(hidden_size=args.hidden_size, rms_norm_eps=args.rms_norm_eps)
    head = MTPHead(config, layer, model.embed, model.output_weight)
    head.norm.weight = mx.array(model.model.norm.weight)
    head.set_draft_vocab(draft_vocab)
    mx.eval(head.parameters())
    return head


def last_layer_input_rms(model, tokens: list[int]) -> float:
    """Median RMS of the residual stream entering the target's last decoder layer."""
    x = model.embed(mx.array([tokens]))
    caches = model.make_caches()
    for layer, cache in zip(model.layers[:-1], caches, strict=False):
        x = layer(x, "causal" if len(tokens) > 1 else None, cache)
    rms = mx.sqrt(mx.mean(mx.square(x[0]), axis=-1))
    return float(mx.median(rms).item())


def match_residual_scale(head: MTPHead, model, tokens: list[int]) -> float:
    """Scale ``fc`` so its outputs have the RMS of the residual stream the copied last layer
    sees in the target (about 29 vs 0.6 for SmolLM2 with the default init). At the default
    scale the layer's own attention and MLP outputs swamp fc's signal on the residual path,
    and Adam's fixed step is a large relative change on such small weights."""
    ids = mx.array([tokens])
    caches = model.make_caches()
    hidden = model.hidden(ids, caches)
    e = head.pre_fc_norm_embedding(model.embed(ids[:, 1:]))
    h = head.pre_fc_norm_hidden(hidden[:, :-1])
    x0 = head.fc(mx.concatenate([e, h], axis=-1))
    have = float(mx.sqrt(mx.mean(mx.square(x0))).item())
    want = last_layer_input_rms(model, tokens)
    factor = want / max(have, 1e-6)
    head.fc.weight = head.fc.weight * factor
    mx.eval(head.fc.weight)
    return factor


def write_head(out_dir: str, head: MTPHead, model, training: dict) -> None:
    """Write ``head`` as a float16 sidecar in the Qwen3-Next naming (drafting.load's format)."""
    write_sidecar(
        out_dir, head, naming="qwen3_next", target=sidecar_target(model.args), training=training,
        dtype=mx.float16,
    )  # fmt: skip
