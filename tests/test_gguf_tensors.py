"""runner.gguf_tensors: GGUF files written with llama.cpp's own writer (``gguf.GGUFWriter``),
holding random raw blocks of every supported type, read back and checked value for value
against llama.cpp's numpy dequantizer (``gguf.quants.dequantize``); and the default model
against what ``mx.load`` made of it."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from protocol import errors
from runner import gguf as runner_gguf
from runner.gguf_tensors import FORMATS, GGUFQuantized, dense, open_gguf, read_gguf_file
from runner.quantized import affine_dense

# Byte offsets of every block's fp16 fields (d, and dmin or m), per type.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "IQ4_NL": (0,),
}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
GROUP = {"Q6_K": 16}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``uint8 [rows, row bytes]`` of random blocks whose fp16 fields are finite (any sign,
    subnormals included): random bytes, with an all-ones exponent cleared."""
    qtype = T[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        bits = np.ascontiguousarray(raw[:, at : at + 2]).view(np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
        raw[:, at : at + 2] = bits.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    path, tensors: dict[str, tuple[np.ndarray, T | None]], arch: str = "llama", **meta
) -> str:
    """A GGUF file of ``arch`` with ``tensors`` (numpy array, raw GGML type or None) and
    metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_quantized_type_unpacks_to_ggml_values(tmp_path, kind):
    rows, cols = 6, 512
    raw = random_blocks(kind, rows, cols)
    path = write_gguf(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (raw, T[kind])})
    tensors, _ = read_gguf_file(path)
    t = tensors["blk.0.ffn_up.weight"]
    assert isinstance(t, GGUFQuantized)
    assert (t.kind, t.shape, t.bits, t.nbytes) == (kind, (rows, cols), BITS[kind], raw.nbytes)
    assert t.group == GROUP.get(kind, 32)
    values, scales, biases = t.unpack()
    assert values.dtype == np.uint8 and values.shape == (rows, cols)
    assert scales.dtype == biases.dtype == np.float32
    assert scales.shape == biases.shape == (rows, cols // t.group)
    # Random bytes reach the top of the range: no bit of the width is lost.
    assert values.max() == 2**t.bits - 1 and values.min() == 0
    expected = gguf.quants.dequantize(raw, T[kind])
    got = affine_dense(values, scales, biases)
    assert got.shape == expected.shape and np.isfinite(expected).all()
    assert (got == expected).all()  # as values: ggml's -0.0 equals the affine form's +0.0
    assert np.array_equal(np.array(dense(t)), got)


def test_dense_types_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((5, 8)).astype(np.float32)
    f16 = rng.standard_normal((3, 16)).astype(np.float16)
    norm = rng.standard_normal(8).astype(np.float32)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    path = write_gguf(
        tmp_path / "d.gguf",
        {
            "a.weight": (f32, None),
            "b.weight": (f16, None),
            "norm.weight": (norm, None),
            "c.weight": (bf16_bits.view(np.uint8), T.BF16),
        },
    )
    tensors, _ = read_gguf_file(path)
    assert tensors["a.weight"].dtype == mx.float32 and tensors["b.weight"].dtype == mx.float16
    assert np.array_equal(np.array(tensors["a.weight"]), f32)
    assert np.array_equal(np.array(tensors["b.weight"]), f16)
    assert tensors["norm.weight"].shape == (8,)
    assert np.array_equal(np.array(tensors["norm.weight"]), norm)
    c = tensors["c.weight"]
    assert c.dtype == mx.bfloat16 and c.shape == (5, 8)
    truncated = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(np.array(c.astype(mx.float32)), truncated)


def test_metadata_is_plain_python(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        {"x.weight": (np.zeros(4, np.float32), None)},
        **{
            "general.name": "tiny",
            "llama.block_count": 3,
            "llama.rope.freq_base": 10000.0,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.tokens": ["a", "b", "é"],
            "tokenizer.ggml.token_type": [1, 3, 4],
        },
    )
    _, meta = read_gguf_file(path)
    assert not any(k.startswith("GGUF.") for k in meta)
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "tiny"
    assert meta["llama.block_count"] == 3 and type(meta["llama.block_count"]) is int
    assert meta["llama.rope.freq_base"] == 10000.0
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.tokens"] == ["a", "b", "é"]
    assert meta["tokenizer.ggml.token_type"] == [1, 3, 4]


def test_take_rows_permutes_or_picks_whole_rows(tmp_path):
    raw = random_blocks("Q4_K", 8, 256, seed=2)
    path = write_gguf(tmp_path / "p.gguf", {"w": (raw, T.Q4_K)})
    t = read_gguf_file(path)[0]["w"]
    order = np.array([3, 1, 7, 0, 2, 6, 5, 4])
    moved = t.take_rows(order)
    assert moved.shape == t.shape and moved.kind == t.kind and moved.nbytes == t.nbytes
    for got, want in zip(moved.unpack(), t.unpack(), strict=True):
        assert np.array_equal(got, want[order])
    twice = moved.take_rows(order)  # orders compose: row i is old row order[order[i]]
    assert np.array_equal(twice.unpack()[0], t.unpack()[0][order[order]])
    # Some of the rows (a fused stack's halves): those rows, and their bytes only.
    some = moved.take_rows(np.arange(4, 8))
    assert some.shape == (4, 256) and some.nbytes == t.nbytes // 2
    for got, want in zip(some.unpack(), t.unpack(), strict=True):
        assert np.array_equal(got, want[order[4:]])
    with pytest.raises(ValueError):
        t.take_rows(np.array([0, 8]))


def test_llama_qk_rows_unpermute_quantized_as_dense(tmp_path):
    heads, head_dim, cols = 2, 8, 32
    raw = random_blocks("Q8_0", heads * head_dim, cols, seed=3)
    path = write_gguf(tmp_path / "qk.gguf", {"blk.0.attn_q.weight": (raw, T.Q8_0)})
    tensors, _ = read_gguf_file(path)
    config = {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": 1}
    mapped = runner_gguf.map_gguf_tensors(dict(tensors), config)
    q = mapped["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFQuantized)
    stored = dense(tensors["blk.0.attn_q.weight"])
    assert np.array_equal(np.array(dense(q)), np.array(runner_gguf._unpermute_rows(stored, heads)))
    assert not np.array_equal(np.array(dense(q)), np.array(stored))


@pytest.mark.parametrize("kind", ["Q2_K", "IQ4_NL"])
def test_unsupported_type_is_refused_by_name(tmp_path, kind):
    raw = random_blocks(kind, 2, 256)
    path = write_gguf(tmp_path / "u.gguf", {"blk.3.ffn_down.weight": (raw, T[kind])})
    with pytest.raises(errors.UnsupportedTensorType) as info:
        read_gguf_file(path)
    message = str(info.value)
    assert info.value.code == "unsupported_tensor_type"
    assert "blk.3.ffn_down.weight" in message and kind in message and "u.gguf" in message
    assert "Q4_K" in message and "Q6_K" in message  # the supported types


def test_quantized_tensors_that_are_not_matrices_are_refused(tmp_path):
    raw = random_blocks("Q4_0", 4, 64).reshape(2, 2, -1)  # [experts, rows, row bytes]
    path = write_gguf(tmp_path / "e.gguf", {"blk.0.ffn_up_exps.weight": (raw, T.Q4_0)})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        read_gguf_file(path)
    assert "blk.0.ffn_up_exps.weight" in str(info.value) and "[2, 2, 64]" in str(info.value)


def test_unreadable_files_are_corrupt(tmp_path):
    raw = random_blocks("Q4_0", 4, 64)
    path = write_gguf(tmp_path / "ok.gguf", {"w": (raw, T.Q4_0)})
    data = open(path, "rb").read()
    for name, content in [
        ("cut.gguf", data[:-40]),  # the tensor's blocks end early
        ("head.gguf", data[:20]),  # the header ends early
        ("empty.gguf", b""),
        ("text.gguf", b"hello, not a GGUF file"),
    ]:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(errors.CorruptModelFile) as info:
            read_gguf_file(str(bad))
        assert name in str(info.value)


@pytest.mark.default_model
def test_default_model_reads_exactly_as_mx_load(default_model):
    """Every tensor of the default model (Q4_1, one Q8_0, F32 norms): our dense float32 equals
    MLX's own dequantization of the affine triples ``mx.load`` makes of the file."""
    tensors, meta = read_gguf_file(default_model)
    loaded, loaded_meta = mx.load(default_model, return_metadata=True)
    assert set(meta) == set(loaded_meta)
    assert all(runner_gguf._scalar(v) == meta[k] for k, v in loaded_meta.items())
    kinds = set()
    for name, t in tensors.items():
        stem = name.removesuffix(".weight")
        if isinstance(t, mx.array):
            assert np.array_equal(np.array(t), np.array(loaded[name])), name
            continue
        kinds.add(t.kind)
        scales = loaded[f"{stem}.scales"].astype(mx.float32)
        biases = loaded[f"{stem}.biases"].astype(mx.float32)
        want = mx.dequantize(loaded[name], scales, biases, group_size=32, bits=t.bits)
        assert np.array_equal(np.array(dense(t)), np.array(want)), name
    assert kinds == {"Q4_1", "Q8_0"}


def test_metadata_reads_as_the_librarys_own_reader(tmp_path):
    # Every value type, arrays of numbers, strings and arrays, non-ASCII text:
    # the one-pass metadata reader gives what gguf.GGUFReader's fields give, and the reader
    # finds the tensors where its own parse puts them.
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    V = gguf.GGUFValueType
    scalars = [(V.UINT8, 7), (V.INT8, -7), (V.UINT16, 60000), (V.INT16, -3), (V.UINT32, 1 << 31)]
    scalars += [(V.INT32, -(1 << 30)), (V.FLOAT32, 0.1), (V.BOOL, True), (V.UINT64, 1 << 40)]
    scalars += [(V.INT64, -(1 << 40)), (V.FLOAT64, 1e-300), (V.STRING, "naïve ☃")]
    for i, (kind, value) in enumerate(scalars):
        writer.add_key_value(f"test.scalar.{i}", value, kind)
    writer.add_array("test.ints", [3, -1, 4])
    writer.add_array("test.floats", [0.5, 1.25])
    writer.add_array("test.strings", ["a", "", "ünï", "Ġthe"] * 1000)
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", random_blocks("Q8_0", 4, 64), raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = str(tmp_path / "m.gguf")
    reader, metadata = open_gguf(path)
    library = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in library.fields.items() if not k.startswith("GGUF.")}
    # The library flattens an array of arrays (its own note says so); this keeps the nesting.
    assert metadata.pop("test.nested") == [[1, 2], [3]] and expected.pop("test.nested") == [1, 2, 3]
    assert metadata == expected
    assert {k: list(f.types) for k, f in reader.fields.items()} == {
        k: list(f.types) for k, f in library.fields.items()
    }
    assert metadata["test.strings"][2] == "ünï" and metadata["test.bools"] == [True, False]
    ours = [(t.name, t.data_offset, list(t.shape)) for t in reader.tensors]
    assert ours == [(t.name, t.data_offset, list(t.shape)) for t in library.tensors]
