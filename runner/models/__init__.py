"""Model families by ``model_type``."""

from __future__ import annotations

from protocol.errors import UnsupportedArchitecture
from runner.models import llama

_FAMILIES = {name: llama for name in llama.FAMILIES}
# Aliases seen in real configs for the same architecture.
_FAMILIES["smollm"] = llama
_FAMILIES["smollm2"] = llama


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def build_model(config: dict, path: str | None = None) -> llama.Model:
    """Instantiate the (uninitialised) model a Hugging Face config describes."""
    model_type = config.get("model_type")
    module = _FAMILIES.get(model_type or "")
    if module is None:
        raise UnsupportedArchitecture(
            f"unsupported model_type {model_type!r} (supported: "
            f"{', '.join(supported_model_types())})",
            path=path,
        )
    args = module.ModelArgs.from_config(config)
    if args.model_type not in llama.FAMILIES:
        args.model_type = "llama"
    return module.Model(args)
