"""Reference fixtures for the MoE hybrids (Qwen3.5-MoE, Qwen3-Next with MoE layers): tiny random
float32 checkpoints and what transformers computes for them, beside the other MoE cases under
``tests/fixtures/reference/moe/``.

    .venv-ref/bin/python scripts/make_reference_checkpoints.py --only moe   # all MoE cases

A module of ``make_reference_checkpoints.py`` (run in ``.venv-ref``), called by
``reference_moe.make`` with the same ``base``; it borrows the hybrid fixtures' weight recipe
and writers (``reference_hybrid``) and never imports ``base`` itself. 24 greedy tokens per
prompt, the files of ``../README.md``. Cases:

- ``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration``'s tensors as the released
  checkpoints store them (nested ``text_config``, ``model.language_model.*``, a tiny vision
  tower, experts fused: ``experts.gate_up_proj`` ``[E, 2I, D]``, ``experts.down_proj``), 4
  layers [linear x3, full], every MLP a sparse block of 8 experts / 2 active plus a gated
  shared expert, and an inline MTP head whose ``mtp.layers.0`` MLP is such a block too
  (random, fused likewise);
- ``qwen3_5_moe_mlx``: that checkpoint converted by ``mlx_lm.convert`` (float32):
  ``switch_mlp`` experts, mlx-lm names, norms stored shifted, head and vision tower dropped;
- ``qwen3_next_moe``: ``Qwen3NextForCausalLM``, 6 layers (``full_attention_interval`` 3),
  layers sparse but for ``mlp_only_layers`` [1], ``norm_topk_prob`` false (its default is
  true), a gated shared expert, and an inline MTP head with a sparse block.
"""

from __future__ import annotations

import copy
import math
import zlib
from pathlib import Path

import numpy as np
import reference_hybrid as hybrid
import torch

MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
)
EXERCISES = {
    "qwen3_5_moe": "qwen3_5_moe in the released layout (nested text_config, "
    "model.language_model.*, tiny vision tower, fused experts.gate_up_proj / down_proj): 4 "
    "layers [linear x3, full], "
    "every MLP sparse (8 experts / 2 active, softmax top-k renormalised, shared expert gated "
    "by sigmoid(shared_expert_gate)), tied head, inline MTP head (mtp_num_hidden_layers 1) "
    "whose block is sparse too",
    "qwen3_5_moe_mlx": "qwen3_5_moe converted by mlx_lm.convert (float32): switch_mlp experts, "
    "language_model.model.* names, norms stored shifted, MTP head and vision tower dropped",
    "qwen3_next_moe": "qwen3_next with MoE layers: 6 layers (full_attention_interval 3), sparse "
    "but for mlp_only_layers [1] (a dense MLP), 8 experts / 2 active, norm_topk_prob false, "
    "gated shared expert, untied head, inline MTP head (num_nextn_predict_layers 1) with a "
    "sparse block",
}


def text_config(base) -> dict:
    cfg = hybrid.text_config(base)
    cfg.pop("intermediate_size")
    return dict(cfg, **MOE)


def next_config(base) -> dict:
    return dict(
        hybrid.next_config(base),
        **MOE,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        decoder_sparse_step=1,
    )


def randomize(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """The hybrid fixtures' recipe, then the experts N(0, 1/fan_in) by their own input width
    (down x2) and the router x2 (decisive routing: no near ties between implementations)."""
    hybrid.randomize(model, seed, tied)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                value = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
                if "down_proj" in name or name.endswith("mlp.gate.weight"):
                    value = value * 2.0
                p.copy_(value)


def build(kind: str, config: dict, seed: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**config))
    else:
        cfg = Qwen3_5MoeConfig(
            text_config=config,
            vision_config=hybrid.VISION,
            tie_word_embeddings=config["tie_word_embeddings"],
        )
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    model.config._attn_implementation = "eager"
    randomize(model, seed, bool(config["tie_word_embeddings"]))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(torch.float32).eval()


def mtp_tensors(cfg: dict, seed: int, per_expert: bool) -> dict[str, torch.Tensor]:
    """An inline MTP head (``reference_hybrid.mtp_tensors``' attention, norms and fusion) whose
    block's MLP is a sparse one: router, experts (per expert, or fused ``gate_up_proj`` /
    ``down_proj`` as the target's were saved), shared expert and its gate."""
    out = {
        k: v
        for k, v in hybrid.mtp_tensors(dict(cfg, intermediate_size=1), seed).items()
        if ".mlp." not in k
    }
    gen = torch.Generator().manual_seed(seed + 1)
    d, e, i, s = (
        cfg["hidden_size"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
        cfg["shared_expert_intermediate_size"],
    )
    mlp = "mtp.layers.0.mlp."

    def rand(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return gain * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    out[mlp + "gate.weight"] = rand(e, d, gain=2.0)
    gate_up, down = rand(e, 2 * i, d), rand(e, d, i, gain=2.0)
    if per_expert:
        for x in range(e):
            out[f"{mlp}experts.{x}.gate_proj.weight"] = gate_up[x, :i].clone()
            out[f"{mlp}experts.{x}.up_proj.weight"] = gate_up[x, i:].clone()
            out[f"{mlp}experts.{x}.down_proj.weight"] = down[x].clone()
    else:
        out[mlp + "experts.gate_up_proj"], out[mlp + "experts.down_proj"] = gate_up, down
    out[mlp + "shared_expert.gate_proj.weight"] = rand(s, d)
    out[mlp + "shared_expert.up_proj.weight"] = rand(s, d)
    out[mlp + "shared_expert.down_proj.weight"] = rand(d, s, gain=2.0)
    out[mlp + "shared_expert_gate.weight"] = rand(1, d)
    return out


def saved_per_expert(directory: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return any(".experts.0." in k for k in f.keys())  # noqa: SIM118


def save_fused(model, directory: Path, base, extra: dict, config_edit) -> None:
    """The model's own tensors (experts fused, ``experts.gate_up_proj`` / ``down_proj``, as the
    released Qwen3.5-MoE checkpoints store them and mlx-lm's conversion expects), ``extra``
    beside them, and the config ``save_pretrained`` writes."""
    from safetensors.torch import save_file

    hybrid.save(model, directory, base, config_edit=config_edit)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # a tied head is not stored (as save_pretrained does)
        tensors.pop("lm_head.weight")
    tensors.update(extra)
    save_file(
        dict(sorted(tensors.items())),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )


def make(base, out: Path, summary: list, reference) -> None:
    """Write the MoE hybrid cases under ``out``; ``reference`` is ``reference_moe.reference``
    (prompt choice and writing, 24 greedy tokens), which takes its case notes from ``notes``."""
    cfg = text_config(base)
    model = build("qwen3_5_moe", copy.deepcopy(cfg), zlib.crc32(b"qwen3_5_moe"))
    first = out / "qwen3_5_moe"

    def nest(config: dict) -> None:
        config["text_config"]["mtp_num_hidden_layers"] = 1

    save_fused(model, first, base, mtp_tensors(cfg, 13, per_expert=False), nest)
    assert not saved_per_expert(first)
    prompts, results = reference(
        base,
        out,
        "qwen3_5_moe",
        "qwen3_5_moe",
        hybrid.loader(first, vl=True),
        summary,
        extra={
            "config_layout": "nested text_config (Qwen3_5MoeConfig)",
            "experts_saved": "fused (gate_up_proj, down_proj)",
        },
    )

    hybrid.convert_mlx(first, out / "qwen3_5_moe_mlx", base)
    theirs = hybrid.mlx_lm_logits(out / "qwen3_5_moe_mlx", prompts[0])
    gap = float(np.abs(theirs - results[0]["prompt_logits"]).max())
    assert gap < 1e-3, f"mlx-lm reads its own conversion differently: {gap}"
    reference(
        base,
        out,
        "qwen3_5_moe_mlx",
        "qwen3_5_moe",
        hybrid.loader(first, vl=True),
        summary,
        prompts=prompts,
        extra={
            "config_layout": "mlx_lm.convert of qwen3_5_moe",
            "converted_from": "qwen3_5_moe",
            "mlx_lm_prompt0_logits_vs_reference": gap,
        },
    )

    ncfg = next_config(base)
    nxt = build("qwen3_next", copy.deepcopy(ncfg), zlib.crc32(b"qwen3_next_moe"))
    target = out / "qwen3_next_moe"
    hybrid.save(nxt, target, base)
    layout = saved_per_expert(target)

    def declare(config: dict) -> None:
        config["num_nextn_predict_layers"] = 1

    hybrid.save(nxt, target, base, extra_tensors=mtp_tensors(ncfg, 17, layout), config_edit=declare)
    reference(
        base,
        out,
        "qwen3_next_moe",
        "qwen3_next",
        hybrid.loader(target),
        summary,
        extra={
            "config_layout": "as transformers 5 saves it",
            "experts_saved": "per expert" if layout else "fused",
        },
    )
