"""GGUF files of llama.cpp's ``gemma4`` architecture (``runner.gguf_gemma4``): the Gemma 4 text
models and their ``gemma4`` vocabulary.

The files are written as llama.cpp's converter writes them: its metadata (per-layer head
counts and widths, the sliding pattern as one bool per layer, both head widths), its tensor
names (the ``gguf`` package's own Gemma 4 name map, plus the converter's renames of the router
scale, the per-expert scales and ``layer_scalar``), norms as stored (no ``+ 1`` for Gemma 4) and
``rope_freqs`` for the full layers' proportional RoPE. Two kinds of file per fixture case
(``tests/fixtures/reference/gemma4``: per-layer inputs and shared keys and values, dense, the
expert block):

- the fixture's own float32 tensors: the runner must compute transformers' reference logits
  and greedy tokens (``tests.test_reference_models.check_model``);
- the case's config at widths K-quants take, with random weights and the tensor types of a
  ``Q4_K_M`` file (Q4_K, Q6_K for output, V and down, F32 norms, router and scales): the file
  must compute what a Hugging Face directory holding the dequantized weights computes, to
  1e-4, with the same greedy tokens.

The ``gemma4`` vocabulary must segment as its merges do (SentencePiece-style pieces, no space
prefix, byte fallback) and end turns on ``<turn|>``; a variant no Gemma 4 config can say is
refused naming the key or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from protocol import errors
from runner import gguf as runner_gguf
from runner.loader import load_model
from runner.models.gemma4_config import FULL, SLIDING, model_args, settings
from tests.test_gguf_families import (
    BOS,
    PROMPT,
    TOKENS,
    TYPES,
    VOCAB,
    reference_tokenizer,
    spm_encode,
    tokenizer_meta,
    varied_strings,
)
from tests.test_gguf_models import greedy, logits, quant_blocks, tuned
from tests.test_gguf_tensors import write_gguf
from tests.test_reference_models import check_model, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference" / "gemma4"
CASES = ["gemma4_e", "gemma4_dense", "gemma4_moe"]
T = gguf.GGMLQuantizationType
# Widths whole K-quant blocks (256) fit, for the Q4_K_M files.
D, SWA_HEAD, FULL_HEAD, FF, PER_LAYER, WINDOW = 256, 64, 128, 256, 256, 4
Q6_K_PARTS = ("output", "attn_v", "ffn_down", "ffn_down_exps")  # Q4_K_M's 6-bit tensors


def fixture_config(case: str) -> dict:
    return json.loads((FIXTURES / case / "config.json").read_text())


# --- what llama.cpp's converter writes


def gguf_name(name: str, layers: int) -> str:
    """The converter's GGUF name for a Hugging Face tensor name."""
    stem, _, last = name.rpartition(".")
    if last == "scale" and stem.endswith(".router"):  # the router's input scale
        return f"blk.{name.split('.')[2]}.ffn_gate_inp.scale"
    if last == "per_expert_scale":  # each expert's output weight, a scale of its down
        return f"blk.{name.split('.')[2]}.ffn_down_exps.scale"
    if last != "weight":  # layer_scalar and the fused experts are bare parameters
        name += ".weight"
    found = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers).get_name(
        name, try_suffixes=(".weight",)
    )
    assert found is not None, name
    return found  # the suffix tried comes back with the name


def rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's per-pair factors for the full layers: 1 rotates, 1e30 stops a pair
    (a default full-layer RoPE: every pair rotates)."""
    spec = settings(model_args(cfg)).ropes[FULL]
    pairs = spec.head_dim // 2
    return np.array([1.0] * spec.pairs + [1e30] * (pairs - spec.pairs), dtype=np.float32)


def converter_meta(cfg: dict) -> dict:
    """The ``gemma4.*`` metadata the converter writes for a ``gemma4_text`` config."""
    g = settings(model_args(cfg))
    layers = len(g.layers)
    swa = [spec.layer_type == SLIDING for spec in g.layers]
    full = next(spec for spec in g.layers if spec.layer_type == FULL)
    sliding = next((spec for spec in g.layers if spec.layer_type == SLIDING), full)
    meta = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "block_count": layers,
        "feed_forward_length": [spec.intermediate_size for spec in g.layers],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": [spec.kv_heads for spec in g.layers],
        "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "attention.key_length": full.head_dim,
        "attention.value_length": full.head_dim,
        "attention.key_length_swa": sliding.head_dim,
        "attention.value_length_swa": sliding.head_dim,
        "rope.freq_base": g.ropes[FULL].theta,
        "rope.freq_base_swa": g.ropes[SLIDING].theta,
        "rope.dimension_count": full.head_dim,
        "rope.dimension_count_swa": sliding.head_dim,
        "attention.sliding_window": cfg["sliding_window"],
        "attention.sliding_window_pattern": swa,
        "attention.shared_kv_layers": cfg.get("num_kv_shared_layers") or 0,
        "embedding_length_per_layer_input": g.per_layer_dim,
    }
    if len(set(meta["feed_forward_length"])) == 1:  # one width: written as one value
        meta["feed_forward_length"] = meta["feed_forward_length"][0]
    if g.final_softcap is not None:
        meta["final_logit_softcapping"] = g.final_softcap
    if g.moe is not None:
        meta["expert_count"] = g.moe.num_experts
        meta["expert_used_count"] = g.moe.top_k
        meta["expert_feed_forward_length"] = g.moe.intermediate_size
    return {"general.name": "tiny-gemma4"} | {f"gemma4.{k}": v for k, v in meta.items()}


def write_gemma4_gguf(path, tensors: dict, cfg: dict, tokenizer: dict, **overrides) -> str:
    meta = converter_meta(cfg) | tokenizer | overrides
    tensors = tensors | {"rope_freqs.weight": (rope_freqs(cfg), None)}
    return write_gguf(path, tensors, "gemma4", **meta)


# --- the fixtures' own tensors, against transformers


def gpt2_tokenizer_meta(case: str) -> dict:
    """The fixture's byte-level vocabulary as a ``gpt2`` GGUF tokenizer (the model's logits
    are what these files check; the tokenizer only has to load)."""
    hf = json.loads((FIXTURES / case / "tokenizer.json").read_text())
    vocab = hf["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in hf["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
        "tokenizer.ggml.eos_token_id": fixture_config(case)["eos_token_id"],
        "tokenizer.ggml.add_bos_token": False,
    }


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("gemma4-f32")
    files = {}
    for case in CASES:
        cfg = fixture_config(case)
        hf = mx.load(str(FIXTURES / case / "model.safetensors"))
        layers = cfg["num_hidden_layers"]
        tensors = {gguf_name(k, layers): (np.array(v), None) for k, v in hf.items()}
        meta = gpt2_tokenizer_meta(case)
        files[case] = write_gemma4_gguf(folder / f"{case}.gguf", tensors, cfg, meta)
    return files


@pytest.mark.parametrize("case", CASES)
def test_fixture_file_computes_transformers_logits(fixture_files, case):
    loaded = load_model(fixture_files[case], dtype="float32")
    assert loaded.config["model_type"] == "gemma4_text"
    check_model(loaded.model, reference(f"gemma4/{case}"), "from GGUF")


def test_fixture_file_keeps_the_shapes(fixture_files):
    """What only the tensors say: keys-as-values, the per-layer vocabulary, proportional
    RoPE from ``rope_freqs``; the shared layers' MLPs twice as wide."""
    e = load_model(fixture_files["gemma4_e"], dtype="float32").model
    full = e.layers[1].self_attn
    assert "v_proj" not in full and (full.head_dim, full.n_kv_heads) == (16, 1)
    assert [layer.kv_source for layer in e.layers] == [None] * 4 + [3, 1]
    assert [layer.mlp.gate_proj.weight.shape[0] for layer in e.layers] == [32] * 4 + [64] * 2
    periods = np.array(full.rope._period_table)
    assert np.isfinite(periods[:2]).all() and np.isinf(periods[2:]).all()
    assert e.args.extra["gemma4"].per_layer_vocab == fixture_config("gemma4_e")["vocab_size"]
    dense = load_model(fixture_files["gemma4_dense"], dtype="float32").model
    assert "v_proj" in dense.layers[2].self_attn and "lm_head" in dense
    rope = settings(dense.args).ropes[FULL]
    assert rope.pairs == rope.head_dim // 2 and rope.factor == 1.0  # every pair rotates


# --- Q4_K_M files, against the directory of their dequantized weights


def wide_config(case: str) -> dict:
    """The case's config at widths K-quants take (same layer pattern, sharing, experts)."""
    cfg = fixture_config(case)
    g = settings(model_args(cfg))
    full_kv = next(spec.kv_heads for spec in g.layers if spec.layer_type == FULL)
    per_layer = {
        str(i): {"head_dim": FULL_HEAD, "num_key_value_heads": full_kv}
        for i, spec in enumerate(g.layers)
        if spec.layer_type == FULL
    }
    cfg.update(
        hidden_size=D,
        intermediate_size=FF,
        head_dim=SWA_HEAD,
        per_layer_config=per_layer,
        vocab_size=VOCAB,
        sliding_window=WINDOW,
        bos_token_id=BOS,
        eos_token_id=2,
    )
    if g.per_layer_dim:
        cfg.update(hidden_size_per_layer_input=PER_LAYER, vocab_size_per_layer_input=VOCAB)
    if g.moe is not None:
        cfg["moe_intermediate_size"] = FF
    return cfg


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], str | None]]:
    """``(Hugging Face name, shape, GGML type or None for F32)`` of every tensor of ``cfg``."""
    g = settings(model_args(cfg))
    layers, heads = len(g.layers), cfg["num_attention_heads"]
    plan = [("model.embed_tokens.weight", (VOCAB, D), "Q4_K"), ("model.norm.weight", (D,), None)]
    if not cfg["tie_word_embeddings"]:
        plan.append(("lm_head.weight", (VOCAB, D), "Q6_K"))
    if g.per_layer_dim:
        width = layers * g.per_layer_dim
        plan += [
            ("model.embed_tokens_per_layer.weight", (VOCAB, width), "Q4_K"),
            ("model.per_layer_model_projection.weight", (width, D), "Q4_K"),
            ("model.per_layer_projection_norm.weight", (g.per_layer_dim,), None),
        ]
    for i, spec in enumerate(g.layers):
        h, q, kv = f"model.layers.{i}", heads * spec.head_dim, spec.kv_heads * spec.head_dim
        plan += [(f"{h}.{n}.weight", (D,), None) for n in ("input_layernorm",)]
        plan += [
            (f"{h}.post_attention_layernorm.weight", (D,), None),
            (f"{h}.pre_feedforward_layernorm.weight", (D,), None),
            (f"{h}.post_feedforward_layernorm.weight", (D,), None),
            (f"{h}.layer_scalar", (1,), None),
            (f"{h}.self_attn.q_proj.weight", (q, D), "Q4_K"),
            (f"{h}.self_attn.q_norm.weight", (spec.head_dim,), None),
            (f"{h}.self_attn.o_proj.weight", (D, q), "Q4_K"),
            (f"{h}.mlp.gate_proj.weight", (spec.intermediate_size, D), "Q4_K"),
            (f"{h}.mlp.up_proj.weight", (spec.intermediate_size, D), "Q4_K"),
            (f"{h}.mlp.down_proj.weight", (D, spec.intermediate_size), "Q6_K"),
        ]
        if spec.kv_source is None:
            plan += [
                (f"{h}.self_attn.k_proj.weight", (kv, D), "Q4_K"),
                (f"{h}.self_attn.k_norm.weight", (spec.head_dim,), None),
            ]
            if not spec.k_eq_v:
                plan.append((f"{h}.self_attn.v_proj.weight", (kv, D), "Q6_K"))
        if g.per_layer_dim:
            plan += [
                (f"{h}.per_layer_input_gate.weight", (g.per_layer_dim, D), "Q4_K"),
                (f"{h}.per_layer_projection.weight", (D, g.per_layer_dim), "Q4_K"),
                (f"{h}.post_per_layer_input_norm.weight", (D,), None),
            ]
        if g.moe is not None:
            experts, width = g.moe.num_experts, g.moe.intermediate_size
            plan += [
                (f"{h}.router.proj.weight", (experts, D), None),
                (f"{h}.router.scale", (D,), None),
                (f"{h}.router.per_expert_scale", (experts,), None),
                (f"{h}.experts.gate_up_proj", (experts, 2 * width, D), "Q4_K"),
                (f"{h}.experts.down_proj", (experts, D, width), "Q6_K"),
                (f"{h}.pre_feedforward_layernorm_2.weight", (D,), None),
                (f"{h}.post_feedforward_layernorm_1.weight", (D,), None),
                (f"{h}.post_feedforward_layernorm_2.weight", (D,), None),
            ]
    return plan


def f32_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random F32 tensors of a working model: gains near 1 (Gemma 4 stores them plain), a
    decisive router, scales that differ per dimension, expert and layer."""
    if name.endswith("router.proj.weight"):
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    if name.endswith("layer_scalar"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    return (1.0 + rng.uniform(-0.2, 0.2, shape)).astype(np.float32)


def write_q4_k_m_pair(folder: Path, case: str, **overrides) -> tuple[str, str]:
    """(Hugging Face directory, GGUF file) of one random ``Q4_K_M`` checkpoint of ``case``."""
    rng = np.random.default_rng(sum(map(ord, case)))
    cfg = wide_config(case)
    layers = cfg["num_hidden_layers"]
    hf: dict[str, mx.array] = {}
    tensors: dict[str, tuple[np.ndarray, T | None]] = {}
    for name, shape, kind in tensor_plan(cfg):
        stored = gguf_name(name, layers)
        if kind is None:
            value = f32_value(name, shape, rng)
            hf[name], tensors[stored] = mx.array(value), (value, None)
            continue
        part = stored.split(".")[-2]
        kind = "Q6_K" if part in Q6_K_PARTS else kind
        count = shape[0] if len(shape) == 3 else 1
        stack = [quant_blocks(kind, *shape[-2:], rng) for _ in range(count)]
        values = np.stack([gguf.quants.dequantize(b, T[kind]) for b in stack])
        tensors[stored] = (np.stack(stack) if len(shape) == 3 else stack[0], T[kind])
        hf[name] = mx.array(values if len(shape) == 3 else values[0])
    directory = folder / f"{case}-hf"
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), hf)
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "tokenizer.json").write_text(reference_tokenizer(False).to_str())
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    path = folder / f"{case}.gguf"
    return str(directory), write_gemma4_gguf(path, tensors, cfg, gemma4_vocab(), **overrides)


def gemma4_vocab() -> dict:
    """The families' SentencePiece-style vocabulary as a ``gemma4`` one: its pieces and the
    merges that rebuild them (llama.cpp's converter writes the Hugging Face merges)."""
    from runner.gguf_tokenizer import spm_merges

    meta = tokenizer_meta(False)
    merges = spm_merges(TOKENS, meta["tokenizer.ggml.scores"], TYPES)
    meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_space_prefix"}
    return meta | {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.merges": [" ".join(m) for m in merges],
    }


@pytest.fixture(scope="module")
def q4_k_m_pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("gemma4-q4km")
    return {case: write_q4_k_m_pair(folder, case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_q4_k_m_file_computes_the_directory_model(q4_k_m_pairs, case, exact_products):
    directory, path = q4_k_m_pairs[case]
    got, want = tuned(path), tuned(directory)
    assert got.model.args.layer_types == want.model.args.layer_types
    assert settings(got.model.args) == settings(want.model.args)
    prompt = got.tokenizer.encode(PROMPT)
    assert prompt == want.tokenizer.encode(PROMPT) and prompt[0] == BOS
    assert len(prompt) > WINDOW + 2  # the sliding layers' window hides keys
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0 and np.ptp(b[0] - b[-1]) > 0.1
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert greedy(got.model, prompt, 8) == greedy(want.model, prompt, 8)


# --- the gemma4 vocabulary


def test_gemma4_vocabulary_segments_as_its_merges(tmp_path):
    meta = gemma4_vocab() | {"general.name": "vocab", "gemma4.block_count": 1}
    path = write_gguf(tmp_path / "v.gguf", {}, "gemma4", **meta)
    _, read = runner_gguf.read_gguf(path)
    tok = runner_gguf.gguf_tokenizer(read, path)
    reference = reference_tokenizer(False)
    for text in varied_strings(200):
        ids = tok.encode(text, add_bos=False)
        assert ids == spm_encode(text, False) == reference.encode(text).ids, text
        assert tok.decode(ids) == text, text  # no space prefix; bytes round-trip
    assert tok.add_bos and tok.bos_id == BOS and tok.encode("the cat")[0] == BOS
    # Runs of newlines are pieces of their own: nothing merges across them.
    assert tok.encode("the\n\nthe", add_bos=False) == (
        spm_encode("the", False) + spm_encode("\n\n", False) + spm_encode("the", False)
    )
    ids = tok.encode("sat<end_of_turn>the", add_bos=False)
    assert TOKENS.index("<end_of_turn>") in ids and TOKENS.index("<end_of_turn>") in tok.eos_ids


# --- refusals


def meta_of(case: str, **changes) -> dict:
    cfg = fixture_config(case)
    return {"general.architecture": "gemma4"} | converter_meta(cfg) | changes


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gemma4.attention.scale", 0.125),  # not read: refused, not ignored
        ("gemma4.rope.dimension_count_swa", 4),  # partial rotary on the sliding layers
        ("gemma4.rope.scaling.type", "yarn"),
        ("gemma4.expert_gating_func", 2),  # sigmoid routing
        ("gemma4.attention.value_length", 8),  # values narrower than keys
        ("gemma4.feed_forward_length", [32, 64, 32, 32, 32, 32]),  # not the shared layers
        ("gemma4.attention.sliding_window_pattern", [True] * 6),  # the last layer slides
        ("gemma4.attention.head_count_kv", [2, 1, 2, 2, 2, 2]),  # full layers differ
    ],
)
def test_an_unsupported_variant_is_refused_by_name(key, value):
    meta = meta_of("gemma4_moe" if "expert" in key else "gemma4_e", **{key: value})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        runner_gguf.gguf_config(meta, "x.gguf")
    assert key in str(info.value) and info.value.path == "x.gguf"


def test_a_file_with_an_unsupported_variant_is_refused_naming_it(tmp_path):
    _, path = write_q4_k_m_pair(tmp_path, "gemma4_dense", **{"gemma4.attention.scale": 0.5})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert "gemma4.attention.scale" in str(info.value) and info.value.path == path


def gguf_tensors(case: str) -> dict:
    """The fixture's tensors under the converter's names, with its ``rope_freqs``."""
    cfg = fixture_config(case)
    hf = mx.load(str(FIXTURES / case / "model.safetensors"))
    named = {gguf_name(k, cfg["num_hidden_layers"]): v for k, v in hf.items()}
    return named | {"rope_freqs.weight": mx.array(rope_freqs(cfg))}


@pytest.mark.parametrize(
    ("case", "meta", "extra", "named", "error"),
    [
        (
            "gemma4_e",
            {"gemma4.embedding_length_per_layer_input": 0},
            {},
            "gemma4.embedding_length_per_layer_input",
            errors.CorruptModelFile,
        ),
        ("gemma4_moe", {"gemma4.expert_count": None}, {}, "ffn_", errors.CorruptModelFile),
        (
            "gemma4_dense",
            {},
            {"blk.0.attn_q.bias": mx.zeros((32,))},
            "blk.0.attn_q.bias",
            errors.UnsupportedArchitecture,
        ),
    ],
    ids=["per-layer-inputs", "experts", "attention-bias"],
)
def test_tensors_their_keys_do_not_enable_are_refused(case, meta, extra, named, error):
    """Tensors the metadata does not make part of the model are refused by name, not loaded as
    a model without them."""
    changes = meta_of(case) | meta
    config = runner_gguf.gguf_config({k: v for k, v in changes.items() if v is not None}, "x")
    weights = gguf_tensors(case) | extra
    with pytest.raises(error) as info:
        runner_gguf.map_gguf_tensors(weights, config, "gemma4")
    assert named in str(info.value)
    plain = runner_gguf.gguf_config(meta_of(case), "x")
    runner_gguf.map_gguf_tensors(gguf_tensors(case), plain, "gemma4")  # with their keys: read


def test_a_file_without_a_sliding_pattern_is_refused():
    """llama.cpp requires ``attention.sliding_window_pattern``: no all-full default."""
    meta = meta_of("gemma4_dense")
    del meta["gemma4.attention.sliding_window_pattern"]
    with pytest.raises(errors.CorruptModelFile, match="gemma4.attention.sliding_window_pattern"):
        runner_gguf.gguf_config(meta, "x.gguf")


def test_rope_freqs_other_than_proportional_are_refused():
    cfg = fixture_config("gemma4_e")
    config = runner_gguf.gguf_config(meta_of("gemma4_e"), "x.gguf")
    factors = rope_freqs(cfg)
    factors[0] = 2.0  # the rotating pairs' factors differ
    weights = {"rope_freqs.weight": mx.array(factors)}
    with pytest.raises(errors.UnsupportedArchitecture, match="rope_freqs"):
        runner_gguf.map_gguf_tensors(weights, config, "gemma4")


def test_the_supported_architectures_include_gemma4():
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        runner_gguf.gguf_config({"general.architecture": "gemma4_assistant"}, "m.gguf")
    assert "gemma4" in str(info.value)


def test_gemma4_end_of_turn_ends_generation():
    """Gemma 4 ends a turn on ``<turn|>``, a control token its eos id need not name."""
    meta = gemma4_vocab()
    tokens = [*meta["tokenizer.ggml.tokens"], "<|turn>", "<turn|>"]
    types = [*meta["tokenizer.ggml.token_type"], 3, 3]
    scores = [*meta["tokenizer.ggml.scores"], 0.0, 0.0]
    meta |= {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
    }
    tok = runner_gguf.gguf_tokenizer(meta, "v.gguf")
    assert len(tokens) - 1 in tok.eos_ids and len(tokens) - 2 not in tok.eos_ids
    assert tok.encode("<|turn>the", add_bos=False)[0] == len(tokens) - 2  # matched whole
