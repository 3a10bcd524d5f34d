"""Gemma 4's assistant drafter (``gemma4_assistant``, transformers 5.24's
``Gemma4AssistantForCausalLM``): a small Gemma 4 stack with no keys or values of its own that
drafts over the target's caches, run by ``drafting.assistant.AssistantSession``.

One step, for a token at position ``P`` (the first slot the target caches do not hold):

    x = pre_projection(concat(target.embed(token), h))      h: the target's hidden row that
                                                             predicted the token, or the
                                                             previous step's projected output
    every layer (all of them shared-KV layers): q at position P attends, without a causal
        mask, over the keys and values of the target's last computing layer of its type
        (full: every position below P; sliding: the last ``sliding_window + 1`` of them, the
        inclusive window transformers' bidirectional sliding mask gives one query row)
    y = norm(x);  next h = post_projection(y)
    logits: ``lm_head(y)``, or with ``use_ordered_embeddings`` the centroid head: the
        ``centroid_intermediate_top_k`` best of ``num_centroids`` centroids pick their
        ``vocab / num_centroids`` tokens (``token_ordering`` lays them out by centroid), only
        those get ``y . E[token]``, every other token the smallest of those minus 1

Every draft of a round is made at the same ``P``, as transformers' single-position generator
makes them. Its reference slices the target's last fetch of keys and values, which after a
rejected draft can still hold that draft's row; the runner reads the caches as plain decoding
left them, so the drafts are what transformers drafts after a fully accepted round or a
prompt (``tests/test_gemma4_model.py`` checks the latter). A sliding cache holds at least the
target's own window before ``P`` (and usually its slack): the assistant reads as much of its
``window + 1`` as is held. With ``--kv-bits`` a full-attention cache holds packed rows: the
assistant reads the rows it needs dequantized.

Found as ``--draft DIR`` or beside the target (``<model>-assistant``, ``<model>/assistant``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import mlx.core as mx
import mlx.nn as nn

from cache.kv import KVCache
from cache.kv_quantized import QuantizedKVCache
from cache.window import RotatingKVCache
from drafting.assistant import AssistantSession
from drafting.weights import check_and_load, read_json, read_safetensors
from protocol.errors import DraftHeadError, LoadError
from runner.models.gemma4 import FetchedKV, Gemma4DecoderLayer, Model, RMSNorm
from runner.models.gemma4_config import model_args as text_model_args
from runner.models.gemma4_config import settings
from runner.models.layers import Linear
from runner.models.llama import ModelArgs

log = logging.getLogger("mtp_runner.assistant")

MODEL_TYPE = "gemma4_assistant"
# Gemma4AssistantConfig's defaults.
_DEFAULTS = {
    "backbone_hidden_size": 1536,
    "use_ordered_embeddings": False,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
    "tie_word_embeddings": True,
}
EXTERNAL = -1  # a layer's kv_source: the target's caches


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    backbone_hidden_size: int
    ordered: bool
    num_centroids: int
    top_centroids: int
    tied: bool


class CentroidHead(nn.Module):
    """transformers' ``Gemma4AssistantMaskedEmbedder``: logits for the tokens of the best
    centroids only (module docstring)."""

    def __init__(self, dim: int, vocab: int, centroids: int, top: int) -> None:
        super().__init__()
        self.centroids = nn.Linear(dim, centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top = top

    def __call__(self, y: mx.array, table: mx.array) -> mx.array:
        """``y`` ``[R, D]``, ``table`` the ``[V, D]`` output embedding: logits ``[R, V]``."""
        scores = self.centroids(y)
        best = mx.argpartition(-scores, self.top - 1, axis=-1)[..., : self.top]  # [R, top]
        count = self.centroids.weight.shape[0]
        by_centroid = self.token_ordering.astype(mx.int32).reshape(count, -1)
        chosen = by_centroid[best].reshape(y.shape[0], -1)  # [R, top * V / C]
        picked = (table[chosen] @ y[:, :, None])[..., 0]  # [R, top * V / C]
        floor = picked.min() - 1
        logits = mx.full((y.shape[0], table.shape[0]), floor, dtype=picked.dtype)
        return mx.put_along_axis(logits, chosen, picked, axis=-1)


class AssistantStack(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Gemma4DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Assistant(nn.Module):
    """The assistant's weights, named as its checkpoint names them."""

    def __init__(self, args: ModelArgs, config: AssistantConfig) -> None:
        super().__init__()
        dim, backbone = args.hidden_size, config.backbone_hidden_size
        self.args, self.config = args, config
        self.pre_projection = Linear(2 * backbone, dim, bias=False)
        self.post_projection = Linear(dim, backbone, bias=False)
        self.model = AssistantStack(args)
        if not config.tied:
            self.lm_head = nn.Linear(dim, args.vocab_size, bias=False)
        if config.ordered:
            self.masked_embedding = CentroidHead(
                dim, args.vocab_size, config.num_centroids, config.top_centroids
            )

    def output_table(self) -> mx.array:
        return self.model.embed_tokens.weight if self.config.tied else self.lm_head.weight

    def step(
        self, embedded: mx.array, hidden: mx.array, position: int, kv: dict
    ) -> tuple[mx.array, mx.array]:
        """Logits ``[1, V]`` and the next step's hidden ``[1, 1, backbone]`` for the token
        embedded as ``embedded`` at ``position`` over ``kv`` (layer type -> keys, values)."""
        x = self.pre_projection(mx.concatenate([embedded, hidden.astype(embedded.dtype)], -1))
        for layer in self.model.layers:
            tables = layer.self_attn.rope.tables(position, 1, x.dtype)
            (q,) = layer.before_cache(x, *tables)
            keys, values = kv[layer.rope_group]
            fetched = FetchedKV(keys, values)
            x = layer.after_attention(
                x, layer.self_attn.attend_cached(q, keys, values, None, fetched)
            )
        y = self.model.norm(x)
        table = self.output_table()
        if self.config.ordered:
            logits = self.masked_embedding(y[:, -1], table)
        else:
            logits = y[:, -1] @ table.T
        return logits, self.post_projection(y)


class AssistantDrafter:
    """The engine's assistant for one target: builds each request's session; ``__call__`` is
    the session's step over the request's caches."""

    def __init__(self, assistant: Assistant, target: Model, path: str) -> None:
        self.assistant, self.target, self.path = assistant, target, path
        self.window = assistant.args.sliding_window
        # The target cache each layer type reads: its last computing layer's.
        self.sources = {
            t: target.store_cache(t) for t in {lay.rope_group for lay in assistant.model.layers}
        }

    def describe(self) -> str:
        layers = len(self.assistant.model.layers)
        head = "centroid head" if self.assistant.config.ordered else "output head"
        return f"gemma4 assistant ({layers} layers, {head}) from {self.path}"

    def session(self) -> AssistantSession:
        return AssistantSession(self)

    def __call__(
        self, token: mx.array, hidden: mx.array, position: int, caches: list
    ) -> tuple[mx.array, mx.array]:
        kv = {t: self._held(caches[i], position) for t, i in self.sources.items()}
        return self.assistant.step(self.target.embed(token), hidden, position, kv)

    def _held(self, cache, position: int) -> tuple[mx.array, mx.array]:
        """The keys and values below ``position`` the assistant reads from ``cache``."""
        if cache.keys is None:
            raise ValueError("the target cache holds nothing to draft over")
        if isinstance(cache, RotatingKVCache):
            lo = max(position - self.window - 1, cache.valid_lo, cache.base)
            a, b = lo - cache.base, position - cache.base
        elif type(cache) is KVCache or isinstance(cache, QuantizedKVCache):
            a, b = 0, position
        else:
            raise ValueError(f"the assistant cannot read a {type(cache).__name__}")
        keys, values = cache.keys[..., a:b, :], cache.values[..., a:b, :]
        if isinstance(cache, QuantizedKVCache):  # --kv-bits: the held rows as float rows
            return cache.dequantize(keys, values)
        return keys, values


def read_config(config: dict, path: str) -> tuple[ModelArgs, AssistantConfig]:
    """The assistant's text stack (``runner.models.gemma4_config``, every layer reading the
    target's keys and values) and its own keys, or a ``DraftHeadError`` naming the key."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise DraftHeadError("bad config key text_config: expected a dict", path=path)
    _check_text(text, path)
    text = dict(text, num_kv_shared_layers=0, model_type=text.get("model_type", "gemma4_text"))
    try:
        args = text_model_args({"text_config": text}, path)
    except LoadError as exc:  # the text stack's refusal, naming its key
        raise DraftHeadError(str(exc), path=path) from None
    g = settings(args)
    external = tuple(
        dataclasses.replace(s, kv_source=EXTERNAL, shares_kv=False, k_eq_v=False) for s in g.layers
    )
    args.extra["gemma4"] = dataclasses.replace(g, layers=external, final_softcap=None)

    def value(key: str, kind: type):
        found = config.get(key, _DEFAULTS[key])
        if isinstance(found, bool) is not (kind is bool) or not isinstance(found, kind):
            raise DraftHeadError(f"bad config key {key}: found {found!r}", path=path)
        return found

    own = AssistantConfig(
        backbone_hidden_size=value("backbone_hidden_size", int),
        ordered=value("use_ordered_embeddings", bool),
        num_centroids=value("num_centroids", int),
        top_centroids=value("centroid_intermediate_top_k", int),
        tied=value("tie_word_embeddings", bool),
    )
    if own.ordered and (
        own.num_centroids < 1
        or args.vocab_size % own.num_centroids
        or not 1 <= own.top_centroids <= own.num_centroids
    ):
        raise DraftHeadError(
            f"bad config key num_centroids: {own.num_centroids} centroids (top "
            f"{own.top_centroids}) for a vocabulary of {args.vocab_size}",
            path=path,
        )
    return args, own


def _check_text(text: dict, path: str) -> None:
    """What ``Gemma4AssistantConfig.validate_architecture`` requires of the text stack, each
    refused by name: no per-layer inputs (0, which the text defaults are not), no expert
    block, no double-wide MLPs, and every layer shared (0 or null: transformers makes it
    every layer)."""
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        found = text.get(key, "absent")
        if found != 0 or isinstance(found, bool):
            raise DraftHeadError(
                f"unsupported config key text_config.{key} = {found!r}: an assistant has no "
                "per-layer inputs (0)",
                path=path,
            )
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if text.get(key) not in (None, False):
            raise DraftHeadError(
                f"unsupported config key text_config.{key} = {text[key]!r}: an assistant has none",
                path=path,
            )
    layers, shared = text.get("num_hidden_layers"), text.get("num_kv_shared_layers")
    if shared not in (None, 0) and (shared != layers or isinstance(shared, bool)):
        raise DraftHeadError(
            f"unsupported config key text_config.num_kv_shared_layers = {shared!r}: every one "
            f"of an assistant's {layers!r} layers reads the target's keys and values",
            path=path,
        )


def _check_target(args: ModelArgs, own: AssistantConfig, target: Model, path: str) -> None:
    """The assistant must read the target's keys as they are: same vocabulary, hidden rows of
    its backbone width, and per layer type the target's head size and key heads."""
    targs = target.args
    if own.backbone_hidden_size != targs.hidden_size or args.vocab_size != targs.vocab_size:
        raise DraftHeadError(
            f"assistant for a backbone of {own.backbone_hidden_size} x {args.vocab_size}, "
            f"target {targs.hidden_size} x {targs.vocab_size}",
            path=path,
        )
    for spec in settings(args).layers:
        try:
            producer = target.layers[target.store_layer(spec.layer_type)].self_attn
        except ValueError as exc:  # the target has no such layer to read
            raise DraftHeadError(f"{spec.layer_type} layers: {exc}", path=path) from None
        if (spec.head_dim, spec.kv_heads) != (producer.head_dim, producer.n_kv_heads):
            raise DraftHeadError(
                f"{spec.layer_type} layers read {spec.kv_heads} key heads of {spec.head_dim}; "
                f"the target's have {producer.n_kv_heads} of {producer.head_dim}",
                path=path,
            )


def is_assistant(directory: str) -> bool:
    config = os.path.join(directory, "config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            return json.load(f).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def load_assistant(directory: str, target: Model, dtype: mx.Dtype) -> AssistantDrafter:
    """The assistant in ``directory`` for ``target`` (a ``DraftHeadError`` when it cannot
    draft for it)."""
    if not isinstance(target, Model):
        raise DraftHeadError("a gemma4 assistant drafts for a Gemma 4 target only", path=directory)
    config_path = os.path.join(directory, "config.json")
    args, own = read_config(read_json(config_path, error=DraftHeadError), config_path)
    _check_target(args, own, target, directory)
    assistant = Assistant(args, own)
    weights = read_safetensors(os.path.join(directory, "model.safetensors"), error=DraftHeadError)
    if own.tied:
        weights.pop("lm_head.weight", None)
    check_and_load(assistant, weights, path=directory, dtype=dtype, error=DraftHeadError)
    return AssistantDrafter(assistant, target, directory)


def find_assistant(
    target, model_path: str, draft_path: str | None, dtype: mx.Dtype
) -> tuple[AssistantDrafter | None, str | None]:
    """The assistant named by ``draft_path`` (when that is one) or found beside the target
    (``<model>-assistant``, ``<model>/assistant``), and a description; (None, None) when there
    is none. A named one that cannot draft raises; a found one is reported and skipped."""
    if draft_path:
        path = os.path.expanduser(draft_path)
        if not is_assistant(path):
            return None, None
        drafter = load_assistant(path, target, dtype)
        return drafter, drafter.describe()
    if not isinstance(target, Model):
        return None, None
    base = os.path.normpath(model_path)
    for path in (base + "-assistant", os.path.join(base, "assistant")):
        if not is_assistant(path):
            continue
        try:
            drafter = load_assistant(path, target, dtype)
        except DraftHeadError as exc:
            log.warning("assistant %s not usable: %s", path, exc)
            return None, f"assistant {path} is not usable: {exc}"
        return drafter, drafter.describe()
    return None, None
