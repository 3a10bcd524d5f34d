"""The runner's side of head training: a target loaded with the runner's own model code,
in the shape ``drafting.training.target.Target`` asks for.

Generation runs the runner's forward over left-padded batches (a per-sequence additive mask;
RoPE is relative, so the padding shift changes nothing a row computes), so the hiddens a head
is trained on are exactly the ones it drafts from. The head's layer starts as a copy of the
target's last layer; its NumPy training copy reads that layer's weights through here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from cache.kv import KVCache
from drafting.training.config import TrainingError
from drafting.training.target import as_numpy
from protocol.errors import LoadError
from runner import blas, device
from runner.heads import load_draft_head
from runner.loader import load_model
from runner.models import moe
from runner.models.layers import dense_weight
from runner.models.llama import MLP, DecoderLayer


class RunnerTarget:
    """A loaded model as the trainer's target (``drafting.training.target.Target``)."""

    takes_layer_hook: bool = False  # its ``hidden`` feeds a whole batch (no ``on_layer``)

    def __init__(self, path: str, *, tune: bool = True) -> None:
        self.path = path
        try:
            self.loaded = load_model(path)
        except LoadError as exc:
            raise TrainingError(f"cannot load the target {path}: {exc}") from exc
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        family = type(self.model).__module__.rsplit(".", 1)[-1]
        if not all(type(c) is KVCache for c in self.model.make_caches()):
            raise TrainingError(
                f"the trainer generates in left-padded batches, which a target with recurrent "
                f"or sliding-window layers ({family}: {path}) cannot take yet"
            )
        if not isinstance(self.model.layers[-1], DecoderLayer):
            raise TrainingError(f"the trainer copies a Llama-family last layer; {family} has none")
        self._head_source = self.model.layers[-1]
        self.tuned = False
        if tune:  # the runner's layout and compiled blocks: generation at serving speed
            self._head_source = self._detached_last_layer()
            device.tune(self.model)
            self.tuned = True

    # -- generation ----------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> list:
        return self.model.make_caches()

    def hidden(self, tokens: np.ndarray, cache: list, offset: int, mask: np.ndarray) -> np.ndarray:
        return self.hidden_features(tokens, cache, offset, mask, ())[0]

    def hidden_features(
        self, tokens: np.ndarray, cache: list, offset: int, mask: np.ndarray, layers: tuple
    ) -> tuple[np.ndarray, np.ndarray | None]:
        if cache and cache[0].offset != offset:
            raise ValueError(f"the caches hold {cache[0].offset} positions, not {offset}")
        h, feats = self.model.hidden_features(
            mx.array(tokens), cache, tuple(layers), mask=mx.array(mask)[:, None]
        )
        mx.eval(h) if feats is None else mx.eval(h, feats)
        return as_numpy(h), (as_numpy(feats) if layers else None)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return as_numpy(self.model.unembed(mx.array(hidden)))

    def keep_rows(self, cache: list, rows: np.ndarray) -> None:
        keep = mx.array(np.asarray(rows, dtype=np.int32))
        for c in cache:
            c.keep_rows(keep)

    def chat_prompt(self, text: str) -> str | None:
        template = self.loaded.chat_template
        if template is None:
            return None
        return template.render([{"role": "user", "content": text}])

    # -- the head ------------------------------------------------------------------------

    def _detached_last_layer(self) -> nn.Module:
        """A copy of the last layer in the checkpoint's layout, made before tuning re-lays
        the model's weights out (the head's layer is trained from this one)."""
        layer = self._fresh_layer(self.model.layers[-1])
        mx.eval(layer.parameters())
        return layer

    def _fresh_layer(self, last: nn.Module) -> nn.Module:
        args = self.model.args
        if isinstance(last.mlp, moe.SparseMoE):
            args = dataclasses.replace(args, intermediate_size=last.mlp.settings.intermediate_size)
            layer = DecoderLayer(args)
            layer.mlp = _dense_stand_in_from(last.mlp, args)
            for name in ("self_attn", "input_layernorm", "post_attention_layernorm"):
                _copy_layer(getattr(layer, name), getattr(last, name))
        else:
            layer = DecoderLayer(args)
            _copy_layer(layer, last)
        return layer

    def head_layer(self) -> nn.Module:
        return self._fresh_layer(self._head_source)

    def numpy_layer(self, layer: nn.Module) -> dict[str, np.ndarray]:
        return pack_layer(layer)

    def embedding_table(self) -> np.ndarray:
        return as_numpy(dense_weight(self.model.model.embed_tokens))

    def last_layer_input_rms(self, tokens: list[int]) -> float:
        x = self.model.embed(mx.array([tokens]))
        caches = self.model.make_caches()
        for layer, cache in zip(self.model.layers[:-1], caches, strict=False):
            x = layer(x, "causal" if len(tokens) > 1 else None, cache)
        rms = mx.sqrt(mx.mean(mx.square(x[0]), axis=-1))
        return float(mx.median(rms).item())

    def load_head(self, path: str):
        """The sidecar as the runner loads it; on an untuned target both are then laid out
        as the runner runs them (what evaluation times)."""
        head, description = load_draft_head(self.loaded, path)
        if not self.tuned:
            device.tune(self.model, head, compile=False)
            self.tuned = True
        return head, description

    def training_threads(self):
        return blas.wide()

    def time_steps(self, head, reps: int, context: int = 128) -> dict:
        return time_steps(self.model, head, reps, context)


def load_target(path: str, *, tune: bool = True) -> RunnerTarget:
    """The trainer's target factory (``drafting.training.target.LoadTarget``); ``tune=False``
    leaves the layout to the first ``load_head``."""
    return RunnerTarget(path, tune=tune)


# -- weights -------------------------------------------------------------------------------


def _copy_layer(dst: nn.Module, src: nn.Module) -> None:
    """Copy a decoder layer's weights (dense, Hugging Face layout) into a fresh one."""
    src_modules = dict(src.named_modules())
    for name, module in dst.named_modules():
        other = src_modules[name]
        if isinstance(module, nn.Linear):
            module.weight = mx.array(dense_weight(other))
            if "bias" in module:
                module.bias = mx.array(other.bias)
        elif isinstance(module, nn.RMSNorm):
            module.weight = mx.array(other.weight)


def _dense_stand_in_from(mlp: moe.SparseMoE, args) -> MLP:
    """A dense MLP (``args``' width: the experts') holding a MoE block's first routed expert."""
    dense = MLP(args)
    switch = mlp.switch_mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dense, name).weight = mx.array(getattr(switch, name).dense()[0])
    return dense


def _gate_up_down(mlp) -> tuple[np.ndarray, np.ndarray]:
    """A dense MLP's fused ``[in, 2I]`` gate/up and ``[I, out]`` down."""
    gate_up = np.concatenate(
        [as_numpy(dense_weight(mlp.gate_proj)), as_numpy(dense_weight(mlp.up_proj))]
    )
    down = as_numpy(dense_weight(mlp.down_proj))
    return np.ascontiguousarray(gate_up.T), np.ascontiguousarray(down.T)


def pack_layer(layer) -> dict[str, np.ndarray]:
    """A dense decoder layer's weights as float32 NumPy, ``[in, out]``, q/k/v and gate/up
    fused: ``qkv``, ``o``, ``gate_up``, ``down``, ``ln1``, ``ln2``, the biases (``*_b``) and
    ``q_norm`` / ``k_norm`` where the layer has them."""
    att, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, moe.SparseMoE):
        raise TrainingError("a head's layer is dense; this one has a sparse MLP")
    params = dict(tree_flatten(layer.parameters()))
    w = {
        "qkv": np.ascontiguousarray(
            np.concatenate(
                [as_numpy(dense_weight(m)) for m in (att.q_proj, att.k_proj, att.v_proj)]
            ).T
        ),
        "o": np.ascontiguousarray(as_numpy(dense_weight(att.o_proj)).T),
        "ln1": as_numpy(layer.input_layernorm.weight),
        "ln2": as_numpy(layer.post_attention_layernorm.weight),
    }
    w["gate_up"], w["down"] = _gate_up_down(mlp)
    if "self_attn.q_proj.bias" in params:
        w["qkv_b"] = np.concatenate([as_numpy(params[f"self_attn.{p}_proj.bias"]) for p in "qkv"])
    for name, key in (("self_attn.o_proj.bias", "o_b"), ("mlp.down_proj.bias", "down_b")):
        if name in params:
            w[key] = as_numpy(params[name])
    if "mlp.gate_proj.bias" in params:
        w["gate_up_b"] = np.concatenate(
            [as_numpy(params["mlp.gate_proj.bias"]), as_numpy(params["mlp.up_proj.bias"])]
        )
    if "q_norm" in att:
        w["q_norm"], w["k_norm"] = as_numpy(att.q_norm.weight), as_numpy(att.k_norm.weight)
    return w


# -- timing --------------------------------------------------------------------------------


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def time_steps(model, head, reps: int, context: int = 128) -> dict:
    """One target decode step vs one draft step (batch 1, ``context`` positions cached)."""
    ids = mx.array([[(7 * i) % model.args.vocab_size for i in range(context)]], dtype=mx.int32)
    caches = model.make_caches()
    mx.eval(model.hidden(ids, caches))
    token = mx.array([[11]], dtype=mx.int32)

    def target_step():
        for c in caches:
            c.rewind(context)
        h = model.hidden(token, caches)
        return mx.argmax(model.unembed(h[:, -1]), axis=-1)

    hcache = KVCache()
    hid = mx.random.normal((1, context, head.feature_width))
    mx.eval(head(ids, hid, hcache))
    one_hid = hid[:, :1]

    def draft_step():
        hcache.rewind(context)
        y = head(token, one_hid, hcache)
        return mx.argmax(head.logits(y[:, -1], model.unembed), axis=-1)

    t_target = _median_ms(target_step, reps)
    t_draft = _median_ms(draft_step, reps)
    vocab = head.config.draft_vocab
    head.set_draft_vocab(None)
    t_full = _median_ms(draft_step, reps)
    head.set_draft_vocab(vocab)
    return {
        "target_step_ms": round(t_target, 3),
        "draft_step_ms": round(t_draft, 3),
        "draft_step_full_vocab_ms": round(t_full, 3),
        "draft_cost": round(t_draft / t_target, 4),
        "draft_cost_full_vocab": round(t_full / t_target, 4),
    }
