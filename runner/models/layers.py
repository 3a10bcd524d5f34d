"""Linear layers whose weight may be stored for the CPU's products instead of as loaded.

Two CPU layouts, applied once after loading by ``runner.device.tune``:

- packed, ``_wt`` ``[in, out]``: ``x @ Wt`` with ``Wt`` contiguous; a BLAS otherwise packs the
  transposed operand of ``x @ W.T`` on every call, and decode is nothing but such products.
- panels, ``_wt`` ``[out / 16, in, 16]`` (``runner.native``): column panels that the native
  few-row product reads once for all rows, so 2-16 verify rows cost about one row, and every
  row's result is the same whatever batch it is computed in.

A quantized checkpoint on the CPU arrives in a third form, set by the loader: quantized
panels, ``_wt`` uint8 ``[out / 16, in / group, ...]`` (``runner.native.quantized``), 4- or 8-bit
values multiplied without a float copy; a tied embedding becomes a :class:`PanelEmbedding`
whose lookups read the output projection's panels.

The Hugging Face layout stays readable through :func:`dense_weight` in every case.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner import native
from runner.quantized import QuantizedTensor

# Feeds of 2-16 rows (a speculative verify) use the [out, in] copy when one exists: some BLAS
# libraries pack the transposed operand on every multi-row call (blas.row_layout_pays).
MAX_ROWS_LEFT = 16

# Quantized panels multiply bit-for-bit as their dequantized weight (True) or with int8
# activations (False, faster); one choice per process, made at load (runner.device.tune).
_exact_products = False


def set_exact_products(exact: bool) -> None:
    """How every quantized panel product computes from now on (graphs built after the call)."""
    global _exact_products
    _exact_products = bool(exact)


def exact_products() -> bool:
    return _exact_products


def product(x: mx.array, wt: mx.array) -> mx.array:
    """``x @ W`` for ``wt`` packed (2-D, ``[in, out]``), in panels (3-D) or in quantized
    panels (4-D uint8)."""
    if wt.ndim == 4:
        return native.qpanel_matmul(x, wt, wt.shape[0] * native.PANEL, exact=_exact_products)
    if wt.ndim == 3:
        return native.panel_matmul(x, wt, wt.shape[0] * native.PANEL)
    return x @ wt


class PanelEmbedding(nn.Module):
    """An embedding table kept as the quantized panels of its transpose, the product a tied
    output projection runs (``[D, V]``, one column per token): a lookup reads each token's
    column (``runner.native.qpanel_columns``), so the table is stored once, quantized."""

    def __init__(self, panels: mx.array, num_embeddings: int) -> None:
        super().__init__()
        self._table = panels
        self.num_embeddings = num_embeddings

    def __call__(self, ids: mx.array) -> mx.array:
        return native.qpanel_columns(self._table, ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self._table)[..., : self.num_embeddings]

    def dense(self) -> mx.array:
        """The float32 ``[V, D]`` table (a draft vocabulary's rows, training)."""
        return native.quantized.dense(self._table, self.num_embeddings).T


def to_panels(wt: mx.array) -> mx.array | None:
    """The panel layout of a packed ``[in, out]`` weight, or None when ``out`` is not a whole
    number of panels (such a product stays packed)."""
    if wt.ndim != 2 or wt.shape[1] % native.PANEL:
        return None
    return native.to_panels(wt)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may live in ``_wt`` (not a parameter), packed or in panels."""

    def __call__(self, x: mx.array) -> mx.array:
        wt = self.get("_wt")
        if wt is None:
            return super().__call__(x)
        if wt.ndim >= 3:
            y = product(x, wt)
            return y + self["bias"] if "bias" in self else y
        w = self.get("_w_rows")
        rows = x.size // x.shape[-1]
        if w is not None and 1 < rows <= MAX_ROWS_LEFT:
            # A few rows (a speculative verify): the weight as the left operand is faster.
            y = (w @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], -1)
        else:
            y = x @ wt
        return y + self["bias"] if "bias" in self else y

    def pack(self) -> None:
        if "weight" in self:
            self._wt = mx.contiguous(self.weight.T)
            del self["weight"]


def fuse_linears(owner: nn.Module, key: str, parts: list[nn.Module]) -> bool:
    """Store one ``[in, sum of outs]`` weight for packed projections that read the same input
    as ``owner[key]`` (a bias, when they all have one, as ``owner[key + "_bias"]``), or one
    quantized-panel array for parts in quantized panels of one width and group (their panels
    concatenated); False when they cannot share one (MLX-quantized, unpacked, mixed layouts or
    biases, already fused). The parts keep their ``_wt`` as views of the fused weight, so
    ``dense_weight`` still reads them and no weight is stored twice. :func:`fused_product`
    applies it."""
    if not all(
        isinstance(p, Linear) and "_wt" in p and not getattr(p, "fused", False) for p in parts
    ):
        return False
    biased = ["bias" in p for p in parts]
    if any(biased) and not all(biased):
        return False
    dims = {p._wt.ndim for p in parts}
    if dims == {4}:  # quantized panels fuse along their panels when width and group agree
        if len({tuple(p._wt.shape[1:]) for p in parts}) != 1:
            return False
        axis = 0
    elif dims == {2}:
        axis = 1
    else:
        return False
    fused = mx.contiguous(mx.concatenate([p._wt for p in parts], axis=axis))
    owner[key] = fused
    if all(biased):
        owner[key + "_bias"] = mx.concatenate([p["bias"] for p in parts])
    start = 0
    for p in parts:
        width = p._wt.shape[axis]
        p._wt = fused[start : start + width] if axis == 0 else fused[:, start : start + width]
        p.fused = True  # add_row_layout skips it: the fused product serves every row count
        start += width
    return True


def fused_product(owner: nn.Module, key: str, x: mx.array) -> mx.array:
    """``x`` through the projections :func:`fuse_linears` stored as ``owner[key]``, packed or in
    panels; for verify rows too (the ``[out, in]`` layout does not pay for the fused shapes)."""
    y = product(x, owner[key])
    bias = owner.get(key + "_bias")
    return y if bias is None else y + bias


def dense_weight(layer: nn.Module) -> mx.array:
    """The ``[out, in]`` weight of a (possibly packed or quantized) linear layer, or the
    ``[V, D]`` table of an embedding (float, MLX-quantized or in quantized panels)."""
    if isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return mx.dequantize(
            layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits
        )
    if isinstance(layer, PanelEmbedding):
        return layer.dense()
    wt = layer.get("_wt")
    if wt is None:
        return layer.weight
    if wt.ndim == 4:
        return native.quantized.dense(wt, wt.shape[0] * native.PANEL).T
    if wt.ndim == 3:  # panels [out / P, in, P] -> [out, in]
        return wt.transpose(0, 2, 1).reshape(-1, wt.shape[1])
    return wt.T


def takes_panels(module: nn.Module, outputs: int, group: int) -> bool:
    """Whether quantized panels can hold ``module``'s weight: a ``Linear`` or an embedding,
    its outputs a whole number of panels, groups of 16 or a multiple of 32 inputs."""
    fits = outputs % native.PANEL == 0 and (group == 16 or group % 32 == 0)
    return fits and (isinstance(module, Linear) or type(module) is nn.Embedding)


def hold_quantized(root: nn.Module, name: str, tensor: QuantizedTensor) -> None:
    """Make ``tensor`` the weight of ``root``'s module ``name`` (see :func:`takes_panels`) in
    quantized panels: a ``Linear``'s ``_wt``; an embedding becomes a :class:`PanelEmbedding`
    in its parent. Only the one tensor's unpacked copy lives meanwhile."""
    panels = native.quantized.tensor_panels(tensor)
    mx.eval(panels)
    modules = dict(root.named_modules())
    module = modules[name]
    if isinstance(module, Linear):
        module._wt = panels
        del module["weight"]
    else:
        parent, _, key = name.rpartition(".")
        setattr(modules[parent] if parent else root, key, PanelEmbedding(panels, tensor.shape[0]))


def quantize_in_panels(module: nn.Module, bits: int, group: int = 64) -> int:
    """Quantize every float ``Linear`` and ``nn.Embedding`` below ``module`` into quantized
    panels (MLX's affine quantization, ``bits`` 4 or 8, ``group`` inputs per scale: mlx-lm's
    recipe), in place, one weight at a time; returns how many. Layers whose shape the panels
    do not take (outputs not whole panels, inputs not whole groups) stay float."""
    count = 0
    for name, child in list(module.named_modules()):
        if "weight" not in child or not takes_panels(child, child.weight.shape[0], group):
            continue
        if child.weight.shape[1] % group:
            continue
        tensor = native.quantized.mlx_affine_half(child.weight, group, bits)
        hold_quantized(module, name, tensor)
        count += 1
    return count


def pack_for_cpu(module: nn.Module) -> int:
    """Store every dense ``Linear`` below ``module`` transposed; return how many were packed."""
    count = 0
    for _, child in module.named_modules():
        if isinstance(child, Linear) and "weight" in child:
            child.pack()
            count += 1
    return count


def add_row_layout(module: nn.Module) -> int:
    """Keep a ``[out, in]`` copy of every packed weight below ``module`` for multi-row products
    (speculative verification); costs the weights' memory once more. Returns how many."""
    count = 0
    for _, child in module.named_modules():
        if (
            isinstance(child, Linear)
            and "_wt" in child
            and "_w_rows" not in child
            and not getattr(child, "fused", False)
        ):
            child._w_rows = mx.contiguous(child._wt.T)
            count += 1
    mx.eval([c._w_rows for _, c in module.named_modules() if "_w_rows" in c])
    return count


def fused_to_panels(owner: nn.Module, key: str, parts: list[nn.Module]) -> bool:
    """Panels for the fused matrix ``owner[key]`` (:func:`fuse_linears`), each part a view of
    them; False (left packed) unless every part is a whole number of panels wide."""
    fused = owner.get(key)
    if fused is None or fused.ndim != 2 or any(p._wt.shape[1] % native.PANEL for p in parts):
        return False
    panels = to_panels(fused)
    owner[key] = panels
    start = 0
    for part in parts:
        width = part._wt.shape[1] // native.PANEL
        part._wt = panels[start : start + width]
        start += width
    return True


def linears_to_panels(module: nn.Module) -> int:
    """Panels for every packed ``Linear`` below ``module`` that is not part of a fused product;
    returns how many (a product that is not a whole number of panels wide stays packed)."""
    count = 0
    for _, child in module.named_modules():
        if isinstance(child, Linear) and "_wt" in child and not getattr(child, "fused", False):
            panels = to_panels(child._wt)
            if panels is not None:
                child._wt = panels
                count += 1
    return count
