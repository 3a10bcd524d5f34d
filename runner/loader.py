"""Load a model + tokenizer + config from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from drafting.weights import check_and_load, dequantize, read_json, read_safetensors
from protocol.errors import CorruptModelFile, LoadError, ModelFileMissing, TokenizerMissing
from runner import gguf
from runner.models import build_model
from runner.models.llama import Model
from runner.tokenizer import Tokenizer

Progress = Callable[[str, int, int], None]

# Tensors a target checkpoint may carry that the target itself never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Prefixes of inline MTP heads; kept aside for drafting/ to pick up.
MTP_PREFIXES = ("mtp.", "model.mtp_layers.", "model.mtp.")


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer
    config: dict
    name: str
    path: str
    context_length: int
    dtype: mx.Dtype
    quantized: bool
    # Tensors present in the checkpoint but not used by the target (e.g. an inline MTP head).
    extra_weights: dict[str, mx.array] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size


def default_dtype() -> mx.Dtype:
    """float32 on CPU (BLAS covers it; bf16 and quantized matmuls are slow there)."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def _parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if isinstance(dtype, mx.Dtype):
        return dtype
    try:
        return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    except KeyError:
        raise LoadError(f"unknown dtype {dtype!r} (use float32, float16 or bfloat16)") from None


def _weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        data = read_json(index)
        shards = sorted(set(data.get("weight_map", {}).values()))
        files = [os.path.join(directory, s) for s in shards]
        for f in files:
            if not os.path.exists(f):
                raise ModelFileMissing("shard listed in the index is missing", path=f)
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    # A sidecar draft head shipped next to the target is not part of the target.
    files = [f for f in files if os.path.basename(f) != "mtp.safetensors"]
    if not files:
        raise ModelFileMissing("no *.safetensors weights found", path=directory)
    return files


def quantize_model(model: nn.Module, weights: dict[str, mx.array], group_size: int) -> None:
    """Turn the layers whose weights arrive quantized into QuantizedLinear/QuantizedEmbedding."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        packed = weights[f"{path}.weight"]
        bits = (packed.shape[-1] * 32) // (scales.shape[-1] * group_size)
        return {"group_size": group_size, "bits": bits}

    nn.quantize(model, group_size=group_size, class_predicate=predicate)


def load_model(
    path: str,
    *,
    dtype: str | mx.Dtype | None = None,
    keep_quantized: bool | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a Hugging Face directory or a GGUF file; every failure is a typed ``LoadError``.

    ``keep_quantized`` defaults to False on CPU (dequantize to ``dtype``, since BLAS only
    covers dense float32 there) and True elsewhere. The weights stay in the Hugging Face
    layout; ``runner.device.tune`` lays them out for the device.
    """
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelFileMissing("model path does not exist", path=path)
    if keep_quantized is None:
        keep_quantized = mx.default_device() != mx.cpu
    target_dtype = _parse_dtype(dtype)
    report = progress or (lambda stage, done, total: None)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise CorruptModelFile("not a GGUF file or model directory", path=path)
        config, weights, tokenizer, name = gguf.read_checkpoint(path, report)
        model = build_model(config, path=path)
        sources, group_size, bits = {}, gguf.GROUP_SIZE, None
    else:
        config_path = os.path.join(path, "config.json")
        config = read_json(config_path)
        model = build_model(config, path=config_path)  # refuse before reading any weights
        weights, sources, tokenizer, name = _read_directory(path, config, report)
        quant = config.get("quantization") or config.get("quantization_config") or {}
        group_size, bits = int(quant.get("group_size", 64)), quant.get("bits")
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized and keep_quantized:
        quantize_model(model, weights, group_size)
    elif quantized:
        report("dequantize", 0, 1)
        dequantize(weights, group_size, bits)
    extras = check_and_load(model, weights, path=path, sources=sources, dtype=target_dtype)
    report("ready", 1, 1)
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=config, name=str(name), path=path,
        context_length=int(config.get("max_position_embeddings") or 4096), dtype=target_dtype,
        quantized=quantized and keep_quantized, extra_weights=extras,
    )  # fmt: skip


def _read_directory(directory: str, config: dict, report: Progress):
    """(tensors, tensor -> file, tokenizer, name) of a Hugging Face directory."""
    tokenizer = load_hf_tokenizer(directory, config)
    files = _weight_files(directory)
    weights: dict[str, mx.array] = {}
    sources: dict[str, str] = {}
    for i, f in enumerate(files):
        report("weights", i, len(files))
        shard = read_safetensors(f)
        for k in shard:
            sources[k] = f
        weights.update(shard)
    report("weights", len(files), len(files))
    for k in [k for k in weights if k.endswith(_IGNORED_SUFFIXES)]:
        del weights[k]
    name = config.get("_name_or_path") or os.path.basename(os.path.normpath(directory))
    return weights, sources, tokenizer, name


def _token_id(tok: object, hf) -> int | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    if isinstance(tok, str):
        return hf.token_to_id(tok)
    return None


def load_hf_tokenizer(directory: str, config: dict) -> Tokenizer:
    """``tokenizer.json`` plus BOS/EOS rules from tokenizer_config and generation_config."""
    import tokenizers

    tok_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise TokenizerMissing("tokenizer.json not found", path=tok_path)
    try:
        hf = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as exc:
        raise CorruptModelFile(f"cannot parse tokenizer ({exc})", path=tok_path) from None
    tok_cfg_path = os.path.join(directory, "tokenizer_config.json")
    tok_cfg = read_json(tok_cfg_path) if os.path.exists(tok_cfg_path) else {}
    gen_path = os.path.join(directory, "generation_config.json")
    gen_cfg = read_json(gen_path) if os.path.exists(gen_path) else {}

    eos: set[int] = set()
    for src in (gen_cfg.get("eos_token_id"), config.get("eos_token_id")):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, list):
            eos.update(int(i) for i in src)
    if not eos:
        found = _token_id(tok_cfg.get("eos_token"), hf)
        if found is not None:
            eos.add(found)
    bos = _token_id(tok_cfg.get("bos_token"), hf)
    if bos is None:
        bos = config.get("bos_token_id") if isinstance(config.get("bos_token_id"), int) else None
    if "add_bos_token" in tok_cfg:
        add_bos = bool(tok_cfg["add_bos_token"])
    else:
        # A post-processor that prepends a special token is the other way checkpoints say so.
        post = json.loads(hf.to_str()).get("post_processor") or {}
        single = post.get("single") or []
        add_bos = bool(single) and "SpecialToken" in single[0]
        if add_bos and bos is None:
            bos = hf.token_to_id(single[0]["SpecialToken"]["id"])
    return Tokenizer(
        hf, bos_id=bos, eos_ids=eos, add_bos=add_bos, vocab_size=int(config.get("vocab_size", 0))
    )
