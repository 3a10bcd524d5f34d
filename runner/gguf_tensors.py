"""GGUF tensors and metadata read with llama.cpp's own reader (the ``gguf`` package).

Every GGUF quantized type the runner accepts is, exactly, a grid of affine groups (see
``runner.quantized``): a sub-block of 16 or 32 inputs with one scale and one bias, each weight
``float32(scale * q) + bias`` with an unsigned ``q`` and ``scale * q`` exact in float32. So a
quantized tensor is handed over as it is stored, a lazy :class:`GGUFQuantized` that keeps a
view of its memory-mapped blocks and unpacks them (vectorized numpy) only when asked; nothing
is rounded on the way, unlike ``mx.load``, which decodes K-quants and Q5 types to float16.

| type | group | q | scale | bias |
|------|-------|---|-------|------|
| Q4_0 | 32 | 0..15 | d | -8 d |
| Q4_1 | 32 | 0..15 | d | m |
| Q5_0 | 32 | 0..31 | d | -16 d |
| Q5_1 | 32 | 0..31 | d | m |
| Q8_0 | 32 | 0..255 (int8 + 128) | d | -128 d |
| Q4_K, Q5_K | 32 (8 per 256) | 0..15 / 0..31 | d * sc_i | -dmin * m_i |
| Q6_K | 16 (16 per 256) | 0..63 (int6 + 32) | d * sc_i | -32 scale |

Scales and biases stay float32: a K-quant's ``d * sc_i`` has up to 17 significant bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from protocol.errors import CorruptModelFile, UnsupportedArchitecture, UnsupportedTensorType
from runner import gguf_metadata
from runner.quantized import QuantizedTensor, affine_dense

# (values uint8 [B, block], scales f32 [B, block // group], biases f32 [B, block // group])
# of B blocks' bytes (uint8 [B, block bytes]).
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]
DENSE_TYPES = ("F32", "F16", "BF16")


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as float32 ``[B, 1]``."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[B, n]`` bytes -> ``[B, 2n]``: the n low nibbles, then the n high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's little-endian uint32 ``qh`` -> ``[B, 32]``: bit j is element j's bit 4."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d  # int8 + 128: the sign bit flipped


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's (scales, biases) ``[B, 8]``: ``d * sc_i`` and ``-dmin * m_i`` with the
    6-bit ``sc``/``m`` of ggml's ``get_scale_min_k4`` (12 bytes after ``d`` and ``dmin``)."""
    q = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mixed = q[:, 0], q[:, 1], q[:, 2]
    sc = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Unpacked:
    # qs[128]: chunk c of 32 bytes holds sub-block 2c in its low nibbles, 2c + 1 in its high.
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    values = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    return (values, *_k_scales(b))


def _q5_k(b: np.ndarray) -> Unpacked:
    # qh[32] then qs[128]; sub-block i takes bit i of qh[l] as bit 4 of its element l.
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = ((b[:, 16:48].reshape(-1, 1, 32) >> shifts) & 1) << 4
    return ((low | high).reshape(-1, 256), *_k_scales(b))


def _q6_k(b: np.ndarray) -> Unpacked:
    # ql[128], qh[64], int8 scales[16], fp16 d; two halves of 128 elements, each 4 runs of 32:
    # runs 0, 1 take ql's low nibbles, runs 2, 3 the high ones; run j takes bits 2j of qh.
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3) << 4
    scales = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (low | high).reshape(-1, 256), scales, -32 * scales


@dataclass(frozen=True)
class _Format:
    block: int  # elements per block
    group: int  # elements per scale/bias group
    bits: int
    unpack: Callable[[np.ndarray], Unpacked]


FORMATS: dict[str, _Format] = {
    "Q4_0": _Format(32, 32, 4, _q4_0),
    "Q4_1": _Format(32, 32, 4, _q4_1),
    "Q5_0": _Format(32, 32, 5, _q5_0),
    "Q5_1": _Format(32, 32, 5, _q5_1),
    "Q8_0": _Format(32, 32, 8, _q8_0),
    "Q4_K": _Format(256, 32, 4, _q4_k),
    "Q5_K": _Format(256, 32, 5, _q5_k),
    "Q6_K": _Format(256, 16, 6, _q6_k),
}
SUPPORTED_TYPES = DENSE_TYPES + tuple(FORMATS)


@dataclass(frozen=True, eq=False)
class GGUFQuantized:
    """A quantized ``[N, K]`` GGUF matrix (a :class:`runner.quantized.QuantizedTensor`): its
    blocks as a view of the memory-mapped file, ``uint8 [N, row bytes]``, unpacked on demand.
    ``rows`` is a row order still to apply (see :meth:`take_rows`)."""

    kind: str  # the GGML type name, e.g. "Q4_K"
    shape: tuple[int, int]
    blocks: np.ndarray = field(repr=False)
    rows: np.ndarray | None = field(default=None, repr=False)

    @property
    def group(self) -> int:
        return FORMATS[self.kind].group

    @property
    def bits(self) -> int:
        return FORMATS[self.kind].bits

    @property
    def nbytes(self) -> int:
        """Bytes of its rows' blocks (a view of some rows counts those)."""
        return self.shape[0] * int(self.blocks.shape[1])

    def take_rows(self, order: np.ndarray) -> GGUFQuantized:
        """This tensor with its rows taken in ``order`` (``new[i] = old[order[i]]``: a
        permutation, or some of the rows), lazily: a row is whole blocks, so values, scales
        and biases are taken alike."""
        order = np.asarray(order, dtype=np.intp)
        if order.ndim != 1 or (order.size and not 0 <= order.min() <= order.max() < self.shape[0]):
            raise ValueError(f"row order of shape {order.shape} for {self.shape[0]} rows")
        rows = order if self.rows is None else self.rows[order]
        return replace(self, shape=(len(order), self.shape[1]), rows=rows)

    def unpack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values uint8 [N, K], scales float32 [N, K // group], biases float32 [N, K //
        group])``: the exact affine form of the stored blocks."""
        fmt = FORMATS[self.kind]
        n, k = self.shape
        blocks = self.blocks if self.rows is None else self.blocks[self.rows]
        values, scales, biases = fmt.unpack(blocks.reshape(n * k // fmt.block, -1))
        groups = k // fmt.group
        return values.reshape(n, k), scales.reshape(n, groups), biases.reshape(n, groups)


def dense(t: QuantizedTensor) -> mx.array:
    """The float32 ``[N, K]`` weight of a quantized tensor (``runner.quantized.affine_dense``):
    for loaders that compute with dense weights."""
    return mx.array(affine_dense(*t.unpack()))


def read_tensor(t, path: str) -> mx.array | GGUFQuantized:
    """One ``gguf.ReaderTensor`` as an ``mx.array`` (dense types, in numpy order: GGUF lists
    the row length first) or a lazy :class:`GGUFQuantized`; any other type is refused."""
    kind = t.tensor_type.name
    if kind == "F32" or kind == "F16":
        return mx.array(t.data)
    if kind == "BF16":  # the reader hands bf16 over as bytes
        return mx.array(t.data.view(np.uint16)).view(mx.bfloat16)
    if kind not in FORMATS:
        raise UnsupportedTensorType(
            f"tensor type {kind} is not supported (supported: {', '.join(SUPPORTED_TYPES)})",
            path=path,
            tensor=t.name,
        )
    dims = tuple(int(d) for d in reversed(t.shape.tolist()))
    if len(dims) != 2:
        raise UnsupportedArchitecture(
            f"{kind} tensor of shape {list(dims)}: only quantized matrices are supported",
            path=path,
            tensor=t.name,
        )
    return GGUFQuantized(kind, dims, t.data)


def gguf_reader(path: str, one_pass: bool = True):
    """A ``gguf.GGUFReader`` of ``path`` whose memory map is seen as a plain ndarray (the
    reader slices it once per tensor info, and ``np.memmap``'s per-slice bookkeeping is
    slow; the views still share the map) and, with ``one_pass``, whose metadata is read in
    one pass (``runner.gguf_metadata``: the reader's own numpy views per string made a
    49k-token vocabulary cost seconds; ``scripts/bench/gguf_read.py`` times both)."""
    import gguf  # here: only GGUF files need it (and its ~50 ms import)

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._bytes

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._bytes = value.view(np.ndarray)

        def _build_fields(self, offs: int, count: int) -> int:
            """The metadata; the reader then reads the tensor infos from the offset this
            returns."""
            if not one_pass or self.byte_order != "I":  # refused by ``open_gguf`` once read
                return super()._build_fields(offs, count)
            fields, end = gguf_metadata.read_fields(self._bytes, int(offs), int(count))
            for found in fields.values():
                self._push_field(found, skip_sum=True)
            return end

    return Reader(path)


def open_gguf(path: str):
    """``(reader, metadata)``: the file's ``gguf.GGUFReader`` and its metadata as plain Python
    (str, int, float, bool, lists of them) under its GGUF keys; an unreadable file is
    ``CorruptModelFile``."""
    try:
        reader = gguf_reader(path)
        if reader.byte_order != "I":
            raise ValueError("byte order opposite to this machine's")
        # Plain Python (str, int, float, bool, lists of them); GGUF.* is the header.
        metadata = {
            name: field.contents()
            for name, field in reader.fields.items()
            if not name.startswith("GGUF.")
        }
    except Exception as exc:  # the reader's own checks raise anything from ValueError up
        raise CorruptModelFile(f"cannot read GGUF ({exc})", path=path) from None
    return reader, metadata


def read_gguf_file(path: str) -> tuple[dict[str, mx.array | GGUFQuantized], dict[str, object]]:
    """``(tensors, metadata)`` of a GGUF file: dense tensors as ``mx.array``, quantized ones
    as lazy :class:`GGUFQuantized`, metadata as plain Python under its GGUF keys. An
    unreadable file is ``CorruptModelFile``; a tensor type not in ``SUPPORTED_TYPES`` is
    ``UnsupportedTensorType``, naming the tensor."""
    reader, metadata = open_gguf(path)
    tensors = {t.name: read_tensor(t, path) for t in reader.tensors}
    return tensors, metadata
