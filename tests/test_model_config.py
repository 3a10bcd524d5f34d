"""The config reader and the quantization settings: both config layouts read alike, composite
(``text_config``) checkpoints load, and every key that would change the math without being
implemented is refused with ``unsupported_architecture``, naming the key and the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from drafting.weights import Quantization, QuantSpec, dequantize
from protocol import errors
from protocol.codes import UNSUPPORTED_ARCHITECTURE
from runner.loader import load_model
from runner.models import config as reader
from runner.models import llama
from runner.models.layers import PanelEmbedding
from runner.native import quantized as quantized_panels

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "reference"
TOKENS = [5, 17, 42, 99, 7, 3, 250, 31, 64, 12]


def copy_with_config(src: str, dst, change) -> str:
    """``src`` copied to ``dst`` with ``change(config)`` applied to its config.json."""
    dst = os.fspath(dst)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    change(config)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


def logits(model, tokens=TOKENS) -> np.ndarray:
    return np.array(model.forward(mx.array([tokens]), model.make_caches())[0])


def refused(path: str, key: str) -> errors.UnsupportedArchitecture:
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    exc = info.value
    assert exc.code == UNSUPPORTED_ARCHITECTURE
    assert key in str(exc) and "config.json" in str(exc), str(exc)
    return exc


# --- both layouts, one model


LAYOUT_PAIRS = sorted(
    p.name[: -len("_new")]
    for p in FIXTURES.iterdir()
    if p.name.endswith("_new") and (FIXTURES / (p.name[: -len("_new")] + "_old")).is_dir()
)


@pytest.mark.parametrize("stem", LAYOUT_PAIRS)
def test_old_and_new_layouts_read_as_the_same_model(stem):
    configs = [
        json.loads((FIXTURES / f"{stem}_{lay}" / "config.json").read_text())
        for lay in ("old", "new")
    ]
    if reader.model_type(configs[0]) not in llama.FAMILIES:
        pytest.skip("not a llama-family model")
    old, new = (reader.read_llama_family(c) for c in configs)
    assert old == new


def test_rope_dicts_are_resolved_as_transformers_standardises_them():
    head = dict(head_dim=16, max_position_embeddings=256)
    # A dict without rope_theta takes the top-level one; "type" is the old name.
    spec = reader.rope_spec({"type": "linear", "factor": 2.0}, theta=5e5, **head)
    assert spec == reader.Rope(5e5, {"rope_type": "linear", "factor": 2.0})
    # yarn without a factor: the ratio of the lengths; its attention factor resolved.
    spec = reader.rope_spec(
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}, **head
    )
    assert spec.scaling["factor"] == 4.0
    assert spec.scaling["attention_factor"] == pytest.approx(0.1 * np.log(4) + 1)
    # longrope: a top-level original_max_position_embeddings wins (Phi-3 keeps it there).
    tables = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    spec = reader.rope_spec(
        {"rope_type": "longrope", "original_max_position_embeddings": 128, **tables},
        original_max_position_embeddings=32,
        **head,
    )
    assert spec.scaling["original_max_position_embeddings"] == 32
    # Keys transformers ignores for a type (it warns) are ignored: mrope on a text model.
    assert reader.rope_spec({"rope_type": "default", "mrope_section": [2, 3, 3]}, **head) == (
        reader.Rope(10000.0)
    )


def test_qwen2_window_is_off_without_use_sliding_window(checkpoint_factory):
    path = checkpoint_factory("qwen2", sliding_window=16, use_sliding_window=False)
    args = load_model(path).model.args
    assert args.sliding_window is None and args.layer_types is None


def test_window_fields_follow_transformers():
    base = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "max_position_embeddings": 256,
    }
    read = lambda **kw: reader.read_llama_family(  # noqa: E731
        {**base, **kw}
    )
    got = read(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert got["sliding_window"] == 16
    assert got["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    got = read(model_type="mistral", sliding_window=16)
    assert got["layer_types"] == ["sliding_attention"] * 3
    # mistral's default window (4096) never hides a key in a 256-token context.
    assert read(model_type="mistral")["sliding_window"] == 4096
    assert read(model_type="mistral", sliding_window=None)["sliding_window"] is None
    assert (
        read(model_type="qwen3", sliding_window=None, layer_types=["full_attention"] * 3)[
            "layer_types"
        ]
        is None
    )


# --- composite checkpoints


@pytest.mark.parametrize(
    "prefixes",
    [("language_model.model.", "language_model.lm_head."), ("model.language_model.", "lm_head.")],
    ids=["llava-style", "transformers-5"],
)
def test_text_config_checkpoint_loads_its_language_model(checkpoint_factory, tmp_path, prefixes):
    flat = checkpoint_factory("llama", tie_word_embeddings=False)
    path = tmp_path / "composite"
    shutil.copytree(flat, path)
    config = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in config.items() if k not in ("architectures",)}
    composite = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "clip_vision_model"},
    }
    (path / "config.json").write_text(json.dumps(composite))
    weights = mx.load(str(path / "model.safetensors"))
    model_prefix, head_prefix = prefixes
    renamed = {
        (head_prefix + k[len("lm_head.") :])
        if k.startswith("lm_head.")
        else model_prefix + k[len("model.") :]: v
        for k, v in weights.items()
    }
    renamed["vision_tower.patch_embed.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(path / "model.safetensors"), renamed)
    got = load_model(str(path))
    assert got.context_length == text["max_position_embeddings"]
    np.testing.assert_allclose(logits(got.model), logits(load_model(flat).model), atol=1e-6)


def test_text_config_decides_the_family(tiny_checkpoint, tmp_path):
    def nest(config):
        config["text_config"] = {**config, "model_type": "mamba9000"}

    path = copy_with_config(tiny_checkpoint, tmp_path / "m", nest)
    with pytest.raises(errors.UnsupportedArchitecture, match="mamba9000"):
        load_model(path)


# --- refusals, each naming the key and the config file


def test_unknown_rope_type_is_refused(tiny_checkpoint, tmp_path):
    path = copy_with_config(
        tiny_checkpoint,
        tmp_path / "m",
        lambda c: c.update(rope_scaling={"rope_type": "su-per", "factor": 2.0}),
    )
    exc = refused(path, "rope_scaling.rope_type")
    assert "su-per" in str(exc)


def test_unknown_rope_type_in_the_new_layout_is_refused(tiny_checkpoint, tmp_path):
    def change(config):
        config.pop("rope_theta")
        config["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 1e4}

    refused(copy_with_config(tiny_checkpoint, tmp_path / "m", change), "rope_parameters.rope_type")


def test_per_layer_type_ropes_that_differ_are_refused(checkpoint_factory, tmp_path):
    def change(config):
        # A window longer than the context: harmless, but both layer types are declared.
        config.update(use_sliding_window=True, sliding_window=4096)
        config["layer_types"] = ["full_attention", "sliding_attention"]
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }

    src = checkpoint_factory("qwen2")
    refused(copy_with_config(src, tmp_path / "m", change), "rope_parameters")


def test_per_layer_type_ropes_that_agree_are_one_rope(checkpoint_factory, tmp_path):
    def change(config):
        config.update(use_sliding_window=True, sliding_window=4096)
        config["layer_types"] = ["full_attention", "sliding_attention"]
        same = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        config["rope_parameters"] = {"full_attention": same, "sliding_attention": dict(same)}

    src = checkpoint_factory("qwen2")
    args = load_model(copy_with_config(src, tmp_path / "m", change)).model.args
    assert args.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("attention_chunk_size", 8),  # chunked attention (llama 4)
        ("hidden_act", "gelu"),
        ("partial_rotary_factor", 0.5),
        ("attn_logit_softcapping", 30.0),
        ("use_qk_norm", True),
        ("rope_interleaved", True),
        ("layer_types", ["full_attention", "chunked_attention"]),
    ],
)
def test_unimplemented_attention_and_model_features_are_refused(
    tiny_checkpoint, tmp_path, key, value
):
    path = copy_with_config(tiny_checkpoint, tmp_path / "m", lambda c: c.update({key: value}))
    refused(path, key)


def test_llama_window_that_applies_is_refused(tiny_checkpoint, tmp_path):
    # transformers' llama masks causally but keeps a windowed cache: no model to reproduce.
    path = copy_with_config(tiny_checkpoint, tmp_path / "m", lambda c: c.update(sliding_window=16))
    refused(path, "sliding_window")


def test_neutral_values_and_inference_irrelevant_keys_load(tiny_checkpoint, tmp_path):
    neutral = {
        "rope_interleaved": False,
        "use_mrope": False,
        "pretraining_tp": 4,
        "attention_dropout": 0.1,
        "attn_logit_softcapping": None,
        "hidden_act": "silu",
        "sliding_window": 4096,
        "initializer_range": 0.5,
        "use_cache": False,
    }
    path = copy_with_config(tiny_checkpoint, tmp_path / "m", lambda c: c.update(neutral))
    np.testing.assert_array_equal(
        logits(load_model(path).model), logits(load_model(tiny_checkpoint).model)
    )


def test_missing_required_rope_key_is_a_corrupt_config(tiny_checkpoint, tmp_path):
    scaling = {"type": "longrope", "long_factor": [2.0] * 8}  # no short_factor
    path = copy_with_config(
        tiny_checkpoint, tmp_path / "m", lambda c: c.update(rope_scaling=scaling)
    )
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert "rope_scaling.short_factor" in str(info.value) and "config.json" in str(info.value)


def test_llama3_frequency_bands_default_as_mlx_lm_reads_them():
    head = dict(head_dim=16, max_position_embeddings=256)
    given = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    full = {**given, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert reader.rope_spec(given, **head) == reader.rope_spec(full, **head)


def test_unused_tensor_of_a_known_module_is_refused(tiny_checkpoint, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, path)
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.bias"] = mx.zeros((64,))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(str(path))
    assert info.value.tensor == "model.layers.0.self_attn.q_proj.bias"
    assert "model.safetensors" in str(info.value)


# --- quantization


QUANTIZED = "llama_q_mixed_4_6"


def test_unknown_quantization_mode_is_refused(tmp_path):
    def change(config):
        config["quantization"]["mode"] = "mxfp4"

    exc = refused(
        copy_with_config(str(FIXTURES / QUANTIZED), tmp_path / "m", change), "quantization.mode"
    )
    assert "mxfp4" in str(exc)


def test_per_layer_quantization_mode_is_refused(tmp_path):
    layer = "model.layers.0.mlp.down_proj"

    def change(config):
        config["quantization"][layer]["mode"] = "nvfp4"

    refused(
        copy_with_config(str(FIXTURES / QUANTIZED), tmp_path / "m", change),
        f"quantization.{layer}.mode",
    )


def test_foreign_quantization_method_is_refused(tiny_checkpoint, tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    path = copy_with_config(
        tiny_checkpoint, tmp_path / "m", lambda c: c.update(quantization_config=gptq)
    )
    refused(path, "quantization_config.quant_method")


@pytest.mark.parametrize("case", ["llama_q_mixed_4_6", "llama_q_mixed_8_4"])
def test_kept_quantized_layers_have_their_own_bits(case, exact_products):
    import mlx.nn as nn

    path = str(FIXTURES / case)
    config = json.loads((FIXTURES / case / "config.json").read_text())["quantization"]
    kept = load_model(path, dtype="float32", keep_quantized=True)
    assert kept.quantized
    modules = dict(kept.model.named_modules())
    for name, entry in config.items():
        if isinstance(entry, dict):
            module = modules[name]
            if mx.default_device() == mx.cpu:  # runner.native's quantized panels
                panels = module._table if isinstance(module, PanelEmbedding) else module._wt
                width = quantized_panels.kernel_bits(entry["bits"])  # 6 bits run widened to 8
                assert quantized_panels.layout(panels)[1:3] == (entry["group_size"], width), name
            else:
                assert isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding), name
                assert (module.bits, module.group_size) == (entry["bits"], entry["group_size"])
    dense = load_model(path, dtype="float32", keep_quantized=False)
    np.testing.assert_allclose(logits(kept.model), logits(dense.model), atol=1e-4)


def test_dequantizing_casts_scales_to_float32_first():
    w = mx.random.normal((8, 64), key=mx.random.key(0))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    weights = {
        "x.weight": packed,
        "x.scales": scales.astype(mx.float16),
        "x.biases": biases.astype(mx.float16),
    }
    dequantize(weights, 32)
    s32, b32 = (t.astype(mx.float16).astype(mx.float32) for t in (scales, biases))
    want = mx.dequantize(packed, s32, b32, group_size=32, bits=4)
    assert weights["x.weight"].dtype == mx.float32 and set(weights) == {"x.weight"}
    assert mx.array_equal(weights["x.weight"], want)


def test_bits_the_tensors_contradict_name_the_tensor_and_file(tmp_path):
    layer = "model.layers.1.mlp.down_proj"

    def change(config):
        config["quantization"][layer]["bits"] = 4  # the file holds 6 bits

    path = copy_with_config(str(FIXTURES / QUANTIZED), tmp_path / "m", change)
    with pytest.raises(errors.TensorShapeMismatch) as info:
        load_model(path)
    assert info.value.tensor == f"{layer}.weight"
    assert "model.safetensors" in str(info.value) and "4-bit" in str(info.value)


def test_broken_scales_name_the_tensor_and_file(tmp_path):
    path = tmp_path / "m"
    shutil.copytree(FIXTURES / QUANTIZED, path)
    weights = mx.load(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.scales"
    weights[name] = weights[name][:, :0]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    for keep in (False, True):
        with pytest.raises(errors.LoadError) as info:
            load_model(str(path), keep_quantized=keep)
        assert info.value.tensor and "q_proj" in info.value.tensor
        assert "model.safetensors" in str(info.value)


def test_layer_listed_dense_with_scales_is_corrupt(tmp_path):
    layer = "model.layers.0.mlp.up_proj"

    def change(config):
        config["quantization"][layer] = False

    path = copy_with_config(str(FIXTURES / QUANTIZED), tmp_path / "m", change)
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert info.value.tensor == f"{layer}.scales"


def test_quantization_settings_are_read_as_mlx_lm_writes_them():
    config = json.loads((FIXTURES / QUANTIZED / "config.json").read_text())
    quant = Quantization.from_config(config, path="config.json")
    assert quant.default == QuantSpec(64, 4)
    assert quant.layers["lm_head"] == QuantSpec(64, 6)
    assert Quantization.from_config({"vocab_size": 3}, path=None) is None
    # Only a foreign quantization_config is refused; mlx-lm's copy of "quantization" is fine.
    assert Quantization.from_config(
        {"quantization_config": {"bits": 8, "group_size": 32}}, path=None
    ).default == QuantSpec(32, 8)


# --- through the real pipe


def test_refused_config_is_one_error_frame_and_exit_one(tiny_checkpoint, tmp_path):
    path = copy_with_config(
        tiny_checkpoint,
        tmp_path / "m",
        lambda c: c.update(rope_scaling={"rope_type": "su-per", "factor": 2.0}),
    )
    out = subprocess.run(
        [sys.executable, "-m", "runner", "--model", path, "--no-draft"],
        cwd=ROOT,
        input=b"",
        capture_output=True,
        timeout=120,
    )
    frames = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    frames = [f for f in frames if f["type"] != "progress"]
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == UNSUPPORTED_ARCHITECTURE
    assert "rope_scaling.rope_type" in frames[0]["message"]
    assert "config.json" in frames[0]["message"]
    assert out.returncode == 1, out.stderr[-2000:]


# --- GGUF metadata goes through the same rule


def _gguf(path: str, **extra) -> str:
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": mx.array(64, dtype=mx.uint32),
        "llama.block_count": mx.array(1, dtype=mx.uint32),
        "llama.feed_forward_length": mx.array(128, dtype=mx.uint32),
        "llama.attention.head_count": mx.array(4, dtype=mx.uint32),
        "llama.context_length": mx.array(256, dtype=mx.uint32),
        **extra,
    }
    mx.save_gguf(path, {"token_embd.weight": mx.zeros((3, 64))}, meta)
    return path


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.rope.scaling.type", "yarn"),
        ("llama.expert_count", mx.array(8, dtype=mx.uint32)),
        ("llama.rope.dimension_count", mx.array(8, dtype=mx.uint32)),
        ("llama.attention.sliding_window", mx.array(16, dtype=mx.uint32)),
    ],
)
def test_gguf_keys_that_change_the_math_are_refused(tmp_path, key, value):
    path = _gguf(str(tmp_path / "m.gguf"), **{key: value})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert key in str(info.value) and "m.gguf" in str(info.value)
