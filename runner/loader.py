"""Load a model + tokenizer + config from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from drafting.weights import (
    Quantization,
    QuantSpec,
    check_and_load,
    dequantize,
    quantized_modules,
    read_json,
    read_safetensors,
)
from protocol.errors import (
    CorruptModelFile,
    LoadError,
    ModelFileMissing,
    TokenizerMissing,
    UnsupportedArchitecture,
)
from runner import gguf, gguf_families, native
from runner.chat_template import ChatTemplate, from_directory
from runner.models import build_model
from runner.models import config as config_reader
from runner.models.layers import hold_quantized, takes_panels
from runner.models.llama import Model
from runner.quantized import MlxAffine, QuantizedTensor, affine_dense
from runner.tokenizer import Tokenizer

Progress = Callable[[str, int, int], None]

# Tensors a target checkpoint may carry that the target itself never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Prefixes of inline MTP heads; kept aside for drafting/ to pick up.
MTP_PREFIXES = ("mtp.", "model.mtp_layers.", "model.mtp.")
# Where composite (text_config) checkpoints keep the language model's tensors: transformers 5,
# then older llava-style files and mlx-vlm. Other tensors (a vision tower) stay unused extras.
TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


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
    chat_template: ChatTemplate | None = None  # None: the checkpoint has none

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


def text_name(name: str) -> str:
    """A composite checkpoint's language-model tensor (or module) under its plain name."""
    for prefix, plain in TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return name


def input_widths(model: nn.Module) -> dict[str, int]:
    """``module path -> input width`` of every module with a weight (a quantized triple's
    shapes are checked against it)."""
    return {
        name[: -len(".weight")]: int(value.shape[-1])
        for name, value in tree_flatten(model.parameters())
        if name.endswith(".weight") and value.ndim >= 2
    }


def quantize_model(
    model: nn.Module, weights: dict[str, mx.array], specs: dict[str, tuple[int, int]]
) -> None:
    """Turn the layers whose weights arrive quantized into QuantizedLinear/QuantizedEmbedding,
    each with its own group size and bits (``specs``: module path -> (group_size, bits), from
    ``drafting.weights.quantized_modules``)."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        spec = specs.get(path)
        if spec is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": spec[0], "bits": spec[1], "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def refuse_unused_parameters(
    model: nn.Module, extras: dict[str, mx.array], sources: dict[str, str], path: str
) -> None:
    """A tensor of a module the model has but a parameter the config does not give it (a bias
    where the config says none) would change the math if used: refuse it by name."""
    modules = {name for name, _ in model.named_modules()}
    for name in extras:
        module = name.rpartition(".")[0]
        if module and module in modules:
            raise UnsupportedArchitecture(
                "tensor not used by the model the config describes (e.g. a bias where the "
                "config has none)",
                path=sources.get(name, path),
                tensor=name,
            )


def load_model(
    path: str,
    *,
    dtype: str | mx.Dtype | None = None,
    keep_quantized: bool | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a Hugging Face directory or a GGUF file; every failure is a typed ``LoadError``.

    ``keep_quantized`` (None: yes, where the device has a fast quantized product: MLX's on a
    GPU, ``runner.native``'s vector kernels on the CPU): run quantized weights as stored; False:
    dequantize them to ``dtype`` at load. On the CPU a kept weight goes straight into the
    native product's quantized panels (no float copy); other weights stay in the Hugging Face
    layout for ``runner.device.tune`` to lay out.
    """
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelFileMissing("model path does not exist", path=path)
    if keep_quantized is None:
        keep_quantized = mx.default_device() != mx.cpu or native.qpanels_fast()
    target_dtype = _parse_dtype(dtype)
    report = progress or (lambda stage, done, total: None)
    read = _read_gguf(path, report) if os.path.isfile(path) else _read_hf(path, report)
    quantized, extras = _load_weights(read, path, keep_quantized, target_dtype, report)
    report("ready", 1, 1)
    return LoadedModel(
        model=read.model,
        tokenizer=read.tokenizer,
        config=read.config,
        name=str(read.name),
        path=path,
        context_length=int(read.model.args.max_position_embeddings),
        dtype=target_dtype,
        quantized=quantized,
        extra_weights=extras,
        chat_template=read.template,
    )


@dataclass
class _Checkpoint:
    """A checkpoint as read: its model built (uninitialised) from its config, which refused
    what it must before any weight was read, and its tensors with the file each came from."""

    config: dict
    model: Model
    weights: dict[str, mx.array]
    sources: dict[str, str]
    tokenizer: Tokenizer
    name: object
    template: ChatTemplate | None
    quantization: Quantization | None


def check_gguf(path: str) -> None:
    """Refuse a file that is neither named ``.gguf`` nor starts as one."""
    if not path.endswith(".gguf"):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CorruptModelFile("not a GGUF file or model directory", path=path)


def _read_gguf(path: str, report: Progress) -> _Checkpoint:
    check_gguf(path)
    config, weights, tokenizer, name, template = gguf.read_checkpoint(path, report)
    model = build_model(config, path=path)
    return _Checkpoint(config, model, weights, {}, tokenizer, name, template, gguf_quantization())


def gguf_quantization() -> Quantization:
    """How a GGUF file's quantized tensors load (each carries its type; group of 32)."""
    return Quantization(QuantSpec(gguf.GROUP_SIZE), key="GGUF")


def _read_hf(path: str, report: Progress) -> _Checkpoint:
    config_path = os.path.join(path, "config.json")
    config = read_json(config_path)
    # Refuse before reading any weights.
    model = build_model(config, path=config_path)
    quantization = Quantization.from_config(config, path=config_path)
    weights, sources, tokenizer, name = _read_directory(path, config, report)
    template = _directory_template(path)
    if config_reader.is_nested(config):
        weights = {text_name(k): v for k, v in weights.items()}
        sources = {text_name(k): v for k, v in sources.items()}
        if quantization is not None:
            quantization = quantization.renamed(text_name)
    return _Checkpoint(config, model, weights, sources, tokenizer, name, template, quantization)


def _load_weights(
    read: _Checkpoint, path: str, keep_quantized: bool, dtype: mx.Dtype, report: Progress
) -> tuple[bool, dict[str, mx.array]]:
    """Load the checkpoint's tensors into its model (kept quantized, or dequantized to
    ``dtype``); return whether the model stays quantized and the tensors it does not use."""
    model, weights, sources = read.model, read.weights, read.sources
    prepare = getattr(model, "prepare_weights", None)
    if prepare is not None:  # a family's own checkpoint conventions (runner/models/qwen3_5.py)
        weights, sources = prepare(weights, sources)
    if model.args.tie_word_embeddings:
        # The embedding is the head (transformers ignores a stored one too), quantized or not.
        for suffix in ("weight", "scales", "biases"):
            weights.pop(f"lm_head.{suffix}", None)
    # Only the model's own triples: other tensors (an inline MTP head) stay as stored for
    # their own loader, which reports their faults without failing the target.
    # A GGUF file's stacked quantized experts (a list of matrices, one per expert): expert
    # panels where the gathered product takes them, else float32 as one tensor.
    on_cpu = keep_quantized and mx.default_device() == mx.cpu
    kept_experts = False
    for name in [k for k, v in weights.items() if isinstance(v, list)]:
        if on_cpu and keep_expert_list(model, weights, name):
            kept_experts = True
        else:
            weights[name] = gguf_families.dense_stack(weights[name])
    widths = input_widths(model)
    own = {k: v for k, v in weights.items() if k.rpartition(".")[0] in widths}
    specs = quantized_modules(own, read.quantization, in_dims=widths, path=path, sources=sources)
    quantized = bool(specs) or any(not isinstance(v, mx.array) for v in weights.values())
    kept = False
    if quantized and keep_quantized and mx.default_device() == mx.cpu:
        # Stacked experts ([E, out, in]) go to quantized expert panels where the gathered
        # product takes them; any others are dequantized to float32.
        stacked = {b: spec for b, spec in specs.items() if weights[b + ".weight"].ndim != 2}
        experts = {b for b, spec in stacked.items() if keep_experts(model, weights, b, spec)}
        stacked = {b: spec for b, spec in stacked.items() if b not in experts}
        if stacked:
            dequantize(weights, specs=stacked, path=path, sources=sources)
        report("quantized panels", 0, 1)
        flat = {b: spec for b, spec in specs.items() if b not in stacked and b not in experts}
        kept = keep_in_panels(model, weights, flat, path=path) or bool(experts)
    elif quantized and keep_quantized:
        quantize_model(model, weights, specs)
        kept = bool(specs)
    elif specs:
        report("dequantize", 0, 1)
        dequantize(weights, specs=specs, path=path, sources=sources)
    for name in [k for k, v in weights.items() if not isinstance(v, mx.array)]:
        weights[name] = mx.array(affine_dense(*weights[name].unpack()))  # not kept: float32
    extras = check_and_load(model, weights, path=path, sources=sources, dtype=dtype)
    refuse_unused_parameters(model, extras, sources, path)
    return kept or kept_experts, extras


def keep_experts(model: nn.Module, weights: dict, base: str, spec: tuple[int, int]) -> bool:
    """Move the stacked quantized experts ``base`` (mlx-lm's triple, ``[E, out, in]``) out of
    ``weights`` into their ``SwitchLinear`` as quantized expert panels, one expert unpacked at
    a time; False (left in ``weights``) where the gathered product does not take them."""
    from runner.native.quantized import halves_exactly

    group, bits = spec
    module = dict(model.named_modules()).get(base)
    if not _takes_experts(module, weights[base + ".weight"].shape[1], group):
        return False
    packed = weights.pop(base + ".weight")
    scales, biases = weights.pop(base + ".scales"), weights.pop(base + ".biases")
    half = halves_exactly(np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32)))
    experts = [MlxAffine(packed[e], scales[e], biases[e], group, bits) for e in range(len(packed))]
    _hold_experts(module, experts, half)
    return True


def keep_expert_list(model: nn.Module, weights: dict, name: str) -> bool:
    """Move a GGUF file's stacked quantized experts ``name`` (one ``QuantizedTensor`` per
    expert, of one type) out of ``weights`` into their ``SwitchLinear`` as quantized expert
    panels, one expert unpacked at a time; False (left in ``weights``) where the gathered
    product does not take them."""
    from runner.native.quantized import halves_exactly

    experts: list[QuantizedTensor] = weights[name]
    module = dict(model.named_modules()).get(name.rpartition(".")[0])
    first = experts[0]
    if not (
        _takes_experts(module, first.shape[0], first.group)
        and tuple(module.weight.shape) == (len(experts), *first.shape)
        and all(e.shape == first.shape and e.kind == first.kind for e in experts)
    ):
        return False
    half = all(halves_exactly(*e.unpack()[1:]) for e in experts)
    _hold_experts(module, weights.pop(name), half)
    return True


def _takes_experts(module: nn.Module | None, outputs: int, group: int) -> bool:
    """Whether the gathered quantized product takes a ``SwitchLinear``'s experts of
    ``outputs`` rows in groups of ``group``."""
    from runner.models.moe import SwitchLinear

    return (
        type(module) is SwitchLinear
        and native.gathered_quantized_available()
        and outputs % native.PANEL == 0
        and (group == 16 or group % 32 == 0)
    )


def _hold_experts(module: nn.Module, experts: list[QuantizedTensor], half: bool) -> None:
    """Lay ``experts`` out as ``module``'s quantized expert panels (one header format for
    them all, they are stacked: float16 only where every expert's fit, ``half``), one expert
    unpacked at a time."""
    from runner.native.quantized import tensor_panels

    panels = []
    for tensor in experts:
        panels.append(tensor_panels(tensor, half=half))
        mx.eval(panels[-1])
    module._panels = mx.stack(panels)
    mx.eval(module._panels)
    module.output_dims = experts[0].shape[0]
    del module["weight"]


def keep_in_panels(
    model: nn.Module, weights: dict, specs: dict[str, tuple[int, int]], *, path: str
) -> bool:
    """Move every quantized weight the native product runs (a ``Linear`` or an embedding
    whose output width is whole panels, groups of 16 or a multiple of 32) out of ``weights``
    into its module as quantized panels, one tensor at a time (the unpacked copy of one
    tensor at most is alive); what it does not take stays in ``weights`` as a quantized
    tensor, dequantized by the caller. Returns whether any weight was kept quantized."""
    for base, (group, bits) in specs.items():
        packed = weights.pop(base + ".weight")
        scales, biases = weights.pop(base + ".scales"), weights.pop(base + ".biases")
        weights[base + ".weight"] = MlxAffine(packed, scales, biases, group, bits)
    modules = dict(model.named_modules())
    kept = False
    for name in [k for k, v in weights.items() if not isinstance(v, mx.array)]:
        tensor: QuantizedTensor = weights[name]
        base = name.rpartition(".")[0]
        if base in modules and takes_panels(modules[base], tensor.shape[0], tensor.group):
            hold_quantized(model, base, weights.pop(name))
            kept = True
    return kept


def _directory_template(directory: str) -> ChatTemplate | None:
    try:
        return from_directory(directory)
    except (OSError, ValueError) as exc:  # unreadable or malformed: the file is named
        raise CorruptModelFile(f"cannot read the chat template ({exc})", path=directory) from None


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
