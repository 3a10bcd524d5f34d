"""GGUF files of the Qwen3.5 hybrids, dense (``qwen35``) and MoE (``qwen35moe``), and of
Qwen3-Next (``qwen3next``) (``runner.gguf_hybrid``); of GLM-4.5 (``glm4moe``,
``runner.gguf_families``); the byte-level split of Qwen3.5's and GLM's vocabularies.

As in ``tests.test_gguf_families``: each tiny checkpoint is written twice from one set of
tensors, as a Hugging Face directory and as the GGUF file llama.cpp's converter would make of
it: its names, its transforms (zero-centred gains stored ``1 + w``, ``ssm_a = -exp(A_log)``,
the conv squeezed to ``[C, K]``, value heads reordered from grouped to tiled, ``dt_bias`` as
``ssm_dt.bias``, MTP blocks appended; Qwen3-Next's ``in_proj_qkvz`` split), a ``Q4_K_M`` file's
tensor types (Q4_K, Q6_K for output, V and down, F32 norms, vectors and conv). Random quantized
blocks stand in for the quantizer, so the directory holds their dequantized values, in the
Hugging Face order. The GGUF model must compute the directory model's logits and greedy tokens.
"""

from __future__ import annotations

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest

from protocol import errors
from runner import native
from runner.gguf_hybrid import ColumnPermuted, value_head_order
from runner.loader import load_model
from runner.models import qwen3_5
from tests.test_gguf_families import (
    BOS,
    PROMPT,
    VOCAB,
    reference_tokenizer,
    tokenizer_meta,
    write_family_gguf,
)
from tests.test_gguf_models import greedy, logits, quant_blocks, tuned

T = gguf.GGMLQuantizationType
D, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 4
INTERVAL = 2  # layers 1 and 3 full attention, 0 and 2 Gated DeltaNet
ROTARY = 0.25
K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL = 2, 4, 64, 64, 4
EXPERTS, TOP_K, EXPERT_FF, SHARED_FF = 4, 2, 256, 256
KEYS, VALUES = K_HEADS * K_DIM, V_HEADS * V_DIM
CASES = {
    "qwen35": ("qwen35", False),
    "qwen35moe": ("qwen35moe", False),
    "qwen35moe-fused": ("qwen35moe", True),  # the converter's fused gate/up experts
    "qwen3next": ("qwen3next", False),
    "qwen3next-unsplit": ("qwen3next", True),  # an older converter's fused ssm_in
}
# The runner's model type of a GGUF architecture (Qwen3-Next runs on Qwen3.5-MoE's code).
MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
MODEL_TYPES["qwen3next"] = "qwen3_5_moe_text"
HF_TYPES = MODEL_TYPES | {"qwen3next": "qwen3_next"}


def hf_config(arch: str) -> dict:
    config = {
        "model_type": HF_TYPES[arch],
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": ROTARY,
        "full_attention_interval": INTERVAL,
        "linear_conv_kernel_dim": KERNEL,
        "linear_key_head_dim": K_DIM,
        "linear_value_head_dim": V_DIM,
        "linear_num_key_heads": K_HEADS,
        "linear_num_value_heads": V_HEADS,
        "tie_word_embeddings": False,
    }
    if arch != "qwen35":
        config |= {
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": EXPERT_FF,
            "shared_expert_intermediate_size": SHARED_FF,
        }
    return config


def gguf_meta(arch: str, mtp: int) -> dict:
    """The metadata llama.cpp's converter writes (its MTP blocks counted in block_count)."""
    meta = {
        "general.name": f"tiny-{arch}",
        f"{arch}.context_length": 1024,
        f"{arch}.embedding_length": D,
        f"{arch}.block_count": LAYERS + mtp,
        f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.key_length": HEAD_DIM,
        f"{arch}.attention.value_length": HEAD_DIM,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1_000_000.0,
        f"{arch}.rope.dimension_count": int(HEAD_DIM * ROTARY),
        f"{arch}.rope.dimension_sections": [2, 1, 1, 0],
        f"{arch}.ssm.conv_kernel": KERNEL,
        f"{arch}.ssm.state_size": K_DIM,
        f"{arch}.ssm.group_count": K_HEADS,
        f"{arch}.ssm.time_step_rank": V_HEADS,
        f"{arch}.ssm.inner_size": VALUES,
        f"{arch}.full_attention_interval": INTERVAL,
    }
    if mtp:
        meta[f"{arch}.nextn_predict_layers"] = mtp
    if arch != "qwen35":
        meta |= {
            f"{arch}.expert_count": EXPERTS,
            f"{arch}.expert_used_count": TOP_K,
            f"{arch}.expert_feed_forward_length": EXPERT_FF,
            f"{arch}.expert_shared_feed_forward_length": SHARED_FF,
        }
    if arch == "qwen3next":  # Qwen3-Next's RoPE is not multimodal
        del meta["qwen3next.rope.dimension_sections"]
    return meta | tokenizer_meta(True)


# (GGUF part, Hugging Face part, shape, GGML type or None for F32)
Plan = list[tuple[str, str, tuple[int, ...], str | None]]


# A dense feed-forward block's tensors.
DENSE_FFN = [
    ("ffn_gate", "mlp.gate_proj.weight", (FF, D), "Q4_K"),
    ("ffn_up", "mlp.up_proj.weight", (FF, D), "Q4_K"),
    ("ffn_down", "mlp.down_proj.weight", (D, FF), "Q6_K"),
]
# The MTP layer's own tensors, after its block's.
NEXTN = [
    ("nextn.eh_proj", "eh_proj.weight", (D, 2 * D), "Q4_K"),
    ("nextn.enorm", "enorm.weight", (D,), None),
    ("nextn.hnorm", "hnorm.weight", (D,), None),
    ("nextn.shared_head_norm", "shared_head.norm.weight", (D,), None),
]


def layer_plan(arch: str, i: int, fused: bool) -> Plan:
    kv = KV_HEADS * HEAD_DIM
    plan: Plan = [
        ("attn_norm", "input_layernorm.weight", (D,), None),
        ("post_attention_norm", "post_attention_layernorm.weight", (D,), None),
    ]
    qkvz = "linear_attn.in_proj_qkvz.weight"
    if (i + 1) % INTERVAL and arch == "qwen3next" and fused:
        plan += [
            ("ssm_in", qkvz, (2 * KEYS + 2 * VALUES, D), "Q4_K"),
            ("ssm_ba", "linear_attn.in_proj_ba.weight", (2 * V_HEADS, D), "Q4_K"),
        ]
    elif (i + 1) % INTERVAL and arch == "qwen3next":
        plan += [  # split by the converter: the directory's rows are interleaved from these
            ("attn_qkv", qkvz + "#qkv", (2 * KEYS + VALUES, D), "Q4_K"),
            ("attn_gate", qkvz + "#z", (VALUES, D), "Q4_K"),
            ("ssm_ba", "linear_attn.in_proj_ba.weight", (2 * V_HEADS, D), None),
        ]
    elif (i + 1) % INTERVAL:
        plan += [
            ("attn_qkv", "linear_attn.in_proj_qkv.weight", (2 * KEYS + VALUES, D), "Q4_K"),
            ("attn_gate", "linear_attn.in_proj_z.weight", (VALUES, D), "Q4_K"),
            ("ssm_beta", "linear_attn.in_proj_b.weight", (V_HEADS, D), "Q4_K"),
            ("ssm_alpha", "linear_attn.in_proj_a.weight", (V_HEADS, D), None),
        ]
    if (i + 1) % INTERVAL:
        plan += [
            ("ssm_conv1d", "linear_attn.conv1d.weight", (2 * KEYS + VALUES, KERNEL), None),
            ("ssm_a", "linear_attn.A_log", (V_HEADS,), None),
            ("ssm_dt.bias", "linear_attn.dt_bias", (V_HEADS,), None),
            ("ssm_norm", "linear_attn.norm.weight", (V_DIM,), None),
            ("ssm_out", "linear_attn.out_proj.weight", (D, VALUES), "Q4_K"),
        ]
    else:
        plan += [
            ("attn_q", "self_attn.q_proj.weight", (2 * HEADS * HEAD_DIM, D), "Q4_K"),
            ("attn_k", "self_attn.k_proj.weight", (kv, D), "Q4_K"),
            ("attn_v", "self_attn.v_proj.weight", (kv, D), "Q6_K"),
            ("attn_output", "self_attn.o_proj.weight", (D, HEADS * HEAD_DIM), "Q4_K"),
            ("attn_q_norm", "self_attn.q_norm.weight", (HEAD_DIM,), None),
            ("attn_k_norm", "self_attn.k_norm.weight", (HEAD_DIM,), None),
        ]
    if arch == "qwen35":
        return plan + DENSE_FFN
    plan += [
        ("ffn_gate_inp", "mlp.gate.weight", (EXPERTS, D), None),
        ("ffn_gate_inp_shexp", "mlp.shared_expert_gate.weight", (1, D), None),
        ("ffn_gate_shexp", "mlp.shared_expert.gate_proj.weight", (SHARED_FF, D), "Q4_K"),
        ("ffn_up_shexp", "mlp.shared_expert.up_proj.weight", (SHARED_FF, D), "Q4_K"),
        ("ffn_down_shexp", "mlp.shared_expert.down_proj.weight", (D, SHARED_FF), "Q6_K"),
        ("ffn_down_exps", "mlp.experts.*.down_proj.weight", (EXPERTS, D, EXPERT_FF), "Q6_K"),
    ]
    if fused and arch == "qwen35moe":
        shape = (EXPERTS, 2 * EXPERT_FF, D)
        return plan + [("ffn_gate_up_exps", "mlp.experts.*.gate_up", shape, "Q4_K")]
    return plan + [
        ("ffn_gate_exps", "mlp.experts.*.gate_proj.weight", (EXPERTS, EXPERT_FF, D), "Q4_K"),
        ("ffn_up_exps", "mlp.experts.*.up_proj.weight", (EXPERTS, EXPERT_FF, D), "Q4_K"),
    ]


def tiled(n_heads_first: int, width: int) -> np.ndarray:
    """The converter's value-head reorder (grouped by key head -> tiled) of ``n`` elements
    in runs of ``width``: ``file[p]`` holds element ``perm[p]``."""
    per = V_HEADS // K_HEADS
    idx = np.arange(n_heads_first).reshape(K_HEADS, per, width)
    return idx.transpose(1, 0, 2).reshape(-1)


def value_perm(arch: str, part: str) -> tuple[np.ndarray | None, int]:
    """(``perm`` with ``file[..., p] = hf[..., perm[p]]``, axis) for a tensor the converter
    reorders by value head (Qwen3.5 only), or (None, 0)."""
    if arch not in ("qwen35", "qwen35moe"):
        return None, 0
    if part in ("attn_qkv", "ssm_conv1d"):
        return np.concatenate([np.arange(2 * KEYS), 2 * KEYS + tiled(VALUES, V_DIM)]), 0
    if part == "attn_gate":
        return tiled(VALUES, V_DIM), 0
    if part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt.bias"):
        return tiled(V_HEADS, 1), 0
    if part == "ssm_out":
        return tiled(VALUES, V_DIM), 1
    return None, 0


def write_pair(
    folder, case: str, meta_overrides: dict | None = None, mtp: int = 1
) -> tuple[str, str]:
    """(Hugging Face directory, GGUF file) of one random checkpoint, the GGUF with ``mtp``
    MTP blocks the directory does not have (the runner ignores them)."""
    arch, fused = CASES[case]
    plans = [(i, layer_plan(arch, i, fused)) for i in range(LAYERS)]
    # An MTP block as the converter writes it: a full-attention block and the MTP layer's own
    # tensors (what llama.cpp checks when it loads the file).
    plans += [
        (i, layer_plan(arch, INTERVAL - 1, fused) + NEXTN) for i in range(LAYERS, LAYERS + mtp)
    ]
    hf, tensors = make_tensors(arch, plans, np.random.default_rng(12))
    hf = {k: v for k, v in _interleave_qkvz(hf).items() if not _is_mtp(k, LAYERS, mtp)}
    meta = gguf_meta(arch, mtp) | (meta_overrides or {})
    return save_pair(folder, case, arch, hf, tensors, hf_config(arch), meta)


def make_tensors(arch: str, plans: list[tuple[int, Plan]], rng: np.random.Generator):
    """``(Hugging Face tensors, GGUF tensors)`` of the top tensors and the layers' ``plans``:
    float tensors drawn as the directory holds them and converted; quantized ones drawn as
    the file holds them, the directory getting their dequantized values in its own order."""
    top = [
        ("token_embd", "model.embed_tokens.weight", (VOCAB, D), "Q4_K"),
        ("output_norm", "model.norm.weight", (D,), None),
        ("output", "lm_head.weight", (VOCAB, D), "Q6_K"),
    ]
    hf: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[np.ndarray, T | None]] = {}
    for i, plan in [(None, top), *plans]:
        for part, name, shape, kind in plan:
            stem = part if i is None else f"blk.{i}.{part}"
            # The converter writes A_log's tensor bare (blk.N.ssm_a), every other with a suffix.
            if not stem.endswith(".bias") and part != "ssm_a":
                stem += ".weight"
            hf_name = name if i is None else f"model.layers.{i}.{name}"
            perm, axis = value_perm(arch, part)
            if kind is None:
                value = _hf_dense(part, shape, rng)
                if arch == "glm4moe" and part.endswith("norm"):  # plain gains, stored as is
                    value += 1.0
                hf[hf_name] = value
                stored = value if arch == "glm4moe" else _converted(part, value)
                if perm is not None:
                    stored = np.take(stored, perm, axis=axis)
                tensors[stem] = (np.ascontiguousarray(stored), None)
                continue
            rows, cols = shape[-2:]
            count = shape[0] if len(shape) == 3 else 1
            stack = [quant_blocks(kind, rows, cols, rng) for _ in range(count)]
            tensors[stem] = (np.stack(stack) if len(shape) == 3 else stack[0], T[kind])
            values = [gguf.quants.dequantize(b, T[kind]) for b in stack]
            if len(shape) == 2:
                w = values[0]
                if perm is not None:  # the file holds the reordered weight
                    w = np.empty_like(w)
                    if axis == 0:
                        w[perm] = values[0]
                    else:
                        w[:, perm] = values[0]
                hf[hf_name] = w
                continue
            for e, v in enumerate(values):  # transformers' per-expert layout
                if part == "ffn_gate_up_exps":
                    base = hf_name.replace("*", str(e)).removesuffix(".gate_up")
                    hf[f"{base}.gate_proj.weight"] = v[:EXPERT_FF]
                    hf[f"{base}.up_proj.weight"] = v[EXPERT_FF:]
                else:
                    hf[hf_name.replace("*", str(e))] = v
    return hf, tensors


def save_pair(folder, case: str, arch: str, hf: dict, tensors: dict, config: dict, meta: dict):
    directory = folder / f"{case}-hf"
    directory.mkdir()
    mx.save_safetensors(
        str(directory / "model.safetensors"), {k: mx.array(v) for k, v in hf.items()}
    )
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(reference_tokenizer(True).to_str())
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return str(directory), write_family_gguf(folder / f"{case}.gguf", arch, tensors, meta)


def _interleave_qkvz(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3-Next's ``in_proj_qkvz`` from the converter's split halves (``#qkv``: all q, all
    k, all v; ``#z``: all z): per key-head group ``[q, k, v, z]``, as the checkpoint holds it."""
    out = {k: v for k, v in hf.items() if "#" not in k}
    for name in [k for k in hf if k.endswith("#qkv")]:
        base = name.removesuffix("#qkv")
        qkv, z = hf[name], hf[base + "#z"]
        q, k, v = qkv[:KEYS], qkv[KEYS : 2 * KEYS], qkv[2 * KEYS :]
        per = VALUES // K_HEADS
        out[base] = np.concatenate(
            [
                np.concatenate([x[g * w : (g + 1) * w] for x, w in parts])
                for g in range(K_HEADS)
                for parts in [[(q, K_DIM), (k, K_DIM), (v, per), (z, per)]]
            ]
        )
    return out


def _is_mtp(name: str, layers: int, mtp: int) -> bool:
    return mtp > 0 and name.startswith(tuple(f"model.layers.{layers + j}." for j in range(mtp)))


def _hf_dense(part: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor as a Hugging Face checkpoint holds it: zero-centred gains small,
    the gated norm's about 1, ``A_log`` and ``dt_bias`` in their trained ranges."""
    if part == "ssm_norm":
        return rng.uniform(0.9, 1.1, shape).astype(np.float32)
    if part == "ssm_a":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if part == "ssm_conv1d":
        return rng.uniform(-0.5, 0.5, (shape[0], 1, shape[1])).astype(np.float32)
    scale = 0.1 if part.endswith("norm") else 0.3
    return rng.uniform(-scale, scale, shape).astype(np.float32)


def _converted(part: str, value: np.ndarray) -> np.ndarray:
    """The converter's transform of a float tensor (before the value-head reorder)."""
    if part == "ssm_a":
        return -np.exp(value)
    if part == "ssm_conv1d":
        return value.squeeze()
    if part.endswith("norm") and part != "ssm_norm":
        return value + 1.0
    return value


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("gguf-hybrid")
    return {case: write_pair(folder, case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_hybrid_computes_the_directory_model(pairs, case, exact_products):
    """The GGUF file, loaded as the engine does (kept quantized where the device can), gives
    the logits and greedy tokens of the directory holding its dequantized weights."""
    directory, path = pairs[case]
    got, want = tuned(path), tuned(directory)
    assert got.quantized == native.qpanels_fast()
    assert got.config["model_type"] == MODEL_TYPES[CASES[case][0]]
    assert want.config["model_type"] == HF_TYPES[CASES[case][0]]
    assert len(got.model.layers) == LAYERS  # the MTP block is not a layer
    kinds = [type(layer).__name__ for layer in got.model.layers]
    assert kinds == ["LinearBlock", "AttentionBlock"] * (LAYERS // 2)
    assert kinds == [type(layer).__name__ for layer in want.model.layers]
    prompt = got.tokenizer.encode(PROMPT)
    assert prompt == want.tokenizer.encode(PROMPT) and prompt[0] == BOS
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0 and np.ptp(b[0] - b[-1]) > 0.1
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert len(set(b.argmax(-1).tolist())) > 1
    assert greedy(got.model, prompt, 8) == greedy(want.model, prompt, 8)


def test_value_heads_are_put_back_in_grouped_order(pairs):
    """Dequantized, every reordered tensor is the directory's: rows lazily, ``out_proj``'s
    columns through a quantized wrapper (runs of one value head are not whole Q4_K blocks)."""
    from runner import gguf as runner_gguf

    directory, path = pairs["qwen35"]
    weights, meta = runner_gguf.read_gguf(path)
    config = runner_gguf.gguf_config(meta, path)
    mapped = runner_gguf.map_gguf_tensors(weights, config, "qwen35")
    want = {k: np.array(v) for k, v in mx.load(f"{directory}/model.safetensors").items()}
    out = mapped["model.layers.0.linear_attn.out_proj.weight"]
    assert isinstance(out, ColumnPermuted)
    from runner.quantized import affine_dense

    for leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj"):
        name = f"model.layers.2.linear_attn.{leaf}.weight"
        np.testing.assert_array_equal(affine_dense(*mapped[name].unpack()), want[name])
    for leaf in ("A_log", "dt_bias", "in_proj_a.weight"):
        name = f"model.layers.0.linear_attn.{leaf}"
        np.testing.assert_allclose(np.array(mapped[name]), want[name], rtol=1e-6)
    conv = np.array(mapped["model.layers.0.linear_attn.conv1d.weight"])
    np.testing.assert_array_equal(
        conv[..., 0], want["model.layers.0.linear_attn.conv1d.weight"][:, 0]
    )
    assert not any(k.startswith(f"model.layers.{LAYERS}.") or ".nextn." in k for k in mapped)
    assert value_head_order(2, 4).tolist() == [0, 2, 1, 3]


@pytest.mark.parametrize("case", ["qwen3next", "qwen3next-unsplit"])
def test_qwen3next_projections_are_split_and_stay_quantized(pairs, case):
    """Qwen3-Next's fused rows become Qwen3.5's four projections, row subsets of the stored
    blocks (no float copy), equal to the directory's rows regrouped."""
    from runner import gguf as runner_gguf
    from runner.gguf_tensors import GGUFQuantized
    from runner.quantized import affine_dense

    directory, path = pairs[case]
    weights, meta = runner_gguf.read_gguf(path)
    config = runner_gguf.gguf_config(meta, path)
    mapped = runner_gguf.map_gguf_tensors(weights, config, "qwen3next")
    want = {k: np.array(v) for k, v in mx.load(f"{directory}/model.safetensors").items()}
    base = "model.layers.0.linear_attn."
    assert not any("in_proj_qkvz" in k or "in_proj_ba" in k for k in mapped)
    parts = {leaf: mapped[f"{base}{leaf}.weight"] for leaf in ("in_proj_qkv", "in_proj_z")}
    parts |= {leaf: mapped[f"{base}{leaf}.weight"] for leaf in ("in_proj_b", "in_proj_a")}
    assert all(isinstance(parts[leaf], GGUFQuantized) for leaf in ("in_proj_qkv", "in_proj_z"))
    dense = {
        k: affine_dense(*w.unpack()) if isinstance(w, GGUFQuantized) else np.array(w)
        for k, w in parts.items()
    }
    qkvz = want[base + "in_proj_qkvz.weight"].reshape(K_HEADS, -1, D)
    per = VALUES // K_HEADS
    q, k = qkvz[:, :K_DIM], qkvz[:, K_DIM : 2 * K_DIM]
    v, z = qkvz[:, 2 * K_DIM : 2 * K_DIM + per], qkvz[:, 2 * K_DIM + per :]
    regrouped = np.concatenate([x.reshape(-1, D) for x in (q, k, v)])
    np.testing.assert_array_equal(dense["in_proj_qkv"], regrouped)
    np.testing.assert_array_equal(dense["in_proj_z"], z.reshape(-1, D))
    ba = want[base + "in_proj_ba.weight"].reshape(K_HEADS, 2, -1, D)
    np.testing.assert_array_equal(dense["in_proj_b"], ba[:, 0].reshape(-1, D))
    np.testing.assert_array_equal(dense["in_proj_a"], ba[:, 1].reshape(-1, D))


def test_gains_are_handed_over_as_stored(pairs):
    """The file's ``1 + w`` gains are what the model's plain RMSNorm multiplies by."""
    _, path = pairs["qwen35"]
    loaded = load_model(path, keep_quantized=False)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    layer = loaded.model.layers[1]
    assert isinstance(layer, qwen3_5.AttentionBlock)
    for name, module in [
        ("blk.1.attn_norm", layer.input_layernorm),
        ("blk.1.attn_q_norm", layer.self_attn.q_norm),
        ("output_norm", loaded.model.model.norm),
    ]:
        np.testing.assert_array_equal(np.array(module.weight), stored[f"{name}.weight"])
    gated = loaded.model.layers[0].linear_attn.norm.weight
    np.testing.assert_array_equal(np.array(gated), stored["blk.0.ssm_norm.weight"])


@pytest.mark.parametrize(
    ("case", "key", "value"),
    [
        ("qwen35", "qwen35.expert_count", 4),  # a dense file with experts: not read, refused
        ("qwen35", "qwen35.attention.sliding_window", 8),
        ("qwen35", "qwen35.rope.scaling.type", "yarn"),
        ("qwen35moe", "qwen35moe.expert_gating_func", 2),  # sigmoid routing
        ("qwen35moe", "qwen35moe.expert_weights_norm", False),
        ("qwen35moe", "qwen35moe.attention.value_length", 32),
        ("qwen3next", "qwen3next.expert_gating_func", 2),
        ("qwen3next", "qwen3next.rope.scaling.type", "yarn"),
    ],
)
def test_unmapped_keys_are_refused_by_name(tmp_path, case, key, value):
    _, path = write_pair(tmp_path, case, {key: value}, mtp=0)
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert key in str(info.value) and info.value.path == path


def test_hybrid_defaults_follow_llama_cpp():
    from runner import gguf as runner_gguf

    meta = {"general.architecture": "qwen35"} | gguf_meta("qwen35", 1)
    meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    meta["qwen35.vocab_size"] = VOCAB
    cfg = runner_gguf.gguf_config(meta, "x.gguf")
    assert cfg["num_hidden_layers"] == LAYERS and cfg["partial_rotary_factor"] == ROTARY
    assert (cfg["linear_num_key_heads"], cfg["linear_value_head_dim"]) == (K_HEADS, V_DIM)
    # No interval: every fourth layer is full attention, as llama.cpp reads it.
    del meta["qwen35.full_attention_interval"]
    meta["qwen35.block_count"] = 9  # 8 layers and the MTP block
    args = qwen3_5.model_args(runner_gguf.gguf_config(meta, "x.gguf"))
    types = qwen3_5.settings(args).layer_types
    assert types == (("linear_attention",) * 3 + ("full_attention",)) * 2


# --- GLM-4.5 (glm4moe): nothing transformed; sigmoid routing, groups, biases, an MTP block

GLM_LAYERS, GLM_GROUPS = 3, 2  # layer 0 dense, 1 and 2 sparse


def glm_config() -> dict:
    return {
        "model_type": "glm4_moe",
        "hidden_size": D,
        "num_hidden_layers": GLM_LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_group": GLM_GROUPS,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": EXPERT_FF,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    }


def glm_meta() -> dict:
    """What the converter writes for ``glm_config()`` plus one MTP layer."""
    arch = "glm4moe"
    return {
        "general.name": "tiny-glm4moe",
        f"{arch}.context_length": 1024,
        f"{arch}.embedding_length": D,
        f"{arch}.block_count": GLM_LAYERS + 1,
        f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.key_length": HEAD_DIM,
        f"{arch}.attention.value_length": HEAD_DIM,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 1_000_000.0,
        f"{arch}.rope.dimension_count": HEAD_DIM // 2,
        f"{arch}.expert_count": EXPERTS,
        f"{arch}.expert_used_count": TOP_K,
        f"{arch}.expert_group_count": GLM_GROUPS,
        f"{arch}.expert_group_used_count": 1,
        f"{arch}.expert_feed_forward_length": EXPERT_FF,
        f"{arch}.expert_shared_count": 1,
        f"{arch}.leading_dense_block_count": 1,
        f"{arch}.expert_gating_func": 2,
        f"{arch}.expert_weights_scale": 2.5,
        f"{arch}.expert_weights_norm": True,
        f"{arch}.nextn_predict_layers": 1,
    } | tokenizer_meta(True)


def glm_layer_plan(i: int) -> Plan:
    kv = KV_HEADS * HEAD_DIM
    plan: Plan = [
        ("attn_norm", "input_layernorm.weight", (D,), None),
        ("post_attention_norm", "post_attention_layernorm.weight", (D,), None),
        ("attn_q", "self_attn.q_proj.weight", (HEADS * HEAD_DIM, D), "Q4_K"),
        ("attn_q.bias", "self_attn.q_proj.bias", (HEADS * HEAD_DIM,), None),
        ("attn_k", "self_attn.k_proj.weight", (kv, D), "Q4_K"),
        ("attn_k.bias", "self_attn.k_proj.bias", (kv,), None),
        ("attn_v", "self_attn.v_proj.weight", (kv, D), "Q6_K"),
        ("attn_v.bias", "self_attn.v_proj.bias", (kv,), None),
        ("attn_output", "self_attn.o_proj.weight", (D, HEADS * HEAD_DIM), "Q4_K"),
        ("attn_q_norm", "self_attn.q_norm.weight", (HEAD_DIM,), None),
        ("attn_k_norm", "self_attn.k_norm.weight", (HEAD_DIM,), None),
    ]
    if i == 0:
        return plan + DENSE_FFN
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
    if i == GLM_LAYERS:
        plan += NEXTN
    return plan


def write_glm_pair(folder, meta_overrides: dict | None = None) -> tuple[str, str]:
    plans = [(i, glm_layer_plan(i)) for i in range(GLM_LAYERS + 1)]
    hf, tensors = make_tensors("glm4moe", plans, np.random.default_rng(3))
    hf = {k: v for k, v in hf.items() if not _is_mtp(k, GLM_LAYERS, 1)}
    meta = glm_meta() | (meta_overrides or {})
    return save_pair(folder, "glm4moe", "glm4moe", hf, tensors, glm_config(), meta)


def test_gguf_glm4moe_computes_the_directory_model(tmp_path, exact_products):
    directory, path = write_glm_pair(tmp_path)
    got, want = tuned(path), tuned(directory)
    assert got.quantized == native.qpanels_fast()
    assert got.config["model_type"] == "glm4_moe" and len(got.model.layers) == GLM_LAYERS
    assert got.config["attention_bias"] and got.config["use_qk_norm"]
    assert not got.extra_weights  # the MTP layer was dropped, not left over
    prompt = got.tokenizer.encode(PROMPT)
    assert prompt == want.tokenizer.encode(PROMPT)
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0 and np.ptp(b[0] - b[-1]) > 0.1
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert len(set(b.argmax(-1).tolist())) > 1
    assert greedy(got.model, prompt, 8) == greedy(want.model, prompt, 8)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("glm4moe.expert_gating_func", 1),  # softmax routing
        ("glm4moe.attention.sliding_window", 8),
        ("glm4moe.rope.scaling.type", "yarn"),
    ],
)
def test_glm4moe_unmapped_keys_are_refused_by_name(tmp_path, key, value):
    _, path = write_glm_pair(tmp_path, {key: value})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert key in str(info.value) and info.value.path == path
