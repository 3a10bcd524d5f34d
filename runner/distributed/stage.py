"""One rank's part of the model: its run of decoder layers, read from the checkpoint alone.

Every rank reads the checkpoint's shard headers (``mx.load`` maps safetensors lazily: a
tensor's bytes are read only when it is evaluated), keeps the tensors of its own layers,
renamed to the stage's local indices, and loads them through the loader's own path
(quantized triples, ties, dtype casts and shape checks as for a whole model). Rank 0's stage
also holds the embedding, the final norm and the output projection: the sampler runs there,
a tied embedding is one table for the lookup and the output product, and the last rank
hands back a row of D values instead of V logits. The other ranks' stages take hidden rows
in place of token ids (their embedding and final norm are identities).

The llama family (llama, mistral, qwen2, qwen3), qwen3_moe and the Qwen3.5 / Qwen3-Next
hybrids from a Hugging Face directory or a GGUF file (read by the loader's own reader, its
tensors under Hugging Face names) are split; anything else is refused by name before any
weight is read. A stage's layers keep their own kind (a MoE model's sparse or dense MLPs, a
hybrid's Gated DeltaNet or attention blocks: the config's schedules are by global layer
index).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from drafting.weights import Quantization, read_json
from protocol.errors import (
    LoadError,
    ModelFileMissing,
    UnsupportedArchitecture,
)
from runner import device, gguf, loader, native
from runner.chat_template import ChatTemplate
from runner.distributed.split import FIRST_RANK, LAYER, LayerPlan, plan_layers, weight_sizes
from runner.models import config as config_reader
from runner.models import family, llama, moe, qwen3_5, qwen3_moe
from runner.models.qwen3_5_config import settings as hybrid_settings

Progress = Callable[[str, int, int], None]
# The families split across ranks: their module (``model_args`` and ``Model``).
SPLIT = (llama, qwen3_moe, qwen3_5)


@dataclass
class Checkpoint:
    """A directory's or GGUF file's config, its family's arguments and model class, and its
    tensors, still lazy (a GGUF file's quantized matrices are views of the mapped file)."""

    path: str
    config: dict
    args: llama.ModelArgs
    tensors: dict[str, mx.array]
    sources: dict[str, str]
    tokenizer: object
    name: str
    model_class: type[llama.Model] = llama.Model
    quantization: Quantization | None = None  # how its quantized tensors load
    template: ChatTemplate | None = None  # its chat template (rank 0's tokenizer side)


def read_checkpoint(path: str, report: Progress) -> Checkpoint:
    """Read a Hugging Face directory's config, tokenizer and tensor headers; refuse what the
    pipeline does not split (a GGUF file, another family) before any weight is read."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelFileMissing("model path does not exist", path=path)
    if not os.path.isdir(path):
        return _read_gguf(path, report)
    config_path = os.path.join(path, "config.json")
    config = read_json(config_path)
    module = _split_family(config, config_path)
    args = module.model_args(config, config_path)
    quantization = Quantization.from_config(config, path=config_path)
    tensors, sources, tokenizer, name = loader._read_directory(path, config, report)
    if config_reader.is_nested(config):
        tensors = {loader.text_name(k): v for k, v in tensors.items()}
        sources = {loader.text_name(k): v for k, v in sources.items()}
        if quantization is not None:
            quantization = quantization.renamed(loader.text_name)
    template = loader._directory_template(path)
    return Checkpoint(
        path,
        config,
        args,
        tensors,
        sources,
        tokenizer,
        str(name),
        module.Model,
        quantization,
        template,
    )


def _read_gguf(path: str, report: Progress) -> Checkpoint:
    """A GGUF file as the loader reads it (its tensors under Hugging Face names)."""
    loader.check_gguf(path)
    refuse = functools.partial(_split_family, path=path)  # before any tensor is mapped
    config, tensors, tokenizer, name, template = gguf.read_checkpoint(path, report, refuse)
    module = _split_family(config, path)
    args = module.model_args(config, path)
    quantization = loader.gguf_quantization()
    return Checkpoint(
        path, config, args, tensors, {}, tokenizer, str(name), module.Model, quantization, template
    )


def _split_family(config: dict, path: str):
    """The family module of ``config``, refused by name unless it is split across ranks."""
    model_type = config_reader.model_type(config)
    module = family(model_type, path)
    if module not in SPLIT:
        names = ", ".join(name for split in SPLIT for name in split.FAMILIES)
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not split across ranks yet (only {names})", path=path
        )
    return module


def output_copy(args: llama.ModelArgs, layout: str, tensors: Mapping[str, mx.array]) -> bool:
    """Whether rank 0 holds a tied float embedding twice: the packed layouts give the output
    product its own contiguous ``[D, V]`` copy (``runner.device``)."""
    embed = tensors.get("model.embed_tokens.weight")
    # An MLX triple has scales beside it; a GGUF file's quantized matrix is no array.
    quantized = "model.embed_tokens.scales" in tensors or not isinstance(embed, mx.array)
    return bool(
        args.tie_word_embeddings
        and layout in ("packed", "panels")
        and embed is not None
        and not quantized
    )


def plan(checkpoint: Checkpoint, ranks: int, dtype: mx.Dtype, layout: str) -> LayerPlan:
    """The layer split of ``checkpoint`` over ``ranks`` ranks (``runner.distributed.split``)."""
    args = checkpoint.args
    copy = output_copy(args, layout, checkpoint.tensors)
    per_layer, first = weight_sizes(checkpoint.tensors, args.num_hidden_layers, dtype, copy)
    if len(per_layer) < ranks:
        raise LoadError(
            f"{len(per_layer)} layers cannot be split over {ranks} ranks (each rank holds one "
            f"layer at least): use at most {len(per_layer)} ranks",
            path=checkpoint.path,
        )
    return plan_layers(per_layer, first, ranks)


def stage_args(args: llama.ModelArgs, run: range, first: bool) -> llama.ModelArgs:
    """The arguments of a model holding layers ``run`` only (their layer types, and a MoE
    model's sparse or dense MLPs, kept). A later rank's stage is built tied, so it has no
    output projection of its own."""
    types = args.layer_types[run.start : run.stop] if args.layer_types else None
    tied = args.tie_word_embeddings if first else True
    extra = args.extra
    if "moe" in extra:
        settings = moe.settings(args)
        sparse = settings.sparse_layers[run.start : run.stop]
        extra = {**extra, "moe": dataclasses.replace(settings, sparse_layers=sparse)}
    if "hybrid" in extra:
        hybrid = hybrid_settings(args)
        kinds = hybrid.layer_types[run.start : run.stop]
        extra = {**extra, "hybrid": dataclasses.replace(hybrid, layer_types=kinds)}
    return dataclasses.replace(
        args,
        num_hidden_layers=len(run),
        layer_types=types,
        tie_word_embeddings=tied,
        extra=extra,
    )


def stage_tensors(tensors: Mapping[str, mx.array], run: range, first: bool) -> dict:
    """The tensors of layers ``run`` under the stage's local indices, and on rank 0 the
    embedding, final norm and output projection; every other tensor is left unread."""
    kept = {}
    for name, tensor in tensors.items():
        match = LAYER.match(name)
        if match is not None:
            index = int(match[1])
            if index in run:
                kept[f"model.layers.{index - run.start}.{match[2]}"] = tensor
        elif first and name.startswith(FIRST_RANK):
            kept[name] = tensor
    return kept


def global_name(name: str, run: range) -> str:
    """A stage tensor's name in the checkpoint (its layer index back to the global one)."""
    match = LAYER.match(name)
    if match is None:
        return name
    return f"model.layers.{int(match[1]) + run.start}.{match[2]}"


def build_stage(
    checkpoint: Checkpoint, run: range, first: bool, cls: type[llama.Model] | None = None
) -> llama.Model:
    """The (uninitialised) stage model: ``cls`` (default: the checkpoint's model class) over
    layers ``run``; a later rank's embedding and final norm are identities (its input is
    hidden rows, its output pre-norm rows)."""
    cls = checkpoint.model_class if cls is None else cls
    model = cls(stage_args(checkpoint.args, run, first))
    if not first:
        model.model.embed_tokens = nn.Identity()
        model.model.norm = nn.Identity()
    return model


@dataclass(frozen=True)
class StageLoad:
    """How a rank loads and lays out its stage: the engine options every rank shares."""

    dtype: str | None = None
    keep_quantized: bool | None = None
    layout: str = "auto"
    compile: bool = True
    native_blocks: bool = True
    exact_products: bool = False
    quantize: int | None = None
    kv_bits: int | None = None  # --kv-bits: full-attention caches packed (if served)
    kv_group: int = 64


def load_stage(
    checkpoint: Checkpoint,
    run: range,
    first: bool,
    options: StageLoad,
    report: Progress,
    cls: type[llama.Model] | None = None,
) -> loader.LoadedModel:
    """Load layers ``run`` of ``checkpoint`` (and rank 0's own tensors when ``first``) into a
    stage model, through the loader's own weight path; the model is not tuned yet. The
    checkpoint's tensors are released (one stage per checkpoint read)."""
    model = build_stage(checkpoint, run, first, cls)
    keep = options.keep_quantized
    if keep is None:
        keep = mx.default_device() != mx.cpu or native.qpanels_fast()
    dtype = loader._parse_dtype(options.dtype)
    tensors = stage_tensors(checkpoint.tensors, run, first)
    check_hybrid_layout(checkpoint, tensors)
    # Loading evaluates the kept tensors and the layout step copies them; the checkpoint's
    # own references would keep the stored copies alive, so a checkpoint loads one stage.
    checkpoint.tensors = {}
    sources = {k: checkpoint.sources.get(k, checkpoint.path) for k in tensors}
    read = loader._Checkpoint(
        config=checkpoint.config,
        model=model,
        weights=tensors,
        sources=sources,
        tokenizer=checkpoint.tokenizer,
        name=checkpoint.name,
        template=None,
        quantization=checkpoint.quantization,
    )
    try:
        quantized, extras = loader._load_weights(read, checkpoint.path, keep, dtype, report)
    except LoadError as exc:  # name the tensor as the checkpoint does, not the stage
        if exc.tensor is None:
            raise
        raise type(exc)(exc.reason, path=exc.path, tensor=global_name(exc.tensor, run)) from None
    return loader.LoadedModel(
        model=model,
        tokenizer=checkpoint.tokenizer,
        config=checkpoint.config,
        name=checkpoint.name,
        path=checkpoint.path,
        context_length=int(checkpoint.args.max_position_embeddings),
        dtype=dtype,
        quantized=quantized,
        chat_template=checkpoint.template if first else None,
        extra_weights=extras,  # rank 0's: an inline MTP head (``FIRST_RANK``)
    )


def check_hybrid_layout(checkpoint: Checkpoint, tensors: Mapping[str, mx.array]) -> None:
    """A hybrid's weights tell their layout (Hugging Face or mlx-lm's, which differ in how the
    norm gains are stored) by the conv weights of its Gated DeltaNet layers
    (``qwen3_5.prepare_weights``); a stage holding none of them would take the Hugging Face
    layout whatever the checkpoint's is, so a split giving a rank only attention layers of
    an mlx-lm checkpoint is refused (another rank count splits it otherwise)."""
    if checkpoint.model_class is not qwen3_5.Model:
        return
    if any(name.endswith(qwen3_5.CONV) for name in tensors):
        return
    if not qwen3_5.stores_zero_centred(checkpoint.tensors):
        raise LoadError(
            "this split gives a rank only attention layers of an mlx-lm converted hybrid, "
            "whose layout its conv weights tell: choose another number of ranks",
            path=checkpoint.path,
        )


def tune_stage(model: llama.Model, options: StageLoad) -> device.Tuning:
    """Lay a later rank's stage out for its device as the engine lays out rank 0's."""
    return device.tune(
        model,
        None,
        layout=options.layout,
        compile=options.compile,
        native_blocks=options.native_blocks,
        exact_products=options.exact_products,
        quantize=options.quantize,
    )


def held_as(options: StageLoad) -> tuple[mx.Dtype, str]:
    """The dtype and weight layout the stages are held in: what the split weighs."""
    dtype = loader._parse_dtype(options.dtype)
    return dtype, device.resolve_layout(options.layout, device.on_cpu())
