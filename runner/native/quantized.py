"""Quantized column panels: 4- and 8-bit weights kept as stored, multiplied by the native
``qpanel_matmul`` (``qkernels.h``) without a float copy of the weight.

A quantized ``[N, K]`` weight (``runner.quantized``: values, and a float32 scale and bias per
group of ``group`` inputs) is laid out once, at load, as ``uint8 [NB, K / group, header rows +
group, 2 bits]``: per panel of 16 output columns and per group, the 16 scales and 16 biases
(float16 when every one of them is a float16 number, as GGUF's Q4_0, Q4_1 and Q8_0 ones are:
fewer bytes to read; else float32), then the values in 32-bit lanes, one lane per column
(``qkernels.h`` explains why). The shape alone says the width, the group and the header's
type, so a layer keeps one array, as with float panels.
Widths the kernel does not run (5 and 6 bits) widen to 8 bits: the same values, exactly.

Two products over it: ``exact`` (bit-for-bit the float32 product of the dequantized weight)
and the default fast one (each row of ``x`` quantized to int8 per block of 32 inputs, integer
dot products); both give row ``i`` of an ``M``-row product the bits of its one-row product.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

PANEL = 16  # columns per panel (qkernels.h kPanel)
BITS = (4, 8)


def kernel_bits(bits: int) -> int:
    """The width a stored width runs at: 4 stays 4, 2-8 bits otherwise widen to 8."""
    if bits <= 4:
        return 4
    if bits <= 8:
        return 8
    raise ValueError(f"no quantized panels for {bits}-bit values")


def _valid_group(group: int) -> bool:
    return group == 16 or (group >= 32 and group % 32 == 0)


def halves_exactly(*arrays: np.ndarray) -> bool:
    """Whether every value of ``arrays`` is a float16 number (a float16 header keeps it)."""
    for a in arrays:
        a = np.asarray(a, dtype=np.float32)
        with np.errstate(over="ignore"):
            if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
                return False
    return True


def to_qpanels(
    values: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    *,
    half: bool | None = None,
) -> mx.array:
    """The panel layout of an affine ``[N, K]`` weight (``values`` uint8 ``[N, K]``, ``scales``
    and ``biases`` ``[N, K / group]``) at a kernel width of 4 or 8 ``bits``; N is padded with
    zero columns to whole panels. ``values`` must be below ``2 ** bits``. ``half``: float16
    scales and biases (None: exactly when that keeps every one; True where it would not is a
    ``ValueError``)."""
    if bits not in BITS:
        raise ValueError(f"quantized panels hold 4- or 8-bit values, not {bits}")
    n, k = values.shape
    groups = scales.shape[1]
    if groups == 0 or k % groups or scales.shape != (n, groups) or biases.shape != scales.shape:
        raise ValueError(
            f"values {values.shape}, scales {scales.shape} and biases {biases.shape} differ"
        )
    group = k // groups
    if not _valid_group(group):
        raise ValueError(
            f"quantized panels need groups of 16 inputs or a multiple of 32, not {group}"
        )
    exact16 = halves_exactly(scales, biases)
    if half and not exact16:
        raise ValueError("float16 scales and biases would round some of them")
    half = exact16 if half is None else half
    nb = -(-n // PANEL)
    pad = nb * PANEL - n
    v = np.asarray(values, dtype=np.uint8)
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    if pad:
        v = np.pad(v, [(0, pad), (0, 0)])
        s = np.pad(s, [(0, pad), (0, 0)])
        b = np.pad(b, [(0, pad), (0, 0)])
    # [NB, 16 (column j), groups, group (input)] -> [NB, groups, group, 16]
    v = v.reshape(nb, PANEL, groups, group).transpose(0, 2, 3, 1)
    if bits == 4:
        # units of 8 inputs: lane j byte t = value 2t | value 2t + 1 << 4
        u = v.reshape(nb, groups, group // 8, 4, 2, PANEL)
        lanes = (u[:, :, :, :, 0, :] | (u[:, :, :, :, 1, :] << 4)).transpose(0, 1, 2, 4, 3)
    else:
        # units of 4 inputs: lane j byte i = value i
        lanes = v.reshape(nb, groups, group // 4, 4, PANEL).transpose(0, 1, 2, 4, 3)
    body = np.ascontiguousarray(lanes).reshape(nb, groups, -1)
    head = np.concatenate(
        [
            s.reshape(nb, PANEL, groups).transpose(0, 2, 1),
            b.reshape(nb, PANEL, groups).transpose(0, 2, 1),
        ],
        axis=2,
    )
    head = np.ascontiguousarray(head.astype(np.float16 if half else np.float32)).view(np.uint8)
    blocks = np.concatenate([head, body], axis=2)
    return mx.array(blocks.reshape(nb, groups, header_rows(bits, half) + group, 2 * bits))


def header_rows(bits: int, half: bool) -> int:
    """Rows (of ``2 bits`` bytes) a block's scales and biases take."""
    return (32 if half else 64) // bits


def tensor_panels(tensor, *, half: bool | None = None) -> mx.array:
    """The quantized panels of a ``runner.quantized.QuantizedTensor`` (its unpacked values,
    scales and biases at its kernel width; ``half`` as :func:`to_qpanels`)."""
    return to_qpanels(*tensor.unpack(), kernel_bits(tensor.bits), half=half)


def mlx_affine_half(w: mx.array, group: int, bits: int):
    """MLX's affine quantization of a float ``[N, K]`` weight (``mx.quantize``: groups of 32,
    64 or 128) with float16 scales and biases, as mlx-lm's half-precision checkpoints hold
    them (the panels' headers take half the bytes): a ``runner.quantized.MlxAffine``."""
    from runner.quantized import MlxAffine

    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return MlxAffine(packed, scales.astype(mx.float16), biases.astype(mx.float16), group, bits)


def layout(panels: mx.array) -> tuple[int, int, int, bool]:
    """``(K, group, bits, half)`` of quantized panels, read from their shape (``half``:
    float16 scales and biases; one header size leaves a valid group, the other does not)."""
    if panels.ndim != 4 or panels.dtype != mx.uint8 or panels.shape[3] not in (8, 16):
        raise ValueError(f"not quantized panels: {panels.dtype} {tuple(panels.shape)}")
    bits = panels.shape[3] // 2
    half = not _valid_group(panels.shape[2] - header_rows(bits, False))
    group = panels.shape[2] - header_rows(bits, half)
    if not _valid_group(group):
        raise ValueError(f"not quantized panels: {panels.dtype} {tuple(panels.shape)}")
    return panels.shape[1] * group, group, bits, half


def columns(panels: mx.array, ids: mx.array) -> mx.array:
    """Columns ``ids`` of the weight ``[K, N]`` as float32 rows ``[*ids.shape, K]`` (a tied
    embedding's lookups from the output projection's panels), each value ``s * q + b`` as the
    dequantized weight has it. MLX ops: a lookup reads one panel per id
    (``runner.native.qpanel_columns`` computes the same values in one node)."""
    k, group, bits, half = layout(panels)
    flat = ids.reshape(-1)
    lane = (flat % PANEL).astype(mx.uint32)
    blocks = panels[flat // PANEL]  # [T, groups, rows, 2 bits]
    t, groups = blocks.shape[0], blocks.shape[1]
    head_rows = header_rows(bits, half)
    head = blocks[:, :, :head_rows, :].reshape(t, groups, head_rows * 2 * bits)
    head = head.view(mx.float16).astype(mx.float32) if half else head.view(mx.float32)
    pick = lane.reshape(t, 1, 1)
    s = mx.take_along_axis(head[:, :, :PANEL], pick, axis=2)  # [T, groups, 1]
    b = mx.take_along_axis(head[:, :, PANEL:], pick, axis=2)
    per = 32 // bits  # inputs per lane word
    words = blocks[:, :, head_rows:, :].reshape(t, groups, -1).view(mx.uint32)
    words = words.reshape(t, groups, group // per, PANEL)
    mine = mx.take_along_axis(words, pick.reshape(t, 1, 1, 1), axis=3)  # [T, groups, units, 1]
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    q = (mine >> shifts) & ((1 << bits) - 1)  # [T, groups, units, per]
    q = q.reshape(t, groups, group).astype(mx.float32)
    w = (q * s + b).reshape(t, k)
    return w.reshape(*ids.shape, k)


def dense(panels: mx.array, n: int) -> mx.array:
    """The float32 weight ``[K, n]`` of quantized panels (a draft vocabulary's rows, training,
    tests), a few panels at a time so the unpacking's temporaries stay small."""
    k, group, bits, half = layout(panels)
    nb, groups = panels.shape[0], panels.shape[1]
    rows = header_rows(bits, half)
    per = 32 // bits  # values per lane word
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    step = max(1, (1 << 20) // (k * PANEL))  # panels per piece: about a million weights
    pieces = []
    for p0 in range(0, nb, step):
        part = panels[p0 : p0 + step]
        count = part.shape[0]
        head = part[:, :, :rows, :].reshape(count, groups, rows * 2 * bits)
        head = head.view(mx.float16).astype(mx.float32) if half else head.view(mx.float32)
        s, b = head[:, :, None, :PANEL], head[:, :, None, PANEL:]  # [P, groups, 1, 16]
        words = part[:, :, rows:, :].reshape(count, groups, -1).view(mx.uint32)
        words = words.reshape(count, groups, group // per, 1, PANEL)
        q = ((words >> shifts[:, None]) & ((1 << bits) - 1)).reshape(count, groups, group, PANEL)
        w = q.astype(mx.float32) * s + b  # [P, groups, group, 16]
        pieces.append(w.reshape(count, k, PANEL).transpose(1, 0, 2).reshape(k, count * PANEL))
        mx.eval(pieces[-1])
    return mx.concatenate(pieces, axis=1)[:, :n]
