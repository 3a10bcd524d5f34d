"""GGUF files: hyper-parameters and tensors mapped to the Hugging Face layout, and a tokenizer.

``runner.gguf_tensors`` reads the file (llama.cpp's ``gguf`` reader): dense tensors as
``mx.array``, quantized ones (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K) as lazy
``runner.quantized.QuantizedTensor`` objects, exact. llama.cpp's converter permutes the rows
of llama Q/K projections for interleaved RoPE; we undo that so every model in memory has the
Hugging Face layout (rotate-half RoPE), whatever file it came from. The Gemma 2 / Gemma 3,
Phi-3, Qwen3-MoE and GLM-4.5 families are mapped by ``runner.gguf_families``, the Qwen3.5
hybrids (dense and MoE) and Qwen3-Next by ``runner.gguf_hybrid``, llama.cpp's ``deepseek2``
(DeepSeek-V3, GLM-4.7-Flash) by ``runner.gguf_mla``; SentencePiece BPE
vocabularies (``llama`` tokenizer model) are built by ``runner.gguf_tokenizer``. Gemma 4
(``gemma4``: the file's config, tensors and ``gemma4`` vocabulary) is ``runner.gguf_gemma4``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from protocol.errors import CorruptModelFile, UnsupportedArchitecture, UnsupportedTokenizer
from runner import chat_template, gguf_families, gguf_gemma4, gguf_hybrid, gguf_mla
from runner.chat_template import ChatTemplate
from runner.gguf_tensors import FORMATS, GGUFQuantized, open_gguf, read_tensor
from runner.gguf_tokenizer import spm_hf_tokenizer
from runner.models.config import refuse
from runner.tokenizer import Tokenizer

# The group size of Q4_0/Q4_1/Q5_*/Q8_0 (K-quants: 32, Q6_K: 16; each tensor carries its own).
GROUP_SIZE = 32
Tensor = mx.array | GGUFQuantized
Progress = Callable[[str, int, int], None]
LLAMA_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_ARCHS = LLAMA_ARCHS + gguf_families.ARCHS + gguf_hybrid.ARCHS + gguf_mla.ARCHS
SUPPORTED_ARCHS += gguf_gemma4.ARCHS
# Stacked quantized tensors ``[N, out, in]`` read as N matrices: routed experts, and the
# per-head halves of an MLA ``kv_b_proj`` (``runner.gguf_mla``).
_STACKED = ("_exps.weight", ".attn_k_b.weight", ".attn_v_b.weight")
# Control tokens llama.cpp also ends generation on, by their text (its end-of-generation
# list): a chat model's end of turn is often not the file's eos_token_id.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")
_EOG_TEXTS += ("<turn|>",)  # Gemma 4's end of turn

_LAYER_NAMES = gguf_families.ATTENTION_NAMES | {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre`` (llama.cpp's names).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: letters run on through combining marks (\p{M}), which Qwen2's split off.
_QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_PATTERNS = {
    "llama-bpe": _LLAMA3_PATTERN,
    "llama3": _LLAMA3_PATTERN,
    "glm4": _LLAMA3_PATTERN,  # llama.cpp's chatglm4 split is llama3's
    "chatglm-bpe": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "qwen35": _QWEN35_PATTERN,
}
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact"}
# Pre-tokenizers whose BOS llama.cpp sets to none whatever the file says: GLM's chat format
# opens with its own tokens (``[gMASK]<sop>``), which its chat template writes.
_NO_BOS = {"glm4", "chatglm-bpe"}


def _scalar(v):
    """A metadata value as plain Python (metadata given as ``mx.array`` values included)."""
    if isinstance(v, mx.array):
        return v.item() if v.size == 1 else v.tolist()
    return v


def read_gguf(path: str) -> tuple[dict[str, Tensor | list[GGUFQuantized]], dict]:
    """``(tensors, metadata)`` of a GGUF file, as ``runner.gguf_tensors.read_gguf_file`` reads
    them, except stacked quantized tensors (experts ``*_exps``, MLA's ``attn_k_b`` /
    ``attn_v_b``; ``[N, out, in]``): a list of N lazy ``GGUFQuantized`` matrices, views of the
    one block array (a matrix's rows are whole blocks), which the family mappings dequantize."""
    reader, metadata = open_gguf(path)
    tensors: dict = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in FORMATS and len(t.shape) == 3 and t.name.endswith(_STACKED):
            count, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
            blocks = t.data.reshape(count, rows, -1)
            tensors[t.name] = [GGUFQuantized(kind, (rows, cols), blocks[i]) for i in range(count)]
        else:
            tensors[t.name] = read_tensor(t, path)
    return tensors, metadata


def gguf_config(meta: dict, path: str) -> dict:
    """A Hugging Face style config dict from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitecture(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})",
            path=path,
        )
    if arch in gguf_gemma4.ARCHS:  # per-layer arrays among its common keys: read whole there
        return gguf_gemma4.gguf_config(meta, path)

    def get(key: str, default=None):
        v = meta.get(f"{arch}.{key}", default)
        return _scalar(v)

    if arch in gguf_families.ARCHS:
        gguf_families.refuse_unknown_keys(arch, meta, path)
    elif arch in gguf_hybrid.ARCHS:
        gguf_hybrid.refuse_unknown_keys(arch, meta, path)
    elif arch in gguf_mla.ARCHS:
        gguf_mla.refuse_unknown_keys(arch, meta, path)
    try:
        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        # A MoE file may leave out the dense width; its experts' width stands in.
        width = get("feed_forward_length", get("expert_feed_forward_length"))
        config = {
            "model_type": arch,
            "hidden_size": hidden,
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(width),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
        }
    except (TypeError, ValueError) as exc:
        raise CorruptModelFile(f"missing or bad hyper-parameter ({exc})", path=path) from None
    key_len = get("attention.key_length")
    if key_len is not None:
        config["head_dim"] = int(key_len)
    if arch in gguf_families.ARCHS:
        gguf_families.family_config(arch, config, get, path)
    elif arch in gguf_hybrid.ARCHS:
        gguf_hybrid.family_config(arch, config, get, path)
    vocab = get("vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    config["vocab_size"] = int(vocab) if vocab is not None else len(tokens or [])
    if arch in gguf_mla.ARCHS:
        gguf_mla.family_config(arch, config, get, path, config["vocab_size"])
    elif arch in LLAMA_ARCHS:
        _llama_config(arch, config, get, path)
    return config


def _llama_config(arch: str, config: dict, get: Callable, path: str) -> None:
    """The llama / qwen2 / qwen3 keys beyond the common ones; the ones that change the math and
    that this mapping does not carry over are refused by name (the rule of
    runner.models.config, which reads the config returned)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotated = get("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        raise refuse(
            f"{arch}.rope.dimension_count", rotated, f"partial rotary (head {head_dim})", path
        )
    experts = get("expert_count")
    if experts:
        raise refuse(f"{arch}.expert_count", experts, "mixture-of-experts blocks", path)
    window = get("attention.sliding_window")
    if window and int(window) < config["max_position_embeddings"]:
        raise refuse(f"{arch}.attention.sliding_window", window, "sliding windows in GGUF", path)
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise refuse(f"{arch}.rope.scaling.type", scaling, "GGUF RoPE scaling: linear only", path)


def _unpermute_rows(w: Tensor, n_heads: int) -> Tensor:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves); a
    quantized tensor's rows are whole blocks, so they are reordered (lazily) as they are."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    if isinstance(w, GGUFQuantized):
        order = np.arange(rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)
        return w.take_rows(order)
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def map_gguf_tensors(
    weights: dict[str, Tensor], config: dict, arch: str | None = None
) -> dict[str, Tensor]:
    """Rename GGUF tensors to Hugging Face names and undo the converter's transforms (the llama
    Q/K permutation; a family's own, in ``runner.gguf_families``). ``arch``: the file's
    architecture (default: the config's model type)."""
    arch = arch or config["model_type"]
    if arch in gguf_families.ARCHS:
        return gguf_families.map_family_tensors(arch, weights, config)
    if arch in gguf_hybrid.ARCHS:
        return gguf_hybrid.map_hybrid_tensors(arch, weights, config)
    if arch in gguf_mla.ARCHS:
        return gguf_mla.map_mla_tensors(arch, weights, config)
    if arch in gguf_gemma4.ARCHS:
        return gguf_gemma4.map_tensors(weights, config)
    out: dict[str, Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, list):  # stacked quantized experts (read_gguf): no such blocks here
            raise UnsupportedArchitecture(
                f"stacked {w[0].kind} experts: not part of the {arch} architecture",
                path=None,
                tensor=name,
            )
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("blk."):
            _, idx, part = stem.split(".", 2)
            mapped = _LAYER_NAMES.get(part)
            if mapped is None:
                out[name] = w  # unknown tensors surface as extras, not silently used
                continue
            key = f"model.layers.{idx}.{mapped}.{suffix}"
            if config["model_type"] == "llama" and part in ("attn_q", "attn_k"):
                heads = (
                    config["num_attention_heads"]
                    if part == "attn_q"
                    else config["num_key_value_heads"]
                )
                w = _unpermute_rows(w, heads)
            out[key] = w
        elif stem in _TOP_NAMES:
            out[f"{_TOP_NAMES[stem]}.{suffix}"] = w
        elif stem == "rope_freqs":
            factors = w.astype(mx.float32).tolist()
            config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
        else:
            out[name] = w
    return out


def gguf_tokenizer(meta: dict, path: str) -> Tokenizer:
    """The file's tokenizer: byte-level BPE (``gpt2`` model) or SentencePiece BPE (``llama``
    model, ``runner.gguf_tokenizer``), with the file's BOS / end-of-generation ids."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise UnsupportedTokenizer("GGUF carries no tokenizer", path=path)
    if kind == "gpt2":
        hf = _gpt2_tokenizer(meta, path)
    elif kind == "llama":
        hf = spm_hf_tokenizer(meta, path)
    elif kind == "gemma4":
        hf = gguf_gemma4.hf_tokenizer(meta, path)
    else:
        raise UnsupportedTokenizer(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE, 'gemma4' character BPE)",
            path=path,
        )
    tokens = meta["tokenizer.ggml.tokens"]

    def token_id(key: str) -> int | None:
        v = meta.get(key)
        return None if v is None else int(_scalar(v))

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos_ids = {token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")}
    types = _scalar(meta.get("tokenizer.ggml.token_type"))
    if kind in ("llama", "gemma4") and isinstance(types, list):
        # SentencePiece chat models (Gemma's <end_of_turn>, Phi-3's <|end|>) end turns on a
        # control token their eos_token_id does not name; llama.cpp finds these by text.
        eos_ids.add(token_id("tokenizer.ggml.eom_token_id"))
        eos_ids |= {i for i, t in enumerate(tokens) if t in _EOG_TEXTS and types[i] in (3, 4)}
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    # llama.cpp's default when the key is absent: SentencePiece vocabularies add BOS.
    add_bos = bool(_scalar(add_bos)) if add_bos is not None else kind == "llama"
    add_bos = add_bos or kind == "gemma4"  # llama.cpp adds BOS to gemma4 vocabularies always
    if meta.get("tokenizer.ggml.pre") in _NO_BOS:  # llama.cpp drops their BOS id
        bos, add_bos = None, False
    eos_ids.discard(None)
    return Tokenizer(hf, bos_id=bos, eos_ids=eos_ids, add_bos=add_bos, vocab_size=len(tokens))


def _gpt2_tokenizer(meta: dict, path: str):
    """A byte-level BPE ``tokenizers.Tokenizer`` from a ``gpt2`` model's tokens and merges."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CorruptModelFile("GGUF tokenizer lacks tokens or merges", path=path)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    pattern = _PRE_PATTERNS.get(pre)
    steps = []
    if pre in _DIGIT_SPLITTING:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pattern is not None:
        steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    types = _scalar(meta.get("tokenizer.ggml.token_type"))
    if isinstance(types, list):
        # 3 = control, 4 = user-defined: matched as whole strings before BPE.
        special = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]
        hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return hf


def read_checkpoint(
    path: str, report: Progress, check: Callable[[dict], object] | None = None
) -> tuple[dict, dict[str, Tensor], Tokenizer, str, ChatTemplate | None]:
    """(Hugging Face style config, tensors under Hugging Face names, tokenizer, name, chat
    template) of a GGUF file; the loader builds and loads the model from them as from a
    directory. Quantized tensors arrive as lazy ``GGUFQuantized`` objects (stacked experts
    as a list of them, one per expert). ``check`` sees the config first and may refuse it
    before any tensor is mapped."""
    report("read", 0, 1)
    weights, meta = read_gguf(path)
    report("read", 1, 1)
    config = gguf_config(meta, path)
    if check is not None:
        check(config)
    tokenizer = gguf_tokenizer(meta, path)
    weights = map_gguf_tensors(weights, config, meta.get("general.architecture"))
    # Explicit both ways: Gemma ties by default, so a stored head must say it is its own.
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    name = _scalar(meta.get("general.name")) or os.path.splitext(os.path.basename(path))[0]
    template = chat_template.from_gguf(path, meta, meta.get("tokenizer.ggml.tokens"))
    return config, weights, tokenizer, str(name), template
