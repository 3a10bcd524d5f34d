"""Small random Hugging Face checkpoints for tests: config, safetensors and a trained tokenizer.

Nothing can be downloaded here, so tests build their own models: a byte-level BPE tokenizer
trained with ``tokenizers`` on a fixed corpus, and a Llama-family model with seeded random
weights, saved exactly as a Hugging Face (or mlx-community quantized) directory would be.
"""

from __future__ import annotations

import functools
import json
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from runner.models import build_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS_TOKEN = "<|im_end|>"

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be or not to be, that is the question. All that glitters is not gold.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
The capital of France is Paris. The capital of Italy is Rome. Water boils at 100 degrees.
Once upon a time there was a little robot who wanted to learn how to paint the sky.
1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Emoji: 😀 🎉 ✨ — em dash, café, naïve, 日本語, Ünïcödé.
user: hello! assistant: Hi, how can I help you today? system: You are a helpful assistant.
"""


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int = 320) -> str:
    """A byte-level BPE tokenizer (JSON) with the chat special tokens, trained deterministically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def tokenizer_vocab_size(vocab_size: int = 320) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(vocab_size)).get_vocab_size(with_added_tokens=True)


def model_config(
    model_type: str = "llama",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
    **extra,
) -> dict:
    config = {
        "model_type": model_type,
        "architectures": [
            {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
                model_type, "LlamaForCausalLM"
            )
        ],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
    }
    if model_type == "qwen3":
        config["head_dim"] = hidden_size // num_attention_heads
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    config.update(extra)
    return config


def random_weights(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Seeded random parameters for ``config`` with the Hugging Face names."""
    mx.random.seed(seed)
    model = build_model(config)
    # Norm weights start at 1; jitter them so tests notice a norm that is skipped.
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if "norm" in name:
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith(".bias"):
            params[name] = 0.1 * mx.random.normal(value.shape)
    mx.eval(params)
    return params


def quantize_weights(
    config: dict, weights: dict[str, mx.array], bits: int = 4, group_size: int = 32
) -> dict[str, mx.array]:
    """Quantize linear and embedding weights the way mlx-community checkpoints store them."""
    model = build_model(config)
    model.load_weights(list(weights.items()))
    nn.quantize(model, group_size=group_size, bits=bits)
    out = dict(tree_flatten(model.parameters()))
    mx.eval(out)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    return out


def write_checkpoint(
    path: str | os.PathLike,
    model_type: str = "llama",
    *,
    seed: int = 0,
    quantize_bits: int | None = None,
    shards: int = 1,
    tokenizer_vocab: int = 320,
    **config_overrides,
) -> str:
    """Write a complete random checkpoint directory and return its path."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok_json = tokenizer_json(tokenizer_vocab)
    vocab = tokenizer_vocab_size(tokenizer_vocab)
    config = model_config(model_type, vocab_size=vocab, **config_overrides)
    weights = random_weights(config, seed)
    if quantize_bits:
        weights = quantize_weights(config, weights, bits=quantize_bits)
    names = sorted(weights)
    if shards > 1:
        per = (len(names) + shards - 1) // shards
        weight_map = {}
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(os.path.join(path, fname), {k: weights[k] for k in part})
            weight_map.update({k: fname for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    else:
        mx.save_safetensors(os.path.join(path, "model.safetensors"), weights)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tok_json)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS_TOKEN, "bos_token": None, "add_bos_token": False}, f)
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_str(tok_json).token_to_id(EOS_TOKEN)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos_id]}, f)
    return path
