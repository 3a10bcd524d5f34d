"""The Qwen3.5 vision tower (transformers' ``Qwen3_5VisionModel``) on MLX, one image per call.

Patch rows in (``runner.vision.preprocess``: ``[N, C*T*P*P]``, merge-block-major), the merged
features out (``[N / merge**2, out_hidden_size]``, in merged raster order: the rows that
replace the image's pad tokens). Per image:

1. **Patch embedding**: the Conv3d's stride equals its kernel, so it is one linear product of
   each row with the weight flattened ``[D, C*T*P*P]``; the rows are cast to the weights'
   dtype first, as the reference does.
2. **Learned positions**: the square ``[S*S, D]`` table resampled to the ``gh x gw`` grid by
   bilinear interpolation with ``align_corners=True``, in float32: patch (r, c) reads the
   table at ``r (S-1) / max(gh-1, 1)``, ``c (S-1) / max(gw-1, 1)``, four taps (the ``+1``
   tap clamped to ``S-1``, where its weight is 0), summed in float32, cast to the hidden
   dtype and added.
3. **2-D rotary**, in float32 over the whole head: ``hd / 4`` frequencies
   ``theta**(-2j / (hd/2))``; dims ``[0, hd/4)`` turn with the patch's row, ``[hd/4, hd/2)``
   with its column, duplicated for rotate-half (dim j pairs with j + hd/2).
4. **Blocks**: ``x += proj(attn(LN1 x))``, ``x += fc2(act(fc1(LN2 x)))``: LayerNorms with
   weight and bias, eps 1e-6 (no zero-centred ``1 + w`` gain); qkv with a bias; attention
   over every patch of the image (bidirectional), softmax in float32; the block MLP's
   activation is the config's ``hidden_act`` (``gelu_pytorch_tanh``: the tanh GELU).
5. **Merger**: LayerNorm per patch, every ``merge**2`` consecutive rows (one block)
   concatenated, ``fc2(gelu(fc1 .))`` with the *exact* (erf) GELU whatever ``hidden_act``.

Per-grid tables (interpolation taps and weights, rotary cos/sin) are computed in numpy and
kept for the most recent grids. Attention: ``mx.fast.scaled_dot_product_attention`` off the
CPU; on the CPU, for float32, ``runner.models.attention.blocked_attention`` (the native fused
kernel where built), which never holds the ``[heads, N, N]`` scores of a large image at once
(MLX's CPU fallback for ``mx.fast`` does).

Every product is a ``runner.models.layers.Linear``, so :meth:`VisionTower.lay_out` can give
the CPU the text model's packed or panel layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.models.attention import blocked_attention
from runner.models.layers import Linear, linears_to_panels, pack_for_cpu

ROOTS = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
PATCH_WEIGHT = "patch_embed.proj.weight"
EPS = 1e-6
_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
_MODEL_TYPES = ("qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_5", "qwen3_5_moe")
TABLE_CACHE = 32  # grids whose tables are kept


@dataclass(frozen=True)
class TowerConfig:
    """The ``vision_config`` keys the tower reads (absent keys: transformers' defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    out_hidden_size: int = 3584
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def row_width(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, config: dict) -> TowerConfig:
        """Read and check ``vision_config``; ``ValueError`` naming what is unsupported."""
        model_type = config.get("model_type")
        if model_type is not None and model_type not in _MODEL_TYPES:
            raise ValueError(f"vision_config model_type {model_type!r} is not a Qwen3.5 tower")
        if config.get("deepstack_visual_indexes"):
            raise ValueError(
                "vision_config deepstack_visual_indexes "
                f"{config['deepstack_visual_indexes']} is not supported (Qwen3.5 has none)"
            )
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"vision_config rope_type {rope['rope_type']!r} is not supported (axial only)"
            )
        fields = {}
        for key in (
            "depth",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "in_channels",
            "num_position_embeddings",
            "out_hidden_size",
        ):
            if key in config:
                fields[key] = int(config[key])
        patch = config.get("patch_size", cls.patch_size)
        if isinstance(patch, list | tuple):
            if len(set(patch)) != 1:
                raise ValueError(f"vision_config patch_size {patch} is not square")
            patch = patch[0]
        fields["patch_size"] = int(patch)
        if "hidden_act" in config:
            fields["hidden_act"] = str(config["hidden_act"])
        fields["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        cfg = cls(**fields)
        cfg._check(config)
        return cfg

    def _check(self, config: dict) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"vision_config hidden_act {self.hidden_act!r} is not supported "
                f"({', '.join(_ACTIVATIONS)})"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config hidden_size {self.hidden_size} is not a multiple of "
                f"num_heads {self.num_heads}"
            )
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) != self.head_dim:
            raise ValueError(
                f"vision_config head_dim {head_dim} is not hidden_size / num_heads "
                f"({self.head_dim})"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"vision head_dim {self.head_dim} is not a multiple of 4 (2-D rotary halves)"
            )
        if self.side * self.side != self.num_position_embeddings:
            raise ValueError(
                f"vision_config num_position_embeddings {self.num_position_embeddings} is not "
                "a square table"
            )
        for key in ("depth", "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"vision_config {key} must be positive")


def vision_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Pop the vision tower's tensors out of a checkpoint's ``weights``, under any of the
    roots ``model.visual.``, ``visual.``, ``model.vision_tower.``, ``vision_tower.`` (HF,
    Qwen2-VL-era and mlx-vlm saves), and return them under canonical names
    (``patch_embed.proj.weight``, ``blocks.0.norm1.weight``, ...); empty when there are none.

    The patch embedding is returned in the Hugging Face Conv3d layout ``[D, C, T, P, P]``:
    mlx-vlm's ``[D, T, P, P, C]`` (told apart by shape: the patch side is the pair of equal
    axes) is moved back. Other tensors are returned as stored."""
    out: dict[str, mx.array] = {}
    for name in list(weights):
        root = next((r for r in ROOTS if name.startswith(r)), None)
        if root is None:
            continue
        key = name[len(root) :]
        if key in out:
            raise ValueError(f"vision tensor {key!r} is stored under two roots")
        value = weights.pop(name)
        if key == PATCH_WEIGHT and value.ndim == 5 and _mlx_conv_layout(value.shape):
            value = value.transpose(0, 4, 1, 2, 3)
        out[key] = value
    return out


def _mlx_conv_layout(shape: tuple[int, ...]) -> bool:
    """``[D, T, P, P, C]`` rather than ``[D, C, T, P, P]``."""
    return shape[2] == shape[3] and shape[3] != shape[4]


# --- per-grid tables (numpy; a few recent grids kept)


def block_order(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch in the rows' merge-block-major order."""
    rows = np.arange(gh).reshape(gh // merge, 1, merge, 1)
    cols = np.arange(gw).reshape(1, gw // merge, 1, merge)
    shape = (gh // merge, gw // merge, merge, merge)
    return np.broadcast_to(rows, shape).reshape(-1), np.broadcast_to(cols, shape).reshape(-1)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps ``[n, 2]`` and weights into a ``side`` table for positions on an axis of
    ``size`` (align_corners=True), in float32 with the reference's operation order."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.minimum(floor.astype(np.int64)[:, None] + np.arange(2), side - 1)
    distance = np.abs((src - floor)[:, None] - offsets)
    weights = np.maximum(np.float32(1) - distance, np.float32(0))
    return taps, weights.astype(np.float32)


@functools.lru_cache(maxsize=TABLE_CACHE)
def grid_tables(
    gh: int, gw: int, merge: int, side: int, head_dim: int, theta: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For a ``gh x gw`` grid: interpolation taps (int32 ``[N, 4]``, into the flattened
    table) and weights (float32 ``[N, 4]``), taps in the order (h0 w0, h0 w1, h1 w0, h1 w1);
    rotary cos and sin (float32 ``[N, head_dim]``). Arrays are shared: do not write them."""
    rows, cols = block_order(gh, gw, merge)
    h_taps, h_w = _axis_taps(rows, gh, side)
    w_taps, w_w = _axis_taps(cols, gw, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).astype(np.int32)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    half = head_dim // 2
    inv = np.float32(1.0) / (
        np.float32(theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
    )
    angles = np.concatenate(
        [rows.astype(np.float32)[:, None] * inv, cols.astype(np.float32)[:, None] * inv], axis=1
    )
    angles = np.concatenate([angles, angles], axis=1)
    cos, sin = np.cos(angles), np.sin(angles)
    for table in (taps, weights, cos, sin):
        table.setflags(write=False)
    return taps, weights, cos, sin


# --- the modules


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.proj = Linear(cfg.row_width, cfg.hidden_size, bias=True)


class VisionAttention(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, fast: bool) -> mx.array:
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        dtype = q.dtype
        q, k = q.astype(mx.float32), k.astype(mx.float32)
        q = (q * cos + _rotate_half(q) * sin).astype(dtype)
        k = (k * cos + _rotate_half(k) * sin).astype(dtype)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))
        if fast or dtype != mx.float32:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=None)
        else:
            out = blocked_attention(q, k, v, scale=self.scale, mask=None)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, fast: bool) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, fast)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.width = width
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=EPS)
        self.linear_fc1 = Linear(width, width, bias=True)
        self.linear_fc2 = Linear(width, cfg.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """The tower of a checkpoint's ``vision_config`` (module docstring); load its tensors with
    :meth:`load` (canonical names, :func:`vision_weights`), then call it on one image's patch
    rows. ``fast``: attention through ``mx.fast`` (True), through the blocked CPU kernel
    (False), or by device (None: ``mx.fast`` off the CPU)."""

    def __init__(self, vision_config: dict) -> None:
        super().__init__()
        cfg = TowerConfig.from_dict(vision_config)
        self.config = cfg
        self.fast: bool | None = None
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [VisionBlock(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg)

    @property
    def dtype(self) -> mx.Dtype:
        """The weights' dtype (the features come out in it)."""
        return self.pos_embed.weight.dtype

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical tensor name -> shape, as the checkpoint stores them."""
        cfg = self.config
        d, width = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        shapes: dict[str, tuple[int, ...]] = {
            PATCH_WEIGHT: (
                d,
                cfg.in_channels,
                cfg.temporal_patch_size,
                cfg.patch_size,
                cfg.patch_size,
            ),
            "patch_embed.proj.bias": (d,),
            "pos_embed.weight": (cfg.num_position_embeddings, d),
            "merger.norm.weight": (d,),
            "merger.norm.bias": (d,),
            "merger.linear_fc1.weight": (width, width),
            "merger.linear_fc1.bias": (width,),
            "merger.linear_fc2.weight": (cfg.out_hidden_size, width),
            "merger.linear_fc2.bias": (cfg.out_hidden_size,),
        }
        block = {
            "norm1.weight": (d,),
            "norm1.bias": (d,),
            "norm2.weight": (d,),
            "norm2.bias": (d,),
            "attn.qkv.weight": (3 * d, d),
            "attn.qkv.bias": (3 * d,),
            "attn.proj.weight": (d, d),
            "attn.proj.bias": (d,),
            "mlp.linear_fc1.weight": (cfg.intermediate_size, d),
            "mlp.linear_fc1.bias": (cfg.intermediate_size,),
            "mlp.linear_fc2.weight": (d, cfg.intermediate_size),
            "mlp.linear_fc2.bias": (d,),
        }
        for i in range(cfg.depth):
            shapes.update({f"blocks.{i}.{k}": v for k, v in block.items()})
        return shapes

    def load(self, weights: dict[str, mx.array], dtype: mx.Dtype | None = None) -> None:
        """Load the canonical tensors (:func:`vision_weights`), cast to ``dtype`` when given;
        ``ValueError`` naming a missing, unexpected or mis-shaped tensor. The patch weight
        may also be in mlx-vlm's ``[D, T, P, P, C]`` layout."""
        expected = self.expected_shapes()
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError(f"vision tensor {missing[0]} is missing ({len(missing)} missing)")
        extra = sorted(set(weights) - set(expected))
        if extra:
            raise ValueError(f"vision tensor {extra[0]} is not part of the tower")
        loaded = []
        for name, shape in expected.items():
            value = weights[name]
            if name == PATCH_WEIGHT and tuple(value.shape) != shape:
                d, c, t, p, _ = shape
                if tuple(value.shape) == (d, t, p, p, c):
                    value = value.transpose(0, 4, 1, 2, 3)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"vision tensor {name} has shape {tuple(value.shape)}, expected {shape}"
                )
            if name == PATCH_WEIGHT:
                value = value.reshape(shape[0], -1)
            if dtype is not None and mx.issubdtype(value.dtype, mx.floating):
                value = value.astype(dtype)
            loaded.append((name, value))
        self.load_weights(loaded, strict=True)
        mx.eval(self.parameters())

    def lay_out(self, layout: str) -> int:
        """Lay the tower's products out as ``runner.device`` lays the text model's: "hf" (as
        loaded), "packed" (weights stored ``[in, out]``) or "panels" (``runner.native``'s
        column panels, where a product is whole panels wide; float32 weights only, others
        stay packed). Call once, after :meth:`load`, with the layout ``runner.device.tune``
        reported; returns how many products changed layout."""
        if layout == "hf":
            return 0
        if layout not in ("packed", "panels"):
            raise ValueError(f"vision tower layout must be hf, packed or panels, not {layout!r}")
        count = pack_for_cpu(self)
        if layout == "panels" and self.dtype == mx.float32:
            linears_to_panels(self)
        arrays = [v for _, m in self.named_modules() for k, v in m.items() if k == "_wt"]
        mx.eval(arrays)
        return count

    def tokens(self, grid: tuple[int, int]) -> int:
        """Feature rows of an image of ``grid`` patches."""
        return grid[0] * grid[1] // self.config.spatial_merge_size**2

    def __call__(self, pixels: mx.array | np.ndarray, grid: tuple[int, int]) -> mx.array:
        """The merged features ``[N / merge**2, out_hidden_size]`` (the weights' dtype) of one
        image's patch rows ``[N, C*T*P*P]`` (float32, merge-block-major) on a ``grid``
        of (gh, gw) patches."""
        cfg = self.config
        gh, gw = (int(g) for g in grid)
        merge = cfg.spatial_merge_size
        if gh < 1 or gw < 1 or gh % merge or gw % merge:
            raise ValueError(f"grid {gh}x{gw} is not whole {merge}x{merge} blocks")
        if tuple(pixels.shape) != (gh * gw, cfg.row_width):
            raise ValueError(
                f"pixels of shape {tuple(pixels.shape)} do not fit a {gh}x{gw} grid of "
                f"{cfg.row_width}-value patches"
            )
        taps, weights, cos, sin = grid_tables(gh, gw, merge, cfg.side, cfg.head_dim, cfg.rope_theta)
        dtype = self.dtype
        x = self.patch_embed.proj(mx.array(pixels).astype(dtype))
        table = self.pos_embed.weight.astype(mx.float32)
        taps_mx, weights_mx = mx.array(taps), mx.array(weights)
        pos = table[taps_mx[:, 0]] * weights_mx[:, 0:1]
        for j in range(1, 4):
            pos = pos + table[taps_mx[:, j]] * weights_mx[:, j : j + 1]
        x = x + pos.astype(x.dtype)
        cos_mx, sin_mx = mx.array(cos)[:, None, :], mx.array(sin)[:, None, :]
        fast = self.fast if self.fast is not None else mx.default_device() != mx.cpu
        for block in self.blocks:
            x = block(x, cos_mx, sin_mx, fast)
        return self.merger(x)
