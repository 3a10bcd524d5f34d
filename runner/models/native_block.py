"""A llama-shaped decoder block as two native nodes for the few rows of a decode step.

A compiled ``DecoderLayer`` still leaves about 40 graph nodes per layer (RMSNorm composed of 3
ops, the fused q/k/v product split into heads by views and transposes, the rotation's product
and multiply-add, the gate), and MLX's CPU stream runs each as a task of its own. With 4-bit
weights those tasks cost about as much as the products. :class:`NativeBlock` serves the same
two parts ``runner.device.compile_blocks`` compiles, ``before_cache`` and ``after_attention``,
each as one ``runner.native`` primitive (``block.h``) over the very weights the layer holds:
the cache append and the attention between them stay the layer's own (every cache type, the
row attention, packed caches).

Each row's norms, rotation and activation are computed alone and the products do not depend
on the row count, so verify rows and shared forwards (``hidden_rows``) keep plain decoding's
bits. The numbers differ from the compiled MLX ops in the last bits (the norm's sum in
another order, the SiLU's exponential from ``flash.h``), which is why prefill chunks (eager
MLX) and decode steps were never bit-identical anyway.

Serves blocks of the ``DecoderLayer`` shape exactly (subclasses that change a part are
refused by :func:`refusal`), SiLU MLPs, weights in panels (float32 or quantized), float32
activations, composed RoPE tables.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner import blas, native
from runner.models.layers import exact_products
from runner.models.llama import MLP, Attention, CompiledBlock, DecoderLayer


def _panels(w: mx.array | None) -> bool:
    """Quantized panels (uint8, 4-D) or float32 ones (3-D)."""
    if w is None:
        return False
    return (w.ndim == 4 and w.dtype == mx.uint8) or (w.ndim == 3 and w.dtype == mx.float32)


def refusal(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot run as a :class:`NativeBlock` (None: it can)."""
    if not native.block_available():
        return "runner.native has no decoder block"
    if not isinstance(layer, DecoderLayer):
        return f"{type(layer).__name__} is not a DecoderLayer"
    cls = type(layer)
    if cls.before_cache is not DecoderLayer.before_cache or (
        cls.after_attention is not DecoderLayer.after_attention
    ):
        return f"{cls.__name__} changes the block's parts"
    attn, mlp = layer.self_attn, layer.mlp
    for part, base, names in (
        (attn, Attention, ("queries_keys_values", "_project", "output")),
        (mlp, MLP, ("__call__",)),
    ):
        if not isinstance(part, base) or any(
            getattr(type(part), n) is not getattr(base, n) for n in names
        ):
            return f"{type(part).__name__} changes the block's parts"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if "q_norm" in attn:
        norms += [attn.q_norm, attn.k_norm]
    if any(type(n) is not nn.RMSNorm for n in norms):
        return "a norm is not an RMSNorm"
    if any(n.weight.dtype != mx.float32 for n in norms):
        return "the block does not run in float32"
    if attn.rope.fast or attn.fast or attn.softcap is not None:
        return "the attention runs mx.fast kernels or a soft-cap"
    if attn.head_dim > 512 or attn.rope.dims % 2 or attn.rope.dims > attn.head_dim:
        return "the head size or rotary width is outside what the block takes"
    bias = attn.get("_qkv_t_bias")
    if bias is not None and bias.dtype != mx.float32:
        return "the q/k/v bias is not float32"
    if not (_panels(attn.get("_qkv_t")) and _panels(mlp.get("_gate_up_t"))):
        return "q/k/v or gate/up are not fused into panels"
    if not (_panels(attn.o_proj.get("_wt")) and _panels(mlp.down_proj.get("_wt"))):
        return "the output or down projection is not in panels"
    if "bias" in attn.o_proj or "bias" in mlp.down_proj or "_gate_up_t_bias" in mlp:
        return "the output or MLP projections have a bias"
    return None


def decode_threads(quantized: bool) -> int:
    """Threads for a decode step's products and the row attention between them: a decode
    step's (``runner.blas.decode_threads``), every core for quantized weights where their
    product runs on vector kernels (``runner.native.quantized_decode_threads``)."""
    threads = blas.decode_threads()
    return native.quantized_decode_threads(threads) if quantized else threads


class NativeBlock:
    """``before_cache`` and ``after_attention`` of one ``DecoderLayer`` as native nodes (a
    plain object, outside the parameter tree, in the place of a ``CompiledBlock``). Like a
    compiled block it holds the weights the layer had when it was made (a decode forward
    builds its graph with two calls a layer and no lookups), so it is made after the last
    weight change (``runner.device.compile_blocks`` runs last; ``uncompile_blocks`` first)."""

    __slots__ = ("_front", "_front_numbers", "_back", "_back_numbers")

    serves = staticmethod(CompiledBlock.serves)

    def __init__(self, layer: DecoderLayer, threads: int | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        if threads is None:
            quantized = any(w.dtype == mx.uint8 for w in (attn["_qkv_t"], mlp["_gate_up_t"]))
            threads = decode_threads(quantized)
        qk_norm = "q_norm" in attn
        self._front = (
            layer.input_layernorm.weight,
            attn["_qkv_t"],
            attn.get("_qkv_t_bias"),
            attn.q_norm.weight if qk_norm else None,
            attn.k_norm.weight if qk_norm else None,
        )
        shape = {"heads": attn.n_heads, "kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim}
        self._front_numbers = {
            **shape,
            "rotary": attn.rope.dims,
            "traditional": attn.rope.traditional,
            "eps": layer.input_layernorm.eps,
            "qk_eps": attn.q_norm.eps if qk_norm else 0.0,
            "threads": threads,
        }
        self._back = (
            attn.o_proj["_wt"],
            layer.post_attention_layernorm.weight,
            mlp["_gate_up_t"],
            mlp.down_proj["_wt"],
        )
        self._back_numbers = {
            **shape,
            "eps": layer.post_attention_layernorm.eps,
            "threads": threads,
        }

    def before_cache(self, x: mx.array, *rope: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # Composed tables (cos, sin, rotation): refusal() turns mx.fast's offsets away.
        q, k, v = native.block_front(
            x, *self._front, rope[0], rope[1], **self._front_numbers, exact=exact_products()
        )
        return q, k, v

    def after_attention(self, x: mx.array, attended: mx.array) -> mx.array:
        return native.block_back(
            x, attended, *self._back, **self._back_numbers, exact=exact_products()
        )
