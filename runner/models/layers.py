"""Linear layers that can store their weight transposed for fast single-row matmuls on CPU.

With the OpenBLAS that Debian ships, ``x @ W.T`` for one row runs about half as fast as
``x @ Wt`` with ``Wt`` stored contiguous (the transposed operand is packed on every call),
and decode is nothing but such products. :func:`pack_for_cpu` swaps the stored layout once
after loading; the Hugging Face layout stays readable through :func:`dense_weight`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Feeds of 2-16 rows (a speculative verify) use the [out, in] copy when one exists: some BLAS
# libraries pack the transposed operand on every multi-row call (blas.row_layout_pays).
MAX_ROWS_LEFT = 16


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may live transposed in ``_wt`` (not a parameter)."""

    def __call__(self, x: mx.array) -> mx.array:
        wt = self.get("_wt")
        if wt is None:
            return super().__call__(x)
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
    """``x`` through the projections :func:`fuse_linears` stored as ``owner[key]``; for verify
    rows too (``x @ Wt`` beat the ``[out, in]`` layout for the fused shapes)."""
    y = x @ owner[key]
    bias = owner.get(key + "_bias")
    return y if bias is None else y + bias


def dense_weight(layer: nn.Module) -> mx.array:
    """The ``[out, in]`` weight of a (possibly packed or quantized) linear layer."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(
            layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits
        )
    wt = layer.get("_wt")
    return wt.T if wt is not None else layer.weight


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
