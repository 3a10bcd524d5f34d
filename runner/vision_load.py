"""A multimodal checkpoint's image side, found at load: the vision tower the text model's
loader set aside, the preprocessing its configs describe, and the image token ids.

A checkpoint takes images when it carries a vision tower's tensors and a ``vision_config``;
a text-only checkpoint (or a conversion that dropped the tower, or a tower the runner cannot
use) serves text, and a request with images is refused by name, with the reason
(``runner.prepare``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import mlx.core as mx

from protocol.errors import CorruptModelFile
from runner.image_prompt import ImageTokens, PromptImages
from runner.loader import LoadedModel
from runner.vision.preprocess import ImageSettings
from runner.vision.tower import VisionTower, vision_weights

log = logging.getLogger("mtp_runner.vision")

PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass
class Vision:
    """The tower and the prompt side of a model that takes images."""

    tower: VisionTower
    prompts: PromptImages

    def encode(self, image) -> mx.array:
        """One prepared image's feature rows ``[rows, D]`` (lazy: the forward that needs
        them evaluates them)."""
        return self.tower(mx.array(image.pixels), tuple(image.grid))

    def tune(self, tuning) -> None:
        """Lay the tower's products out as the text model's were (``runner.device``)."""
        from runner import device

        device.tune_vision(self.tower, tuning)


def load_vision(loaded: LoadedModel) -> tuple[Vision | None, str]:
    """The model's image side, or None and why it takes no images. A checkpoint whose image
    side cannot be used (no ``vision_config``, image token ids outside the vocabulary, a tower
    the runner does not implement or whose tensors do not fit it) still serves text: the
    reason is logged and a request with images is refused with it."""
    tensors = loaded.model.vision_tensors
    config = loaded.config.get("vision_config")
    if not tensors:
        return None, "no vision tower"
    try:
        return _load(loaded, tensors, config), ""
    except (ValueError, CorruptModelFile) as exc:
        reason = f"its vision tower cannot be used: {exc}"
        log.warning("%s: serving text only (%s)", loaded.path, reason)
        return None, reason


def _load(loaded: LoadedModel, tensors: dict, config: object) -> Vision:
    if not isinstance(config, dict):
        raise ValueError(f"{len(tensors)} vision-tower tensors but no vision_config")
    where = os.path.join(loaded.path, PREPROCESSOR_FILE) if os.path.isdir(loaded.path) else None
    preprocessor = _read_json(where) if where and os.path.exists(where) else None
    tokens = ImageTokens.from_config(loaded.config)
    named = (
        ("vision_start_token_id", tokens.start),
        ("image_token_id", tokens.pad),
        ("vision_end_token_id", tokens.end),
    )
    for name, token in named:
        if not 0 <= token < loaded.vocab_size:
            raise ValueError(
                f"{name} {token} is outside the vocabulary (0..{loaded.vocab_size - 1})"
            )
    tower = VisionTower(config)
    tower.load(vision_weights(dict(tensors)), dtype=loaded.dtype)
    settings = ImageSettings.from_configs(config, preprocessor)
    log.info("vision tower: %d blocks; images %s", config.get("depth"), settings)
    return Vision(tower, PromptImages(settings, tokens))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptModelFile(f"{PREPROCESSOR_FILE}: {exc}", path=path) from None
    if not isinstance(value, dict):
        raise CorruptModelFile(f"{PREPROCESSOR_FILE}: not a JSON object", path=path)
    return value
