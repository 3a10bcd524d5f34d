"""Device tuning behind one door: how a loaded target (and its draft head) is laid out and run.

``tune`` is the only code that changes a model's layout after loading, and it applies every
step in the one order that is valid: weights first (packing, fused projections, the verify-row
layout), compiled blocks last, because compiled parts keep the weights they traced. It returns
a ``Tuning`` record; the engine reports it and nothing else probes a model for its layout.

- CPU: q/k/v and gate/up fused into one product each, and every product's weight in the
  column panels of ``runner.native``'s few-row product, which reads each weight once for all
  the rows of a feed (verify rows cost about one row; prefill chunks run on every core);
  a MoE block's routed experts in per-expert panels of its gathered product, which reads each
  selected expert once for all the rows that chose it (packed: the down projection stored
  ``[in, out]`` for ``gather_mm``);
  without the native build, dense weights stored transposed (``x @ Wt``: one-row products
  skip a per-call transpose in the BLAS) and an ``[out, in]`` copy of the o and down weights
  for verify rows where the BLAS runs them faster that way (``blas.row_layout_pays``; only
  with a head). The composed attention and RoPE kernels (``mx.fast`` falls back to many small
  ops on the CPU).
- GPU: the Hugging Face layout and ``mx.fast``'s fused attention and RoPE.
- Both: each block's fixed-shape parts ``mx.compile``d for decode and verify rows; on the
  CPU, blocks of the llama shape in panels run those parts as two native nodes instead
  (``runner.models.native_block``).

``scripts/bench/forward.py`` measures each choice.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from runner import blas, native
from runner.models import native_block
from runner.models.layers import (
    PanelEmbedding,
    add_row_layout,
    linears_to_panels,
    pack_for_cpu,
    quantize_in_panels,
    set_exact_products,
    to_panels,
)
from runner.models.llama import MLP, Attention, CompiledBlock, DecoderLayer, Model
from runner.models.moe import lay_out_experts, quantize_experts

LAYOUTS = ("auto", "hf", "packed", "panels")
HEAD_BITS = 8  # a float head beside a quantized target (see tune)


@dataclass(frozen=True)
class Tuning:
    """What ``tune`` applied."""

    device: str  # "cpu" | "gpu"
    layout: str  # "hf" (as loaded) | "packed" (transposed, fused) | "panels" (runner.native)
    row_layout: bool  # the [out, in] copy of o and down for verify rows
    compiled: bool
    fast_kernels: bool  # mx.fast attention and RoPE, else the composed kernels
    native_blocks: int = 0  # blocks whose compiled parts are native nodes instead

    def describe(self) -> str:
        parts = [self.device, f"{self.layout} weights"]
        if self.row_layout:
            parts.append("verify-row layout")
        parts.append("compiled blocks" if self.compiled else "eager blocks")
        if self.native_blocks:
            parts.append(f"{self.native_blocks} native blocks")
        parts.append("mx.fast kernels" if self.fast_kernels else "composed kernels")
        return ", ".join(parts)


def release_memory() -> None:
    """Hand the memory a request freed back to the system: MLX's buffer cache, then the C
    heap's free pages (glibc keeps freed blocks below its adaptive mmap threshold mapped, so
    a long prompt's transient buffers would otherwise stay in the resident set for good)."""
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def tune(
    model: nn.Module,
    head: nn.Module | None = None,
    *,
    layout: str = "auto",
    row_layout: bool | None = None,
    compile: bool = True,
    native_blocks: bool = True,
    fast_kernels: bool | None = None,
    expert_layout: str | None = None,
    exact_products: bool | None = None,
    quantize: int | None = None,
    quantize_head: bool = True,
) -> Tuning:
    """Lay out and compile ``model`` (a ``runner.models`` model) and ``head`` (its MTP head)
    for the default device, once, right after loading; return what was applied.

    ``layout``: "auto" (on the CPU panels when ``runner.native`` is built, else packed; the
    Hugging Face layout on a GPU), "hf", "packed" or "panels" (packed, then every product
    whose width allows it in the native few-row product's panels). ``row_layout`` None:
    where the BLAS gains from it. ``fast_kernels`` None: on a GPU only (tests force either
    path on the CPU). ``expert_layout`` "hf" keeps a MoE model's routed experts as loaded
    (``scripts/bench/moe.py`` measures the layouts against each other); None: they follow
    ``layout`` (``runner.models.moe.lay_out_experts``). ``exact_products``: quantized panels
    (the loader's, on the CPU) multiply bit-for-bit as their dequantized weight (True) or with
    int8 activations (False); None leaves the process's choice as it is. ``quantize`` (4 or 8
    bits) quantizes the float weights first (affine, groups of 64: quantized panels on the CPU,
    MLX's quantized layers on a GPU), the head's too unless ``quantize_head`` is False;
    without ``quantize``, a float head beside a target held in quantized panels is quantized
    to ``HEAD_BITS`` (again unless ``quantize_head`` is False).
    ``native_blocks`` False keeps every compiled block in MLX ops (see :func:`compile_blocks`).
    """
    if expert_layout not in (None, "hf"):
        raise ValueError(f"expert_layout must be None or 'hf', not {expert_layout!r}")
    cpu = on_cpu()
    if exact_products is not None:
        set_exact_products(exact_products)
    layout = resolve_layout(layout, cpu)
    fast = (not cpu) if fast_kernels is None else fast_kernels
    parts = [model] + ([head] if head is not None else [])
    for part in parts:
        set_kernels(part, fast)
    if quantize is not None:
        for part in parts if quantize_head else [model]:
            quantize_weights(part, quantize, cpu)
    elif head is not None and quantize_head and cpu and holds_quantized_panels(model):
        # A float head beside a quantized target: its read is a quarter of a step's bytes in
        # float32 and every round pays it; 8 bits keep its acceptance (scripts/bench/spec.py).
        quantize_weights(head, HEAD_BITS, cpu)
    _lay_out_weights(model, head, layout, expert_layout)
    for part in parts:
        set_row_threads(part)
    rows = False
    if head is not None and layout == "packed":
        rows = blas.row_layout_pays() if row_layout is None else row_layout
        if rows:
            add_row_layout(model)
    natives = 0
    if compile:
        for part in parts:
            compile_blocks(part, native_blocks)
            natives += sum(isinstance(b, native_block.NativeBlock) for b in blocks_of(part))
    return Tuning(
        device="cpu" if cpu else "gpu",
        layout=layout,
        row_layout=rows,
        compiled=compile,
        fast_kernels=fast,
        native_blocks=natives,
    )


def tune_vision(tower: nn.Module, tuning: Tuning) -> int:
    """Lay a vision tower's products out as ``tuning`` laid out the text model's (its
    ``lay_out``: packed, then panels where its widths allow); its float weights stay float (a
    ``--quantize`` choice is the text model's). Returns how many products changed layout."""
    return tower.lay_out(tuning.layout)


def resolve_layout(layout: str, cpu: bool) -> str:
    """The weight layout ``layout`` names on this device ("auto": panels on the CPU when
    ``runner.native`` is built, else packed; the Hugging Face layout on a GPU); a layout
    that is unknown or that the device cannot run is a ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "auto":
        layout = ("panels" if native.available() else "packed") if cpu else "hf"
    if layout == "panels" and not (cpu and native.available()):
        raise ValueError(f"the panel layout needs runner.native on the CPU: {native.reason()}")
    return layout


def _lay_out_weights(
    model: nn.Module, head: nn.Module | None, layout: str, expert_layout: str | None
) -> None:
    """The weight steps of ``tune``, in their order: packed (and fused) weights, then the
    panels of the native product, then the routed experts' layout."""
    parts = [model] + ([head] if head is not None else [])
    if layout in ("packed", "panels"):
        _pack_model(model)
        if head is not None:
            pack_for_cpu(head)
            fuse_projections(head)
            mx.eval([v for _, v in private_arrays(head)], head.parameters())
    if layout == "panels":
        for part in parts:
            to_panel_layout(part)
    if layout in ("packed", "panels") and expert_layout != "hf":
        for part in parts:
            lay_out_experts(part, layout)


# --- the steps (each walks the modules below the one it is given)


def quantize_weights(module: nn.Module, bits: int, cpu: bool) -> int:
    """Quantize ``module``'s float products and embeddings at ``bits`` (groups of 64, mlx-lm's
    recipe): quantized panels on the CPU (``runner.models.layers.quantize_in_panels``), MLX's
    quantized layers on a GPU. Returns how many layers (GPU: every quantizable one)."""
    if bits not in (4, 8):
        raise ValueError(f"quantize takes 4 or 8 bits, not {bits}")
    if cpu and native.qpanels_available():
        return quantize_experts(module, bits) + quantize_in_panels(module, bits)
    if cpu:
        raise ValueError(f"quantizing at load needs runner.native on the CPU: {native.reason()}")
    nn.quantize(module, group_size=64, bits=bits)
    return sum(1 for _, m in module.named_modules() if isinstance(m, nn.QuantizedLinear))


def holds_quantized_panels(model: nn.Module) -> bool:
    """Whether ``model`` holds any weight in quantized panels (a quantized checkpoint kept
    quantized on the CPU)."""
    for _, child in model.named_modules():
        if isinstance(child, PanelEmbedding):
            return True
        wt = child.get("_wt") if isinstance(child, nn.Module) else None
        if wt is not None and wt.ndim == 4 and wt.dtype == mx.uint8:
            return True
    return False


def _pack_model(model: nn.Module) -> None:
    """Store a target's dense weights transposed for fast one-row products
    (``runner.models.layers.pack_for_cpu``), fuse its projections, and give a tied output
    projection its own ``[D, V]`` copy (lookups need the ``[V, D]`` table, the product wants
    ``[D, V]`` contiguous)."""
    pack_for_cpu(model)
    fuse_projections(model)
    embed = model.model.embed_tokens
    if model.args.tie_word_embeddings and type(embed) is nn.Embedding:
        model._embed_t = mx.contiguous(embed.weight.T)
    elif model.args.tie_word_embeddings and isinstance(embed, PanelEmbedding):
        model._embed_t = embed._table  # the one copy: lookups and the product share it
    mx.eval([v for _, v in private_arrays(model)])


def fuse_projections(module: nn.Module) -> int:
    """Fuse the packed q/k/v and gate/up projections of every block below ``module``; return
    how many products were fused: fewer, larger BLAS calls (scripts/bench/forward.py)."""
    return sum(
        child.fuse() for _, child in module.named_modules() if isinstance(child, Attention | MLP)
    )


def to_panel_layout(module: nn.Module) -> int:
    """Every packed product below ``module`` (fused ones, plain linears, a tied model's output
    projection) in the panel layout of ``runner.native``; returns how many products."""
    count = sum(
        child.fused_to_panels()
        for _, child in module.named_modules()
        if isinstance(child, Attention | MLP)
    )
    count += linears_to_panels(module)
    for _, child in module.named_modules():
        if isinstance(child, Model) and "_embed_t" in child:
            panels = to_panels(child._embed_t)
            if panels is not None:
                child._embed_t = panels
                count += 1
    mx.eval([v for _, v in private_arrays(module)])
    return count


def weight_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the weights ``modules`` hold: parameters and private arrays, each array once
    (a fused product's parts are views of it; a tied table and its output projection are one
    array)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        arrays = [v for _, v in tree_flatten(module.parameters())]
        for _, child in module.named_modules():
            if getattr(child, "fused", False):
                continue  # its _wt is a view of the fused array, counted with its owner
            arrays += [v for k, v in child.items() if k.startswith("_") and isinstance(v, mx.array)]
        for array in arrays:
            if id(array) not in seen:
                seen.add(id(array))
                total += array.nbytes
    return total


def private_arrays(module: nn.Module) -> Iterator[tuple[str, mx.array]]:
    """Arrays kept outside ``parameters()`` (underscore keys), e.g. packed weights."""
    for _, child in module.named_modules():
        for key, value in child.items():
            if key.startswith("_") and isinstance(value, mx.array):
                yield key, value


def set_kernels(module: nn.Module, fast: bool) -> None:
    """Attention and RoPE below ``module`` through ``mx.fast`` (``fast``) or the composed
    kernels; both compute the same values (tests compare them). With the composed kernels a
    few rows attend through ``runner.native``'s row attention where it is built."""
    for _, child in module.named_modules():
        if isinstance(child, Attention):
            child.fast = fast
            child.rope.fast = fast
            child.rows_native = not fast and native.row_attention_available()


def set_row_threads(module: nn.Module) -> None:
    """The native row attention's threads below ``module``: its decode products' threads
    (``native_block.decode_threads``). The attention runs between a layer's products on the
    stream's thread, where their other threads wait."""
    threads = native_block.decode_threads(holds_quantized_panels(module))
    for _, child in module.named_modules():
        if isinstance(child, Attention):
            child.row_threads = threads


def compile_blocks(module: nn.Module, native_blocks: bool = True) -> int:
    """Compile the fixed-shape parts of every block below ``module``
    (``runner.models.llama.DecoderLayer``); return how many blocks. A compiled part replays
    its graph without Python graph building and MLX fuses its elementwise ops
    (scripts/bench/forward.py measures the gain). On the CPU a block the native build serves
    (``runner.models.native_block.refusal``) runs its two parts as two native nodes instead,
    unless ``native_blocks`` is False."""
    native_blocks = native_blocks and on_cpu()
    count = 0
    for _, child in module.named_modules():
        if isinstance(child, DecoderLayer):
            if native_blocks and native_block.refusal(child) is None:
                child.compiled = native_block.NativeBlock(child)
            else:
                child.compiled = CompiledBlock(child)
            count += 1
    return count


def blocks_of(module: nn.Module) -> list:
    """The compiled parts (``CompiledBlock`` or ``NativeBlock``) of the blocks below ``module``."""
    return [
        child.compiled
        for _, child in module.named_modules()
        if isinstance(child, DecoderLayer) and child.compiled is not None
    ]


def uncompile_blocks(module: nn.Module) -> int:
    """Drop the compiled parts below ``module`` (before changing weights); return how many."""
    count = 0
    for _, child in module.named_modules():
        if isinstance(child, DecoderLayer) and child.compiled is not None:
            child.compiled = None
            count += 1
    return count
