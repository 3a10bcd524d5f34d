"""Image input for Qwen3.5: bytes to patch rows (:mod:`runner.vision.preprocess`, numpy and
Pillow, for a preparation thread) and patch rows to the language model's feature rows
(:mod:`runner.vision.tower`, MLX)."""

from runner.vision.preprocess import (
    ImageError,
    ImageSettings,
    PreparedImage,
    decode_base64,
    decode_image,
    prepare_image,
    smart_resize,
)

__all__ = [
    "ImageError",
    "ImageSettings",
    "PreparedImage",
    "decode_base64",
    "decode_image",
    "prepare_image",
    "smart_resize",
]
