"""The Gemma 4 text models (``gemma4_text``, and the text side of a ``gemma4`` checkpoint)
against transformers, their shared keys and values, and what their config reader refuses.

The fixtures under ``tests/fixtures/reference/gemma4/`` (``scripts/fixtures/gemma4.py``) hold
three tiny checkpoints with transformers' logits and greedy tokens: ``gemma4_e`` (per-layer
inputs, shared-KV layers, keys-as-values full layers, proportional RoPE, soft-capping, a tied
head), ``gemma4_dense`` (none of those) and ``gemma4_moe`` (the expert block beside every
MLP), and ``gemma4_e-assistant``, a tiny assistant
drafter for ``gemma4_e`` with what transformers' assistant drafts after each prompt, and
``gemma4_dense-nested.json``, transformers' ``gemma4`` config of ``gemma4_dense`` untied.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from cache.kv import KVCache
from cache.kv_quantized import QuantizedKVCache, quantize_caches
from drafting.assistant import AssistantSession
from protocol.errors import CorruptModelFile, DraftHeadError, UnsupportedArchitecture
from runner import device
from runner.engine import Engine, EngineOptions
from runner.loader import load_model
from runner.models.gemma4 import Model, model_args
from runner.models.gemma4_assistant import (
    EXTERNAL,
    Assistant,
    AssistantDrafter,
    find_assistant,
    load_assistant,
    read_config,
)
from runner.prefill import POLL_ROWS, ChunkedPrefill, prefill
from tests.test_engine import complete
from tests.test_moe_models import three_turn_chat
from tests.test_reference_models import ATOL, check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "gemma4"
CASES = ["gemma4_e", "gemma4_dense", "gemma4_moe"]
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}


def ref(case: str):
    return reference(f"gemma4/{case}")


def load(case: str | Path):
    return load_model(str(FIXTURES / case), dtype="float32")


def config(case: str, **changes) -> dict:
    cfg = json.loads((FIXTURES / case / "config.json").read_text())
    cfg.update(changes)
    return cfg


# --- fidelity


def test_fixtures_take_every_branch():
    e, dense = load("gemma4_e").model, load("gemma4_dense").model
    # gemma4_e: layers 4 and 5 read the keys and values of layers 3 and 1 and keep no cache.
    assert [layer.kv_source for layer in e.layers] == [None] * 4 + [3, 1]
    assert [layer.shares_kv for layer in e.layers] == [False, True, False, True, False, False]
    assert len(e.make_caches()) == 4 and len(dense.make_caches()) == 6
    full, sliding, shared = e.layers[1].self_attn, e.layers[0].self_attn, e.layers[5].self_attn
    assert (full.head_dim, full.n_kv_heads, sliding.head_dim, sliding.n_kv_heads) == (16, 1, 8, 2)
    assert "k_proj" in full and "v_proj" not in full  # keys are the values
    assert "k_proj" not in shared and "v_proj" not in shared
    widths = [layer.mlp.gate_proj.weight.shape[0] for layer in e.layers]
    assert widths == [32] * 4 + [64] * 2  # the shared layers' MLPs are double-wide
    # Proportional RoPE: 2 of the full heads' 8 pairs rotate.
    periods = np.array(full.rope._period_table)
    assert np.isfinite(periods[:2]).all() and np.isinf(periods[2:]).all()
    assert "embed_tokens_per_layer" in e.model and "per_layer_input_gate" in e.layers[0]
    assert "embed_tokens_per_layer" not in dense.model and "lm_head" in dense
    assert "v_proj" in dense.layers[2].self_attn and dense.layers[2].self_attn.head_dim == 16
    assert len({float(layer.layer_scalar[0]) for layer in e.layers}) == 6
    assert "experts" not in e.layers[0] and "experts" not in dense.layers[0]
    moe = load("gemma4_moe").model
    for layer in moe.layers:
        assert layer.experts.gate_proj.weight.shape == (4, 16, 32)  # split from gate_up_proj
        assert layer.experts.down_proj.weight.shape == (4, 32, 16)
        assert layer.router.top_k == 2 and "v_proj" not in moe.layers[2].self_attn


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


def test_chunked_prefill_gives_the_whole_forward_logits():
    """A prompt fed in chunks (the sliding layers' caches rotate between them, the shared
    layers read their source's fetch of each chunk) gives the logits of one forward."""
    model = load("gemma4_e").model
    prompt = ref("gemma4_e").prompts[2]
    whole, _ = model.forward(mx.array([prompt]), model.make_caches())
    caches = model.make_caches()
    prefill(model, caches, prompt[:-1], 0, chunk=7)
    last, _ = model.forward(mx.array([prompt[-1:]]), caches)
    assert float(mx.abs(last[0, -1] - whole[0, -1]).max()) <= 1e-5
    assert all(c.offset == len(prompt) for c in caches)


def long_prompt(length: int, seed: int = 3) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, 300, size=length)]


@pytest.mark.parametrize("length", [100, 200])
@pytest.mark.parametrize("budget", [None, 1e-6], ids=["whole-chunk", "budgeted"])
def test_long_chunks_run_layer_by_layer_over_fewer_caches(length, budget):
    """A chunk of at least ``POLL_ROWS`` rows goes layer by layer (cancel polls), each layer
    evaluating its cache: the shared layers' caches are their sources' (fewer caches than
    layers), and the logits are one forward's and transformers'."""
    model = load("gemma4_e").model
    with np.load(ref("gemma4_e").path / "reference.npz") as npz:
        prompt, want = npz[f"long_prompt_{length}"].tolist(), npz[f"long_logits_{length}"]
    assert length - 1 >= POLL_ROWS and len(model.make_caches()) < len(model.layers)
    whole, _ = model.forward(mx.array([prompt]), model.make_caches())
    caches = model.make_caches()
    work = ChunkedPrefill(model, caches, prompt[:-1], 0, chunk=512)
    steps = 0
    while not work.run(budget):
        steps += 1
    assert budget is None or steps >= len(model.layers) - 1  # a layer per step, at least
    last, _ = model.forward(mx.array([prompt[-1:]]), caches)
    assert float(mx.abs(last[0, -1] - whole[0, -1]).max()) <= 1e-5
    assert np.abs(np.array(last[0, -1]) - want).max() <= ATOL  # transformers'
    assert all(c.offset == length for c in caches)


def test_the_engine_completes_a_long_prompt(plain):
    """A 100-token prompt (one chunk, fed layer by layer) completes normally, with and
    without the assistant drafting after it."""
    prompt = long_prompt(100)
    got, _, done, _ = complete(plain, tokens=prompt, num_predict=8, **GREEDY)
    assert done.done_reason == "length" and len(got) == 8
    model = load("gemma4_e").model
    logits, _ = model.forward(mx.array([prompt]), model.make_caches())
    assert got[0] == int(mx.argmax(logits[0, -1]))
    spec = assistant_engine(draft_sources=("head",), draft_depth=2, prefix_cache=False)
    drafted, _, spec_done, _ = complete(spec, tokens=prompt, num_predict=8, **GREEDY)
    assert drafted == got and spec_done.done_reason == "length"
    assert spec_done.speculation.drafted > 0


def test_a_gemma4_directory_serves_its_text_model(tmp_path):
    """A ``gemma4`` checkpoint: the text config nested, the language model's tensors under
    ``model.language_model.``, a vision tower beside it and the key/value tensors a shared
    layer keeps in some files: the text model loads and computes what the flat one does."""
    source = FIXTURES / "gemma4_e"
    target = tmp_path / "gemma4"
    shutil.copytree(source, target)
    text = config("gemma4_e")
    nested = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16},
        "tie_word_embeddings": True,
    }
    (target / "config.json").write_text(json.dumps(nested))
    tensors = mx.load(str(source / "model.safetensors"))
    renamed = {"model.language_model." + k[len("model.") :]: v for k, v in tensors.items()}
    renamed["model.vision_tower.patch_embedder.weight"] = mx.ones((4, 4))
    renamed["model.language_model.layers.4.self_attn.k_proj.weight"] = mx.ones((16, 32))
    mx.save_safetensors(str(target / "model.safetensors"), renamed, {"format": "pt"})
    nested_model, flat_model = load(target).model, load("gemma4_e").model
    prompt = mx.array([ref("gemma4_e").prompts[1]])
    got, _ = nested_model.forward(prompt, nested_model.make_caches())
    want, _ = flat_model.forward(prompt, flat_model.make_caches())
    assert np.array_equal(np.array(got), np.array(want))


def test_a_nested_checkpoint_ties_its_head_by_the_top_level_key(tmp_path):
    """transformers' ``gemma4`` config of an untied model (``tie_word_embeddings: false`` at
    the top, the text_config's left ``true``): the real ``lm_head`` is kept and the logits
    are transformers' (gemma4_dense's text model, nested)."""
    target = tmp_path / "gemma4"
    shutil.copytree(FIXTURES / "gemma4_dense", target)
    nested = json.loads((FIXTURES / "gemma4_dense-nested.json").read_text())
    assert nested["text_config"]["tie_word_embeddings"] and not nested["tie_word_embeddings"]
    (target / "config.json").write_text(json.dumps(nested))
    tensors = mx.load(str(FIXTURES / "gemma4_dense" / "model.safetensors"))
    renamed = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in tensors.items()
    }
    assert "lm_head.weight" in renamed
    mx.save_safetensors(str(target / "model.safetensors"), renamed, {"format": "pt"})
    model = load(target).model
    assert not model.args.tie_word_embeddings and "lm_head" in model
    check_model(model, ref("gemma4_dense"), "nested, untied")
    assert model_args(dict(nested, tie_word_embeddings=None)).tie_word_embeddings  # default


def test_hidden_act_is_ignored_as_transformers_ignores_it():
    """Gemma4TextConfig reads ``hidden_activation`` only (``hidden_act`` keeps its default)."""
    cfg = {k: v for k, v in config("gemma4_e").items() if k != "hidden_activation"}
    for act in ("silu", "relu", "gelu_pytorch_tanh"):
        assert model_args(dict(cfg, hidden_act=act)).extra["gemma4"].activation == (
            "gelu_pytorch_tanh"
        )
    chosen = model_args(dict(cfg, hidden_act="silu", hidden_activation="gelu"))
    assert chosen.extra["gemma4"].activation == "gelu"


# --- the engine: greedy decoding, the prefix cache


@pytest.mark.parametrize("case", CASES)
def test_the_engine_decodes_transformers_greedy_tokens(case):
    engine = Engine(EngineOptions(model_path=str(FIXTURES / case), use_draft=False))
    reference_ = ref(case)
    for p, prompt in enumerate(reference_.prompts):
        got, _, _, _ = complete(engine, tokens=prompt, num_predict=24, **GREEDY)
        assert got == reference_.greedy[p].tolist(), (case, p)


@pytest.mark.parametrize("case", CASES)
def test_prefix_cache_gives_the_same_tokens_on_a_three_turn_chat(case):
    three_turn_chat(str(FIXTURES / case), ref(case).prompts[0], False, seed=11)


# --- configs the family refuses


@pytest.mark.parametrize(
    ("changes", "key", "error"),
    [
        ({"enable_moe_block": True}, "num_experts", CorruptModelFile),
        (
            {"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3},
            "top_k_experts",
            CorruptModelFile,
        ),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention", None),
        ({"hidden_activation": "relu"}, "hidden_activation", UnsupportedArchitecture),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", UnsupportedArchitecture),
        ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar", UnsupportedArchitecture),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "rope_parameters.sliding_attention.rope_type",
            UnsupportedArchitecture,
        ),
        (
            {"per_layer_config": {"1": {"sliding_window": 4}}},
            "per_layer_config.1.sliding_window",
            UnsupportedArchitecture,
        ),
        ({"per_layer_config": {"9": {"head_dim": 4}}}, "per_layer_config.9", CorruptModelFile),
        ({"layer_types": ["chunked_attention"] * 6}, "layer_types", UnsupportedArchitecture),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling", None),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            "rope_parameters.",
            CorruptModelFile,
        ),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers", UnsupportedArchitecture),
        ({"num_key_value_heads": 3}, "num_key_value_heads", CorruptModelFile),
        ({"sliding_window": None}, "sliding_window", UnsupportedArchitecture),
        (
            {"hidden_size_per_layer_input": "16"},
            "hidden_size_per_layer_input",
            CorruptModelFile,
        ),
        (
            {"hidden_size_per_layer_input": -1},
            "hidden_size_per_layer_input",
            CorruptModelFile,
        ),
    ],
)
def test_refuses_what_it_does_not_implement(changes, key, error):
    with pytest.raises(UnsupportedArchitecture if error is None else error) as caught:
        model_args(config("gemma4_e", **changes), "config.json")
    assert key in str(caught.value)


def test_reads_the_config_defaults_as_transformers_does():
    """Without ``per_layer_config`` the full layers take ``global_head_dim`` (and, keys being
    values, ``num_global_key_value_heads``); without ``layer_types`` every sixth layer is
    full and the last is forced full."""
    cfg = {k: v for k, v in config("gemma4_e").items() if k not in ("per_layer_config",)}
    cfg.update(global_head_dim=16, num_global_key_value_heads=1)
    args = model_args(cfg)
    g = args.extra["gemma4"]
    assert [(s.head_dim, s.kv_heads) for s in g.layers] == [(8, 2), (16, 1)] + [(8, 2)] * 3 + [
        (16, 1)
    ]
    plain = {k: v for k, v in cfg.items() if k != "layer_types"}
    types = model_args(dict(plain, num_hidden_layers=8, num_kv_shared_layers=0)).layer_types
    assert types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"] + [
        "full_attention"
    ]


# --- the assistant drafter

ASSISTANT = FIXTURES / "gemma4_e-assistant"
# The fixture assistant's logits reach ~14 (embedding rows of norm 4, tied): float32 rounding
# over its three chained steps moves them by up to ~2e-4 (about 1e-5 of their size).
ASSISTANT_ATOL = 5e-4


@pytest.mark.parametrize("tuned", [False, True], ids=["as-loaded", "tuned"])
def test_assistant_drafts_what_transformers_drafts(tuned):
    """After each prompt (one forward), three chained assistant steps at the position after
    it, fed the tokens transformers' assistant was fed: the same logits."""
    model = load("gemma4_e").model
    if tuned:
        device.tune(model)
    drafter = load_assistant(str(ASSISTANT), model, mx.float32)
    reference_ = ref("gemma4_e")
    with np.load(reference_.path / "reference.npz") as npz:
        saved = {k: npz[k] for k in npz.files}
    for p, prompt in enumerate(reference_.prompts):
        caches = model.make_caches()
        hidden = model.hidden(mx.array([prompt]), caches)[:, -1:]
        fed, want = saved[f"assistant_tokens_{p}"], saved[f"assistant_logits_{p}"]
        assert fed[0] == reference_.greedy[p][0]
        for step in range(len(fed)):
            token = mx.array([[int(fed[step])]])
            logits, hidden = drafter(token, hidden, len(prompt), caches)
            got = np.array(logits[0])
            assert np.abs(got - want[step]).max() <= ASSISTANT_ATOL, (p, step)
            assert got.argmax() == want[step].argmax()
        assert all(c.offset == len(prompt) for c in caches)  # drafting appends nothing


def assistant_engine(**options) -> Engine:
    return Engine(EngineOptions(model_path=str(FIXTURES / "gemma4_e"), **options))


@pytest.fixture(scope="module")
def plain():
    return assistant_engine(use_draft=False, prefix_cache=False)


def test_the_assistant_is_found_beside_the_model_or_named():
    found = assistant_engine(prefix_cache=False)
    named = Engine(
        EngineOptions(
            model_path=str(FIXTURES / "gemma4_e"), draft_path=str(ASSISTANT), prefix_cache=False
        )
    )
    for engine in (found, named):
        assert engine.info.draft_sources == ("assistant", "suffix")
        assert "gemma4 assistant" in engine.info.mtp_detail and engine.draft_cache is None
    off = assistant_engine(draft_sources=("suffix",), prefix_cache=False)
    assert off.info.draft_sources == ("suffix",)


@pytest.mark.parametrize("depth", [None, 3], ids=["adaptive", "fixed-3"])
@pytest.mark.parametrize(
    "options", [GREEDY, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"]
)
def test_drafting_with_the_assistant_is_lossless(plain, depth, options, monkeypatch):
    """The output is plain decoding's, and the assistant drafted: at a fixed depth, and at
    the adaptive depth too (a fresh controller drafts each depth it has no cost for)."""
    original, proposals = AssistantSession.propose, []

    def counted(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        if proposal is not None:
            proposals.append(proposal.tokens.shape[0])
        return proposal

    monkeypatch.setattr(AssistantSession, "propose", counted)
    spec = assistant_engine(draft_sources=("head",), draft_depth=depth, prefix_cache=False)
    drafted = 0
    for prompt in ref("gemma4_e").prompts:
        want, _, done, _ = complete(plain, tokens=prompt, num_predict=24, **options)
        got, _, spec_done, _ = complete(spec, tokens=prompt, num_predict=24, **options)
        assert got == want and spec_done.done_reason == done.done_reason
        drafted += spec_done.speculation.drafted
        assert set(spec_done.speculation.sources) <= {"assistant"}
    assert proposals and drafted > 0
    assert depth is None or max(proposals) == depth


def test_accepted_assistant_drafts_keep_it_drafting(plain, monkeypatch):
    """The random assistant is never right: its proposals (computed, then replaced by the
    plain answer with one in five wrong) make rounds accept and reject; after every round
    the assistant drafts again from the verified frontier, and the output is plain's."""
    original = AssistantSession.propose
    script: list[int] = []
    rng = random.Random(5)
    missed = []

    def scripted(self, current, k, *args, **kwargs):
        proposal = original(self, current, k, *args, **kwargs)
        if proposal is None:
            missed.append(self.frontier)
            return None
        assert proposal.tokens.shape == (k,)
        drafts = []
        for i in range(k):
            pos = self.frontier + 1 + i
            token = script[pos] if pos < len(script) else 5
            drafts.append(token if rng.random() < 0.8 else (token + 1) % 320)
        return dataclasses.replace(proposal, tokens=mx.array(drafts, dtype=mx.int32))

    monkeypatch.setattr(AssistantSession, "propose", scripted)
    spec = assistant_engine(draft_sources=("head",), draft_depth=4, prefix_cache=False)
    accepted = by_assistant = 0
    for prompt in ref("gemma4_e").prompts:
        want, _, _, _ = complete(plain, tokens=prompt, num_predict=30, **GREEDY)
        script[:] = prompt + want
        got, _, done, _ = complete(spec, tokens=prompt, num_predict=30, **GREEDY)
        assert got == want
        accepted += done.speculation.accepted
        # The assistant's rounds count as its own, not as an MTP head's.
        sources = done.speculation.sources
        assert "head" not in sources and set(sources) <= {"assistant", "suffix"}
        counts = sources["assistant"]
        assert counts.drafted > 0 and counts.accepted <= counts.drafted
        assert sum(c.accepted for c in sources.values()) == done.speculation.accepted
        by_assistant += counts.accepted
    assert accepted > 0 and by_assistant > 0 and not missed


def test_prefix_cache_with_the_assistant_on_a_three_turn_chat():
    three_turn_chat(str(FIXTURES / "gemma4_e"), ref("gemma4_e").prompts[0], True, seed=3)


def test_an_assistant_for_other_key_shapes_is_refused():
    dense = load("gemma4_dense").model
    with pytest.raises(DraftHeadError, match="key heads"):
        load_assistant(str(ASSISTANT), dense, mx.float32)
    with pytest.raises(DraftHeadError):
        Engine(EngineOptions(model_path=str(FIXTURES / "gemma4_dense"), draft_path=str(ASSISTANT)))


ABSENT = object()


def assistant_config(**changes) -> dict:
    """The fixture assistant's config with its text_config changed (``ABSENT``: removed)."""
    cfg = json.loads((ASSISTANT / "config.json").read_text())
    for key, value in changes.items():
        cfg["text_config"].pop(key, None)
        if value is not ABSENT:
            cfg["text_config"][key] = value
    return cfg


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"enable_moe_block": True}, "enable_moe_block"),
        ({"use_double_wide_mlp": True}, "use_double_wide_mlp"),
        ({"num_kv_shared_layers": 1}, "num_kv_shared_layers"),
        ({"hidden_size_per_layer_input": ABSENT}, "hidden_size_per_layer_input"),
        ({"vocab_size_per_layer_input": ABSENT}, "vocab_size_per_layer_input"),
        ({"hidden_size_per_layer_input": 16}, "hidden_size_per_layer_input"),
    ],
)
def test_an_assistant_config_transformers_refuses_is_refused_by_name(changes, key):
    with pytest.raises(DraftHeadError, match=key):
        read_config(assistant_config(**changes), "config.json")


@pytest.mark.parametrize("shared", [0, None, ABSENT, 2])
def test_an_assistant_shares_every_layer_however_its_config_says_so(shared):
    args, _ = read_config(assistant_config(num_kv_shared_layers=shared), "config.json")
    assert [s.kv_source for s in args.extra["gemma4"].layers] == [EXTERNAL, EXTERNAL]


def test_an_assistant_found_for_a_target_it_cannot_read_is_skipped(tmp_path):
    """A target with no sliding layer (the assistant's first layer reads one): the found
    assistant is reported and skipped, not an error that stops the engine."""
    cfg = config("gemma4_dense", layer_types=["full_attention"] * 6, per_layer_config={})
    target = Model(model_args(cfg))
    with pytest.raises(DraftHeadError, match="sliding_attention"):
        load_assistant(str(ASSISTANT), target, mx.float32)
    shutil.copytree(ASSISTANT, tmp_path / "m-assistant")
    drafter, detail = find_assistant(target, str(tmp_path / "m"), None, mx.float32)
    assert drafter is None and "not usable" in detail and "sliding_attention" in detail
    # The engine starts without it, saying why.
    shutil.copytree(FIXTURES / "gemma4_dense", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    weights = dict(tree_flatten(randomized(target).parameters()))
    mx.save_safetensors(str(tmp_path / "m" / "model.safetensors"), weights, {"format": "pt"})
    engine = Engine(EngineOptions(model_path=str(tmp_path / "m"), prefix_cache=False))
    assert "not usable" in engine.info.mtp_detail and engine.assistant is None


def randomized(module):
    """``module`` with every parameter drawn at random (a fixed seed)."""
    mx.random.seed(4)
    module.update(tree_map(lambda p: 0.3 * mx.random.normal(p.shape), module.parameters()))
    return module


def test_the_assistant_drafts_over_quantized_kv():
    """``--kv-bits`` on a target without shared layers (heads of 32: a --kv-group): the
    assistant reads the quantized full-attention cache's rows dequantized, the drafts of float
    caches holding those rows."""
    cfg = config("gemma4_dense", head_dim=32, per_layer_config={"2": {}, "5": {}})
    target = randomized(Model(model_args(cfg)))
    text = {"head_dim": 32, "per_layer_config": {"1": {"num_key_value_heads": 2}}}
    args, own = read_config(assistant_config(**text), "config.json")
    drafter = AssistantDrafter(randomized(Assistant(args, own)), target, "assistant")
    prompt = long_prompt(20)
    quantized = quantize_caches(target.make_caches(), 8, 32)
    assert sum(isinstance(c, QuantizedKVCache) for c in quantized) == 2
    hidden = target.hidden(mx.array([prompt]), quantized)[:, -1:]
    floats = []
    for c in quantized:
        if isinstance(c, QuantizedKVCache):
            plain_cache = KVCache()
            plain_cache.update_and_fetch(*c.float_state())
            c = plain_cache
        floats.append(c)
    token = mx.array([[7]])
    got, got_hidden = drafter(token, hidden, len(prompt), quantized)
    want, want_hidden = drafter(token, hidden, len(prompt), floats)
    assert np.array_equal(np.array(got), np.array(want))
    assert np.array_equal(np.array(got_hidden), np.array(want_hidden))
