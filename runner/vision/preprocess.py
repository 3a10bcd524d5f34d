"""Image bytes to the vision tower's patch rows, as transformers' Qwen2-VL image processor
(PIL backend) computes them for an image read with ``load_image``; numpy and Pillow only, so
it runs on a request's preparation thread, off the model's.

The steps, each as the reference takes it:

1. **Decode** (:func:`decode_image`): PNG, JPEG, WebP or GIF only (other formats are refused
   by name); the first frame of an animation; the EXIF orientation applied
   (``ImageOps.exif_transpose``); then ``convert("RGB")``, which *drops* alpha and keeps the
   stored colour under it (what ``load_image`` hands the processor; compositing on white
   happens only for in-memory RGBA images given to the processor directly). Palette, grey and
   CMYK images go through the same conversion; 16-bit ``I;16`` saturates at 255 there.
2. **Resize** (:func:`smart_resize`): each side a multiple of ``patch_size * merge_size``,
   the area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as the
   rounding allows (half-to-even, Python's ``round``); an aspect ratio over 200 is refused.
   The uint8 RGB image is resized by Pillow with the processor's resampler (BICUBIC unless
   the preprocessor config names another): the same library call on the same uint8 input, so
   the resized pixels are bit-identical to the reference's.
3. **Rescale and normalise** as the reference does, in its precision: ``float32(float64(u)
   * rescale_factor)``, then ``(x - mean) / std`` in float32. Same operations on the same
   values, so the rows equal the processor's exactly, not approximately.
4. **Patchify** (:func:`patchify`): rows in merge-block-major order (blocks in raster order,
   the ``merge x merge`` patches of a block in raster order inside it), columns in the patch
   embedding's ``[C, T, P, P]`` flattening with the image duplicated over the
   ``temporal_patch_size`` frames.

A :class:`PreparedImage` also carries a digest of the original bytes and the resized size:
a stable key (``hashlib``, unsalted) for caches of what the image produces.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

# Pillow's format names of the accepted encodings; only their decoders ever see the bytes.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_ACCEPTED = "a PNG, JPEG, WebP or GIF image"
# Well-known signatures of formats that are refused, to name them in the error.
_SIGNATURES = (
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"qoif", "QOI"),
    (b"%PDF", "PDF"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"P1", "PNM"),
    (b"P2", "PNM"),
    (b"P3", "PNM"),
    (b"P4", "PNM"),
    (b"P5", "PNM"),
    (b"P6", "PNM"),
)
_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}

# Defaults of an absent key: Qwen3.5's released preprocessor_config.json.
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image the request cannot use; the message names it (``images[i]: ...``)."""


@dataclass(frozen=True)
class ImageSettings:
    """What turns an image into patch rows: the tower's patch geometry (its ``vision_config``)
    and the processor's resize bounds, resampler and normalisation (its
    ``preprocessor_config.json``).

    The resampler is the processor's: BICUBIC by default (Pillow's Keys a = -0.5 kernel,
    antialiased when shrinking, in fixed point on uint8), or the Pillow filter the config's
    ``resample`` names. Pillow on the same uint8 RGB input gives the very pixels the PIL
    backend of the processor gives; the torchvision backend ("...Fast") differs from it by a
    level or two on some pixels, which this does not imitate.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = DEFAULT_MEAN
    image_std: tuple[float, ...] = DEFAULT_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: Image.Resampling = Image.Resampling.BICUBIC
    channels: int = 3

    @property
    def factor(self) -> int:
        """Pixels per side of one merged block: each resized side is a multiple of it."""
        return self.patch_size * self.merge_size

    @property
    def row_width(self) -> int:
        """Values per patch row: ``C * T * P * P``."""
        return self.channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_configs(
        cls, vision_config: dict, preprocessor_config: dict | None = None
    ) -> ImageSettings:
        """Settings from a checkpoint's ``vision_config`` and its ``preprocessor_config.json``
        (None: absent). Patch geometry comes from the tower; a preprocessor that disagrees
        with it is refused (``ValueError`` naming the key). Resize bounds: ``size``'s
        ``shortest_edge`` / ``longest_edge`` (total pixels, despite the names), else the
        ``min_pixels`` / ``max_pixels`` keys of older saves; absent keys take Qwen3.5's
        released values."""
        pre = dict(preprocessor_config or {})
        patch = _square(vision_config.get("patch_size", 16), "vision_config.patch_size")
        temporal = int(vision_config.get("temporal_patch_size", 2))
        merge = int(vision_config.get("spatial_merge_size", 2))
        channels = int(vision_config.get("in_channels", 3))
        if channels != 3:
            raise ValueError(f"vision_config in_channels {channels} is not supported (RGB: 3)")
        for key, want in (
            ("patch_size", patch),
            ("temporal_patch_size", temporal),
            ("merge_size", merge),
        ):
            if key in pre and _square(pre[key], key) != want:
                raise ValueError(
                    f"preprocessor_config {key} {pre[key]} disagrees with the vision tower's {want}"
                )
        size = pre.get("size") or {}
        if not isinstance(size, dict):
            raise ValueError(f"preprocessor_config size must be an object, not {size!r}")
        lo = size.get("shortest_edge", pre.get("min_pixels", DEFAULT_MIN_PIXELS))
        hi = size.get("longest_edge", pre.get("max_pixels", DEFAULT_MAX_PIXELS))
        lo, hi = int(lo), int(hi)
        if not 0 < lo <= hi:
            raise ValueError(f"preprocessor_config pixel bounds [{lo}, {hi}] are not a range")
        if pre.get("do_resize", True) is False:
            raise ValueError("preprocessor_config do_resize false is not supported")
        mean = _per_channel(pre.get("image_mean", DEFAULT_MEAN), channels, "image_mean")
        std = _per_channel(pre.get("image_std", DEFAULT_STD), channels, "image_std")
        if any(s == 0 for s in std):
            raise ValueError("preprocessor_config image_std has a zero")
        resample = pre.get("resample", Image.Resampling.BICUBIC)
        try:
            resample = Image.Resampling(int(resample))
        except (TypeError, ValueError):
            raise ValueError(f"preprocessor_config resample {resample!r} is unknown") from None
        return cls(
            patch_size=patch,
            temporal_patch_size=temporal,
            merge_size=merge,
            min_pixels=lo,
            max_pixels=hi,
            image_mean=mean,
            image_std=std,
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            do_rescale=bool(pre.get("do_rescale", True)),
            do_normalize=bool(pre.get("do_normalize", True)),
            resample=resample,
            channels=channels,
        )


def _square(value: object, key: str) -> int:
    """A patch size given as an int or as equal sides."""
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ValueError(f"{key} {value} is not square")
        value = value[0]
    return int(value)


def _per_channel(value: object, channels: int, key: str) -> tuple[float, ...]:
    if isinstance(value, int | float):
        return (float(value),) * channels
    values = tuple(float(v) for v in value)
    if len(values) != channels:
        raise ValueError(f"preprocessor_config {key} has {len(values)} values for {channels}")
    return values


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower.

    ``pixels``: float32 ``[N, C*T*P*P]``, N = gh * gw patches in merge-block-major order;
    ``grid``: (gh, gw) in patches; ``tokens``: the language model's rows for it,
    ``gh * gw / merge**2``; ``size``: the resized (height, width) in pixels; ``digest``: a
    stable hash of the original bytes, the resized size and the settings that shape the
    pixels (equal digests: equal pixels).
    """

    pixels: np.ndarray
    grid: tuple[int, int]
    tokens: int
    size: tuple[int, int]
    digest: bytes


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The processor's target (height, width): sides multiples of ``factor`` (rounded half to
    even), the area brought inside ``[min_pixels, max_pixels]`` by one common scale.
    ``ImageError`` when the longer side is over 200 times the shorter."""
    if min(height, width) <= 0:
        raise ImageError(f"an image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"aspect ratio {max(height, width) / min(height, width):g} of a {width}x{height} "
            f"image is over {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _refused_format(data: bytes) -> str | None:
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return _BRANDS.get(data[8:12])
    head = data[:256].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "SVG"
    return None


def decode_image(data: bytes, index: int) -> Image.Image:
    """The RGB image ``data`` holds (module docstring, step 1), fully decoded.

    ``ImageError`` naming ``images[index]`` for bytes that are not a PNG, JPEG, WebP or GIF
    image (a recognised other format is named), that are corrupt or truncated, or whose
    declared size exceeds Pillow's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``,
    checked from the header before any pixel is decoded). Pillow reports malformed input
    through many exception types, so every exception from it is taken as bad input."""
    name = f"images[{index}]"
    if not data:
        raise ImageError(f"{name}: empty image data")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{name}: image too large to decode ({exc})") from None
    except Exception as exc:
        refused = _refused_format(data)
        if refused is not None:
            raise ImageError(
                f"{name}: {refused} images are not supported (send {_ACCEPTED})"
            ) from None
        raise ImageError(f"{name}: not {_ACCEPTED} ({type(exc).__name__}: {exc})") from None
    limit = Image.MAX_IMAGE_PIXELS
    width, height = image.size
    if limit is not None and width * height > limit:
        image.close()
        raise ImageError(
            f"{name}: a {width}x{height} image is over the decoder's limit of {limit} pixels"
        )
    try:
        image.load()  # the first frame: GIF, APNG and WebP animations open on frame 0
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Exception as exc:
        raise ImageError(
            f"{name}: cannot decode the {image.format} image ({type(exc).__name__}: {exc})"
        ) from None


def decode_base64(text: str, index: int) -> bytes:
    """The bytes of a base64 image (standard alphabet; ASCII whitespace ignored; a
    ``data:<type>;base64,`` prefix allowed); ``ImageError`` naming ``images[index]``."""
    name = f"images[{index}]"
    if not isinstance(text, str):
        raise ImageError(f"{name}: expected a base64 string, got {type(text).__name__}")
    if text.startswith("data:"):
        header, comma, text = text.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageError(f"{name}: a data URL must be ';base64,' encoded")
    compact = "".join(text.split())
    if not compact:
        raise ImageError(f"{name}: empty image data")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{name}: invalid base64 ({exc})") from None


@functools.lru_cache(maxsize=8)
def value_table(settings: ImageSettings) -> np.ndarray:
    """float32 ``[256, C]``: each uint8 level's value in each channel, rescaled and normalised
    in the reference's precision and order (module docstring, step 3). A value depends only on
    its level and channel, so a lookup gives the reference's bits without the float64 copy of
    the whole image that its arithmetic makes. Shared: do not write it."""
    levels = np.arange(256, dtype=np.uint8)[:, None].repeat(settings.channels, axis=1)
    x = levels.astype(np.float32)
    if settings.do_rescale:
        x = (levels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    if settings.do_normalize:
        mean = np.array(settings.image_mean, dtype=np.float32)
        std = np.array(settings.image_std, dtype=np.float32)
        x = (x - mean) / std
    x.setflags(write=False)
    return x


def normalize(rgb: np.ndarray, settings: ImageSettings) -> np.ndarray:
    """float32 values of a uint8 ``[..., C]`` image (:func:`value_table`)."""
    return value_table(settings)[rgb, np.arange(rgb.shape[-1])]


def patchify(image: np.ndarray, settings: ImageSettings) -> np.ndarray:
    """Patch rows ``[gh * gw, C*T*P*P]`` of a ``[H, W, C]`` image whose sides are multiples
    of ``patch_size * merge_size`` (module docstring, step 4), in the image's dtype."""
    height, width, channels = image.shape
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    gh, gw = height // p, width // p
    if gh * p != height or gw * p != width or gh % m or gw % m:
        raise ValueError(f"a {height}x{width} image is not whole merged blocks of {p * m}")
    blocks = image.reshape(gh // m, m, p, gw // m, m, p, channels)
    # -> [block row, block col, row in block, col in block, C, y, x]
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, channels * t * p * p))


def _digest(data: bytes, size: tuple[int, int], settings: ImageSettings) -> bytes:
    key = hashlib.blake2b(data, digest_size=16, person=b"mtp-runner-img")
    shape = (
        size,
        settings.patch_size,
        settings.temporal_patch_size,
        settings.merge_size,
        settings.image_mean,
        settings.image_std,
        settings.rescale_factor,
        settings.do_rescale,
        settings.do_normalize,
        int(settings.resample),
    )
    key.update(repr(shape).encode())
    return key.digest()


def prepare_image(data: bytes, settings: ImageSettings, index: int) -> PreparedImage:
    """Decode, resize, normalise and patchify one image (module docstring); ``ImageError``
    naming ``images[index]`` for anything wrong with the image itself."""
    image = decode_image(data, index)
    width, height = image.size
    try:
        size = smart_resize(
            height, width, settings.factor, settings.min_pixels, settings.max_pixels
        )
    except ImageError as exc:
        raise ImageError(f"images[{index}]: {exc}") from None
    if size != (height, width):
        image = image.resize((size[1], size[0]), resample=settings.resample)
    # Patchify the uint8 levels, then look their values up in the final layout: the only
    # float32 array made is the result.
    levels = patchify(np.asarray(image, dtype=np.uint8), settings)
    channels = settings.channels
    levels = levels.reshape(levels.shape[0], channels, -1)
    pixels = value_table(settings)[levels, np.arange(channels)[:, None]]
    pixels = pixels.reshape(levels.shape[0], -1)
    p, m = settings.patch_size, settings.merge_size
    grid = (size[0] // p, size[1] // p)
    return PreparedImage(
        pixels=pixels,
        grid=grid,
        tokens=grid[0] * grid[1] // (m * m),
        size=size,
        digest=_digest(data, size, settings),
    )
