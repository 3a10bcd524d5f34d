"""Model families by ``model_type``: llama (llama, mistral, qwen2, qwen3 and the smollm
aliases), gemma (gemma2, gemma3_text), gemma4 (gemma4_text), phi3 and the hybrids in qwen3_5
(qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next, dense or MoE), the MoE families
qwen3_moe and glm4_moe (runner.models.moe), and the multi-head latent attention families
deepseek_v3 and glm4_moe_lite (runner.models.mla).

Every family module has ``FAMILIES``, ``model_args(config, path) -> ModelArgs``, ``Model``
(the llama family's interface: ``forward``, ``hidden``, ``unembed``, ``embed``,
``make_caches``, ...) and ``head_layer(args)``, the decoder layer an MTP head for a target of
that family runs.
"""

from __future__ import annotations

from types import ModuleType

import mlx.nn as nn

from protocol.errors import UnsupportedArchitecture
from runner.models import config, gemma, gemma4, glm4_moe, llama, mla, phi3, qwen3_5, qwen3_moe

_FAMILIES: dict[str, ModuleType] = {name: llama for name in llama.FAMILIES}
# Aliases seen in real configs for the same architecture.
_FAMILIES.update({alias: llama for alias in config.ALIASES})
_FAMILIES.update({name: gemma for name in gemma.FAMILIES})
_FAMILIES.update({name: gemma4 for name in gemma4.FAMILIES})
_FAMILIES.update({name: phi3 for name in phi3.FAMILIES})
_FAMILIES.update({name: qwen3_5 for name in qwen3_5.FAMILIES})
_FAMILIES.update({name: m for m in (qwen3_moe, glm4_moe) for name in m.FAMILIES})  # MoE
_FAMILIES.update({name: mla for name in mla.FAMILIES})  # latent attention


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def family(model_type: str | None, path: str | None = None) -> ModuleType:
    """The module implementing ``model_type``, or an ``UnsupportedArchitecture``."""
    module = _FAMILIES.get(model_type or "")
    if module is None:
        raise UnsupportedArchitecture(
            f"unsupported model_type {model_type!r} (supported: "
            f"{', '.join(supported_model_types())})",
            path=path,
        )
    return module


def build_model(config: dict, path: str | None = None) -> llama.Model:
    """Instantiate the (uninitialised) model a Hugging Face config describes."""
    module = family(_model_type(config), path)
    return module.Model(module.model_args(config, path))


def head_layer(model: llama.Model, args: llama.ModelArgs | None = None) -> nn.Module:
    """A fresh decoder layer for an MTP head of ``model`` (its family's own block) built from
    ``args`` (default: the model's)."""
    return family(model.model_type).head_layer(args if args is not None else model.args)


def _model_type(cfg: dict) -> str | None:
    return config.model_type(cfg)


def feed_dependent(model: nn.Module) -> bool:
    """Whether the model's output depends on how a sequence is split into forwards (dynamic
    and longrope RoPE pick their rotation per forward, as transformers does): then one prompt
    fed in chunks, restored from a cache or verified with drafts rotates differently."""
    from runner.models.rope import RoPE

    return any(isinstance(m, RoPE) and m.depends_on_feed for _, m in model.named_modules())
