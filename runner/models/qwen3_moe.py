"""Qwen3-MoE (``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder MoE) on the llama
family's pieces.

What differs from ``runner.models.qwen3`` (transformers 5.24's ``modeling_qwen3_moe``): the MLP
of a sparse layer is ``runner.models.moe.SparseMoE`` with softmax top-k routing (no shared
expert); the layer schedule is ``mlp_only_layers`` / ``decoder_sparse_step`` (dense layers keep
a plain MLP of ``intermediate_size``). Attention is Qwen3's: per-head RMS q/k norms before
RoPE, ``attention_bias`` on q, k, v and o.

Config keys: the attention and RoPE keys are read by ``runner.models.config.
read_llama_family`` as for qwen3 (with qwen3_moe's own defaults: 4 KV heads, ``head_dim``
``hidden_size / num_attention_heads``), the MoE keys by ``runner.models.moe.read_qwen_moe``
(``num_experts`` or transformers 5's ``num_local_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``).
Refused by name: ``use_sliding_window`` (transformers slides every layer; no checkpoint uses
it), ``shared_expert_intermediate_size`` > 0 (qwen3_moe has no shared expert: its tensors
would be dropped), activations other than SiLU. Ignored (training only):
``output_router_logits``, ``router_aux_loss_coef``.
"""

from __future__ import annotations

import runner.models.config as cfgs
from protocol.errors import UnsupportedArchitecture
from runner.models.llama import ModelArgs
from runner.models.moe import MoEDecoderLayer, MoEModel, read_qwen_moe

FAMILIES = ("qwen3_moe",)
# transformers 5.24's Qwen3MoeConfig defaults that differ from qwen3's.
_DEFAULTS = {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}


def model_args(config: dict, path: str | None = None) -> ModelArgs:
    """``ModelArgs`` for a ``qwen3_moe`` config (either layout, flat or nested); keys that
    change the math and are not implemented are refused by name."""
    cfg, prefix = cfgs.text_config(config)
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedArchitecture(f"unsupported model_type {kind!r}", path=path)
    if cfg.get("use_sliding_window"):
        raise cfgs.refuse(
            prefix + "use_sliding_window",
            True,
            "qwen3_moe slides every layer then; not implemented for this family",
            path,
        )
    dense = {k: v for k, v in cfg.items() if k != "text_config"}
    dense["model_type"] = "qwen3"
    for key, value in _DEFAULTS.items():
        if dense.get(key) is None:
            dense[key] = value
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if dense.get("head_dim") is None and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)
    ):
        dense["head_dim"] = hidden // heads  # transformers: getattr(config, "head_dim", ...)
    args = cfgs.read_llama_family(dense, path)
    args["model_type"] = "qwen3_moe"
    args["qk_norm"] = True
    moe = read_qwen_moe(cfg, args["num_hidden_layers"], prefix, path, shared=False)
    extra = {k: v for k, v in cfg.items() if k not in ModelArgs.__dataclass_fields__}
    extra["moe"] = moe
    return ModelArgs(**args, extra=extra)


def head_layer(args: ModelArgs) -> MoEDecoderLayer:
    """An MTP head's block for a qwen3_moe target: qwen3_moe checkpoints carry no MTP layer,
    so a head is a sidecar trained by this project, whose block is dense (its MLP width from
    its tensors); full attention, a plain ``KVCache``."""
    return MoEDecoderLayer(args, sparse=False)


class Model(MoEModel):
    """A Qwen3-MoE causal LM with the llama family's interface (Qwen3's attention: llama's
    with q/k norms; a MoE or dense MLP per layer)."""

    takes_layer_hook: bool = True  # llama's ``hidden``, ``on_layer`` included
