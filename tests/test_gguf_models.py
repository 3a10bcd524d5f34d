"""End to end: tiny llama GGUF models written with llama.cpp's own writer (``gguf.GGUFWriter``),
tensors as a ``Q4_K_M`` file holds them (Q4_K, Q6_K, F32 norms) or in the older types (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0), a ``gpt2`` byte-level BPE tokenizer in the metadata; loaded by
``runner.loader.load_model`` kept quantized (the CPU's quantized panels) and dequantized, run,
and refused by type through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from protocol import errors
from runner import native
from runner.device import tune
from runner.loader import load_model
from runner.models.layers import PanelEmbedding
from runner.tokenizer import bytes_to_unicode
from tests.test_gguf_tensors import FP16_FIELDS, write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, FF, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
KV = D // HEADS * KV_HEADS
MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at", "o n", "Ġ on"]
MERGES += ["Ġ m", "Ġm at", "t he", "i n"]
SPECIALS = ["<s>", "</s>"]
VOCAB = 256 + len(MERGES) + len(SPECIALS)  # 272: whole panels of 16 rows
BOS, EOS = VOCAB - 2, VOCAB - 1
SHAPES = {
    "token_embd": (VOCAB, D),
    "output": (VOCAB, D),
    "attn_q": (D, D),
    "attn_k": (KV, D),
    "attn_v": (KV, D),
    "attn_output": (D, D),
    "ffn_gate": (FF, D),
    "ffn_up": (FF, D),
    "ffn_down": (D, FF),
}
# What llama.cpp's Q4_K_M recipe stores (output and V/down one step up, at Q6_K), and a file of
# the older 32-element types with a tied embedding (no ``output``).
Q4_K_M = dict.fromkeys(SHAPES, "Q4_K") | {"output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}
LEGACY = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q5_0",
    "attn_output": "Q5_1",
    "ffn_gate": "Q5_0",
    "ffn_up": "Q4_1",
    "ffn_down": "Q8_0",
}
RECIPES = {"q4_k_m": Q4_K_M, "legacy": LEGACY}
# The largest |w| / |d| a block's values reach (K-quants: 6-bit sub-scales times the values).
REACH = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 128, "Q4_K": 945, "Q6_K": 4096}
REACH |= {"Q2_K": 45, "IQ4_NL": 127}
WEIGHT = 0.15  # the largest |w| a tensor reaches, about
TEXT = "the cat sat on the mat"
T = gguf.GGMLQuantizationType


def quant_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``uint8 [rows, row bytes]`` of random blocks whose fp16 scale fields (d, dmin, m) are
    random in +-[0.5, 1] * WEIGHT / REACH, so every weight stays below about WEIGHT."""
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        magnitude = rng.uniform(0.5, 1.0, len(raw)) * WEIGHT / REACH[kind]
        d = (magnitude * rng.choice([-1.0, 1.0], len(raw))).astype(np.float16)
        raw[:, at : at + 2] = d.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def tokenizer_meta() -> dict:
    """A minimal ``gpt2`` byte-level BPE: GPT-2's 256 byte tokens, MERGES, two specials."""
    tokens = list(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES] + SPECIALS
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": [1] * (VOCAB - 2) + [3, 3],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.add_bos_token": True,
    }


def write_model(path, recipe: dict[str, str], overrides: dict[str, str] | None = None) -> str:
    """A tiny llama GGUF: tensors in ``recipe``'s types (``overrides``: by tensor stem, e.g.
    ``blk.1.ffn_down``), F32 norms, hyper-parameters and tokenizer in the metadata."""
    rng = np.random.default_rng(7)
    overrides = overrides or {}
    tensors = {}

    def add(stem: str, part: str) -> None:
        kind = overrides.get(stem, recipe[part])
        tensors[f"{stem}.weight"] = (quant_blocks(kind, *SHAPES[part], rng), T[kind])

    def norm(stem: str) -> None:
        tensors[f"{stem}.weight"] = (rng.uniform(0.8, 1.2, D).astype(np.float32), None)

    add("token_embd", "token_embd")
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm")
        norm(f"blk.{i}.ffn_norm")
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            add(f"blk.{i}.{part}", part)
        add(f"blk.{i}.ffn_down", "ffn_down")
    norm("output_norm")
    if "output" in recipe:
        add("output", "output")
    meta = {
        "general.name": "tiny-gguf",
        "llama.embedding_length": D,
        "llama.block_count": LAYERS,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.context_length": 256,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
    }
    return write_gguf(path, tensors, **meta, **tokenizer_meta())


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("gguf-models")
    return {name: write_model(folder / f"{name}.gguf", r) for name, r in RECIPES.items()}


def tuned(path: str, *, keep_quantized: bool | None = None, exact: bool = True):
    """``load_model`` then ``runner.device.tune`` as the engine does (tune sets the product
    path itself: ``exact``)."""
    loaded = load_model(path, keep_quantized=keep_quantized)
    tune(loaded.model, None, exact_products=exact)
    return loaded


def logits(model, tokens: list[int]) -> np.ndarray:
    """Float32 logits ``[L, V]`` of one prefill of ``tokens``."""
    out = model(mx.array([tokens]), model.make_caches())
    return np.array(out[0].astype(mx.float32))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, one forward per token."""
    caches = model.make_caches()
    out = model(mx.array([prompt]), caches)
    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(out[0, -1]).item()))
        out = model(mx.array([tokens[-1:]]), caches)
    return tokens


needs_qpanels = pytest.mark.skipif(
    mx.default_device() != mx.cpu or not native.qpanels_available(),
    reason="quantized panels: the CPU with runner.native built",
)


def test_tokenizer_from_metadata(model_files):
    loaded = load_model(model_files["legacy"], keep_quantized=False)
    tok = loaded.tokenizer
    ids = tok.encode(TEXT)
    pieces = ["the", "Ġcat", "Ġsat", "Ġon", "Ġthe", "Ġmat"]
    vocab = tok.hf.get_vocab()
    assert ids == [BOS] + [vocab[p] for p in pieces]
    assert tok.decode(ids[1:]) == TEXT and tok.eos_ids == {EOS}
    assert tok.decode(tok.encode("zé\n", add_bos=False)) == "zé\n"  # byte tokens round trip
    assert (loaded.name, loaded.context_length, loaded.vocab_size) == ("tiny-gguf", 256, VOCAB)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row order (rotate-half pairs interleaved), applied to a
    Hugging Face weight: the file's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_dequantized_weights_are_llama_cpps(model_files, recipe):
    """Every quantized tensor of the model, dequantized, is llama.cpp's own dequantization
    (``gguf.quants``) of the file, Q and K in the file's permuted row order."""
    path = model_files[recipe]
    params = dict(tree_flatten(load_model(path, keep_quantized=False).model.parameters()))
    names = {"token_embd": "model.embed_tokens", "output": "lm_head"}
    for i in range(LAYERS):
        for part, hf in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj")]:
            names[f"blk.{i}.{part}"] = f"model.layers.{i}.{hf}"
        names[f"blk.{i}.ffn_down"] = f"model.layers.{i}.mlp.down_proj"
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for stem, hf in names.items():
        if stem == "output" and recipe == "legacy":
            assert "lm_head.weight" not in params  # tied
            continue
        t = tensors[f"{stem}.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = np.array(params[f"{hf}.weight"])
        if stem.endswith(("attn_q", "attn_k")):
            got = llama_cpp_permute(got, HEADS if stem.endswith("attn_q") else KV_HEADS)
        assert got.dtype == np.float32 and (got == want).all(), stem


@needs_qpanels
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kept_quantized_logits_match_dequantized(model_files, recipe, product_path):
    path = model_files[recipe]
    kept = load_model(path)
    assert kept.quantized
    layer = kept.model.layers[1]
    for linear in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.down_proj):
        assert "weight" not in linear and linear._wt.dtype == mx.uint8 and linear._wt.ndim == 4
    assert isinstance(kept.model.model.embed_tokens, PanelEmbedding)
    assert kept.model.args.tie_word_embeddings == (recipe == "legacy")
    tune(kept.model, None, exact_products=product_path)
    tokens = kept.tokenizer.encode(TEXT)
    got = logits(kept.model, tokens)
    dense = tuned(path, keep_quantized=False)
    assert not dense.quantized and dense.model.layers[1].mlp.down_proj._wt.dtype == mx.float32
    want = logits(dense.model, tokens)
    assert np.isfinite(want).all() and 1.0 < np.ptp(want) < 100.0  # sane activations
    assert np.ptp(want[0] - want[-1]) > 0.1  # the logits depend on the tokens
    if product_path:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    else:  # int8 activations (two levels): close, same argmax
        assert np.abs(got - want).max() < 1e-3 * np.ptp(want)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_qpanels
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_greedy_continuation_is_the_dequantized_one(model_files, recipe, exact_products):
    path = model_files[recipe]
    kept, dense = tuned(path), tuned(path, keep_quantized=False)
    prompt = kept.tokenizer.encode(TEXT)
    want = greedy(dense.model, prompt, 8)
    assert len(set(want)) > 1  # not one token over and over
    assert greedy(kept.model, prompt, 8) == want


@pytest.mark.parametrize("kind", ["Q2_K", "IQ4_NL"])
def test_unsupported_tensor_type_is_refused_by_name(tmp_path, kind):
    path = write_model(tmp_path / "bad.gguf", Q4_K_M, {"blk.1.ffn_up": kind})
    with pytest.raises(errors.UnsupportedTensorType) as info:
        load_model(path)
    assert info.value.tensor == "blk.1.ffn_up.weight" and info.value.path == path
    assert kind in str(info.value) and "blk.1.ffn_up.weight" in str(info.value)


def run_cli(path: str, *flags: str, requests: list[dict] = ()) -> tuple[list[dict], int, str]:
    """``python -m runner --model path --no-draft *flags`` fed ``requests`` then end of
    stdin: (its frames but progress, exit status, stderr's tail)."""
    lines = "".join(json.dumps(r) + "\n" for r in requests).encode()
    argv = [sys.executable, "-m", "runner", "--model", path, "--no-draft", *flags]
    out = subprocess.run(argv, cwd=ROOT, input=lines, capture_output=True, timeout=120)
    frames = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [f for f in frames if f["type"] != "progress"], out.returncode, out.stderr[-2000:]


def test_cli_reports_unsupported_tensor_type_and_exits_one(tmp_path):
    path = write_model(tmp_path / "bad.gguf", Q4_K_M, {"blk.0.ffn_down": "Q2_K"})
    frames, status, stderr = run_cli(path)
    assert [f["type"] for f in frames] == ["error"], (frames, stderr)
    error = frames[0]
    assert (error["code"], error["id"]) == ("unsupported_tensor_type", None)
    assert "blk.0.ffn_down.weight" in error["message"] and "Q2_K" in error["message"]
    assert "bad.gguf" in error["message"]
    assert status == 1, stderr


@needs_qpanels
def test_cli_serves_the_file_kept_quantized_as_dequantized(model_files, exact_products):
    path = model_files["q4_k_m"]
    options = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}  # plain argmax
    request = {"type": "completion", "id": "a", "prompt": TEXT, "options": options}
    runs = {}
    for flag in ("--exact-products", "--dequantize"):
        frames, status, stderr = run_cli(path, flag, requests=[request])
        types = [f["type"] for f in frames]
        assert status == 0 and types == ["ready"] + ["token"] * (len(types) - 2) + ["done"], stderr
        tokens = [t for f in frames if f["type"] == "token" for t in f["tokens"]]
        runs[flag] = (tokens, frames[0]["weights_bytes"])
    (kept, kept_bytes), (dense, dense_bytes) = runs["--exact-products"], runs["--dequantize"]
    assert kept_bytes < dense_bytes / 3  # 4- and 6-bit blocks, not float32
    reference = tuned(path, keep_quantized=False)
    assert kept == dense == greedy(reference.model, reference.tokenizer.encode(TEXT), 8)
