"""GGUF files of the Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE families, and their SentencePiece
vocabularies (``runner.gguf_families``, ``runner.gguf_tokenizer``); the byte-level split of
Qwen3.5's and GLM's vocabularies (GLM-4.5's model: ``tests.test_gguf_hybrid``).

Each family's tiny checkpoint is written twice from one set of tensors: as a Hugging Face
directory (config.json, model.safetensors, tokenizer.json) and as the GGUF file llama.cpp's
converter would make of it (its tensor names, its transforms such as Gemma's ``w + 1`` norms,
a ``Q4_K_M`` file's tensor types: Q4_K weights, Q6_K for output, V and down, F32
norms). Random quantized blocks stand in for the quantizer, so the directory holds their
dequantized values. The GGUF model must compute the directory model's logits and greedy
tokens; its tokenizer must segment text as SentencePiece BPE does.
"""

from __future__ import annotations

import json
import random

import gguf
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from protocol import errors
from runner import native
from runner.gguf_tokenizer import spm_merges
from runner.loader import load_model
from runner.models import gemma
from tests.test_gguf_models import greedy, logits, quant_blocks, tuned
from tests.test_gguf_tensors import write_gguf

T = gguf.GGMLQuantizationType
SPACE = "\u2581"
D, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2
EXPERTS, TOP_K, EXPERT_FF = 4, 2, 256
WINDOW = 4  # shorter than the prompts, so sliding layers see fewer keys
CORPUS = (
    "the cat sat on the mat. the dog ran to the park in the rain; a hat, a bat and a rat! "
    "then they sat there together, and the other cat sang 123 songs at 4 pm. "
    "what is this? that is the thing. where are we going now, said the man to the moon."
)
# llama.cpp will not load a phi3 vocabulary without <|endoftext|>.
SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<end_of_turn>", 3), ("<|end|>", 3)]
SPECIALS += [("<|endoftext|>", 3)]
BOS, EOS, END_OF_TURN, END, END_OF_TEXT = 1, 2, 3, 4, 5
PROMPT = "the cat sat on the mat and the dog ran"


# --- a SentencePiece BPE vocabulary


def spm_vocab(pieces: int = 90) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a SentencePiece-style BPE vocabulary learnt from CORPUS:
    specials, the 256 byte tokens, the corpus's characters then its merged pieces, each
    merged piece scored by when it was learnt (earlier: higher), characters below them."""
    trainer = trainers.BpeTrainer(vocab_size=1000, show_progress=False)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    tok.train_from_iterator([CORPUS], trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    alphabet = sorted({c for c in CORPUS.replace(" ", SPACE)} | {SPACE})
    merged: list[str] = []
    for pair in merges:
        piece = "".join(pair if isinstance(pair, list) else pair.split(" "))
        if piece not in merged and piece not in alphabet:
            merged.append(piece)
    merged = merged[: pieces - len(alphabet)]
    tokens = [s for s, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [t for _, t in SPECIALS] + [6] * 256
    scores = [0.0] * len(tokens)
    tokens += alphabet + merged
    types += [1] * (len(alphabet) + len(merged))
    scores += [-1000.0 - i for i in range(len(alphabet))] + [-float(i) for i in range(len(merged))]
    return tokens, scores, types


TOKENS, SCORES, TYPES = spm_vocab()
VOCAB = len(TOKENS)  # 352: whole panels of 16 rows


def spm_encode(text: str, prefix: bool) -> list[int]:
    """SentencePiece BPE segmentation written out plainly, as llama.cpp's tokenizer runs it:
    join the adjacent pair whose joined piece scores best (the leftmost on ties) until none
    is a piece; a character that is no piece becomes its UTF-8 byte tokens."""
    normal = {t: i for i, t in enumerate(TOKENS) if TYPES[i] == 1}
    symbols = list((SPACE if prefix else "") + text.replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            found = normal.get(symbols[i] + symbols[i + 1])
            if found is not None and (best is None or SCORES[found] > best[0]):
                best = (SCORES[found], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in normal:
            ids.append(normal[s])
        else:
            ids += [TOKENS.index(f"<0x{b:02X}>") for b in s.encode()]
    return ids


def reference_tokenizer(prefix: bool) -> HFTokenizer:
    """The SentencePiece-style ``tokenizers`` BPE a Hugging Face directory would ship for this
    vocabulary: merges are every split of a piece into two pieces, ranked by its score."""
    normal = {t for t, k in zip(TOKENS, TYPES, strict=True) if k == 1}
    ranked = sorted((-s, t) for t, s, k in zip(TOKENS, SCORES, TYPES, strict=True) if k == 1)
    merges = [(t[:c], t[c:]) for _, t in ranked for c in range(1, len(t))]
    merges = [(a, b) for a, b in merges if a in normal and b in normal]
    vocab = {t: i for i, t in enumerate(TOKENS)}
    hf = HFTokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Replace(" ", SPACE)]
    hf.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else []) + steps)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback()])
    specials = [t for t, k in zip(TOKENS, TYPES, strict=True) if k == 3]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return hf


def tokenizer_meta(prefix: bool) -> dict:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": SCORES,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": prefix,
    }


def varied_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` strings mixing corpus words, odd spacing, punctuation, digits and characters
    the vocabulary lacks (accents, CJK, emoji, control characters)."""
    rng = random.Random(seed)
    words = CORPUS.split() + ["café", "日本語", "😀", "naïve", "\t", "\n", "x" * 7, "QUICK"]
    out = []
    for _ in range(n):
        parts = [rng.choice(words) for _ in range(rng.randint(1, 8))]
        glue = rng.choice([" ", "  ", "", " \n "])
        text = glue.join(parts)
        if rng.random() < 0.3:
            text = " " + text
        out.append(text or "a")
    return out


# --- checkpoints


FAMILIES = {
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,  # layer 0 slides, layer 1 is full
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "rope_theta": 10_000.0,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 5.0,  # small: random weights reach it
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    "phi3": {
        "model_type": "phi3",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.75,
        "sliding_window": WINDOW,
        "original_max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "qwen3moe": {
        "model_type": "qwen3_moe",
        "head_dim": HEAD_DIM,
        "rope_theta": 1_000_000.0,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": EXPERT_FF,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}
PREFIX = {"gemma3": False, "gemma2": False, "phi3": True, "qwen3moe": True}


def hf_config(arch: str) -> dict:
    config = {
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        **FAMILIES[arch],
    }
    if arch == "phi3":
        rotated = int(D // HEADS * 0.75) // 2
        rng = np.random.default_rng(3)
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": rng.uniform(1.0, 4.0, rotated).round(3).tolist(),
            "long_factor": rng.uniform(4.0, 16.0, rotated).round(3).tolist(),
        }
    return config


def gguf_meta(arch: str, config: dict) -> dict:
    """The metadata llama.cpp's converter writes for ``config``."""
    meta = {
        "general.name": f"tiny-{arch}",
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": D,
        f"{arch}.block_count": LAYERS,
        f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        f"{arch}.rope.freq_base": config["rope_theta"],
    }
    if "head_dim" in config:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = HEAD_DIM
    if arch == "gemma3":
        meta["gemma3.rope.freq_base_swa"] = config["rope_local_base_freq"]
        meta["gemma3.rope.scaling.type"] = "linear"
        meta["gemma3.rope.scaling.factor"] = config["rope_scaling"]["factor"]
        meta["gemma3.attention.sliding_window"] = config["sliding_window"]
        meta["gemma3.attention.sliding_window_pattern"] = config["sliding_window_pattern"]
    elif arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            meta[f"gemma2.{key}"] = config[key]
        meta["gemma2.attention.sliding_window"] = config["sliding_window"]
    elif arch == "phi3":
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        meta["phi3.rope.dimension_count"] = int(D * config["partial_rotary_factor"]) // HEADS
        meta["phi3.rope.scaling.original_context_length"] = original
        meta["phi3.rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(original)))
        meta["phi3.attention.sliding_window"] = config["sliding_window"]
    else:
        meta["qwen3moe.expert_count"] = EXPERTS
        meta["qwen3moe.expert_used_count"] = TOP_K
        meta["qwen3moe.expert_feed_forward_length"] = EXPERT_FF
    return meta | tokenizer_meta(PREFIX[arch])


def tensor_plan(arch: str) -> list[tuple[str, str, tuple[int, ...], str | None]]:
    """``(GGUF name, Hugging Face name, shape, GGML type or None for F32)`` of every tensor."""
    kv = KV_HEADS * HEAD_DIM
    plan = [("token_embd", "model.embed_tokens", (VOCAB, D), "Q4_K")]
    plan.append(("output_norm", "model.norm", (D,), None))
    if not FAMILIES[arch]["tie_word_embeddings"]:
        plan.append(("output", "lm_head", (VOCAB, D), "Q6_K"))
    for i in range(LAYERS):
        b, h = f"blk.{i}", f"model.layers.{i}"
        plan += [
            (f"{b}.attn_norm", f"{h}.input_layernorm", (D,), None),
            (f"{b}.attn_output", f"{h}.self_attn.o_proj", (D, HEADS * HEAD_DIM), "Q4_K"),
        ]
        if arch == "phi3":
            plan += [
                (
                    f"{b}.attn_qkv",
                    f"{h}.self_attn.qkv_proj",
                    (HEADS * HEAD_DIM + 2 * kv, D),
                    "Q4_K",
                ),
                (f"{b}.ffn_norm", f"{h}.post_attention_layernorm", (D,), None),
                (f"{b}.ffn_up", f"{h}.mlp.gate_up_proj", (2 * FF, D), "Q4_K"),
                (f"{b}.ffn_down", f"{h}.mlp.down_proj", (D, FF), "Q6_K"),
            ]
            continue
        plan += [
            (f"{b}.attn_q", f"{h}.self_attn.q_proj", (HEADS * HEAD_DIM, D), "Q4_K"),
            (f"{b}.attn_k", f"{h}.self_attn.k_proj", (kv, D), "Q4_K"),
            (f"{b}.attn_v", f"{h}.self_attn.v_proj", (kv, D), "Q6_K"),
        ]
        if arch != "gemma2":
            plan += [
                (f"{b}.attn_q_norm", f"{h}.self_attn.q_norm", (HEAD_DIM,), None),
                (f"{b}.attn_k_norm", f"{h}.self_attn.k_norm", (HEAD_DIM,), None),
            ]
        if arch == "qwen3moe":
            plan += [
                (f"{b}.ffn_norm", f"{h}.post_attention_layernorm", (D,), None),
                (f"{b}.ffn_gate_inp", f"{h}.mlp.gate", (EXPERTS, D), None),
                (
                    f"{b}.ffn_gate_exps",
                    f"{h}.mlp.experts.*.gate_proj",
                    (EXPERTS, EXPERT_FF, D),
                    "Q4_K",
                ),
                (f"{b}.ffn_up_exps", f"{h}.mlp.experts.*.up_proj", (EXPERTS, EXPERT_FF, D), "Q4_K"),
                (
                    f"{b}.ffn_down_exps",
                    f"{h}.mlp.experts.*.down_proj",
                    (EXPERTS, D, EXPERT_FF),
                    "Q6_K",
                ),
            ]
            continue
        plan += [
            (f"{b}.post_attention_norm", f"{h}.post_attention_layernorm", (D,), None),
            (f"{b}.ffn_norm", f"{h}.pre_feedforward_layernorm", (D,), None),
            (f"{b}.post_ffw_norm", f"{h}.post_feedforward_layernorm", (D,), None),
            (f"{b}.ffn_gate", f"{h}.mlp.gate_proj", (FF, D), "Q4_K"),
            (f"{b}.ffn_up", f"{h}.mlp.up_proj", (FF, D), "Q4_K"),
            (f"{b}.ffn_down", f"{h}.mlp.down_proj", (D, FF), "Q6_K"),
        ]
    return plan


def write_pair(folder, arch: str, meta_overrides: dict | None = None) -> tuple[str, str]:
    """(Hugging Face directory, GGUF file) of one random ``arch`` checkpoint."""
    rng = np.random.default_rng(11)
    config = hf_config(arch)
    hf: dict[str, mx.array] = {}
    tensors: dict[str, tuple[np.ndarray, T | None]] = {}
    for stem, name, shape, kind in tensor_plan(arch):
        if kind is None:  # F32, as the directory holds it; the converter's transforms
            scale = 0.1 if "norm" in stem else 0.3
            value = rng.uniform(-scale, scale, shape).astype(np.float32)
            if "norm" in stem and not arch.startswith("gemma"):
                value += 1.0
            hf[f"{name}.weight"] = mx.array(value)
            stored = value + 1.0 if arch.startswith("gemma") and "norm" in stem else value
            tensors[f"{stem}.weight"] = (stored, None)
            continue
        rows, cols = shape[-2:]
        stack = [
            quant_blocks(kind, rows, cols, rng) for _ in range(shape[0] if len(shape) == 3 else 1)
        ]
        blocks = np.stack(stack) if len(shape) == 3 else stack[0]
        tensors[f"{stem}.weight"] = (blocks, T[kind])
        values = [gguf.quants.dequantize(b, T[kind]) for b in stack]
        if len(shape) == 3:  # transformers' per-expert layout
            for e, v in enumerate(values):
                hf[f"{name.replace('*', str(e))}.weight"] = mx.array(v)
        else:
            hf[f"{name}.weight"] = mx.array(values[0])
    directory = folder / f"{arch}-hf"
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), hf)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(reference_tokenizer(PREFIX[arch]).to_str())
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    meta = gguf_meta(arch, config) | (meta_overrides or {})
    if arch == "phi3":
        for part in ("short", "long"):
            table = np.array(config["rope_scaling"][f"{part}_factor"], dtype=np.float32)
            tensors[f"rope_factors_{part}.weight"] = (table, None)
    return str(directory), write_family_gguf(folder / f"{arch}.gguf", arch, tensors, meta)


def write_family_gguf(path, arch: str, tensors: dict, meta: dict) -> str:
    """``tests.test_gguf_tensors.write_gguf`` for an ``arch`` other than llama."""
    return write_gguf(path, tensors, arch, **meta)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("gguf-families")
    return {arch: write_pair(folder, arch) for arch in FAMILIES}


# --- the tokenizer


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_spm_tokenizer_segments_as_sentencepiece(tmp_path, prefix):
    meta = tokenizer_meta(prefix) | {"general.name": "vocab", "gemma3.block_count": 1}
    path = write_family_gguf(tmp_path / "v.gguf", "gemma3", {}, meta)
    from runner import gguf as runner_gguf

    _, read = runner_gguf.read_gguf(path)
    tok = runner_gguf.gguf_tokenizer(read, path)
    reference = reference_tokenizer(prefix)
    strings = varied_strings(300)
    fell_back = 0
    for text in strings:
        ids = tok.encode(text, add_bos=False)
        assert ids == spm_encode(text, prefix), text
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == ((" " if prefix else "") + text), text  # bytes round-trip
        fell_back += any(TYPES[i] == 6 for i in ids)
    assert fell_back > 30  # unknown characters went to byte tokens
    assert tok.encode("é", add_bos=False)[-2:] == [TOKENS.index(b) for b in ("<0xC3>", "<0xA9>")]
    assert tok.encode("the cat")[0] == BOS and tok.bos_id == BOS and tok.add_bos
    # Special tokens are matched whole; llama.cpp's end-of-turn texts end generation too.
    ids = tok.encode("sat<end_of_turn>the", add_bos=False)
    assert END_OF_TURN in ids and ids == spm_encode("sat", prefix) + [END_OF_TURN] + spm_encode(
        "the", prefix
    )
    assert tok.eos_ids == {EOS, END_OF_TURN, END, END_OF_TEXT}
    # The merges rank by the joined piece's score: the best-scored piece's merge comes first.
    merges = spm_merges(TOKENS, SCORES, TYPES)
    best = max(
        (s, t) for t, s, k in zip(TOKENS, SCORES, TYPES, strict=True) if k == 1 and len(t) > 1
    )
    assert "".join(merges[0]) == best[1]


# --- the models


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_model_computes_the_directory_model(pairs, arch, exact_products):
    """The GGUF file, loaded as the engine does (kept quantized where the device can), gives
    the logits and greedy tokens of the directory holding its dequantized weights."""
    directory, path = pairs[arch]
    got, want = tuned(path), tuned(directory)
    assert got.quantized == native.qpanels_fast()  # 4- and 6-bit panels where the CPU runs them
    assert got.config["model_type"] == FAMILIES[arch]["model_type"]
    assert got.model.args.layer_types == want.model.args.layer_types
    if arch.startswith("gemma"):
        assert got.model.args.layer_types == ["sliding_attention", "full_attention"]
    prompt = got.tokenizer.encode(PROMPT)
    assert prompt == want.tokenizer.encode(PROMPT) and prompt[0] == BOS
    assert len(prompt) > WINDOW + 2  # the sliding layers' window hides keys
    a, b = logits(got.model, prompt), logits(want.model, prompt)
    assert np.isfinite(b).all() and np.ptp(b) > 1.0 and np.ptp(b[0] - b[-1]) > 0.1
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    assert len(set(b.argmax(-1).tolist())) > 1  # the pick depends on the position
    # Tiny random models often settle on one token; the continuation must still be the same.
    assert greedy(got.model, prompt, 8) == greedy(want.model, prompt, 8)


def test_gemma_norms_are_stored_plus_one(pairs):
    """The model's gains are the file's minus one (its RMSNorm adds the one back)."""
    _, path = pairs["gemma3"]
    loaded = load_model(path, keep_quantized=False)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    layer = loaded.model.layers[1]
    for name, module in [
        ("blk.1.post_ffw_norm", layer.post_feedforward_layernorm),
        ("blk.1.attn_k_norm", layer.self_attn.k_norm),
    ]:
        np.testing.assert_allclose(
            np.array(module.weight) + 1.0, stored[f"{name}.weight"], atol=1e-6
        )


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [
        ("gemma3", "gemma3.attention.scale", 0.125),  # not read: refused, not ignored
        ("gemma3", "gemma3.rope.scaling.type", "yarn"),
        ("gemma2", "gemma2.rope.scaling.type", "linear"),
        ("phi3", "phi3.rope.dimension_sections", [8, 8, 8, 0]),
        ("qwen3moe", "qwen3moe.expert_shared_count", 1),
        ("qwen3moe", "qwen3moe.expert_gating_func", 2),  # sigmoid routing
        ("qwen3moe", "qwen3moe.attention.sliding_window", 8),
    ],
)
def test_unmapped_keys_are_refused_by_name(tmp_path, arch, key, value):
    _, path = write_pair(tmp_path, arch, {key: value})
    with pytest.raises(errors.UnsupportedArchitecture) as info:
        load_model(path)
    assert key in str(info.value) and info.value.path == path


def config_of(arch: str, **extra) -> dict:
    from runner import gguf as runner_gguf

    meta = {"general.architecture": arch} | gguf_meta(arch, hf_config(arch))
    meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    return runner_gguf.gguf_config(meta | extra, "x.gguf")


def test_family_defaults_follow_llama_cpp():
    # Gemma 3 without a window: every layer full; with one but no pattern: 5 of every 6 slide.
    cfg = config_of("gemma3")
    assert cfg["sliding_window_pattern"] == 2 and cfg["rope_local_base_freq"] == 10_000.0
    del_keys = ("gemma3.attention.sliding_window", "gemma3.attention.sliding_window_pattern")
    meta = {"general.architecture": "gemma3"} | gguf_meta("gemma3", hf_config("gemma3"))
    from runner import gguf as runner_gguf

    no_window = {k: v for k, v in meta.items() if k not in del_keys}
    assert runner_gguf.gguf_config(no_window, "x")["layer_types"] == ["full_attention"] * LAYERS
    no_pattern = {k: v for k, v in meta.items() if k != del_keys[1]} | {"gemma3.block_count": 12}
    types = gemma.model_args(runner_gguf.gguf_config(no_pattern, "x")).layer_types
    assert types == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    # The query scale: the head width, but hidden / heads for the 27B models (62 blocks).
    assert cfg["query_pre_attn_scalar"] == HEAD_DIM
    big = config_of("gemma3", **{"gemma3.block_count": 62, "gemma3.embedding_length": 5376})
    assert big["query_pre_attn_scalar"] == 5376 // HEADS
    # Phi-3: no window is written as 0; rotated dims below the head: partial rotary.
    phi = config_of("phi3", **{"phi3.attention.sliding_window": 0})
    assert phi["sliding_window"] is None and phi["partial_rotary_factor"] == 0.75
    moe = config_of("qwen3moe")
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["norm_topk_prob"]) == (4, 2, True)


def test_unknown_architecture_names_the_supported_ones():
    from runner import gguf as runner_gguf

    with pytest.raises(errors.UnsupportedArchitecture) as info:
        runner_gguf.gguf_config({"general.architecture": "mamba"}, "m.gguf")
    for arch in ("llama", "gemma3", "gemma2", "phi3", "qwen3moe"):
        assert arch in str(info.value)


# --- the byte-level BPE split of these files' tokenizers


def gpt2_meta(pre: str) -> dict:
    from runner.tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["<|endoftext|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [1] * 256 + [3],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 256,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_qwen35_split_keeps_combining_marks_and_glm4_has_no_bos():
    from runner import gguf as runner_gguf

    text = "cafe\u0301 x\u0308y"  # decomposed accents: a letter then a combining mark
    pieces = {}
    for pre in ("qwen2", "qwen35"):
        hf = runner_gguf._gpt2_tokenizer(gpt2_meta(pre), "t.gguf")
        pieces[pre] = len(hf.pre_tokenizer.pre_tokenize_str(text))
    assert pieces == {"qwen2": 4, "qwen35": 2}  # Qwen2 splits a mark off a word
    glm = runner_gguf.gguf_tokenizer(gpt2_meta("glm4"), "t.gguf")
    assert glm.bos_id is None and not glm.add_bos
    qwen = runner_gguf.gguf_tokenizer(gpt2_meta("qwen35"), "t.gguf")
    assert qwen.bos_id == 256 and qwen.add_bos


def test_a_bad_required_key_is_a_corrupt_file_naming_it(tmp_path):
    arch = "qwen3moe"
    _, path = write_pair(tmp_path, arch, {f"{arch}.expert_used_count": "two"})
    with pytest.raises(errors.CorruptModelFile) as info:
        load_model(path)
    assert f"{arch}.expert_used_count" in str(info.value) and path in str(info.value)
