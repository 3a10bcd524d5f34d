"""The Qwen3.5 / Qwen3-Next hybrids: against transformers, their recurrent cache, the weight
conventions, the config reader and the engine path.

The fixtures are ``tests/fixtures/reference/hybrid/<case>/`` (``scripts/fixtures/hybrid.py``:
tiny random float32 checkpoints, transformers' last-prompt logits and 32 greedy tokens per
prompt, in the files ``tests/test_reference_models.py`` reads, whose checks are reused here).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cache.kv import KVCache, WindowSnapshot
from cache.recurrent import RecurrentCache, RecurrentSnapshot
from protocol.errors import CorruptModelFile, UnsupportedArchitecture
from runner import device
from runner.engine import Engine, EngineOptions
from runner.loader import load_model
from runner.models import build_model, head_layer, qwen3_5
from runner.models.gated_delta import gated_delta, normalize_qk, unit_lower_inverse
from runner.prefill import prefill
from tests.test_engine import complete
from tests.test_reference_models import ATOL, Reference, check_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "hybrid"
CASES = ["qwen3_5_mlx", "qwen3_5_text", "qwen3_5_vl", "qwen3_next_dense"]
GREEDY = 32
GREEDY_OPTS = {"temperature": 0.0, "repeat_penalty": 1.0}


@functools.cache
def reference(case: str) -> Reference:
    path = FIXTURES / case
    meta = json.loads((path / "reference.json").read_text(encoding="utf-8"))
    with np.load(path / "reference.npz") as npz:
        prompts = [npz[f"prompt_{i}"].tolist() for i in range(len(meta["prompts"]))]
        return Reference(
            case,
            path,
            meta,
            prompts,
            npz["prompt_logits"],
            npz["greedy"],
            npz["step_logit"],
            npz["final_logits"],
        )


def load_file(path: str) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(path).items()}


def save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    mx.save_safetensors(path, {k: mx.array(v) for k, v in tensors.items()})


def load(case: str | Path):
    return load_model(str(FIXTURES / case), dtype="float32")


def last_logits(model, caches, tokens: list[int]) -> np.ndarray:
    logits, _ = model.forward(mx.array([tokens]), caches)
    return np.array(logits[0, -1])


def recurrent(caches) -> list[RecurrentCache]:
    return [c for c in caches if isinstance(c, RecurrentCache)]


# --- fixtures and fidelity


def test_fixtures_are_complete():
    found = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())
    assert found == CASES
    for case in CASES:
        ref = reference(case)
        for name in (
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "model.safetensors",
        ):
            assert (ref.path / name).is_file(), f"{case}: {name} missing"
        assert ref.greedy.shape == (3, GREEDY), case
        assert ref.meta["eos_token_id"] not in ref.greedy, case
        assert ref.meta["min_greedy_margin"] > 10 * ATOL, case
    vl = load_file(str(FIXTURES / "qwen3_5_vl" / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in vl)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(vl)
    assert any(k.startswith("model.language_model.layers.") for k in vl)
    nxt = load_file(str(FIXTURES / "qwen3_next_dense" / "model.safetensors"))
    config = json.loads((FIXTURES / "qwen3_next_dense" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and not any(k.startswith("mtp.") for k in nxt)
    assert "layer_types" not in config and config["full_attention_interval"] == 3
    mlx = load_file(str(FIXTURES / "qwen3_5_mlx" / "model.safetensors"))
    conv = mlx["language_model.model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape[-1] == 1 and conv.shape[1] == 4  # mlx-lm's [C, K, 1]


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case):
    check_model(load(case).model, reference(case), "as loaded")


TUNINGS = [
    {},  # the default: panels (or packed) weights, compiled blocks, composed kernels
    {"layout": "packed", "compile": False},
    {"layout": "hf", "fast_kernels": True},
]


@pytest.mark.parametrize("tune", TUNINGS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("case", ["qwen3_5_vl", "qwen3_next_dense"])
def test_matches_transformers_tuned(case, tune):
    loaded = load(case)
    tuning = device.tune(loaded.model, **tune)
    check_model(loaded.model, reference(case), tuning.describe())
    linear = [x for x in loaded.model.layers if isinstance(x, qwen3_5.LinearBlock)]
    # Decode steps ran the compiled one-row mixer exactly when the blocks are compiled.
    assert all((x._step is not None) == tuning.compiled for x in linear)


@pytest.mark.parametrize("case", ["qwen3_5_text", "qwen3_next_dense"])
def test_chunked_prefill_is_the_same_model(case):
    """Chunks of 1 (the recurrent step), 3 and 16 rows and the whole prompt at once give the
    reference's last-prompt logits (the chunkwise form and the step agree)."""
    ref, model = reference(case), load(case).model
    prompt = ref.prompts[2]
    rows = {}
    for chunk in (1, 3, 16, len(prompt)):
        caches = model.make_caches()
        prefill(model, caches, prompt[:-1], 0, chunk=chunk)
        rows[chunk] = last_logits(model, caches, prompt[-1:])
        assert np.abs(rows[chunk] - ref.prompt_logits[2]).max() <= ATOL, chunk
    for chunk, row in rows.items():
        assert np.abs(row - rows[len(prompt)]).max() <= ATOL / 2, chunk  # float32 rounding


# --- the recurrent cache


def test_restoring_a_boundary_state_equals_feeding_only_the_prefix():
    model = load("qwen3_5_text").model
    prompt = reference("qwen3_5_text").prompts[1]
    other = [7, 8, 9, 10]
    fresh = model.make_caches()
    want = last_logits(model, fresh, prompt[:26])

    caches = model.make_caches()
    model.forward(mx.array([prompt[:20]]), caches)
    for c in recurrent(caches):
        c.keep(range(21, 29))
    model.forward(mx.array([prompt[20:28]]), caches)  # one 8-row feed keeps 8 states
    assert all(c.can_rewind(24) for c in caches)
    snaps = [c.snapshot(0, 24) for c in caches]
    assert all(
        isinstance(s, RecurrentSnapshot)
        for s, c in zip(snaps, caches, strict=True)
        if isinstance(c, RecurrentCache)
    )
    # Rewind to the boundary and go on: the prefix alone.
    for c in caches:
        c.rewind(24)
    got = last_logits(model, caches, prompt[24:26])
    # The feeds chunk the prompt differently from ``want``'s: float32 rounding apart.
    np.testing.assert_allclose(got, want, atol=ATOL / 2)
    # Move on along another continuation, then restore the snapshots taken at 24.
    model.forward(mx.array([other]), caches)
    assert not any(c.can_rewind(24) for c in recurrent(caches))
    for c, snap in zip(caches, snaps, strict=True):
        assert c.can_restore(snap)
        c.restore(snap)
    assert {c.offset for c in caches} == {24}
    np.testing.assert_allclose(last_logits(model, caches, prompt[24:26]), want, atol=ATOL / 2)


def test_rewinding_where_no_state_is_kept_is_a_clear_error():
    model = load("qwen3_next_dense").model
    caches = model.make_caches()
    model.forward(mx.array([list(range(5, 15))]), caches)
    model.forward(mx.array([list(range(20, 28))]), caches)  # no keep(): only its start is kept
    cache = recurrent(caches)[0]
    assert cache.offset == 18
    assert [p for p in range(19) if cache.can_rewind(p)] == [0, 10, 18]
    with pytest.raises(ValueError, match=r"holds no state at 14 \(held: \[0, 10, 18\]\)"):
        cache.rewind(14)
    assert cache.offset == 18  # nothing moved
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(19)
    assert isinstance(cache.snapshot(0, 14), WindowSnapshot)
    assert not cache.snapshot(0, 14).restorable
    cache.rewind(10)  # the last feed's start state: an unfed suffix
    assert not cache.can_rewind(18)  # states past the rewind are gone
    cache.rewind(0)
    assert cache.conv is None and cache.recurrent is None and cache.offset == 0


def test_nbytes_accounts_every_state_held():
    model = load("qwen3_5_text").model
    h = qwen3_5.settings(model.args)
    channels = 2 * h.key_heads * h.key_dim + h.value_heads * h.value_dim
    one = 4 * ((h.conv_kernel - 1) * channels + h.value_heads * h.key_dim * h.value_dim)
    caches = model.make_caches()
    cache = recurrent(caches)[0]
    assert cache.nbytes == 0
    model.forward(mx.array([list(range(5, 17))]), caches)
    assert cache.nbytes == one  # the state; the start state (zeros) holds no arrays
    assert cache.recurrent.dtype == mx.float32 and cache.conv.shape == (1, 3, channels)
    for c in recurrent(caches):
        c.keep([14, 15, 16])
    model.forward(mx.array([list(range(30, 36))]), caches)
    assert cache.nbytes == 5 * one  # current, the feed's start, three kept boundaries
    snap = cache.snapshot(10, 18)
    assert snap.nbytes == one and cache.snapshot(0, 13).nbytes == 0
    snap.close()
    assert snap.nbytes == 0 and not snap.restorable
    # Pins: only as many copies as the budget holds, the most wanted first.
    cache.set_pins([30, 20, 25], budget=one)
    for c in recurrent(caches):
        if c is not cache:
            c.set_pins(())
    model.forward(mx.array([list(range(40, 54))]), caches)  # passes 20, 25 and 30
    assert cache.snapshot(0, 30).restorable  # the most wanted kept its copy
    assert not cache.snapshot(0, 20).restorable and not cache.snapshot(0, 25).restorable
    cache.reset()
    assert cache.nbytes == 0 and cache.offset == 0


def test_gated_delta_chunkwise_equals_the_recurrence():
    rng = np.random.default_rng(3)
    b, length, hk, hv, dk, dv = 1, 70, 2, 4, 8, 12
    q = mx.array(rng.standard_normal((b, length, hk, dk)), mx.float32)
    k = mx.array(rng.standard_normal((b, length, hk, dk)), mx.float32)
    v = mx.array(rng.standard_normal((b, length, hv, dv)), mx.float32)
    g = mx.array(-rng.uniform(0.01, 0.6, (b, length, hv)), mx.float32)
    beta = mx.array(rng.uniform(0, 1, (b, length, hv)), mx.float32)
    s0 = mx.array(0.1 * rng.standard_normal((b, hv, dk, dv)), mx.float32)
    q, k = normalize_qk(q, k)
    qn, kn = (np.repeat(np.array(x, np.float64), hv // hk, axis=2) for x in (q, k))
    state, ys, states = np.array(s0, np.float64), [], []
    for t in range(length):  # transformers' torch_recurrent_gated_delta_rule, in float64
        state = state * np.exp(np.array(g)[:, t])[..., None, None]
        delta = np.array(v)[:, t] - np.einsum("bhk,bhkv->bhv", kn[:, t], state)
        delta = delta * np.array(beta)[:, t][..., None]
        state = state + kn[:, t][..., :, None] * delta[..., None, :]
        ys.append(np.einsum("bhk,bhkv->bhv", qn[:, t], state))
        states.append(state)
    want = np.stack(ys, axis=1)
    for chunk in (4, 16, 64):
        at = [1, 3, 16, 33, 64, 65, 70]
        y, last, kept = gated_delta(q, k, v, g, beta, s0, states_at=at, chunk=chunk)
        assert np.abs(np.array(y) - want).max() < 1e-5, chunk
        assert np.abs(np.array(last) - states[-1]).max() < 1e-5, chunk
        for r, s in zip(at, kept, strict=True):
            assert np.abs(np.array(s) - states[r - 1]).max() < 1e-5, (chunk, r)
    y, last, _ = gated_delta(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
    assert np.abs(np.array(y)[:, 0] - want[:, 0]).max() < 1e-6
    with pytest.raises(ValueError, match="states_at"):
        gated_delta(q, k, v, g, beta, s0, states_at=[0])


@pytest.mark.parametrize("size", [2, 5, 16, 64])
def test_unit_lower_inverse(size):
    rng = np.random.default_rng(size)
    n = np.tril(rng.uniform(-0.5, 0.5, (3, size, size)), -1).astype(np.float32)
    got = np.array(unit_lower_inverse(mx.array(n)))
    want = np.linalg.inv(np.eye(size) + n.astype(np.float64))
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


# --- weights


def test_conv_weights_are_converted_and_norms_shifted_once():
    raw = load_file(str(FIXTURES / "qwen3_5_text" / "model.safetensors"))
    hf_model, mlx_model = load("qwen3_5_text").model, load("qwen3_5_mlx").model
    conv = raw["model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape[1] == 1  # Hugging Face [C, 1, K]
    loaded = np.array(hf_model.model.layers[0].linear_attn.conv1d.weight)
    np.testing.assert_array_equal(loaded, np.swapaxes(conv, 1, 2))
    np.testing.assert_array_equal(
        loaded, np.array(mlx_model.model.layers[0].linear_attn.conv1d.weight)
    )
    for name, shifted in [
        ("model.norm.weight", True),
        ("model.layers.0.input_layernorm.weight", True),
        ("model.layers.3.self_attn.q_norm.weight", True),
        ("model.layers.0.linear_attn.norm.weight", False),
    ]:
        want = raw[name] + (1.0 if shifted else 0.0)
        path = name.split(".")
        got_hf, got_mlx = hf_model, mlx_model
        for part in path:
            got_hf = got_hf[int(part)] if part.isdigit() else getattr(got_hf, part)
            got_mlx = got_mlx[int(part)] if part.isdigit() else getattr(got_mlx, part)
        np.testing.assert_allclose(np.array(got_hf), want, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(np.array(got_mlx), want, atol=1e-6, err_msg=name)


def test_a_pre_shifted_checkpoint_loads_to_the_same_logits(tmp_path):
    """The text-only checkpoint rewritten as mlx-lm writes its conversions (conv [C, K, 1],
    zero-centred gains plus one) is the same model; shifting it again would not be."""
    src = FIXTURES / "qwen3_5_text"
    raw = load_file(str(src / "model.safetensors"))
    converted = {}
    for name, value in raw.items():
        if name.endswith("conv1d.weight"):
            value = np.ascontiguousarray(np.swapaxes(value, 1, 2))
        elif name == "model.norm.weight" or name.endswith(qwen3_5._SHIFTED):
            value = value + np.float32(1.0)
        converted[name] = value
    dst = tmp_path / "shifted"
    shutil.copytree(src, dst)
    save_file(converted, str(dst / "model.safetensors"))
    check_model(load(dst).model, reference("qwen3_5_text"), "pre-shifted")
    again = {
        k: v + np.float32(1.0) if k == "model.norm.weight" else v for k, v in converted.items()
    }
    save_file(again, str(dst / "model.safetensors"))
    caches = load(dst).model.make_caches()
    row = last_logits(load(dst).model, caches, reference("qwen3_5_text").prompts[0])
    assert np.abs(row - reference("qwen3_5_text").prompt_logits[0]).max() > 100 * ATOL


def test_weight_layouts_are_recognised():
    args = qwen3_5.model_args(json.loads((FIXTURES / "qwen3_5_text" / "config.json").read_text()))
    hf = np.arange(2 * 4, dtype=np.float32).reshape(2, 1, 4)
    weights = {
        "model.layers.0.linear_attn.conv1d.weight": mx.array(hf),
        "model.layers.1.linear_attn.conv1d.weight": mx.array(np.swapaxes(hf, 1, 2)),
    }
    with pytest.raises(CorruptModelFile, match="both"):
        qwen3_5.prepare_weights(weights, {}, args)
    weights = {
        "language_model.model.layers.0.linear_attn.conv1d.weight": mx.array(np.swapaxes(hf, 1, 2)),
        "language_model.model.norm.weight": mx.array([0.5]),
        "language_model.lm_head.weight": mx.array([[1.0]]),
        "model.visual.blocks.0.attn.qkv.weight": mx.array([1.0]),
        "mtp.norm.weight": mx.array([0.25]),
    }
    out, _ = qwen3_5.prepare_weights(weights, {}, args)
    assert sorted(out) == [
        "lm_head.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.norm.weight",
        "mtp.norm.weight",
    ]
    assert out["model.norm.weight"].item() == 0.5  # an mlx-lm conversion: already shifted
    assert out["mtp.norm.weight"].item() == 0.25  # the head's: runner.heads decides


def test_qwen3_next_fused_rows_are_regrouped():
    """``in_proj_qkvz`` rows per key-head group [q, k, v, z] become [all q, all k, all v, all
    z]; ``in_proj_ba`` [b, a] per group becomes [all b, all a]."""
    args = qwen3_5.model_args(
        json.loads((FIXTURES / "qwen3_next_dense" / "config.json").read_text())
    )
    h = qwen3_5.settings(args)
    per = h.value_heads // h.key_heads
    sizes = {"q": h.key_dim, "k": h.key_dim, "v": per * h.value_dim, "z": per * h.value_dim}
    labels = [(part, g) for g in range(h.key_heads) for part in "qkvz" for _ in range(sizes[part])]
    codes = np.array([[10 * "qkvz".index(p) + g] for p, g in labels], np.float32)
    ba = np.array(
        [[10 * j + g] for g in range(h.key_heads) for j in range(2) for _ in range(per)], np.float32
    )
    out, _ = qwen3_5.prepare_weights(
        {
            "model.layers.0.linear_attn.in_proj_qkvz.weight": mx.array(codes),
            "model.layers.0.linear_attn.in_proj_ba.weight": mx.array(ba),
        },
        {},
        args,
    )
    got = np.array(out["model.layers.0.linear_attn.in_proj_qkvz.weight"])[:, 0].tolist()
    want = [
        10 * i + g
        for i, p in enumerate("qkvz")
        for g in range(h.key_heads)
        for _ in range(sizes[p])
    ]
    assert got == want
    got = np.array(out["model.layers.0.linear_attn.in_proj_ba.weight"])[:, 0].tolist()
    assert got == [10 * j + g for j in range(2) for g in range(h.key_heads) for _ in range(per)]


def test_vision_tower_and_head_are_set_aside_from_the_text_model(caplog):
    with caplog.at_level(logging.INFO, logger="mtp_runner.models"):
        loaded = load("qwen3_5_vl")
    assert "21 vision-tower tensors" in caplog.text
    assert len(loaded.model.vision_tensors) == 21
    assert all(k.startswith("model.visual.") for k in loaded.model.vision_tensors)
    assert not any("visual" in k for k, _ in tree_flatten(loaded.model.parameters()))
    assert loaded.extra_weights and all(k.startswith("mtp.") for k in loaded.extra_weights)
    assert not load("qwen3_next_dense").extra_weights


# --- config


def config_of(case: str) -> dict:
    return json.loads((FIXTURES / case / "config.json").read_text())


def kinds(model) -> list[str]:
    return [
        "full" if isinstance(layer, qwen3_5.AttentionBlock) else "linear" for layer in model.layers
    ]


def test_layer_schedule_rope_and_caches():
    nxt = build_model(config_of("qwen3_next_dense"))
    assert kinds(nxt) == ["linear", "linear", "full"] * 2  # full_attention_interval 3
    rope = nxt.layers[2].self_attn.rope
    assert (rope.dims, rope.head_dim, rope.base) == (8, 16, 5e5)  # partial 0.5, top-level theta
    text = build_model(config_of("qwen3_5_vl"))
    assert kinds(text) == ["linear"] * 3 + ["full"]
    assert text.layers[3].self_attn.rope.dims == 8 and text.layers[3].self_attn.rope.base == 1e6
    assert [type(c) for c in text.make_caches()] == [RecurrentCache] * 3 + [KVCache]
    cfg = copy.deepcopy(config_of("qwen3_5_text"))
    del cfg["layer_types"]
    cfg["num_hidden_layers"] = 8
    assert kinds(build_model(cfg)) == (["linear"] * 3 + ["full"]) * 2  # the default interval 4
    cfg["layer_types"] = ["full_attention"] + ["linear_attention"] * 7
    assert kinds(build_model(cfg)) == ["full"] + ["linear"] * 7
    rope_less = copy.deepcopy(config_of("qwen3_next_dense"))
    del rope_less["partial_rotary_factor"]
    assert build_model(rope_less).layers[2].self_attn.rope.dims == 4  # the default 0.25


@pytest.mark.parametrize(
    ("case", "change", "key"),
    [
        ("qwen3_5_text", {"num_experts": 8}, "num_experts"),  # that is qwen3_5_moe
        (
            "qwen3_5_text",
            {"model_type": "qwen3_5_moe_text", "num_experts": 8, "mlp_only_layers": [1]},
            "mlp_only_layers",
        ),  # its reference makes every layer sparse
        (
            "qwen3_5_text",
            {"model_type": "qwen3_5_moe_text", "num_experts": 8, "norm_topk_prob": False},
            "norm_topk_prob",
        ),  # and always renormalises
        ("qwen3_next_dense", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3_next_dense", {"attn_output_gate": False}, "attn_output_gate"),
        ("qwen3_next_dense", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ("qwen3_5_text", {"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ("qwen3_5_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ],
)
def test_refusals_name_the_key(case, change, key):
    cfg = {**config_of(case), **change}
    with pytest.raises(UnsupportedArchitecture, match=key):
        build_model(cfg)


def test_more_active_experts_than_experts_is_malformed():
    cfg = {**config_of("qwen3_next_dense"), "num_experts": 8}  # top-k defaults to 10
    with pytest.raises(CorruptModelFile, match="num_experts_per_tok"):
        build_model(cfg)


def test_dense_layers_of_a_moe_config_are_accepted():
    cfg = {
        **config_of("qwen3_next_dense"),
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": list(range(6)),
    }
    assert kinds(build_model(cfg)) == ["linear", "linear", "full"] * 2


def test_the_head_block_is_gated_attention_and_no_padded_batches():
    model = load("qwen3_5_vl").model
    assert isinstance(head_layer(model), qwen3_5.AttentionBlock)  # tests/test_hybrid_speculation
    with pytest.raises(ValueError, match="no per-sequence mask"):
        model.hidden(mx.array([[5, 6]]), model.make_caches(), mask=mx.zeros((1, 1, 2, 2)))


# --- the engine


@pytest.mark.parametrize("case", ["qwen3_5_vl", "qwen3_next_dense"])
def test_engine_plain_greedy_and_prefix_cache(case):
    ref = reference(case)
    engine = Engine(EngineOptions(model_path=str(ref.path), use_draft=False, prefill_chunk=16))
    runs = [(2, 0), (1, 0), (2, None)]  # the repeat restores a state the first run pinned
    for p, cached in runs:
        ids, _, done, _ = complete(engine, tokens=ref.prompts[p], num_predict=GREEDY, **GREEDY_OPTS)
        assert ids == ref.greedy[p].tolist(), (case, p)
        if cached is not None:
            assert done.prompt_cached_tokens == cached
        else:
            assert 0 < done.prompt_cached_tokens < len(ref.prompts[p])
    # A follow-up turn over the previous answer: restores a kept state, continues exactly.
    turn = ref.prompts[2] + ref.greedy[2].tolist()[:20]
    ids, _, done, _ = complete(engine, tokens=turn, num_predict=12, **GREEDY_OPTS)
    assert ids == ref.greedy[2].tolist()[20:] and done.prompt_cached_tokens > 0
    assert engine.prefix.nbytes > 0


def test_engine_speculates_with_the_inline_head():
    ref = reference("qwen3_5_vl")
    engine = Engine(EngineOptions(model_path=str(ref.path), use_draft=True))
    assert engine.info.mtp and "inline" in engine.info.mtp_detail
    ids, _, _, _ = complete(engine, tokens=ref.prompts[0], num_predict=GREEDY, **GREEDY_OPTS)
    assert ids == ref.greedy[0].tolist()
