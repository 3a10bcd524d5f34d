"""Corrupt or unsupported inputs each raise one clear, typed LoadError naming the culprit."""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest

from protocol import errors
from runner.loader import load_model


def _copy(src: str, dst) -> str:
    dst = os.fspath(dst)
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(errors.ModelFileMissing) as info:
        load_model(str(tmp_path / "nope"))
    assert "nope" in str(info.value)


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert "model.safetensors" in str(info.value)


def test_missing_tokenizer(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "m")
    os.unlink(os.path.join(path, "tokenizer.json"))
    with pytest.raises(errors.TokenizerMissing) as info:
        load_model(path)
    assert "tokenizer.json" in str(info.value)


def test_unknown_model_type(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "mamba9000"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert "mamba9000" in str(info.value) and "config.json" in str(info.value)


def test_wrong_tensor_shape_names_tensor_and_file(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "m")
    weights_path = os.path.join(path, "model.safetensors")
    weights = mx.load(weights_path)
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = mx.zeros((weights[name].shape[0] + 1, weights[name].shape[1]))
    mx.save_safetensors(weights_path, weights)
    with pytest.raises(errors.TensorShapeMismatch) as info:
        load_model(path)
    assert info.value.tensor == name
    assert name in str(info.value) and "model.safetensors" in str(info.value)


def test_missing_tensor(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "m")
    weights_path = os.path.join(path, "model.safetensors")
    weights = mx.load(weights_path)
    del weights["model.norm.weight"]
    mx.save_safetensors(weights_path, weights)
    with pytest.raises(errors.MissingTensor) as info:
        load_model(path)
    assert "model.norm.weight" in str(info.value)


def _write_gguf(path: str, tokenizer_model: str | None) -> str:
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": mx.array(64, dtype=mx.uint32),
        "llama.block_count": mx.array(1, dtype=mx.uint32),
        "llama.feed_forward_length": mx.array(128, dtype=mx.uint32),
        "llama.attention.head_count": mx.array(4, dtype=mx.uint32),
        "llama.attention.head_count_kv": mx.array(2, dtype=mx.uint32),
        "llama.context_length": mx.array(256, dtype=mx.uint32),
    }
    if tokenizer_model is not None:
        meta["tokenizer.ggml.model"] = tokenizer_model
        meta["tokenizer.ggml.tokens"] = ["a", "b", "c"]
    tensors = {"token_embd.weight": mx.zeros((3, 64)), "output_norm.weight": mx.ones((64,))}
    mx.save_gguf(path, tensors, meta)
    return path


def test_gguf_with_an_unsupported_tokenizer_model(tmp_path):
    path = _write_gguf(str(tmp_path / "m.gguf"), "bert")
    with pytest.raises(errors.UnsupportedTokenizer) as info:
        load_model(path)
    assert "'bert'" in str(info.value) and "m.gguf" in str(info.value)


def test_gguf_sentencepiece_vocabulary_without_scores_is_corrupt(tmp_path):
    path = _write_gguf(str(tmp_path / "m.gguf"), "llama")  # tokens, no scores
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert "scores" in str(info.value) and "m.gguf" in str(info.value)


def test_gguf_unknown_architecture(tmp_path):
    path = str(tmp_path / "m.gguf")
    mx.save_gguf(path, {"x": mx.zeros((2,))}, {"general.architecture": "rwkv9"})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert "rwkv9" in str(info.value)


def test_truncated_gguf(default_model, tmp_path):
    path = str(tmp_path / "cut.gguf")
    with open(default_model, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert "cut.gguf" in str(info.value)


def test_not_a_model_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(errors.CorruptModelFile):
        load_model(str(path))
