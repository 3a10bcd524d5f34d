"""Image input: preprocessing (``runner.vision.preprocess``) and the Qwen3.5 vision tower
(``runner.vision.tower``).

Unit tests check each rule on its own (resize arithmetic, patch order, decoding, refusals,
position tables, the tower against a float64 numpy tower). The reference tests read
``tests/fixtures/reference/vision/qwen3_5_vision/`` (transformers' processor and
``get_image_features`` on a tiny random float32 tower): the patch rows must equal the
processor's exactly, the features within ``ATOL``, as loaded, laid out for the CPU and loaded
from mlx-vlm's layout.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from runner import device
from runner.vision.preprocess import (
    ImageError,
    ImageSettings,
    decode_base64,
    decode_image,
    normalize,
    patchify,
    prepare_image,
    smart_resize,
)
from runner.vision.tower import VisionTower, grid_tables, vision_weights

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "reference" / "vision" / "qwen3_5_vision"
ATOL = 1e-5
PATCHES = {"patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}
WIDTHS = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 48}
TINY = {**PATCHES, **WIDTHS, "depth": 2, "num_position_embeddings": 36}
SETTINGS = ImageSettings.from_configs(TINY, {"size": {"shortest_edge": 1024, "longest_edge": 4096}})


def encode(array: np.ndarray, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kwargs)
    return buf.getvalue()


# --- resize arithmetic and settings


@pytest.mark.parametrize(
    ("size", "resized"),
    [
        ((480, 640), (480, 640)),
        ((1080, 1920), (1088, 1920)),
        ((3024, 4032), (3008, 4032)),
        ((100, 100), (256, 256)),
        ((1, 1), (256, 256)),
        ((37, 5000), (32, 4992)),
        ((5000, 37), (4992, 32)),
        ((8192, 8192), (4096, 4096)),
    ],
)
def test_smart_resize_examples(size, resized):
    assert smart_resize(*size, 32, 65536, 16777216) == resized


def test_smart_resize_rounding_and_refusal():
    # 48 / 32 = 1.5 -> 2 blocks, 80 / 32 = 2.5 -> 2 blocks (Python's round: half to even)
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)
    with pytest.raises(ImageError, match="aspect ratio 500"):
        smart_resize(10, 5000, 32, 65536, 16777216)
    data = encode(np.zeros((1, 300, 3), np.uint8))
    with pytest.raises(ImageError, match=r"^images\[4\]: aspect ratio 300"):
        prepare_image(data, SETTINGS, 4)


def test_settings_from_configs():
    vision = {"patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2}
    released = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "resample": 3}
    s = ImageSettings.from_configs(vision, released)
    assert (s.factor, s.min_pixels, s.max_pixels, s.row_width) == (32, 65536, 16777216, 1536)
    assert s.resample == Image.Resampling.BICUBIC and s.image_mean == (0.5, 0.5, 0.5)
    old = ImageSettings.from_configs(vision, {"min_pixels": 3136, "max_pixels": 1000000})
    assert (old.min_pixels, old.max_pixels) == (3136, 1000000)
    absent = ImageSettings.from_configs(vision, None)
    assert (absent.min_pixels, absent.max_pixels) == (65536, 16777216)
    assert ImageSettings.from_configs(vision, {"resample": 2}).resample == Image.Resampling.BILINEAR
    with pytest.raises(ValueError, match="patch_size 14 disagrees"):
        ImageSettings.from_configs(vision, {"patch_size": 14})
    with pytest.raises(ValueError, match="resample"):
        ImageSettings.from_configs(vision, {"resample": 99})


# --- patch rows


def test_patchify_matches_a_naive_loop():
    settings = ImageSettings(patch_size=4, temporal_patch_size=3, merge_size=2)
    rng = np.random.default_rng(0)
    image = rng.standard_normal((16, 24, 3)).astype(np.float32)
    rows = patchify(image, settings)
    p, m, t = 4, 2, 3
    expected = []
    for r, c in block_rc(16 // p, 24 // p, m):
        row = np.zeros((3, t, p, p), np.float32)
        for ch, f, py, px in np.ndindex(3, t, p, p):
            row[ch, f, py, px] = image[r * p + py, c * p + px, ch]
        expected.append(row.reshape(-1))
    assert rows.dtype == np.float32 and rows.shape == (24, 3 * t * p * p)
    assert np.array_equal(rows, np.stack(expected))


def test_normalize_is_the_reference_arithmetic():
    values = np.arange(256, dtype=np.uint8).reshape(1, -1, 1).repeat(3, axis=2)
    x = normalize(values, SETTINGS)
    half = np.float32(0.5)
    expected = ((values.astype(np.float64) * (1 / 255)).astype(np.float32) - half) / half
    assert x.dtype == np.float32 and np.array_equal(x, expected)
    assert x[0, 0, 0] == -1.0 and x[0, 255, 0] == 1.0


def test_prepare_image_fields_and_digest():
    rng = np.random.default_rng(1)
    data = encode(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
    prepared = prepare_image(data, SETTINGS, 0)
    assert prepared.size == (48, 64) and prepared.grid == (6, 8) and prepared.tokens == 12
    assert prepared.pixels.shape == (48, 384) and prepared.pixels.dtype == np.float32
    # T copies are duplicated: the two frames of every row are equal
    frames = prepared.pixels.reshape(48, 3, 2, 64)
    assert np.array_equal(frames[:, :, 0], frames[:, :, 1])
    again = prepare_image(data, SETTINGS, 5)
    assert again.digest == prepared.digest and len(prepared.digest) == 16
    other = encode(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
    assert prepare_image(other, SETTINGS, 0).digest != prepared.digest
    smaller = ImageSettings.from_configs(
        TINY, {"size": {"shortest_edge": 256, "longest_edge": 1024}}
    )
    assert prepare_image(data, smaller, 0).digest != prepared.digest


# --- decoding


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"certainly not an image", r"^images\[3\]: not a PNG, JPEG, WebP or GIF image \("),
        (b"", r"^images\[3\]: empty image data"),
        ("BMP", r"^images\[3\]: BMP images are not supported"),
        ("TIFF", r"^images\[3\]: TIFF images are not supported"),
        ("truncated", r"^images\[3\]: cannot decode the PNG image"),
    ],
)
def test_decode_errors_name_the_image(data, message):
    pixels = np.random.default_rng(2).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    if data in ("BMP", "TIFF"):
        data = encode(pixels, data)
    elif data == "truncated":
        data = encode(pixels)[:-60]
    with pytest.raises(ImageError, match=message):
        decode_image(data, 3)


def test_decompression_bomb_is_refused(monkeypatch):
    data = encode(np.zeros((20, 20, 3), np.uint8))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow refuses over twice its limit
    with pytest.raises(ImageError, match=r"^images\[0\]: image too large"):
        decode_image(data, 0)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # Pillow only warns: we refuse
    with (
        pytest.warns(Image.DecompressionBombWarning),
        pytest.raises(ImageError, match=r"^images\[0\]: a 20x20 image is over .* 300 pixels"),
    ):
        decode_image(data, 0)


def test_base64():
    data = encode(np.zeros((8, 8, 3), np.uint8))
    text = base64.b64encode(data).decode()
    assert decode_base64(text, 0) == data
    assert decode_base64(text[:20] + "\n " + text[20:], 0) == data
    assert decode_base64("data:image/png;base64," + text, 0) == data
    for bad, message in [
        ("not base64!", "invalid base64"),
        (text[:-2], "invalid base64"),
        ("", "empty image data"),
        ("data:image/png," + text, "';base64,'"),
    ]:
        with pytest.raises(ImageError, match=rf"^images\[2\]: .*{message}"):
            decode_base64(bad, 2)


def test_rgba_keeps_the_stored_colour():
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., 0] = 255  # red, fully transparent: compositing on white would give white
    image = decode_image(encode(rgba), 0)
    assert image.mode == "RGB"
    assert np.array_equal(np.asarray(image)[0, 0], [255, 0, 0])


def test_exif_orientation_is_applied():
    stored = np.zeros((48, 16, 3), np.uint8)  # 16 wide, 48 high; the top band white
    stored[:8] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned 90 degrees clockwise
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, "PNG", exif=exif.tobytes())
    upright = np.asarray(decode_image(buf.getvalue(), 0))
    assert upright.shape == (16, 48, 3)
    assert (upright[:, -8:] == 255).all() and (upright[:, :-8] == 0).all()


def test_gif_uses_the_first_frame():
    frames = [Image.new("RGB", (32, 24), colour) for colour in ((200, 0, 0), (0, 0, 200))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    first = np.asarray(decode_image(buf.getvalue(), 0))
    assert first.shape == (24, 32, 3) and (first == [200, 0, 0]).all()


def test_sixteen_bit_grey_saturates():
    grey = np.array([[0, 100, 255, 256, 300, 65535]], dtype=np.uint16)
    image = np.asarray(decode_image(encode(grey), 0))
    assert image[0, :, 0].tolist() == [0, 100, 255, 255, 255, 255]
    assert (image[..., 0] == image[..., 2]).all()


# --- the tower: tables, config, weights, numerics against numpy


def test_interpolation_at_the_table_side_is_the_identity():
    taps, weights, _, _ = grid_tables(6, 6, 2, 6, 16, 10000.0)
    assert taps[:, 0].tolist() == [r * 6 + c for r, c in block_rc(6, 6, 2)]
    assert np.array_equal(weights, np.tile(np.float32([1, 0, 0, 0]), (36, 1)))


def test_interpolation_corners_and_one_wide_axis():
    taps, weights, _, _ = grid_tables(1, 4, 1, 6, 16, 10000.0)  # merge 1: raster order
    assert (taps[weights > 0] // 6 == 0).all()  # a 1-high grid reads table row 0 only
    assert taps[0, 0] == 0 and taps[-1, 0] == 5 and weights[-1, 0] == 1.0  # end columns
    assert np.allclose(weights.sum(axis=1), 1.0)
    taps, weights, _, _ = grid_tables(4, 10, 2, 6, 16, 10000.0)
    for i, (r, c) in enumerate(block_rc(4, 10, 2)):
        expected = _bilinear(r, c, 4, 10, 6)
        got = {}
        for tap, weight in zip(taps[i], weights[i], strict=True):
            got[int(tap)] = got.get(int(tap), 0.0) + float(weight)
        got = {k: v for k, v in got.items() if abs(v) > 1e-6}
        assert got.keys() == expected.keys()
        assert all(abs(got[k] - expected[k]) < 1e-6 for k in got)


def block_rc(gh: int, gw: int, m: int) -> list[tuple[int, int]]:
    """(row, column) of each patch in merge-block-major order, by nested loops."""
    out = []
    for bh, bw in np.ndindex(gh // m, gw // m):
        out += [(bh * m + i, bw * m + j) for i, j in np.ndindex(m, m)]
    return out


def _bilinear(r, c, gh, gw, side):
    sh, sw = r * (side - 1) / max(gh - 1, 1), c * (side - 1) / max(gw - 1, 1)
    h0, w0 = math.floor(sh), math.floor(sw)
    h1, w1 = min(h0 + 1, side - 1), min(w0 + 1, side - 1)
    fh, fw = sh - h0, sw - w0
    out: dict[int, float] = {}
    for tap, weight in [
        (h0 * side + w0, (1 - fh) * (1 - fw)),
        (h0 * side + w1, (1 - fh) * fw),
        (h1 * side + w0, fh * (1 - fw)),
        (h1 * side + w1, fh * fw),
    ]:
        out[tap] = out.get(tap, 0.0) + weight
    return {k: v for k, v in out.items() if abs(v) > 1e-6}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"deepstack_visual_indexes": [1]}, "deepstack_visual_indexes"),
        ({"num_position_embeddings": 40}, "num_position_embeddings 40 is not a square"),
        ({"hidden_act": "silu"}, "hidden_act 'silu'"),
        ({"rope_parameters": {"rope_type": "default"}}, "rope_type 'default'"),
        ({"num_heads": 3}, "not a multiple of num_heads"),
        ({"model_type": "qwen2_vl"}, "model_type 'qwen2_vl'"),
        ({"patch_size": [8, 4]}, "patch_size"),
    ],
)
def test_tower_refuses_unsupported_configs(change, message):
    with pytest.raises(ValueError, match=message):
        VisionTower({**TINY, **change})


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    tower = VisionTower(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tower.expected_shapes().items():
        if "norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            scale = 0.5 / math.sqrt(fan) if len(shape) > 1 else 0.2
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def loaded_tower(config: dict, weights: dict[str, np.ndarray]) -> VisionTower:
    tower = VisionTower(config)
    tower.load({k: mx.array(v) for k, v in weights.items()})
    return tower


def numpy_tower(
    w: dict[str, np.ndarray], cfg: dict, pix: np.ndarray, gh: int, gw: int
) -> np.ndarray:
    """An independent float64 tower (loops, no shared tables)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, heads, m = cfg["hidden_size"], cfg["num_heads"], cfg["spatial_merge_size"]
    hd, side = d // heads, int(math.sqrt(cfg["num_position_embeddings"]))
    x = pix.astype(np.float64) @ w["patch_embed.proj.weight"].reshape(d, -1).T
    x += w["patch_embed.proj.bias"]
    rc = block_rc(gh, gw, m)
    for i, (r, c) in enumerate(rc):
        for tap, weight in _bilinear(r, c, gh, gw, side).items():
            x[i] += weight * w["pos_embed.weight"][tap]
    inv = 1.0 / 10000.0 ** (np.arange(0, hd // 2, 2) / (hd // 2))
    ang = np.array([np.concatenate([r * inv, c * inv]) for r, c in rc])
    ang = np.concatenate([ang, ang], 1)[:, None]
    cos, sin = np.cos(ang), np.sin(ang)

    def norm(y, p):
        mu, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        return (y - mu) / np.sqrt(var + 1e-6) * w[p + ".weight"] + w[p + ".bias"]

    def lin(y, p):
        return y @ w[p + ".weight"].T + w[p + ".bias"]

    def rope(t):
        return t * cos + np.concatenate([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin

    n = x.shape[0]
    for b in range(cfg["depth"]):
        p = f"blocks.{b}."
        qkv = lin(norm(x, p + "norm1"), p + "attn.qkv").reshape(n, 3, heads, hd)
        q, k, v = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
        s = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + lin(np.einsum("hij,jhd->ihd", s, v).reshape(n, d), p + "attn.proj")
        y = lin(norm(x, p + "norm2"), p + "mlp.linear_fc1")
        y = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
        x = x + lin(y, p + "mlp.linear_fc2")
    y = lin(norm(x, "merger.norm").reshape(n // (m * m), -1), "merger.linear_fc1")
    y = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    return lin(y, "merger.linear_fc2")


@pytest.mark.parametrize("grid", [(6, 8), (2, 2), (10, 4), (6, 6)])
@pytest.mark.parametrize("fast", [True, False], ids=["mx.fast", "blocked"])
def test_tower_matches_a_numpy_tower(grid, fast):
    weights = random_weights(TINY, seed=sum(grid))
    tower = loaded_tower(TINY, weights)
    tower.fast = fast
    pix = np.random.default_rng(7).uniform(-1, 1, (grid[0] * grid[1], 384)).astype(np.float32)
    features = tower(pix, grid)
    assert features.shape == (grid[0] * grid[1] // 4, 48) and features.dtype == mx.float32
    expected = numpy_tower(weights, TINY, pix, *grid)
    assert np.abs(np.array(features) - expected).max() < ATOL
    again = tower(mx.array(pix), grid)  # tables from the cache, same bits
    assert np.array_equal(np.array(again), np.array(features))


@pytest.mark.parametrize("layout", ["packed", "panels"])
def test_tower_laid_out_for_the_cpu(layout):
    if layout == "panels":
        try:
            device.resolve_layout("panels", cpu=device.on_cpu())
        except ValueError as exc:
            pytest.skip(str(exc))
    weights = random_weights(TINY, seed=3)
    pix = np.random.default_rng(8).uniform(-1, 1, (48, 384)).astype(np.float32)
    plain = np.array(loaded_tower(TINY, weights)(pix, (6, 8)))
    tower = loaded_tower(TINY, weights)
    assert tower.lay_out(layout) == 3 + 4 * TINY["depth"]
    assert all("weight" not in m for _, m in tower.named_modules() if type(m).__name__ == "Linear")
    assert np.abs(np.array(tower(pix, (6, 8))) - plain).max() < ATOL


def test_tower_refuses_bad_inputs_and_tensors():
    tower = loaded_tower(TINY, random_weights(TINY))
    with pytest.raises(ValueError, match="not whole 2x2 blocks"):
        tower(np.zeros((15, 384), np.float32), (3, 5))
    with pytest.raises(ValueError, match="do not fit a 2x4 grid"):
        tower(np.zeros((8, 383), np.float32), (2, 4))
    weights = {k: mx.array(v) for k, v in random_weights(TINY).items()}
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.bias is missing"):
        tower.load({k: v for k, v in weights.items() if k != "blocks.1.attn.qkv.bias"})
    with pytest.raises(ValueError, match=r"blocks\.2\.norm1\.weight is not part"):
        tower.load({**weights, "blocks.2.norm1.weight": mx.zeros((32,))})
    with pytest.raises(ValueError, match=r"merger\.linear_fc2\.weight has shape \(64, 128\)"):
        tower.load({**weights, "merger.linear_fc2.weight": mx.zeros((64, 128))})


def test_vision_weights_roots_and_layouts():
    canonical = {k: mx.array(v) for k, v in random_weights(TINY).items()}
    for root in ("model.visual.", "visual.", "vision_tower.", "model.vision_tower."):
        checkpoint = {root + k: v for k, v in canonical.items()}
        checkpoint["model.language_model.norm.weight"] = mx.ones((4,))
        assert set(vision_weights(checkpoint)) == set(canonical)
        assert list(checkpoint) == ["model.language_model.norm.weight"]  # the rest popped
    mlx_vlm = to_mlx_vlm(canonical)
    found = vision_weights(mlx_vlm)
    assert not mlx_vlm and tuple(found["patch_embed.proj.weight"].shape) == (32, 3, 2, 8, 8)
    patch = "patch_embed.proj.weight"
    assert np.array_equal(np.array(found[patch]), np.array(canonical[patch]))
    assert vision_weights({"model.norm.weight": mx.ones((4,))}) == {}


def to_mlx_vlm(canonical: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-vlm's names (``vision_tower.``) and its Conv3d layout ``[D, T, P, P, C]``."""
    out = {"vision_tower." + k: v for k, v in canonical.items()}
    patch = canonical["patch_embed.proj.weight"]
    out["vision_tower.patch_embed.proj.weight"] = patch.transpose(0, 2, 3, 4, 1)
    return out


# --- against transformers (the fixture)


@functools.cache
def fixture() -> dict:
    """The fixture's vision config, settings, arrays and per-image bytes and metadata."""
    if not (FIXTURE / "reference.npz").exists():
        pytest.skip(f"the vision reference fixture is not generated yet ({FIXTURE})")
    config = json.loads((FIXTURE / "config.json").read_text(encoding="utf-8"))["vision_config"]
    pre = json.loads((FIXTURE / "preprocessor_config.json").read_text(encoding="utf-8"))
    meta = json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))["images"]
    with np.load(FIXTURE / "reference.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    images = {name: (FIXTURE / item["file"]).read_bytes() for name, item in sorted(meta.items())}
    settings = ImageSettings.from_configs(config, pre)
    return {"config": config, "settings": settings, "ref": arrays, "images": images, "meta": meta}


def fixture_tower(layout: str = "hf", mlx_vlm: bool = False) -> VisionTower:
    canonical = vision_weights(dict(mx.load(str(FIXTURE / "model.safetensors"))))
    if mlx_vlm:
        canonical = vision_weights(to_mlx_vlm(canonical))
    tower = VisionTower(fixture()["config"])
    tower.load(canonical)
    tower.lay_out(layout)
    return tower


def test_fixture_images_are_all_referenced():
    found = fixture()
    assert found["images"] and set(found["images"]) == {
        p.stem for p in (FIXTURE / "images").iterdir()
    }
    assert all(f"pixels_{name}" in found["ref"] for name in found["images"])


def test_pixels_equal_the_processor():
    found = fixture()
    ref, meta = found["ref"], found["meta"]
    for index, (name, data) in enumerate(found["images"].items()):
        prepared = prepare_image(data, found["settings"], index)
        assert list(prepared.size) == meta[name]["resized_hw"], name
        assert prepared.grid == tuple(int(g) for g in ref[f"grid_{name}"][-2:]), name
        assert prepared.tokens == meta[name]["tokens"], name
        assert np.array_equal(prepared.pixels, ref[f"pixels_{name}"]), name


@pytest.mark.parametrize(
    ("layout", "mlx_vlm"),
    [("hf", False), ("cpu", False), ("hf", True)],
    ids=["as-loaded", "tuned", "mlx-vlm-layout"],
)
def test_features_match_transformers(layout, mlx_vlm):
    found = fixture()
    if layout == "cpu":
        layout = device.resolve_layout("auto", cpu=True)
    tower = fixture_tower(layout, mlx_vlm)
    for name, data in found["images"].items():
        prepared = prepare_image(data, found["settings"], 0)
        # the reference's own rows, so a preprocessing fault cannot hide here
        features = np.array(tower(found["ref"][f"pixels_{name}"], prepared.grid))
        expected = found["ref"][f"features_{name}"]
        assert features.shape == expected.shape, name
        assert np.abs(features - expected).max() < ATOL, (name, np.abs(features - expected).max())
