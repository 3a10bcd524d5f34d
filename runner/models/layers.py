"""Linear layers whose weight may be stored for the CPU's products instead of as loaded.

Two CPU layouts, applied once after loading by ``runner.device.tune``:

- packed, ``_wt`` ``[in, out]``: ``x @ Wt`` with ``Wt`` contiguous; a BLAS otherwise packs the
  transposed operand of ``x @ W.T`` on every call, and decode is nothing but such products.
- panels, ``_wt`` ``[out / 16, in, 16]`` (``runner.native``): column panels that the native
  few-row product reads once for all rows, so 2-16 verify rows cost about one row, and every
  row's result is the same whatever batch it is computed in.

The Hugging Face layout stays readable through :func:`dense_weight` in every case.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner import native

# Feeds of 2-16 rows (a speculative verify) use the [out, in] copy when one exists: some BLAS
# libraries pack the transposed operand on every multi-row call (blas.row_layout_pays).
MAX_ROWS_LEFT = 16


def product(x: mx.array, wt: mx.array) -> mx.array:
    """``x @ W`` for ``wt`` packed (2-D, ``[in, out]``) or in panels (3-D)."""
    if wt.ndim == 3:
        return native.panel_matmul(x, wt, wt.shape[0] * native.PANEL)
    return x @ wt


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
        if wt.ndim == 3:
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
    as ``owner[key]`` (a bias, when they all have one, as ``owner[key + "_bias"]``); False when
    they cannot share one (quantized, unpacked, mixed biases, already fused). The parts keep
    their ``_wt`` as column views of the fused matrix, so ``dense_weight`` still reads them and
    no weight is stored twice. :func:`fused_product` applies it."""
    if not all(
        isinstance(p, Linear) and "_wt" in p and not getattr(p, "fused", False) for p in parts
    ):
        return False
    biased = ["bias" in p for p in parts]
    if any(biased) and not all(biased):
        return False
    fused = mx.contiguous(mx.concatenate([p._wt for p in parts], axis=1))
    owner[key] = fused
    if all(biased):
        owner[key + "_bias"] = mx.concatenate([p["bias"] for p in parts])
    start = 0
    for p in parts:
        width = p._wt.shape[1]
        p._wt = fused[:, start : start + width]
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
    """The ``[out, in]`` weight of a (possibly packed or quantized) linear layer."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(
            layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits
        )
    wt = layer.get("_wt")
    if wt is None:
        return layer.weight
    if wt.ndim == 3:  # panels [out / P, in, P] -> [out, in]
        return wt.transpose(0, 2, 1).reshape(-1, wt.shape[1])
    return wt.T


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
