"""The multi-head latent attention families (deepseek_v3, glm4_moe_lite, with their MTP
layers) against transformers, and the latent cache's contract.

The fixtures under ``tests/fixtures/reference/mla/`` (``scripts/fixtures/mla.py``) hold one
tiny checkpoint per family with transformers' logits and greedy tokens, and the MTP layer's
logits computed with transformers' own decoder layer (deepseek_v3: checked against its
``MtpModel`` too).
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tests.test_reference_models as reference_models
from cache.kv import KVCache
from drafting.session import DraftSession
from protocol.errors import CorruptModelFile, UnsupportedArchitecture
from protocol.requests import Completion, Options
from runner import device
from runner.batch import Scheduler
from runner.engine import Engine, EngineOptions
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.models import build_model, mla, moe
from runner.models.mla_config import model_args
from runner.prefill import prefill
from tests.test_engine import complete
from tests.test_hybrid_speculation import assert_same_state, cache_state
from tests.test_moe_models import scripted_propose, scripted_rounds, three_turn_chat
from tests.test_reference_models import ATOL, check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "mla"
CASES = ["deepseek_v3", "glm4_moe_lite"]
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
SAMPLED = {"temperature": 0.8, "seed": 1234}  # Ollama's other defaults (top-k 40, penalty 1.1)
# transformers 5.24's softmax scale for the deepseek_v3 fixture: 20 ** -0.5 times
# (0.1 * 0.8 * ln 4 + 1) ** 2 (yarn, mscale_all_dim 0.8); read off DeepseekV3Attention.scaling.
DEEPSEEK_FIXTURE_SCALE = 0.2759546461363348


def ref(case: str):
    return reference(f"mla/{case}")


def load(case: str, **kwargs):
    return load_model(str(FIXTURES / case), dtype="float32", **kwargs)


def config(case: str, **changes) -> dict:
    cfg = json.loads((FIXTURES / case / "config.json").read_text())
    cfg.update(changes)
    return cfg


# --- fidelity


def test_fixtures_take_every_attention_branch():
    ds, glm = load("deepseek_v3").model, load("glm4_moe_lite").model
    for model in (ds, glm):
        assert {type(layer.mlp).__name__ for layer in model.layers} == {"MLP", "SparseMoE"}
        assert model.rows_refusal() is None
    a, b = ds.layers[0].self_attn, glm.layers[0].self_attn
    assert "q_a_proj" in a and "q_proj" not in a and "q_proj" in b and "q_a_proj" not in b
    assert a.rope.traditional and not b.rope.traditional
    assert a.rope.kind == "yarn" and a.rope.attention_factor != 1.0
    assert math.isclose(a.scale, DEEPSEEK_FIXTURE_SCALE, rel_tol=1e-12)
    assert math.isclose(b.scale, 24**-0.5, rel_tol=1e-12)
    assert "bias" in b.kv_a_proj_with_mqa and "bias" in b.o_proj and "bias" not in a.o_proj
    assert moe.settings(ds.args).n_group == 4 and moe.settings(glm.args).n_group == 1


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case):
    check_model(load(case).model, ref(case), "as loaded")


@pytest.mark.parametrize(
    "tune",
    [{}, {"layout": "hf"}, {"compile": False}, {"layout": "packed"}, {"expert_layout": "hf"}],
    ids=["default", "hf", "eager", "packed", "experts-as-loaded"],
)
@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_tuned(case, tune):
    loaded = load(case)
    tuning = device.tune(loaded.model, **tune)
    check_model(loaded.model, ref(case), f"tuned: {tuning.describe()}")


def force_form(model, monkeypatch, form: str) -> None:
    """Every feed but causal verify-sized ones through one form: "absorbed" (the composed
    kernel) or "expanded" (decode steps too)."""
    monkeypatch.setattr(mla, "serves_blocked", lambda *args: False)
    for layer in model.layers:
        layer.self_attn.expand_rows = 1 if form == "expanded" else None


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("case", CASES)
def test_each_attention_form_matches_transformers(case, form, monkeypatch):
    """The fixtures' feeds take the blocked absorbed form (35, 60 rows) and the row-by-row
    one (12 rows, decode steps) by default; the composed absorbed and the expanded forms
    serve other devices and dtypes."""
    model = load(case).model
    force_form(model, monkeypatch, form)
    check_model(model, ref(case), f"{form} attention")


def attention_inputs(attn, rows: int, keys: int, batch: int = 1, seed: int = 0):
    k = iter(mx.random.split(mx.random.key(seed), 3))
    q = mx.random.normal((batch, attn.n_heads, rows, attn.nope + attn.rope_dim), key=next(k))
    latent = mx.random.normal((batch, 1, keys, attn.rank), key=next(k))
    k_rot = mx.random.normal((batch, 1, keys, attn.rope_dim), key=next(k))
    return q, latent, k_rot


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_absorbed_and_expanded_forms_agree(case, rows):
    attn = load(case).model.layers[1].self_attn
    keys = rows + 23
    q, latent, k_rot = attention_inputs(attn, rows, keys)
    causal = mla.causal_mask(keys - rows, rows)
    boolean = None if causal is None else causal == 0
    for mask in (None, "causal", causal, boolean):
        want = attn.expanded(q, latent, k_rot, mask)
        forms = [attn.absorbed(q, latent, k_rot, mask)]
        if mla.serves_blocked(rows, q.dtype, mask):
            forms.append(attn.absorbed_blocked(q, latent, k_rot, mask))
        for got in forms:
            assert got.shape == (1, attn.n_heads, rows, attn.v_dim)
            assert float(mx.abs(got - want).max()) <= 1e-5, (rows, mask)
    # Left-padded batches: a per-sequence [B, 1, L, T] mask.
    q, latent, k_rot = attention_inputs(attn, rows, keys, batch=2, seed=1)
    padded = mx.where(mx.arange(keys) < 3, -mx.inf, 0.0)  # the second sequence's 3 pads
    per_row = mx.stack([mx.zeros((keys,)), padded])[:, None, None]
    per_row = mx.broadcast_to(per_row, (2, 1, rows, keys))
    got, want = (f(q, latent, k_rot, per_row) for f in (attn.absorbed, attn.expanded))
    assert float(mx.abs(got - want).max()) <= 1e-5


def test_verify_rows_attend_with_the_bits_of_one_row_steps():
    """A causal feed of a few rows gives each row what decoding it alone gives, bit for bit
    (both after the same prefix, tuned as the engine tunes)."""
    model = load("deepseek_v3").model
    device.tune(model)
    prompt = ref("deepseek_v3").prompts[1]
    prefix, tail = prompt[:-5], prompt[-5:]
    fed, steps = model.make_caches(), model.make_caches()
    prefill(model, fed, prefix, 0)
    prefill(model, steps, prefix, 0)
    rows = np.array(model.hidden(mx.array([tail]), fed)[0])
    one = [np.array(model.hidden(mx.array([[t]]), steps)[0, 0]) for t in tail]
    assert np.array_equal(rows, np.stack(one))


def test_a_quantized_kv_b_proj_absorbs_its_dequantized_weight():
    """MLX-quantized ``kv_b_proj`` (a GPU's quantized checkpoint or ``--quantize``): the
    expanded form multiplies the quantized layer, the absorbed one its dequantization, kept
    once."""
    args = model_args(config("glm4_moe_lite", kv_lora_rank=64))
    attn = mla.MLAttention(args)
    attn.kv_b_proj.weight = 0.1 * mx.random.normal(attn.kv_b_proj.weight.shape)
    nn.quantize(attn, group_size=32, bits=8, class_predicate=lambda p, m: p == "kv_b_proj")
    assert isinstance(attn.kv_b_proj, nn.QuantizedLinear)
    q, latent, k_rot = attention_inputs(attn, 3, 20)
    got = attn.absorbed(q, latent, k_rot, "causal")
    kept = attn._dense_kv_b
    w_uk, w_uv = attn.up_projections()
    assert attn._dense_kv_b is kept  # dequantized once
    assert w_uk.shape == (attn.n_heads, attn.nope, 64) and w_uv.shape[1] == attn.v_dim
    want = attn.expanded(q, latent, k_rot, "causal")
    assert float(mx.abs(got - want).max()) <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_pipe_streams_reference_greedy_tokens(case, tmp_path, monkeypatch):
    """The real process (``python -m runner``) serves the family."""
    monkeypatch.setitem(reference_models.PIPE_CASES, case, f"mla/{case}")
    reference_models.test_pipe_streams_reference_greedy_tokens(case, tmp_path)


# --- the latent cache


@pytest.mark.parametrize("case", CASES)
def test_the_cache_holds_the_latent_and_the_rope_key_per_token(case):
    """Per token and layer: kv_lora_rank latent numbers ("keys") and qk_rope_head_dim rotated
    key numbers ("values"), not the heads' keys and values."""
    model = load(case).model
    m = mla.mla_settings(model.args)
    caches = model.make_caches()
    tokens = ref(case).prompts[2]
    model.hidden(mx.array([tokens]), caches)
    mx.eval([c.state for c in caches])
    for cache in caches:
        assert type(cache) is KVCache and cache.offset == len(tokens)
        assert cache.keys.shape[:2] == (1, 1) and cache.keys.shape[3] == m.kv_lora_rank
        assert cache.values.shape[:2] == (1, 1) and cache.values.shape[3] == m.qk_rope_head_dim
        snap = cache.snapshot(0)
        snap.materialise()
        assert snap.nbytes == len(tokens) * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    latent, expanded = mla.cache_bytes_per_token(model.args, itemsize=4)
    heads = model.args.num_attention_heads
    assert latent == len(caches) * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    assert expanded == len(caches) * heads * (m.qk_head_dim + m.v_head_dim) * 4


# The published shapes: DeepSeek-V3's config.json (the keys that size the cache) and
# GLM-4.7-Flash's, which are transformers' Glm4MoeLiteConfig defaults.
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    vocab_size=129280,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)
GLM_4_7_FLASH = dict(
    model_type="glm4_moe_lite",
    hidden_size=2048,
    intermediate_size=10240,
    num_hidden_layers=47,
    num_attention_heads=20,
    vocab_size=154880,
)


def test_cache_bytes_per_token_at_the_published_shapes():
    """bfloat16 caches, all layers (the MTP layer's draft cache adds one layer's worth)."""
    ds, glm = model_args(DEEPSEEK_V3), model_args(GLM_4_7_FLASH)
    assert mla.cache_bytes_per_token(ds) == (61 * 576 * 2, 61 * 128 * 320 * 2)  # 68.6 KiB, 4.8 MiB
    assert mla.cache_bytes_per_token(glm) == (47 * 576 * 2, 47 * 20 * 512 * 2)  # 52.9 KiB, 940 KiB
    # DeepSeek-V3's yarn: mscale_all_dim 1 squares into the softmax scale, cos/sin unscaled.
    assert math.isclose(mla.mla_settings(ds).scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert ds.rope_scaling["attention_factor"] == 1.0
    assert [mla.MLAttention(a).expand_rows for a in (ds, glm)] == [171, 399]


# --- the MTP layer


@pytest.mark.parametrize("case", CASES)
def test_mtp_layer_computes_what_the_checkpoint_layer_computes(case):
    loaded = load(case)
    assert "model.layers.2.mlp.switch_mlp.gate_proj.weight" in loaded.extra_weights
    head, detail = load_draft_head(loaded)
    assert head is not None and "inline" in detail and "deepseek" in detail, detail
    block = head.layers[0]
    assert isinstance(block, mla.MLADecoderLayer) and isinstance(block.mlp, moe.SparseMoE)
    reference_ = ref(case)
    with np.load(reference_.path / "reference.npz") as npz:
        for p in (0, 1):
            prompt = reference_.prompts[p]
            _, hidden = loaded.model.forward(mx.array([prompt]), loaded.model.make_caches())
            cache = KVCache()
            y = head(mx.array([prompt[1:]]), hidden[:, :-1], cache)
            logits = np.array(loaded.model.unembed(y)[0])
            assert np.abs(logits - npz[f"mtp_logits_{p}"]).max() <= ATOL, (case, p)
            assert cache.keys.shape[3] == block.self_attn.rank  # the head's cache is latent too


# --- speculation, the prefix cache, shared forwards


@pytest.fixture(scope="module")
def plain():
    path = str(FIXTURES / "deepseek_v3")
    return Engine(EngineOptions(model_path=path, use_draft=False, prefix_cache=False))


@pytest.fixture(scope="module")
def spec():
    path = str(FIXTURES / "deepseek_v3")
    engine = Engine(EngineOptions(model_path=path, prefix_cache=False, draft_sources=("head",)))
    assert engine.info.mtp and "inline" in engine.info.mtp_detail, engine.info.mtp_detail
    return engine


def run_both(plain: Engine, spec: Engine, prompt, budget: int, depth, options: dict):
    """One request on each engine (``depth`` None: the adaptive controller): the same tokens,
    and the target caches in the same state (the latent caches rewound to what plain decoding
    leaves)."""
    want, _, done, _ = complete(plain, tokens=prompt, num_predict=budget, **options)
    state = cache_state(plain)
    spec.speculation.fixed_depth = depth
    got, _, spec_done, _ = complete(spec, tokens=prompt, num_predict=budget, **options)
    assert got == want, (prompt[:3], budget, depth)
    assert spec_done.done_reason == done.done_reason
    assert_same_state(cache_state(spec), state, (budget, depth))
    assert spec.draft_cache.offset == spec.caches[0].offset
    return spec_done


@pytest.mark.parametrize("depth", [None, 1, 3], ids=["adaptive", "fixed-1", "fixed-3"])
def test_greedy_speculation_with_the_mtp_layer_is_lossless(plain, spec, depth):
    drafted = 0
    reference_ = ref("deepseek_v3")
    for p, prompt in enumerate(reference_.prompts):
        for budget in (1, 7, 24):
            done = run_both(plain, spec, prompt, budget, depth, GREEDY)
            drafted += done.speculation.drafted
        assert complete(spec, tokens=prompt, num_predict=24, **GREEDY)[0] == list(
            reference_.greedy[p]
        )
    # The adaptive controller may park a head this rarely right (it keeps its state across
    # requests); test_adaptive_depth_drafts_and_stays_lossless makes it draft.
    assert drafted > 0 or depth is None


@pytest.mark.parametrize("depth", [None, 2], ids=["adaptive", "fixed-2"])
def test_seeded_speculation_with_the_mtp_layer_is_lossless(plain, spec, depth):
    drafted = 0
    for prompt in ref("deepseek_v3").prompts:
        for seed in (1234, 7):
            done = run_both(plain, spec, prompt, 24, depth, {**SAMPLED, "seed": seed})
            drafted += done.speculation.drafted
    assert drafted > 0 or depth is None


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_adaptive_depth_drafts_and_stays_lossless(plain, options, monkeypatch):
    """Drafts mostly right (the plain answer, one in five replaced): the adaptive controller
    keeps drafting, rounds accept and reject, and the tokens are plain decoding's."""
    path = str(FIXTURES / "deepseek_v3")
    engine = Engine(EngineOptions(model_path=path, prefix_cache=False, draft_sources=("head",)))
    script: list[int] = []
    monkeypatch.setattr(DraftSession, "propose", scripted_propose(script, random.Random(3)))
    accepted = 0
    for prompt in ref("deepseek_v3").prompts:
        want, _, _, _ = complete(plain, tokens=prompt, num_predict=40, **options)
        script[:] = prompt + want
        got, _, done, _ = complete(engine, tokens=prompt, num_predict=40, **options)
        assert got == want
        accepted += done.speculation.accepted
    assert accepted > 0


def test_scripted_drafts_accept_and_reject_through_the_latent_cache(monkeypatch):
    """Drafts from the plain answer, each wrong with some probability: rounds accept and
    reject at every depth, the latent caches rewinding after each rejection."""
    path = str(FIXTURES / "deepseek_v3")
    plain_ = Engine(EngineOptions(model_path=path, use_draft=False))
    spec_ = Engine(EngineOptions(model_path=path, draft_depth=5, draft_sources=("head",)))
    per_depth = scripted_rounds(plain_, spec_, ref("deepseek_v3").prompts, 5, monkeypatch)
    assert all(count > 0 for count in per_depth[:5]), per_depth


def test_glm4_moe_lite_speculates_with_its_mtp_layer():
    path = str(FIXTURES / "glm4_moe_lite")
    engine = Engine(EngineOptions(model_path=path, draft_depth=2, draft_sources=("head",)))
    assert engine.info.mtp, engine.info.mtp_detail
    reference_ = ref("glm4_moe_lite")
    for p, prompt in enumerate(reference_.prompts):
        got, _, done, _ = complete(engine, tokens=prompt, num_predict=24, **GREEDY)
        assert got == reference_.greedy[p].tolist() and done.speculation.drafted > 0


@pytest.mark.parametrize(("case", "draft"), [("deepseek_v3", True), ("glm4_moe_lite", False)])
def test_prefix_cache_gives_the_same_tokens_on_a_three_turn_chat(case, draft):
    three_turn_chat(str(FIXTURES / case), ref(case).prompts[0], draft, seed=11)


@pytest.mark.parametrize("case", CASES)
def test_a_shared_forward_row_equals_a_forward_of_its_own(case):
    """Each row of ``hidden_rows`` attends over its own latent cache with the bits of a
    one-row forward after it (tuned: the panel products do not depend on the row count)."""
    model = load(case).model
    device.tune(model)
    prompts = ref(case).prompts
    solo, caches = [], []
    for prompt in prompts:
        own, shared = model.make_caches(), model.make_caches()
        prefill(model, own, prompt[:-1], 0)
        prefill(model, shared, prompt[:-1], 0)
        solo.append(np.array(model.hidden(mx.array([[prompt[-1]]]), own)[0, 0]))
        caches.append(shared)
    rows = model.hidden_rows(mx.array([p[-1] for p in prompts]), caches)
    for i, prompt in enumerate(prompts):
        assert np.array_equal(np.array(rows[i]), solo[i])
        assert all(c.offset == len(prompt) for c in caches[i])


def test_parallel_completions_give_what_each_gives_alone():
    path = str(FIXTURES / "glm4_moe_lite")
    engine = Engine(EngineOptions(model_path=path, parallel=3, use_draft=False))
    assert engine.parallel == 3, engine.parallel_detail
    prompts = ref("glm4_moe_lite").prompts
    alone = [complete(engine, tokens=p, num_predict=12, **GREEDY)[0] for p in prompts]
    scheduler = Scheduler(engine)
    frames: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        request = Completion(id=str(i), tokens=prompt, options=Options(num_predict=12, **GREEDY))
        scheduler.admit(engine.prepare(request), frames[i].append, lambda: False)
    finished = 0
    while finished < len(prompts):
        finished += len(scheduler.step())
    assert scheduler.shared_steps > 0
    for i, want in enumerate(alone):
        got = [t for f in frames[i] if type(f).__name__ == "Token" for t in f.tokens]
        assert got == want, i


# --- configs and checkpoints the families refuse


@pytest.mark.parametrize(
    ("case", "changes", "key", "error"),
    [
        ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads", UnsupportedArchitecture),
        ("deepseek_v3", {"head_dim": 16}, "head_dim", UnsupportedArchitecture),
        ("deepseek_v3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor", None),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func", UnsupportedArchitecture),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method", UnsupportedArchitecture),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq", UnsupportedArchitecture),
        ("deepseek_v3", {"rope_traditional": True}, "rope_traditional", UnsupportedArchitecture),
        ("deepseek_v3", {"n_group": 3}, "n_group", UnsupportedArchitecture),
        ("deepseek_v3", {"topk_group": 5}, "topk_group", CorruptModelFile),
        ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act", UnsupportedArchitecture),
        ("deepseek_v3", {"kv_lora_rank": "32"}, "kv_lora_rank", CorruptModelFile),
        ("deepseek_v3", {"use_qk_norm": True}, "use_qk_norm", UnsupportedArchitecture),
        ("glm4_moe_lite", {"first_k_dense_replace": 2}, "first_k_dense_replace", None),
        ("glm4_moe_lite", {"mlp_layer_types": ["dense"]}, "mlp_layer_types", CorruptModelFile),
        ("glm4_moe_lite", {"head_dim": 16}, "head_dim", UnsupportedArchitecture),
    ],
)
def test_unsupported_or_malformed_keys_are_refused_by_name(case, changes, key, error):
    with pytest.raises(error or UnsupportedArchitecture) as info:
        build_model(config(case, **changes), path="config.json")
    assert key in str(info.value)


def test_config_defaults_and_aliases_follow_transformers():
    # glm4_moe_lite: head_dim is transformers' alias of qk_rope_head_dim.
    cfg = config("glm4_moe_lite", head_dim=8)
    assert mla.mla_settings(model_args(cfg)).qk_rope_head_dim == 8
    alias = {k: v for k, v in config("glm4_moe_lite").items() if k != "qk_rope_head_dim"}
    alias["head_dim"] = 8
    assert mla.mla_settings(model_args(alias)).qk_rope_head_dim == 8
    # A full-rank query projection only when q_lora_rank is null, not when it is absent.
    absent = {k: v for k, v in config("glm4_moe_lite").items() if k != "q_lora_rank"}
    assert mla.mla_settings(model_args(absent)).q_lora_rank == 768
    # glm4_moe_lite without mlp_layer_types: the first layer dense (transformers' default).
    plain = {k: v for k, v in config("glm4_moe_lite").items() if k != "mlp_layer_types"}
    assert moe.settings(model_args({**plain, "num_hidden_layers": 3})).sparse_layers == (
        False,
        True,
        True,
    )
    ds = moe.settings(model_args(config("deepseek_v3", first_k_dense_replace=2)))
    assert ds.sparse_layers == (False, False)
    # Without yarn's mscale_all_dim the softmax scale is plain qk_head_dim ** -0.5.
    rope = dict(config("deepseek_v3")["rope_scaling"], mscale_all_dim=0)
    assert mla.mla_settings(model_args(config("deepseek_v3", rope_scaling=rope))).scale == 20**-0.5


def test_mlx_lm_split_kv_b_proj_is_refused_by_name(tmp_path):
    target = tmp_path / "split"
    shutil.copytree(FIXTURES / "glm4_moe_lite", target)
    weights = mx.load(str(target / "model.safetensors"))
    weights["model.layers.0.self_attn.embed_q.weight"] = mx.zeros((4, 24, 16))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(str(target))
    assert info.value.tensor == "model.layers.0.self_attn.embed_q.weight"
