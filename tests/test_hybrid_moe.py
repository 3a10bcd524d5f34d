"""The MoE hybrids (Qwen3.5-MoE, Qwen3-Next with MoE layers) against transformers, with their
inline MTP heads (a sparse block inside ``mtp.layers.0``) drafting losslessly.

Fixtures: ``tests/fixtures/reference/moe/{qwen3_5_moe,qwen3_5_moe_mlx,qwen3_next_moe}``
(``scripts/fixtures/hybrid_moe.py``): the released Qwen3.5-MoE layout (fused experts, nested
``text_config``, a vision tower), mlx-lm's conversion of it (``switch_mlp``, head dropped), and
a per-expert Qwen3-Next with one dense layer (``mlp_only_layers``) and ``norm_topk_prob``
false.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runner import device, native
from runner.engine import Engine, EngineOptions
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.models import moe, qwen3_5
from tests.test_moe_models import last_logits, run, scripted_rounds, three_turn_chat
from tests.test_reference_models import check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "moe"
CASES = ("qwen3_5_moe", "qwen3_5_moe_mlx", "qwen3_next_moe")
WITH_HEAD = ("qwen3_5_moe", "qwen3_next_moe")


def ref(case: str):
    return reference(f"moe/{case}")


def load(case: str):
    return load_model(str(FIXTURES / case), dtype="float32")


def test_fixtures_hold_the_layouts_and_schedules_they_claim():
    names = set(mx.load(str(FIXTURES / "qwen3_5_moe" / "model.safetensors")))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in names and any(".visual." in n for n in names)
    names = set(mx.load(str(FIXTURES / "qwen3_next_moe" / "model.safetensors")))
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    mlps = [type(layer.mlp).__name__ for layer in load("qwen3_next_moe").model.layers]
    assert mlps == ["SparseMoE", "MLP"] + ["SparseMoE"] * 4  # mlp_only_layers [1]
    for case in ("qwen3_5_moe", "qwen3_5_moe_mlx"):
        model = load(case).model
        assert all(isinstance(layer.mlp, moe.SparseMoE) for layer in model.layers), case
        s = moe.settings(model.args)
        assert (s.norm_topk_prob, s.shared, s.top_k) == (True, "gated", 2)
    assert moe.settings(load("qwen3_next_moe").model.args).norm_topk_prob is False


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case):
    check_model(load(case).model, ref(case), "as loaded")


@pytest.mark.parametrize(
    "tune",
    [{}, {"layout": "packed"}, {"expert_layout": "hf"}, {"compile": False}],
    ids=["default", "packed", "experts-as-loaded", "eager"],
)
@pytest.mark.parametrize("case", WITH_HEAD)
def test_matches_transformers_tuned(case, tune):
    loaded = load(case)
    tuning = device.tune(loaded.model, **tune)
    check_model(loaded.model, ref(case), f"tuned: {tuning.describe()}")


def test_the_mlx_conversion_loads_to_the_same_logits():
    prompts = ref("qwen3_5_moe").prompts
    ours, theirs = load("qwen3_5_moe").model, load("qwen3_5_moe_mlx").model
    for p in prompts:
        assert np.abs(last_logits(ours, p) - last_logits(theirs, p)).max() <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_engine_streams_the_reference_greedy_tokens(case):
    engine = Engine(EngineOptions(model_path=str(FIXTURES / case), use_draft=False))
    for p, prompt in enumerate(ref(case).prompts):
        got, _ = run(engine, prompt, 24)
        assert got == ref(case).greedy[p].tolist(), (case, p)


@pytest.mark.parametrize("case", WITH_HEAD)
def test_the_inline_head_is_a_sparse_gated_attention_block_laid_out_like_the_target(case):
    loaded = load(case)
    head, _ = load_draft_head(loaded)
    block = head.layers[0]
    assert isinstance(block, qwen3_5.AttentionBlock) and isinstance(block.mlp, moe.SparseMoE)
    assert "shared_expert_gate" in block.mlp
    device.tune(loaded.model, head)
    key = "_panels" if native.gathered_available() else "_wt"
    assert key in block.mlp.switch_mlp.down_proj


def test_a_stripped_head_is_reported_as_stripped():
    engine = Engine(EngineOptions(model_path=str(FIXTURES / "qwen3_5_moe_mlx")))
    assert not engine.info.mtp and "stripped" in engine.info.mtp_detail, engine.info.mtp_detail


@pytest.fixture(scope="module", params=WITH_HEAD)
def plain(request):
    case = request.param
    return case, Engine(EngineOptions(model_path=str(FIXTURES / case), use_draft=False))


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_speculation_with_the_inline_head_is_lossless(plain, depth):
    case, engine = plain
    spec = Engine(EngineOptions(model_path=str(FIXTURES / case), draft_depth=depth))
    assert spec.info.mtp and "inline" in spec.info.mtp_detail, spec.info.mtp_detail
    drafted = 0
    for p, prompt in enumerate(ref(case).prompts):
        for budget in (1, 7, 24):
            want, _ = run(engine, prompt, budget)
            got, done = run(spec, prompt, budget)
            assert got == want == ref(case).greedy[p, :budget].tolist(), (depth, p, budget)
            drafted += done.speculation.drafted
    assert drafted > 0


def test_scripted_drafts_accept_and_reject_at_every_depth(plain, monkeypatch):
    """Drafts taken from the plain answer, each wrong with some probability: rounds accept
    every count through the MoE verify rows, and rejections restore the recurrent state."""
    case, engine = plain
    spec = Engine(EngineOptions(model_path=str(FIXTURES / case), draft_depth=4))
    per_depth = scripted_rounds(engine, spec, ref(case).prompts, 9, monkeypatch)
    assert all(count > 0 for count in per_depth[:4]), per_depth


def test_prefix_cache_on_a_three_turn_chat(plain):
    case, _ = plain
    three_turn_chat(str(FIXTURES / case), ref(case).prompts[1], True, seed=4)
