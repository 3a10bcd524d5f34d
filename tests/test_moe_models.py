"""The MoE families (qwen3_moe, glm4_moe with its MTP layer) against transformers, and the sparse
block's own contract.

The fixtures under ``tests/fixtures/reference/moe/`` (``scripts/fixtures/moe.py``) hold each
model in three expert layouts (per expert as transformers 5.24 saves it, transformers 5's
fused ``gate_up_proj``, mlx-lm's ``switch_mlp``) with transformers' logits and greedy tokens;
the GLM cases also carry an MTP layer (``model.layers.{N}``) and its logits computed with
transformers' own decoder layer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from cache.kv import KVCache
from drafting.session import DraftSession
from protocol.errors import CorruptModelFile, MissingTensor, UnsupportedArchitecture
from protocol.requests import Completion, Options
from runner import device, native
from runner.device import fuse_projections, to_panel_layout
from runner.engine import Engine, EngineOptions
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.models import build_model, layers, moe
from runner.models.layers import pack_for_cpu
from runner.quantized import MlxAffine, affine_dense
from tests.checkpoints import random_weights
from tests.test_reference_models import ATOL, check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "moe"
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", "qwen3_moe_fused", "qwen3_moe_mlx"),
    "glm4_moe": ("glm4_moe", "glm4_moe_fused", "glm4_moe_mlx"),
}
CASES = [case for cases in FAMILIES.values() for case in cases]
GREEDY = {"temperature": 0, "repeat_penalty": 1.0}


def ref(case: str):
    return reference(f"moe/{case}")


def load(case: str, **kwargs):
    return load_model(str(FIXTURES / case), dtype=kwargs.pop("dtype", "float32"), **kwargs)


def run(engine: Engine, tokens: list[int], budget: int):
    frames: list = []
    request = Completion(id="r", tokens=tokens, options=Options(num_predict=budget, **GREEDY))
    engine.run(engine.prepare(request), frames.append, lambda: False)
    done = frames[-1]
    assert type(done).__name__ == "Done", frames
    return [t for f in frames if type(f).__name__ == "Token" for t in f.tokens], done


def last_logits(model, prompt: list[int]) -> np.ndarray:
    logits, _ = model.forward(mx.array([prompt]), model.make_caches())
    return np.array(logits[0, -1].astype(mx.float32))


# --- fidelity


def test_fixtures_cover_both_layer_kinds_and_three_layouts():
    for cases in FAMILIES.values():
        for case in cases:
            assert (FIXTURES / case / "reference.json").is_file(), case
            layers = load(case).model.layers
            kinds = {type(layer.mlp).__name__ for layer in layers}
            assert kinds == {"MLP", "SparseMoE"}, (case, kinds)
    names = set(mx.load(str(FIXTURES / "qwen3_moe" / "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in set(
        mx.load(str(FIXTURES / "qwen3_moe_fused" / "model.safetensors"))
    )
    assert "model.layers.1.mlp.switch_mlp.up_proj.weight" in set(
        mx.load(str(FIXTURES / "glm4_moe_mlx" / "model.safetensors"))
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case):
    check_model(load(case).model, ref(case), "as loaded")


@pytest.mark.parametrize(
    "tune",
    [
        {},
        {"layout": "hf", "fast_kernels": True},
        {"compile": False},
        {"layout": "packed"},
        {"expert_layout": "hf"},
    ],
    ids=["default", "hf-fast", "eager", "packed", "experts-as-loaded"],
)
@pytest.mark.parametrize("case", ["qwen3_moe", "glm4_moe_fused"])
def test_matches_transformers_tuned(case, tune):
    loaded = load(case)
    tuning = device.tune(loaded.model, **tune)
    check_model(loaded.model, ref(case), f"tuned: {tuning.describe()}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_three_layouts_load_to_identical_logits(family):
    first, *others = FAMILIES[family]
    prompts = ref(first).prompts
    want = [last_logits(load(first).model, p) for p in prompts]
    for case in others:
        model = load(case).model
        for p, row in zip(prompts, want, strict=True):
            assert np.abs(last_logits(model, p) - row).max() <= 1e-6, case


@pytest.mark.parametrize("case", CASES)
def test_engine_streams_the_reference_greedy_tokens(case):
    engine = Engine(EngineOptions(model_path=str(FIXTURES / case), use_draft=False))
    reference_ = ref(case)
    for p, prompt in enumerate(reference_.prompts):
        got, done = run(engine, prompt, 24)
        assert got == reference_.greedy[p].tolist(), (case, p)
        assert done.done_reason == "length"


@pytest.mark.parametrize("case", ["glm4_moe", "glm4_moe_fused"])
def test_glm_mtp_layer_computes_what_the_checkpoint_layer_computes(case):
    loaded = load(case)
    # The target keeps the MTP layer aside, its experts stacked like its own.
    assert "model.layers.2.mlp.switch_mlp.gate_proj.weight" in loaded.extra_weights
    assert not any(".experts." in name for name in loaded.extra_weights)
    head, detail = load_draft_head(loaded)
    assert head is not None and "inline" in detail and "deepseek" in detail, detail
    assert isinstance(head.layers[0].mlp, moe.SparseMoE)
    reference_ = ref(case)
    with np.load(reference_.path / "reference.npz") as npz:
        for p in (0, 1):
            prompt = reference_.prompts[p]
            _, hidden = loaded.model.forward(mx.array([prompt]), loaded.model.make_caches())
            y = head(mx.array([prompt[1:]]), hidden[:, :-1], KVCache())
            logits = np.array(loaded.model.unembed(y)[0])
            assert np.abs(logits - npz[f"mtp_logits_{p}"]).max() <= ATOL, (case, p)


def test_glm_router_stays_float32_in_a_bfloat16_model():
    model = load("glm4_moe", dtype="bfloat16").model
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == mx.float32 and gate.e_score_correction_bias.dtype == mx.float32
    assert model.layers[1].mlp.switch_mlp.up_proj.weight.dtype == mx.bfloat16
    exact = load("glm4_moe").model.layers[1].mlp.gate.e_score_correction_bias
    assert mx.array_equal(gate.e_score_correction_bias, exact)


# --- the sparse block


def block_and_rows(case: str, layer: int, rows: int = 24, seed: int = 3):
    mlp = load(case).model.layers[layer].mlp
    assert isinstance(mlp, moe.SparseMoE)
    x = mx.random.normal((1, rows, mlp.gate.weight.shape[1]), key=mx.random.key(seed))
    return mlp, x


@pytest.mark.parametrize(("case", "layer"), [("qwen3_moe", 0), ("glm4_moe", 1)])
@pytest.mark.parametrize("rows", [3, 40], ids=["few-rows", "sorted-rows"])
def test_only_the_selected_experts_are_computed(case, layer, rows):
    """Perturbing an expert's matrices changes exactly the rows routed to it."""
    mlp, x = block_and_rows(case, layer, rows)
    experts, _ = moe.route(mlp.gate, x.reshape(rows, -1), mlp.settings)
    chosen = np.array(experts)
    before = np.array(mlp(x)[0])
    switch = mlp.switch_mlp
    for expert in range(mlp.settings.num_experts):
        saved = {n: getattr(switch, n).weight for n in moe.PROJECTIONS}
        for n in moe.PROJECTIONS:
            w = saved[n]
            getattr(switch, n).weight = w + 0.5 * (mx.arange(w.shape[0]) == expert)[:, None, None]
        after = np.array(mlp(x)[0])
        for n in moe.PROJECTIONS:
            getattr(switch, n).weight = saved[n]
        uses = (chosen == expert).any(axis=1)
        assert np.array_equal(after[~uses], before[~uses]), expert
        assert (np.abs(after[uses] - before[uses]).max(axis=1) > 1e-3).all(), expert


def numpy_route(logits: np.ndarray, s: moe.MoESettings, bias: np.ndarray | None):
    """transformers' routers in numpy (float64): the selected set and each expert's weight."""
    if s.scoring == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, : s.top_k]
        w = np.take_along_axis(p, top, -1)
        return top, (w / w.sum(-1, keepdims=True) if s.norm_topk_prob else w)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    grouped = choice.reshape(len(choice), s.n_group, -1)
    rating = np.sort(grouped, -1)[..., -2:].sum(-1)
    keep = np.argsort(-rating, -1)[:, : s.topk_group]
    mask = np.zeros_like(rating, bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(mask[..., None], grouped, -np.inf).reshape(len(choice), -1)
    top = np.argsort(-choice, axis=-1)[:, : s.top_k]
    w = np.take_along_axis(scores, top, -1)
    if s.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return top, w * s.routed_scaling_factor


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"norm_topk_prob": False},
        {"top_k": 3},
        {"scoring": "sigmoid", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        {"scoring": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 1.0},
        {"scoring": "sigmoid", "n_group": 2, "topk_group": 1, "top_k": 3},
    ],
)
def test_routing_follows_transformers(change):
    s = moe.MoESettings(
        num_experts=8,
        top_k=2,
        intermediate_size=4,
        scoring="softmax",
        norm_topk_prob=True,
        sparse_layers=(True,),
        correction_bias=change.get("scoring") == "sigmoid",
    )
    s = dataclasses.replace(s, **change)
    gate = moe.Router(16, s)
    gate.weight = mx.random.normal((8, 16), key=mx.random.key(1))
    bias = None
    if s.correction_bias:
        gate.e_score_correction_bias = 0.3 * mx.random.normal((8,), key=mx.random.key(2))
        bias = np.array(gate.e_score_correction_bias, np.float64)
    x = mx.random.normal((50, 16), key=mx.random.key(0))
    experts, weights = moe.route(gate, x, s)
    logits = np.array(x, np.float64) @ np.array(gate.weight, np.float64).T
    want_experts, want_weights = numpy_route(logits, s, bias)
    got = np.array(experts)
    for row in range(len(got)):
        order = np.argsort(got[row])
        assert sorted(got[row]) == sorted(want_experts[row]), row
        want = dict(zip(want_experts[row], want_weights[row], strict=True))
        assert np.allclose(
            np.array(weights[row])[order], [want[e] for e in got[row][order]], atol=1e-5
        )


def test_gated_shared_expert_adds_its_sigmoid_gated_output():
    """Qwen3-Next's shared expert (``shared="gated"``), for the hybrid family's MoE layers."""
    qwen = load("qwen3_moe").model
    s = dataclasses.replace(moe.settings(qwen.args), shared="gated", shared_intermediate_size=24)
    args = dataclasses.replace(qwen.args, extra={**qwen.args.extra, "moe": s})
    block = moe.SparseMoE(args, s)
    block.update(qwen.layers[0].mlp.parameters())
    block.shared_expert_gate.weight = mx.random.normal((1, 64), key=mx.random.key(4))
    x = mx.random.normal((1, 5, 64), key=mx.random.key(5))
    routed = qwen.layers[0].mlp(x)
    gate = mx.sigmoid(x @ block.shared_expert_gate.weight.T)
    want = routed + gate * block.shared_expert(x)
    assert mx.allclose(block(x), want, atol=1e-5)
    assert not mx.allclose(block(x), routed, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_experts_stay_quantized_and_agree_with_their_dequantization(bits):
    mlp, x = block_and_rows("qwen3_moe", 0, rows=20)
    dense = mlp(x)
    nn.quantize(
        mlp,
        group_size=32,
        bits=bits,
        class_predicate=lambda _, m: (
            isinstance(m, moe.SwitchLinear) and m.weight.shape[-1] % 32 == 0
        ),
    )
    quantized = [
        n
        for n in moe.PROJECTIONS
        if isinstance(getattr(mlp.switch_mlp, n), moe.QuantizedSwitchLinear)
    ]
    assert quantized == ["gate_proj", "up_proj"]  # down_proj's 16 inputs: no group of 32
    y = mlp(x)
    for n in quantized:  # the same block with the dequantized matrices, dense
        layer = getattr(mlp.switch_mlp, n)
        twin = moe.SwitchLinear(1, 1, 1)
        twin.weight = layer.dequantized()
        setattr(mlp.switch_mlp, n, twin)
    assert mx.allclose(y, mlp(x), atol=1e-5)
    error = float(mx.abs(y - dense).max() / mx.abs(dense).max())
    assert error < (0.1 if bits == 4 else 0.01), error


def test_quantized_checkpoint_keeps_gather_qmm_experts(tmp_path):
    """mlx-lm's quantized switch_mlp triples: kept quantized (quantized expert panels on the
    CPU), within quantization tolerance of the float model and of their own dequantization."""
    source = FIXTURES / "qwen3_moe_mlx"
    target = tmp_path / "q"
    shutil.copytree(source, target)
    weights = mx.load(str(source / "model.safetensors"))
    for name in [n for n in weights if ".switch_mlp." in n and "down_proj" not in n]:
        w, s, b = mx.quantize(weights.pop(name), 32, 8)
        stem = name[: -len(".weight")]
        weights.update({f"{stem}.weight": w, f"{stem}.scales": s, f"{stem}.biases": b})
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (target / "config.json").write_text(json.dumps(config))
    kept = load_model(str(target), dtype="float32", keep_quantized=True)
    switch = kept.model.layers[0].mlp.switch_mlp
    if mx.default_device() == mx.cpu and native.gathered_quantized_available():
        # Quantized expert panels: the gathered product over the stored values.
        assert kept.quantized and switch.up_proj._panels.dtype == mx.uint8
        assert "weight" not in switch.up_proj
    elif mx.default_device() == mx.cpu:
        assert not kept.quantized and isinstance(switch.up_proj, moe.SwitchLinear)
    else:
        assert kept.quantized and isinstance(switch.up_proj, moe.QuantizedSwitchLinear)
    assert isinstance(switch.down_proj, moe.SwitchLinear)
    flat = load_model(str(target), dtype="float32", keep_quantized=False)
    if mx.default_device() == mx.cpu and native.gathered_quantized_available():
        # Tuned, the float down projection joins the quantized ones in expert panels.
        device.tune(kept.model, compile=False)
        assert switch.down_proj._panels.dtype == mx.float32 and "weight" not in switch.down_proj
        assert switch.up_proj._panels.dtype == mx.uint8
    for prompt in ref("qwen3_moe").prompts:
        a, b = last_logits(kept.model, prompt), last_logits(flat.model, prompt)
        # int8 activations (the default quantized product) against float32 products
        assert np.abs(a - b).max() <= 2e-4 * np.abs(b).max()
        exact = last_logits(load("qwen3_moe").model, prompt)
        assert np.abs(a - exact).max() < 0.02 * np.abs(exact).max()  # 8-bit, groups of 32


# --- expert layouts (runner.device.tune -> moe.lay_out_experts)

LAYOUTS = ["packed"] + (["panels"] if native.gathered_available() else [])


def expert_block(case: str, layer: int, layout: str):
    """The MoE block of ``layer`` as loaded and a second copy with its experts in ``layout``."""
    loaded, laid = load(case).model.layers[layer].mlp, load(case).model.layers[layer].mlp
    assert moe.lay_out_experts(laid, layout) == 1
    return loaded, laid


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("case", "layer"), [("qwen3_moe", 0), ("glm4_moe", 1)])
def test_laid_out_experts_compute_what_the_loaded_ones_do(case, layer, layout):
    """Every row count a decode step, a verify or a prefill chunk feeds (the sorted path from
    SORT_MIN_PAIRS pairs on): the laid-out block within float32 rounding of the loaded one,
    the loaded copies of what moved gone and each projection readable again, exactly."""
    loaded, laid = expert_block(case, layer, layout)
    switch = laid.switch_mlp
    for name in moe.PROJECTIONS:
        proj = getattr(switch, name)
        moved = layout == "panels" or name == "down_proj"  # packed moves down only
        assert ("weight" not in proj.parameters()) == moved, name
        assert mx.array_equal(proj.dense(), getattr(loaded.switch_mlp, name).weight)
    if layout == "panels":
        assert {k for k in switch if k.startswith("_")} == {"_gate_up_p"}
    else:
        assert "_wt" in switch.down_proj and "weight" in switch.gate_proj
    for rows in (1, 2, 3, 4, 5, 40):
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        assert np.abs(np.array(laid(x)) - np.array(loaded(x))).max() <= 1e-5, rows


needs_gathered = pytest.mark.skipif(
    not native.gathered_available(), reason="runner.native without the gathered product"
)


def rows_alone_and_together(fn, x: mx.array, *rest: mx.array) -> None:
    """Row i of every k-row call of ``fn`` (k = 2, 3, 5) is bit for bit its one-row call."""
    one = np.concatenate(
        [np.array(fn(x[i : i + 1], *(r[i : i + 1] for r in rest))) for i in range(5)]
    )
    for rows in (2, 3, 5):
        got = np.array(fn(x[:rows], *(r[:rows] for r in rest)))
        assert np.array_equal(got, one[:rows]), rows


@needs_gathered
@pytest.mark.parametrize(("case", "layer"), [("qwen3_moe", 0), ("glm4_moe", 1)])
def test_panel_experts_give_verify_rows_the_one_row_results(case, layer):
    """Tuned, each row reads its experts through the same products whatever other rows share
    the feed: the experts' part of a verify row is bit for bit what plain decoding computes
    (the fixtures' 8-expert routers are not whole panels, so they stay BLAS products)."""
    model = load(case).model
    device.tune(model, compile=False)
    block = model.layers[layer].mlp
    assert "_gate_up_p" in block.switch_mlp
    x = mx.random.normal((5, 64), key=mx.random.key(8))
    experts, _ = moe.route(block.gate, x, block.settings)
    rows_alone_and_together(block.switch_mlp, x, experts)


@needs_gathered
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_a_block_in_panels_is_batch_invariant(scoring, compiled):
    """A block whose every product is in panels (16 experts: the router is a whole panel; the
    GLM-style one with a plain shared expert) gives each row of a k-row feed its one-row
    result, bit for bit, eager and compiled."""
    qwen = load("qwen3_moe").model
    s = moe.MoESettings(
        num_experts=16,
        top_k=4,
        intermediate_size=32,
        scoring=scoring,
        norm_topk_prob=True,
        sparse_layers=(True,),
        n_group=4 if scoring == "sigmoid" else 1,
        topk_group=2 if scoring == "sigmoid" else 1,
        correction_bias=scoring == "sigmoid",
        shared="plain" if scoring == "sigmoid" else None,
        shared_intermediate_size=32,
        routed_scaling_factor=2.5 if scoring == "sigmoid" else 1.0,
    )
    args = dataclasses.replace(qwen.args, extra={**qwen.args.extra, "moe": s})
    block = moe.SparseMoE(args, s)
    params = tree_flatten(block.parameters())
    block.update(
        tree_unflatten(
            [
                (n, 0.2 * mx.random.normal(v.shape, key=mx.random.key(i)))
                for i, (n, v) in enumerate(params)
            ]
        )
    )
    pack_for_cpu(block)
    fuse_projections(block)
    to_panel_layout(block)  # as device.tune lays out a head's block
    assert moe.lay_out_experts(block, "panels") == 1
    assert block.gate._wt.ndim == 3  # the router in panels too
    fn = mx.compile(block) if compiled else block
    x = mx.random.normal((5, 1, 64), key=mx.random.key(3))
    rows_alone_and_together(fn, x)


def test_tune_lays_out_the_experts_of_target_and_head():
    """The GLM target and its inline MTP layer (a MoE block too) follow the weight layout;
    "hf" and expert_layout="hf" keep them as loaded."""
    want = "_panels" if native.gathered_available() else "_wt"
    for tune, key in (
        ({}, want),
        ({"layout": "packed"}, "_wt"),
        ({"layout": "hf"}, None),
        ({"expert_layout": "hf"}, None),
    ):
        loaded = load("glm4_moe")
        head, _ = load_draft_head(loaded)
        device.tune(loaded.model, head, **tune)
        for switch in (loaded.model.layers[1].mlp.switch_mlp, head.layers[0].mlp.switch_mlp):
            if key is None:
                assert "weight" in switch.down_proj.parameters(), tune
            else:
                assert key in switch.down_proj and "weight" not in switch.down_proj, tune


def test_quantized_experts_keep_their_layout():
    mlp, x = block_and_rows("qwen3_moe", 0, rows=4)
    nn.quantize(
        mlp,
        group_size=32,
        bits=8,
        class_predicate=lambda _, m: (
            isinstance(m, moe.SwitchLinear) and m.weight.shape[-1] % 32 == 0
        ),
    )
    before = mlp(x)
    for layout in LAYOUTS:
        assert moe.lay_out_experts(mlp, layout) == 0
    assert isinstance(mlp.switch_mlp.up_proj, moe.QuantizedSwitchLinear)
    assert mx.array_equal(mlp(x), before)


# --- speculation and the prefix cache


@pytest.fixture(scope="module")
def glm_plain():
    return Engine(EngineOptions(model_path=str(FIXTURES / "glm4_moe"), use_draft=False))


@pytest.mark.parametrize("depth", [1, 2])
def test_speculation_with_the_glm_mtp_layer_is_lossless(glm_plain, depth):
    spec = Engine(EngineOptions(model_path=str(FIXTURES / "glm4_moe"), draft_depth=depth))
    assert spec.info.mtp and "inline" in spec.info.mtp_detail, spec.info.mtp_detail
    drafted = 0
    reference_ = ref("glm4_moe")
    for p, prompt in enumerate(reference_.prompts):
        for budget in (1, 7, 24):
            want, _ = run(glm_plain, prompt, budget)
            got, done = run(spec, prompt, budget)
            assert got == want == reference_.greedy[p, :budget].tolist(), (depth, p, budget)
            assert spec.draft_cache.offset == spec.caches[0].offset
            drafted += done.speculation.drafted
    assert drafted > 0


def scripted_propose(script: list[int], rng: random.Random, right: float = 0.8):
    """A ``DraftSession.propose`` whose drafts are ``script``'s tokens (the true continuation,
    filled in by the test), each replaced by a wrong one with probability ``1 - right``."""
    original = DraftSession.propose

    def scripted(self, current, k, *args, **kwargs):
        proposal = original(self, current, k, *args, **kwargs)
        if proposal is None:
            return None
        drafts = []
        for i in range(k):
            pos = self.frontier + 1 + i
            token = script[pos] if pos < len(script) else 5
            drafts.append(token if rng.random() < right else (token + 1) % 320)
        return dataclasses.replace(proposal, tokens=mx.array(drafts, dtype=mx.int32))

    return scripted


def test_scripted_drafts_on_a_moe_target_accept_and_reject(glm_plain, monkeypatch):
    """The random MTP layer is rarely right: drafts from the plain answer, each wrong with some
    probability, make rounds accept and reject at every depth through the MoE verify rows."""
    spec = Engine(EngineOptions(model_path=str(FIXTURES / "glm4_moe"), draft_depth=5))
    per_depth = scripted_rounds(glm_plain, spec, ref("glm4_moe").prompts, 5, monkeypatch)
    assert all(count > 0 for count in per_depth[:5]), per_depth


def scripted_rounds(plain: Engine, spec: Engine, prompts, seed: int, monkeypatch) -> list[int]:
    """40 tokens per prompt with ``scripted_propose`` drafts: speculative output equals plain
    output; returns the accepted drafts per depth, summed."""
    script: list[int] = []
    monkeypatch.setattr(DraftSession, "propose", scripted_propose(script, random.Random(seed)))
    per_depth = [0] * 8
    for prompt in prompts:
        want, _ = run(plain, prompt, 40)
        script[:] = prompt + want
        got, done = run(spec, prompt, 40)
        assert got == want
        for depth, count in enumerate(done.speculation.accepted_per_depth):
            per_depth[depth] += count
    return per_depth


def three_turn_chat(path: str, prompt: list[int], draft: bool, seed: int) -> None:
    """Each turn repeats the conversation so far plus a few new tokens: with the prefix cache
    the tokens are those of a cache-less engine, and each turn restores at least the previous
    turn's end."""
    cached = Engine(EngineOptions(model_path=path, use_draft=draft, draft_depth=2))
    fresh = Engine(
        EngineOptions(model_path=path, use_draft=draft, draft_depth=2, prefix_cache=False)
    )
    eos = next(iter(cached.tokenizer.eos_ids))
    rng = random.Random(seed)
    previous = 0
    for turn in range(3):
        got, done = run(cached, prompt, 10)
        want, _ = run(fresh, prompt, 10)
        assert got == want, (path, turn)
        if turn:
            assert done.prompt_cached_tokens >= previous > 0, (turn, done.prompt_cached_tokens)
        previous = len(prompt) + len(got) - 1
        prompt = prompt + got + [eos] + [rng.randrange(5, 320) for _ in range(6)]


@pytest.mark.parametrize(("case", "draft"), [("qwen3_moe", False), ("glm4_moe", True)])
def test_prefix_cache_gives_the_same_tokens_on_a_three_turn_chat(case, draft):
    three_turn_chat(str(FIXTURES / case), ref(case).prompts[0], draft, seed=11)


# --- configs and checkpoints the families refuse


def config(case: str, **changes) -> dict:
    cfg = json.loads((FIXTURES / case / "config.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("case", "changes", "key", "error"),
    [
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window", UnsupportedArchitecture),
        (
            "qwen3_moe",
            {"shared_expert_intermediate_size": 32},
            "shared_expert_intermediate_size",
            UnsupportedArchitecture,
        ),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act", UnsupportedArchitecture),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok", CorruptModelFile),
        ("qwen3_moe", {"mlp_only_layers": "1"}, "mlp_only_layers", CorruptModelFile),
        ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func", UnsupportedArchitecture),
        ("glm4_moe", {"topk_method": "greedy"}, "topk_method", UnsupportedArchitecture),
        ("glm4_moe", {"n_group": 3}, "n_group", UnsupportedArchitecture),
        ("glm4_moe", {"topk_group": 5}, "topk_group", CorruptModelFile),
        ("glm4_moe", {"rope_traditional": True}, "rope_traditional", UnsupportedArchitecture),
        ("glm4_moe", {"routed_scaling_factor": "2"}, "routed_scaling_factor", CorruptModelFile),
    ],
)
def test_unsupported_or_malformed_keys_are_refused_by_name(case, changes, key, error):
    with pytest.raises(error) as info:
        build_model(config(case, **changes), path="config.json")
    assert key in str(info.value)


def test_layer_schedules_follow_transformers():
    assert moe.qwen_sparse_layers(4, 8, [], 1) == (True,) * 4
    assert moe.qwen_sparse_layers(4, 8, [3], 2) == (False, True, False, False)
    assert moe.qwen_sparse_layers(3, 0, [], 1) == (False,) * 3
    glm = moe.settings(
        build_model(config("glm4_moe", first_k_dense_replace=2, num_hidden_layers=3)).args
    )
    assert glm.sparse_layers == (False, False, True)
    qwen = moe.settings(
        build_model(config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=3)).args
    )
    assert qwen.sparse_layers == (False, False, True)
    partial = build_model(config("glm4_moe", partial_rotary_factor=None)).layers[0].self_attn.rope
    assert partial.dims == 8  # transformers' default 0.5 of head_dim 16


@pytest.mark.parametrize(
    ("drop", "error"),
    [
        ("model.layers.2.mlp.experts.3.up_proj.weight", MissingTensor),
        ("model.layers.0.mlp.experts.5.down_proj.weight", MissingTensor),
    ],
)
def test_an_incomplete_set_of_experts_is_refused_by_name(tmp_path, drop, error):
    target = tmp_path / "broken"
    shutil.copytree(FIXTURES / "qwen3_moe", target)
    weights = mx.load(str(target / "model.safetensors"))
    del weights[drop]
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    with pytest.raises(error) as info:
        load_model(str(target))
    assert info.value.tensor == drop


def test_experts_beyond_num_experts_are_refused(tmp_path):
    target = tmp_path / "extra"
    shutil.copytree(FIXTURES / "qwen3_moe", target)
    weights = mx.load(str(target / "model.safetensors"))
    for proj in moe.PROJECTIONS:
        weights[f"model.layers.0.mlp.experts.8.{proj}.weight"] = weights[
            f"model.layers.0.mlp.experts.0.{proj}.weight"
        ]
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    with pytest.raises(CorruptModelFile, match="beyond num_experts"):
        load_model(str(target))


needs_gathered_quantized = pytest.mark.skipif(
    not native.gathered_quantized_available(), reason="runner.native without quantized experts"
)


@pytest.fixture
def exact_choice():
    before = layers.exact_products()
    yield layers.set_exact_products
    layers.set_exact_products(before)


@needs_gathered_quantized
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("exact", [False, True], ids=["int8", "exact"])
def test_quantize_at_load_holds_the_experts_quantized(bits, exact, exact_choice):
    """``--quantize`` on the CPU: the routed experts go to quantized expert panels (no float
    copy left), each projection reads back as its quantized values, the block stays close to
    the float one, the exact product is bit for bit the float product of those values, and
    every verify row gets its one-row bits."""
    config = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    config["moe_intermediate_size"] = 64  # whole panels and groups of 64 for every projection
    weights = random_weights(config, seed=5)
    for name in [n for n in weights if ".switch_mlp." in n]:  # initialised as zeros
        weights[name] = 0.1 * mx.random.normal(weights[name].shape, key=mx.random.key(len(name)))
    weights = list(weights.items())
    float_model, model = build_model(config), build_model(config)
    float_model.load_weights(weights)
    model.load_weights(weights)
    exact_choice(exact)
    device.tune(model, compile=False, quantize=bits, exact_products=exact)
    switch = model.layers[0].mlp.switch_mlp
    assert switch._gate_up_p.dtype == switch.down_proj._panels.dtype == mx.uint8
    assert all("weight" not in getattr(switch, name) for name in moe.PROJECTIONS)
    x = mx.random.normal((5, 64), key=mx.random.key(2))
    block = model.layers[0].mlp
    experts, _ = moe.route(block.gate, x, block.settings)
    want = float_model.layers[0].mlp.switch_mlp(x, experts)
    got = switch(x, experts)
    rel = float(mx.sqrt(mx.mean((got - want) ** 2) / mx.mean(want**2)))
    assert rel < (0.01 if bits == 8 else 0.15), rel
    for name in moe.PROJECTIONS:
        w = getattr(float_model.layers[0].mlp.switch_mlp, name).weight
        want = []
        for e in range(w.shape[0]):
            packed, scales, biases = mx.quantize(w[e], group_size=64, bits=bits)
            half = scales.astype(mx.float16), biases.astype(mx.float16)
            want.append(affine_dense(*MlxAffine(packed, *half, 64, bits).unpack()))
        assert np.array_equal(np.array(getattr(switch, name).dense()), np.stack(want)), name
    if exact:  # the float panels of the dequantized experts compute the same bits
        dense = moe.SwitchGLU(64, 64, config["num_experts"])
        for name in moe.PROJECTIONS:
            getattr(dense, name).weight = getattr(switch, name).dense()
        dense.lay_out("panels")
        assert mx.array_equal(dense(x, experts), got)
    rows_alone_and_together(switch, x, experts)


@needs_gathered_quantized
def test_gemma4_experts_run_quantized_expert_panels():
    """Gemma 4's experts (GELU, their own panel path) read quantized expert panels too."""
    from mlx.utils import tree_flatten

    from runner.models.gemma4 import Gemma4Experts

    source = Gemma4Experts(64, 32, 4, nn.gelu)
    for i, name in enumerate(moe.PROJECTIONS):
        proj = getattr(source, name)
        proj.weight = 0.1 * mx.random.normal(proj.weight.shape, key=mx.random.key(i))
    quantized = Gemma4Experts(64, 32, 4, nn.gelu)
    quantized.load_weights(list(tree_flatten(source.parameters())))
    assert quantized.quantize_in_panels(8)
    x = mx.random.normal((3, 64), key=mx.random.key(7))
    experts = mx.array([[0, 1], [2, 3], [1, 1]], dtype=mx.int32)
    want, got = source(x, experts), quantized(x, experts)
    assert float(mx.sqrt(mx.mean((got - want) ** 2) / mx.mean(want**2))) < 0.01


@needs_gathered_quantized
def test_kept_experts_share_one_header_format():
    """Stacked experts whose scales fit float16 in one expert and not in another are stacked
    with one header format (float32), each expert's values exact."""
    from runner.loader import keep_experts

    block = moe.SwitchGLU(64, 32, 2)
    w = 0.1 * mx.random.normal((2, 32, 64), key=mx.random.key(1))
    parts = [mx.quantize(w[e], group_size=32, bits=4) for e in range(2)]
    packed = mx.stack([p[0] for p in parts])
    # Expert 0's scales and biases are float16 numbers, expert 1's (random) are not.
    scales = mx.stack([mx.full(parts[0][1].shape, 0.5), parts[1][1]])
    biases = mx.stack([mx.full(parts[0][2].shape, -0.25), parts[1][2]])
    weights = {"gate_proj.weight": packed, "gate_proj.scales": scales, "gate_proj.biases": biases}
    assert keep_experts(block, weights, "gate_proj", (32, 4))
    assert not weights and block.gate_proj._panels.dtype == mx.uint8
    for e in range(2):
        want = affine_dense(*MlxAffine(packed[e], scales[e], biases[e], 32, 4).unpack())
        assert np.array_equal(np.array(block.gate_proj.dense()[e]), want)
