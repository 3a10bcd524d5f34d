"""Gemma 2, Gemma 3 (text) and Phi-3 through the device door and as MTP head blocks.

The reference fixtures judge the numerics (tests/test_reference_models.py, as loaded and after
the default tuning); here every other layout ``runner.device.tune`` offers is checked against
the same references, along with what tuning did to the new blocks, the families' head layers
and the config readers' refusals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from protocol.errors import CorruptModelFile, UnsupportedArchitecture
from runner import device, native
from runner.device import compile_blocks
from runner.loader import load_model
from runner.models import build_model, gemma, head_layer
from runner.models.llama import DecoderLayer
from tests.test_reference_models import check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
CASES = ["gemma2_old", "gemma3_text_old", "gemma3_text_new", "phi3_longrope_new"]
LAYOUTS = [
    {"layout": "hf", "fast_kernels": True},
    {"layout": "packed", "fast_kernels": True},
    {"layout": "packed", "row_layout": True},
    {"layout": "panels"},
    {"layout": "packed", "compile": False},
]


def load(case: str):
    return load_model(str(FIXTURES / case), dtype="float32")


@pytest.mark.parametrize("tune", LAYOUTS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("case", CASES)
def test_every_layout_matches_transformers(case, tune):
    if tune.get("layout") == "panels" and not native.available():
        pytest.skip(f"runner.native: {native.reason()}")
    loaded = load(case)
    head = None
    if tune.get("row_layout"):
        from tests.test_head import random_head

        head = random_head(loaded)
    tuning = device.tune(loaded.model, head, **tune)
    check_model(loaded.model, reference(case), tuning.describe())


def test_phi3_fused_checkpoint_weights_become_the_fused_products():
    loaded = load("phi3_longrope_old")
    device.tune(loaded.model, layout="packed", row_layout=True, compile=False)
    from runner.models.layers import add_row_layout

    add_row_layout(loaded.model)
    for layer in loaded.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert "_qkv_t" in attn and attn.qkv_proj.fused and "_w_rows" not in attn.qkv_proj
        assert "_gate_up_t" in mlp and mlp.gate_up_proj.fused and "_w_rows" not in mlp.gate_up_proj
        assert "_w_rows" in attn.o_proj  # plain products still get the verify-row copy
    if native.available():
        panels = load("phi3_longrope_old")
        device.tune(panels.model, layout="panels", compile=False)
        assert panels.model.layers[0].self_attn["_qkv_t"].ndim == 3
        assert panels.model.layers[0].mlp["_gate_up_t"].ndim == 3


@pytest.mark.parametrize("case", ["gemma2_old", "gemma3_text_new", "phi3_longrope_old"])
def test_blocks_compile_and_the_head_layer_is_the_familys(case):
    loaded = load(case)
    model = loaded.model
    assert compile_blocks(model) == len(model.layers)
    layer = head_layer(model)
    assert type(layer) is type(model.layers[0]) and isinstance(layer, DecoderLayer)
    assert layer.window is None  # a head attends over its whole draft cache
    cache = layer.make_cache()
    x = mx.random.normal((1, 3, model.args.hidden_size))
    y = layer(x, "causal", cache)
    assert y.shape == x.shape and cache.offset == 3


def test_gemma_norm_gain_is_one_plus_w_in_float32():
    norm = gemma.RMSNorm(8, eps=1e-6)
    norm.weight = mx.array([0.001, -0.002, 0.5, 0.0, 0.003, 1.0, -0.5, 0.0004], dtype=mx.bfloat16)
    x = mx.random.normal((2, 8), key=mx.random.key(1))
    got = np.array(norm(x.astype(mx.bfloat16)).astype(mx.float32))
    xf = np.array(x.astype(mx.bfloat16).astype(mx.float32))
    w = np.array(norm.weight.astype(mx.float32))
    want = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * (1.0 + w)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)  # one bfloat16 rounding


def config_of(case: str) -> dict:
    return json.loads((FIXTURES / case / "config.json").read_text())


def test_gemma_layouts_read_alike():
    old, new = (build_model(config_of(f"gemma3_text_{v}")) for v in ("old", "new"))
    assert [layer.window for layer in old.layers] == [16, 16, None]
    for a, b in zip(old.layers, new.layers, strict=True):
        assert a.rope_group == b.rope_group
        assert a.self_attn.rope.base == b.self_attn.rope.base
        assert a.self_attn.rope.scale == b.self_attn.rope.scale
    assert old.layers[0].self_attn.rope.base == 10000.0
    assert old.layers[2].self_attn.rope.base == 1e6 and old.layers[2].self_attn.rope.scale == 0.5
    g2 = build_model(config_of("gemma2_old"))
    assert [layer.window for layer in g2.layers] == [16, None, 16]
    assert g2.layers[0].self_attn.softcap == 1.5 and g2.layers[0].self_attn.scale == 24**-0.5


@pytest.mark.parametrize(
    ("case", "change", "error", "key"),
    [
        ("gemma2_old", {"hidden_activation": "relu"}, UnsupportedArchitecture, "hidden_activation"),
        (
            "gemma3_text_old",
            {"use_bidirectional_attention": True},
            UnsupportedArchitecture,
            "use_bidirectional_attention",
        ),
        (
            "gemma3_text_new",
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            UnsupportedArchitecture,
            "layer_types",
        ),
        ("gemma2_old", {"sliding_window": 0}, CorruptModelFile, "sliding_window"),
        ("phi3_longrope_old", {"hidden_act": "gelu"}, UnsupportedArchitecture, "hidden_act"),
        (
            "phi3_longrope_old",
            {"attn_logit_softcapping": 30.0},
            UnsupportedArchitecture,
            "attn_logit_softcapping",
        ),
    ],
)
def test_unimplemented_keys_are_refused_by_name(case, change, error, key):
    with pytest.raises(error, match=key):
        build_model({**config_of(case), **change}, path="config.json")


def test_phi3_old_longrope_names_and_windows(tmp_path):
    config = config_of("phi3_longrope_old")
    config["rope_scaling"] = {**config["rope_scaling"], "type": "su"}  # Phi-3's first name
    model = build_model(config)
    assert model.layers[0].self_attn.rope.kind == "longrope"
    windowed = build_model({**config, "sliding_window": 8})
    assert [layer.window for layer in windowed.layers] == [8, 8]
    # A windowed Phi-3 runs and equals its own full forward, chunked or not.
    shutil.copytree(FIXTURES / "phi3_longrope_old", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    m = load_model(str(tmp_path / "m"), dtype="float32").model
    tokens = list(range(3, 43))
    caches = m.make_caches()
    parts = [np.array(m.forward(mx.array([tokens[:20]]), caches)[0][0])]
    parts += [np.array(m.forward(mx.array([[t]]), caches)[0][0]) for t in tokens[20:]]
    # LongRoPE's factors depend on how a sequence is fed: up to position 32 every forward uses
    # the short ones, so the rows fed so far equal one forward of those 32 tokens.
    whole = np.array(m.forward(mx.array([tokens[:32]]), m.make_caches())[0][0])
    np.testing.assert_allclose(np.concatenate(parts)[:32], whole, atol=1e-4, rtol=0)
    assert all(c.offset == 40 for c in caches) and caches[0].base >= 0


@pytest.mark.parametrize("case", ["phi3_longrope_old", "phi3_longrope_new"])
def test_phi3_partial_rotary_with_longrope_builds_and_caches_exactly(case, tmp_path):
    """Phi-4-mini's layout: LongRoPE over a partial rotary (its factor tables sized for the
    rotated pairs only). One RoPE per layer, built for the rotated dims: the model loads and
    prefill-then-decode equals one forward over the whole sequence."""
    path = tmp_path / case
    shutil.copytree(FIXTURES / case, path)
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    for key in ("long_factor", "short_factor"):
        rope[key] = rope[key][:4]
    (config["rope_parameters"] if "rope_parameters" in config else config)[
        "partial_rotary_factor"
    ] = 0.5
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(str(path)).model
    attn = model.layers[0].self_attn
    assert attn.rope.dims == attn.head_dim // 2 and attn.rope.kind == "longrope"
    tokens = mx.array([[5, 17, 42, 99, 7, 3, 250, 31, 64, 12]])
    whole, _ = model.forward(tokens, model.make_caches())
    caches = model.make_caches()
    model.forward(tokens[:, :6], caches)
    rows = [model.forward(tokens[:, i : i + 1], caches)[0][0, -1] for i in range(6, 10)]
    np.testing.assert_allclose(np.array(rows[-1]), np.array(whole[0, -1]), atol=1e-4)
