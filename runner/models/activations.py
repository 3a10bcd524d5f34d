"""SiLU for long feeds on the CPU: the sigmoid through the blocked attention's vectorisable exp2.

MLX's CPU ``exp`` (inside ``nn.silu``) is a scalar loop with a library call per element, so on
a prefill chunk the SwiGLU's activation costs about as much as the MLP's two products. For
feeds of at least ``MIN_ROWS`` rows in float32 on the CPU, :func:`silu_mul` and :func:`silu`
compute ``x * sigmoid(x)`` as ``x / (1 + e)`` or ``x * e / (1 + e)`` with ``e = 2**(-|x| *
log2(e))`` from ``runner.models.attention.exp2_nonpositive``'s two kernels (never overflows;
relative error ~3e-7 against ``nn.silu``), in ``mx.compile``d elementwise passes. The
selection between the two forms is arithmetic (``max(e, max(sign(x), 0))``): a ``where`` or
a compare cast to float keeps the fused loop from vectorising.

Traced shapeless, so the odd row count of a prompt's last chunk adds no trace: the kernels
are elementwise over operands of one shape, where shapeless tracing loses nothing that
matters. Decode steps and verify rows (fewer rows, inside compiled blocks) keep ``nn.silu``,
so verify rows still compute what plain decoding computes.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from runner.models.attention import exponent_bits, scaled_polynomial

MIN_ROWS = 32  # rows of a feed (all dims but the last) that take the fast form
_LOG2E = math.log2(math.e)


def _minus_abs(x: mx.array) -> mx.array:
    return -mx.abs(x) * _LOG2E


def _sigmoid_factor(x: mx.array, e: mx.array) -> mx.array:
    """``sigmoid(x)`` from ``e = exp(-|x|)``."""
    return mx.maximum(e, mx.maximum(mx.sign(x), 0.0)) / (1.0 + e)


_minus_abs_kernel = mx.compile(_minus_abs, shapeless=True)
_bits_kernel = mx.compile(exponent_bits, shapeless=True)
_poly_kernel = mx.compile(scaled_polynomial, shapeless=True)
_silu_kernel = mx.compile(lambda x, e: x * _sigmoid_factor(x, e), shapeless=True)
_silu_mul_kernel = mx.compile(lambda x, y, e: (x * y) * _sigmoid_factor(x, e), shapeless=True)


def serves(x: mx.array) -> bool:
    """Whether ``x`` takes the fast form: float32 on the CPU with ``MIN_ROWS`` rows or more."""
    return (
        x.dtype == mx.float32
        and x.ndim >= 2
        and x.size // x.shape[-1] >= MIN_ROWS
        and mx.default_device() == mx.cpu
    )


def _exp_minus_abs(x: mx.array) -> mx.array:
    d = _minus_abs_kernel(x)
    return _poly_kernel(d, _bits_kernel(d).view(mx.float32))


def silu(x: mx.array) -> mx.array:
    """``nn.silu(x)``, through the fast form where it serves."""
    if not serves(x):
        return nn.silu(x)
    return _silu_kernel(x, _exp_minus_abs(x))


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``nn.silu(gate) * up`` (a SwiGLU's activation), through the fast form where it
    serves."""
    if not serves(gate) or up.shape != gate.shape or up.dtype != gate.dtype:
        return nn.silu(gate) * up
    return _silu_mul_kernel(gate, up, _exp_minus_abs(gate))
