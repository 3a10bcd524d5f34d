"""GGUF files of llama.cpp's ``deepseek2`` architecture (``runner.gguf_mla``): DeepSeek-V3 and
GLM-4.7-Flash (``glm4_moe_lite``), which llama.cpp's converter writes alike.

As in ``tests.test_gguf_families`` / ``tests.test_gguf_hybrid``: each tiny checkpoint is
written twice from one set of tensors, as a Hugging Face directory (the MLA fixtures' two
configurations of ``scripts/fixtures/mla.py``, widened so that K-quant blocks fit) and as the
GGUF file llama.cpp's converter would make of it: its names, its keys (the absorbed-MQA key
lengths, ``*_mla`` per-head sizes, YaRN's ``yarn_log_multiplier`` stored as 0.1 x
``mscale_all_dim``), ``kv_b_proj`` split per head into ``attn_k_b`` (key rows transposed) and
``attn_v_b`` (or whole, as older files keep it), an MTP block appended; a ``Q4_K_M`` file's
tensor types (Q4_K, Q6_K for output and down, F32 norms, router and correction bias;
``attn_k_b``, whose rows are ``qk_nope`` long, no K-quant block fits: Q5_0, llama.cpp's
fallback for Q4_K). Random quantized blocks stand in for the quantizer, so the directory holds
their dequantized values. The GGUF model must compute the directory model's logits and greedy
tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from protocol import errors
from runner import native
from runner.loader import load_model
from runner.models.mla_config import settings as mla_settings
from tests.test_gguf_families import BOS, PROMPT, VOCAB, tokenizer_meta
from tests.test_gguf_hybrid import NEXTN, save_pair
from tests.test_gguf_models import greedy, logits, quant_blocks, tuned

T = gguf.GGMLQuantizationType
ARCH = "deepseek2"
D, FF, HEADS, LAYERS = 256, 512, 4, 2  # layer 0 dense, layer 1 sparse; one MTP block after
Q_RANK, KV_RANK, NOPE, ROPE, V = 256, 256, 64, 32, 64
QK = NOPE + ROPE
EXPERTS, TOP_K, EXPERT_FF = 4, 2, 256
# Exact in float32 (the file's type), so the directory's config holds the file's value.
LOG_MUL = float(np.float32(0.08))  # 0.1 x mscale_all_dim 0.8
CASES = {
    # (family, low-rank queries, kv_b split per head, YaRN, expert groups, biases)
    "deepseek_v3": ("deepseek_v3", True, True, True, 2, False),
    "glm4_moe_lite": ("glm4_moe_lite", True, True, False, 1, False),
    # An older file's whole attn_kv_b, with a full-rank attn_q and attention biases as the
    # converter maps them (llama.cpp itself reads a full-rank query only for 26 / 27 layers,
    # DeepSeek-V2-Lite's, and no biases): the branches of the mapping the others leave out.
    "kv_b-q_proj-bias": ("deepseek_v3", False, False, False, 2, True),
}
Plan = list[tuple[str, str, tuple[int, ...], str | None]]


def hf_config(case: str) -> dict:
    family, low_rank, _, yarn, groups, bias = CASES[case]
    config = {
        "model_type": family,
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "q_lora_rank": Q_RANK if low_rank else None,
        "kv_lora_rank": KV_RANK,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V,
        "rope_interleave": True,
        "attention_bias": bias,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_group": groups,
        "topk_group": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": EXPERT_FF,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    }
    if family == "glm4_moe_lite":
        return config | {
            "rms_norm_eps": 1e-5,
            "routed_scaling_factor": 1.75,
            "mlp_layer_types": ["dense", "sparse"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    config |= {"rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}
    config["rope_theta"] = 10000.0
    if yarn:
        mscale = LOG_MUL / 0.1
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    return config


def gguf_meta(case: str) -> dict:
    """What the converter writes for ``hf_config(case)`` plus one MTP block."""
    family, low_rank, split, yarn, groups, _ = CASES[case]
    config = hf_config(case)
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    meta = {
        "general.name": f"tiny-{case}",
        f"{ARCH}.context_length": 1024,
        f"{ARCH}.embedding_length": D,
        f"{ARCH}.block_count": LAYERS + 1,
        f"{ARCH}.feed_forward_length": FF,
        f"{ARCH}.attention.head_count": HEADS,
        f"{ARCH}.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        f"{ARCH}.rope.freq_base": theta,
        f"{ARCH}.rope.dimension_count": ROPE,
        f"{ARCH}.attention.kv_lora_rank": KV_RANK,
        f"{ARCH}.vocab_size": VOCAB,
        f"{ARCH}.leading_dense_block_count": 1,
        f"{ARCH}.expert_count": EXPERTS,
        f"{ARCH}.expert_used_count": TOP_K,
        f"{ARCH}.expert_feed_forward_length": EXPERT_FF,
        f"{ARCH}.expert_shared_count": 1,
        f"{ARCH}.expert_group_count": groups,
        f"{ARCH}.expert_group_used_count": 1,
        f"{ARCH}.expert_weights_scale": config["routed_scaling_factor"],
        f"{ARCH}.expert_weights_norm": True,
        f"{ARCH}.expert_gating_func": 2,
        f"{ARCH}.nextn_predict_layers": 1,
    }
    if low_rank:
        meta[f"{ARCH}.attention.q_lora_rank"] = Q_RANK
    if split:  # the absorbed layout: one KV head of [latent, rope key]
        meta[f"{ARCH}.attention.head_count_kv"] = 1
        meta[f"{ARCH}.attention.key_length"] = KV_RANK + ROPE
        meta[f"{ARCH}.attention.value_length"] = KV_RANK
        meta[f"{ARCH}.attention.key_length_mla"] = QK
        meta[f"{ARCH}.attention.value_length_mla"] = V
    else:
        meta[f"{ARCH}.attention.head_count_kv"] = HEADS
        meta[f"{ARCH}.attention.key_length"] = QK
        meta[f"{ARCH}.attention.value_length"] = V
    if yarn:
        meta[f"{ARCH}.rope.scaling.type"] = "yarn"
        meta[f"{ARCH}.rope.scaling.factor"] = 4.0
        meta[f"{ARCH}.rope.scaling.original_context_length"] = 256
        meta[f"{ARCH}.rope.scaling.yarn_beta_fast"] = 32.0
        meta[f"{ARCH}.rope.scaling.yarn_beta_slow"] = 1.0
        meta[f"{ARCH}.rope.scaling.yarn_log_multiplier"] = LOG_MUL
    return meta | tokenizer_meta(True)


def layer_plan(case: str, i: int) -> Plan:
    _, low_rank, split, _, _, bias = CASES[case]
    plan: Plan = [
        ("attn_norm", "input_layernorm.weight", (D,), None),
        ("ffn_norm", "post_attention_layernorm.weight", (D,), None),
        ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa.weight", (KV_RANK + ROPE, D), "Q4_K"),
        ("attn_kv_a_norm", "self_attn.kv_a_layernorm.weight", (KV_RANK,), None),
        ("attn_output", "self_attn.o_proj.weight", (D, HEADS * V), "Q4_K"),
    ]
    if low_rank:
        plan += [
            ("attn_q_a", "self_attn.q_a_proj.weight", (Q_RANK, D), "Q4_K"),
            ("attn_q_a_norm", "self_attn.q_a_layernorm.weight", (Q_RANK,), None),
            ("attn_q_b", "self_attn.q_b_proj.weight", (HEADS * QK, Q_RANK), "Q4_K"),
        ]
    else:
        plan.append(("attn_q", "self_attn.q_proj.weight", (HEADS * QK, D), "Q4_K"))
    if bias:  # transformers' attention_bias without q_lora_rank: kv_a and o only
        plan += [
            ("attn_kv_a_mqa.bias", "self_attn.kv_a_proj_with_mqa.bias", (KV_RANK + ROPE,), None),
            ("attn_output.bias", "self_attn.o_proj.bias", (D,), None),
        ]
    kv_b = "self_attn.kv_b_proj.weight"
    if split:  # the directory's kv_b_proj is put together from the two (make_tensors)
        plan += [
            ("attn_k_b", kv_b + "#k", (HEADS, KV_RANK, NOPE), "Q5_0"),
            ("attn_v_b", kv_b + "#v", (HEADS, V, KV_RANK), "Q4_K"),
        ]
    else:
        plan.append(("attn_kv_b", kv_b, (HEADS * (NOPE + V), KV_RANK), "Q4_K"))
    if i == 0:
        return plan + [
            ("ffn_gate", "mlp.gate_proj.weight", (FF, D), "Q4_K"),
            ("ffn_up", "mlp.up_proj.weight", (FF, D), "Q4_K"),
            ("ffn_down", "mlp.down_proj.weight", (D, FF), "Q6_K"),
        ]
    plan += [
        ("ffn_gate_inp", "mlp.gate.weight", (EXPERTS, D), None),
        ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", (EXPERTS,), None),
        ("ffn_gate_shexp", "mlp.shared_experts.gate_proj.weight", (EXPERT_FF, D), "Q4_K"),
        ("ffn_up_shexp", "mlp.shared_experts.up_proj.weight", (EXPERT_FF, D), "Q4_K"),
        ("ffn_down_shexp", "mlp.shared_experts.down_proj.weight", (D, EXPERT_FF), "Q6_K"),
        ("ffn_gate_exps", "mlp.experts.*.gate_proj.weight", (EXPERTS, EXPERT_FF, D), "Q4_K"),
        ("ffn_up_exps", "mlp.experts.*.up_proj.weight", (EXPERTS, EXPERT_FF, D), "Q4_K"),
        ("ffn_down_exps", "mlp.experts.*.down_proj.weight", (EXPERTS, D, EXPERT_FF), "Q6_K"),
    ]
    return plan + (NEXTN if i == LAYERS else [])


def make_tensors(case: str, rng: np.random.Generator, floats: bool = False) -> tuple[dict, dict]:
    """``(Hugging Face tensors, GGUF tensors)``: float tensors drawn as both hold them (plain
    gains about 1), quantized ones drawn as the file holds them, the directory getting their
    dequantized values (per expert; ``kv_b_proj`` joined from the split halves per head).
    ``floats``: every tensor F32 instead (a float reference for another reader)."""
    top = [
        ("token_embd", "model.embed_tokens.weight", (VOCAB, D), "Q4_K"),
        ("output_norm", "model.norm.weight", (D,), None),
        ("output", "lm_head.weight", (VOCAB, D), "Q6_K"),
    ]
    plans = [(None, top)] + [(i, layer_plan(case, i)) for i in range(LAYERS + 1)]
    hf: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[np.ndarray, T | None]] = {}
    for i, plan in plans:
        for part, name, shape, kind in plan:
            stem = part if i is None else f"blk.{i}.{part}"
            stem += "" if stem.endswith(".bias") else ".weight"
            hf_name = name if i is None else f"model.layers.{i}.{name}"
            if floats and kind is not None:
                kind = "F32"  # a weight about as large as the quantized blocks' values
            if kind in (None, "F32"):
                scale = 0.15 if kind else (0.1 if part.endswith("norm") else 0.3)
                value = rng.uniform(-scale, scale, shape).astype(np.float32)
                value += 1.0 if part.endswith("norm") else 0.0
                if len(shape) == 3 and part.endswith("_exps"):  # transformers' per-expert layout
                    hf.update({hf_name.replace("*", str(e)): v for e, v in enumerate(value)})
                else:
                    hf[hf_name] = value
                tensors[stem] = (value, None)
                continue
            rows, cols = shape[-2:]
            count = shape[0] if len(shape) == 3 else 1
            stack = [quant_blocks(kind, rows, cols, rng) for _ in range(count)]
            tensors[stem] = (np.stack(stack) if len(shape) == 3 else stack[0], T[kind])
            values = [gguf.quants.dequantize(b, T[kind]) for b in stack]
            if len(shape) == 2:
                hf[hf_name] = values[0]
            elif part in ("attn_k_b", "attn_v_b"):
                hf[hf_name] = np.stack(values)
            else:
                for e, v in enumerate(values):  # transformers' per-expert layout
                    hf[hf_name.replace("*", str(e))] = v
    for name in [k for k in hf if k.endswith("#k")]:
        base = name.removesuffix("#k")
        k_b, v_b = hf.pop(name), hf.pop(base + "#v")  # [H, rank, nope], [H, v, rank]
        joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
        hf[base] = joined.reshape(-1, KV_RANK)
    mtp = f"model.layers.{LAYERS}."
    return {k: v for k, v in hf.items() if not k.startswith(mtp)}, tensors


def write_pair(
    folder, case: str, overrides: dict | None = None, drop=(), floats: bool = False
) -> tuple[str, str]:
    """(Hugging Face directory, GGUF file) of one random checkpoint; ``overrides`` / ``drop``:
    metadata keys set or left out of the file; ``floats``: F32 tensors only."""
    hf, tensors = make_tensors(case, np.random.default_rng(5), floats)
    meta = {k: v for k, v in gguf_meta(case).items() if k not in drop} | (overrides or {})
    return save_pair(folder, case, ARCH, hf, tensors, hf_config(case), meta)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("gguf-mla")
    return {case: write_pair(folder, case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_mla_computes_the_directory_model(pairs, case, exact_products):
    """The GGUF file, loaded as the engine does (kept quantized where the device can), gives
    the logits and greedy tokens of the directory holding its dequantized weights."""
    directory, path = pairs[case]
    got, want = tuned(path), tuned(directory)
    assert got.quantized == native.qpanels_fast()
    assert got.config["model_type"] == "deepseek_v3"
    assert want.config["model_type"] == CASES[case][0]
    assert len(got.model.layers) == LAYERS and not got.extra_weights  # the MTP block dropped
    assert mla_settings(got.model.args) == mla_settings(want.model.args)  # ranks, scale, RoPE
    assert got.config["attention_bias"] == CASES[case][5]
    prompt = got.tokenizer.encode(PROMPT)
    assert prompt == want.tokenizer.encode(PROMPT) and prompt[0] == BOS
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0 and np.ptp(b[0] - b[-1]) > 0.1
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert len(set(b.argmax(-1).tolist())) > 1  # the pick depends on the position
    assert greedy(got.model, prompt, 8) == greedy(want.model, prompt, 8)


def test_float_file_computes_the_directory_model(tmp_path):
    """An F32 file (dense ``attn_k_b`` / ``attn_v_b`` and expert stacks, not per-head lists)
    gives the directory model's logits too."""
    directory, path = write_pair(tmp_path, "deepseek_v3", floats=True)
    got, want = tuned(path), tuned(directory)
    assert not got.quantized
    prompt = got.tokenizer.encode(PROMPT)
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_kv_b_is_joined_from_llama_cpps_dequantized_halves(pairs):
    """``kv_b_proj`` is, per head, the transposed ``attn_k_b`` rows then ``attn_v_b``, each
    llama.cpp's own dequantization (``gguf.quants``) of the file."""
    _, path = pairs["deepseek_v3"]
    layer = load_model(path, keep_quantized=False).model.layers[1].self_attn
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def dequantized(name: str) -> np.ndarray:
        t = stored[name]
        return gguf.quants.dequantize(t.data, t.tensor_type)

    k_b, v_b = dequantized("blk.1.attn_k_b.weight"), dequantized("blk.1.attn_v_b.weight")
    assert k_b.shape == (HEADS, KV_RANK, NOPE) and v_b.shape == (HEADS, V, KV_RANK)
    weight = np.array(layer.kv_b_proj.weight).reshape(HEADS, NOPE + V, KV_RANK)
    assert weight.dtype == np.float32
    assert (weight[:, :NOPE] == k_b.transpose(0, 2, 1)).all() and (weight[:, NOPE:] == v_b).all()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (f"{ARCH}.expert_gating_func", 1),  # softmax routing (DeepSeek-V2)
        (f"{ARCH}.rope.scaling.type", "linear"),
        (f"{ARCH}.rope.scaling.yarn_ext_factor", 0.5),  # not read: refused, not ignored
        (f"{ARCH}.attention.sliding_window", 8),
    ],
)
def test_unmapped_keys_are_refused_by_name(tmp_path, key, value):
    _, path = write_pair(tmp_path, "deepseek_v3", {key: value})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert key in str(info.value) and info.value.path == path


def config_of(case: str, drop=(), **extra) -> dict:
    from runner import gguf as runner_gguf

    meta = {"general.architecture": ARCH} | gguf_meta(case) | extra
    meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.") and k not in drop}
    return runner_gguf.gguf_config(meta, "x.gguf")


def test_routing_and_scaling_defaults_follow_llama_cpp():
    gating = f"{ARCH}.expert_gating_func"
    # No gating function: llama.cpp routes by softmax, which these models do not.
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        config_of("glm4_moe_lite", drop=(gating,))
    assert gating in str(info.value)
    # ... except GLM-4.7-Flash's files (47 layers and an MTP block, its vocabulary): sigmoid.
    glm = {f"{ARCH}.block_count": 48, f"{ARCH}.vocab_size": 154880}
    cfg = config_of("glm4_moe_lite", drop=(gating,), **glm)
    assert cfg["scoring_func"] == "sigmoid" and cfg["num_hidden_layers"] == 47
    # Without the weights keys: no renormalisation, scale 1; one group.
    keys = ("expert_weights_norm", "expert_weights_scale", "expert_group_count")
    cfg = config_of("glm4_moe_lite", drop=tuple(f"{ARCH}.{k}" for k in keys))
    assert (cfg["norm_topk_prob"], cfg["routed_scaling_factor"], cfg["n_group"]) == (False, 1, 1)
    # YaRN: the stored log multiplier is 0.1 x mscale_all_dim; without it, refused.
    cfg = config_of("deepseek_v3")
    assert cfg["rope_scaling"]["mscale_all_dim"] == cfg["rope_scaling"]["mscale"] == LOG_MUL / 0.1
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]) == (NOPE, V, KV_RANK)
    log_mul = f"{ARCH}.rope.scaling.yarn_log_multiplier"
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        config_of("deepseek_v3", drop=(log_mul,))
    assert f"{ARCH}.rope.scaling.type" in str(info.value)


def test_inconsistent_key_lengths_are_named(tmp_path):
    key = f"{ARCH}.attention.key_length"
    with pytest.raises(errors.LoadError) as info:
        config_of("deepseek_v3", **{key: QK})  # an MLA file's key length is rank + rope
    assert key in str(info.value)


def test_a_sibling_architecture_stays_refused_by_name():
    """llama.cpp's DeepSeek-OCR variant shares the tensors but not the model: refused, the
    message naming it and the supported architectures (``deepseek2`` among them)."""
    from runner import gguf as runner_gguf

    with pytest.raises(errors.UnsupportedArchitecture) as info:
        runner_gguf.gguf_config({"general.architecture": "deepseek2-ocr"}, "o.gguf")
    message = str(info.value)
    supported = message.split("(supported: ", 1)[1].split(")")[0].split(", ")
    assert "'deepseek2-ocr'" in message and ARCH in supported
