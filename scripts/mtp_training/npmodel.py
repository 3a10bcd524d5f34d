"""A NumPy forward pass of a loaded Llama-family target (dense, or with Qwen-style sparse MoE
MLPs), for bulk generation on CPU.

MLX's CPU backend evaluates ``exp`` one element at a time (tens of ns each), so at batch 48
the attention softmax and the SwiGLU sigmoid cost more than the matrix products, and the
attention part grows with the sequence. NumPy's ``exp`` is vectorised and its matmuls go to
OpenBLAS, which roughly doubles generation throughput here. The weights are the target's own
(read from the loaded MLX model); the outputs match MLX to float32 rounding (the test checks).
"""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten

NEG = np.float32(-1e9)


def _np(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.astype(mx.float32), dtype=np.float32, copy=True)


def _embedding_table(model) -> np.ndarray:
    """The ``[V, D]`` input embedding, dequantized if needed."""
    import mlx.nn as nn

    e = model.model.embed_tokens
    if isinstance(e, nn.QuantizedEmbedding):
        return _np(mx_dequantize(e))
    return _np(e.weight)


def mx_dequantize(e):
    import mlx.core as mx

    return mx.dequantize(e.weight, e.scales, e.get("biases"), e.group_size, e.bits)


def rope_periods(rope) -> tuple[np.ndarray, float]:
    """Per-pair periods (1 / inverse frequency) and the position scale of an MLX RoPE module."""
    return np.array(rope._period_table, dtype=np.float64), float(rope.scale)


def rms_forward(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm output and the per-row inverse RMS (kept for the head's backward pass)."""
    r = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    return x * r * w, r


def rope_table(offset: int, length: int, pos_scale: float, periods: np.ndarray):
    """cos and sin ``[length, dims/2]`` for positions ``offset..offset+length-1``."""
    pos = (np.arange(offset, offset + length, dtype=np.float64) * pos_scale)[:, None]
    theta = pos / periods[None, :]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rope_rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dims: int, traditional: bool):
    """Rotate ``x`` ``[B, H, L, hd]`` (MLX's conventions: halves, or adjacent pairs); ``-sin``
    rotates back (the backward pass)."""
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return np.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def _gate_up_down(mlp) -> tuple[np.ndarray, np.ndarray]:
    """A dense MLP's fused ``[in, 2I]`` gate/up and ``[I, out]`` down."""
    from runner.models.layers import dense_weight

    gate_up = np.concatenate([_np(dense_weight(mlp.gate_proj)), _np(dense_weight(mlp.up_proj))])
    return np.ascontiguousarray(gate_up.T), np.ascontiguousarray(_np(dense_weight(mlp.down_proj)).T)


def pack_moe(mlp) -> dict[str, np.ndarray]:
    """A sparse MoE block (``runner.models.moe.SparseMoE``) as NumPy: the router ``[D, E]``,
    experts' ``[E, D, 2I]`` gate/up and ``[E, I, D]`` down, a shared expert and its gate.
    Softmax routing only (Qwen's); GLM's grouped sigmoid routing is refused by name."""
    from runner.models import moe
    from runner.models.layers import dense_weight

    s = mlp.settings
    if s.scoring != "softmax":
        raise ValueError(f"the trainer's NumPy target routes by softmax only, not {s.scoring!r}")
    switch = mlp.switch_mlp
    if not isinstance(switch.down_proj, moe.SwitchLinear):
        raise ValueError("the trainer's NumPy target needs float experts (dequantize them)")
    gate, up, down = (_np(p.dense()) for p in (switch.gate_proj, switch.up_proj, switch.down_proj))
    w = {
        "router": np.ascontiguousarray(_np(dense_weight(mlp.gate)).T),
        "experts_gate_up": np.ascontiguousarray(np.concatenate([gate, up], axis=1).swapaxes(1, 2)),
        "experts_down": np.ascontiguousarray(down.swapaxes(1, 2)),
        "top_k": np.array(s.top_k),
        "norm_topk": np.array(s.norm_topk_prob),
    }
    shared = mlp.get("shared_experts", mlp.get("shared_expert"))
    if shared is not None:
        w["shared_gate_up"], w["shared_down"] = _gate_up_down(shared)
    if "shared_expert_gate" in mlp:
        w["shared_gate"] = np.ascontiguousarray(_np(dense_weight(mlp.shared_expert_gate)).T)
    return w


def swiglu(gu: np.ndarray) -> np.ndarray:
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter], gu[..., inter:]
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g)) * u


def moe_forward(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """``SparseMoE`` over rows ``x`` ``[T, D]``: softmax over all experts in float32, the top-k
    (renormalised when asked), each selected expert run once over the rows that chose it."""
    logits = x @ w["router"]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    k = int(w["top_k"])
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if bool(w["norm_topk"]):
        weights /= weights.sum(axis=-1, keepdims=True)
    y = np.zeros_like(x)
    for expert in np.unique(chosen):
        rows, slot = np.nonzero(chosen == expert)
        out = swiglu(x[rows] @ w["experts_gate_up"][expert]) @ w["experts_down"][expert]
        np.add.at(y, rows, out * weights[rows, slot][:, None])
    if "shared_gate_up" in w:
        shared = swiglu(x @ w["shared_gate_up"]) @ w["shared_down"]
        if "shared_gate" in w:
            shared = shared / (1.0 + np.exp(-(x @ w["shared_gate"])))
        y = y + shared
    return y


def pack_layer(layer) -> dict[str, np.ndarray]:
    """A decoder layer's weights as float32 NumPy, ``[in, out]``, q/k/v and gate/up fused:
    ``qkv``, ``o``, ``gate_up``, ``down`` (or ``moe``: :func:`pack_moe`), ``ln1``, ``ln2``,
    the biases (``*_b``) and ``q_norm`` / ``k_norm`` where the layer has them (shared by the
    target and the head)."""
    from runner.models.layers import dense_weight
    from runner.models.moe import SparseMoE

    att, mlp = layer.self_attn, layer.mlp
    params = dict(tree_flatten(layer.parameters()))
    w = {
        "qkv": np.ascontiguousarray(
            np.concatenate([_np(dense_weight(m)) for m in (att.q_proj, att.k_proj, att.v_proj)]).T
        ),
        "o": np.ascontiguousarray(_np(dense_weight(att.o_proj)).T),
        "ln1": _np(layer.input_layernorm.weight),
        "ln2": _np(layer.post_attention_layernorm.weight),
    }
    if isinstance(mlp, SparseMoE):
        w["moe"] = pack_moe(mlp)
    else:
        w["gate_up"], w["down"] = _gate_up_down(mlp)
    if "self_attn.q_proj.bias" in params:
        w["qkv_b"] = np.concatenate([_np(params[f"self_attn.{p}_proj.bias"]) for p in "qkv"])
    for name, key in (("self_attn.o_proj.bias", "o_b"), ("mlp.down_proj.bias", "down_b")):
        if name in params:
            w[key] = _np(params[name])
    if "mlp.gate_proj.bias" in params:
        w["gate_up_b"] = np.concatenate(
            [_np(params["mlp.gate_proj.bias"]), _np(params["mlp.up_proj.bias"])]
        )
    if "q_norm" in att:
        w["q_norm"], w["k_norm"] = _np(att.q_norm.weight), _np(att.k_norm.weight)
    return w


class NumpyOutput:
    """The target's output projection alone: all that evaluating a head's chains needs."""

    def __init__(self, model) -> None:
        self.out_t = np.ascontiguousarray(_np(model.output_weight()).T)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return hidden @ self.out_t


class NumpyLlama(NumpyOutput):
    """Holds float32 copies of the target's weights (transposed for ``x @ w``)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        args = model.args
        self.args = args
        self.eps = float(args.rms_norm_eps)
        self.n_heads, self.n_kv = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = np.float32(args.head_dim**-0.5)
        rope = model.layers[0].self_attn.rope
        self.rope_dims, self.traditional = rope.dims, rope.traditional
        self.periods, self.pos_scale = rope_periods(rope)
        self.embed = _embedding_table(model)
        self.norm = _np(model.model.norm.weight)
        self.layers = [pack_layer(layer) for layer in model.layers]

    def new_cache(self, batch: int, capacity: int) -> list[list[np.ndarray]]:
        """Per-layer [keys, values] buffers ``[B, kv_heads, capacity, head_dim]``.

        Filled explicitly: pages of a lazily zeroed buffer fault on first touch, which made
        the cache writes the slowest part of a decode step."""
        shape = (batch, self.n_kv, capacity, self.head_dim)
        cache = []
        for _ in self.layers:
            k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
            k.fill(0.0)
            v.fill(0.0)
            cache.append([k, v])
        return cache

    def _rope_table(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return rope_table(offset, length, self.pos_scale, self.periods)

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return rope_rotate(x, cos, sin, self.rope_dims, self.traditional)

    def hidden(self, tokens: np.ndarray, cache, offset: int, mask: np.ndarray) -> np.ndarray:
        """Post-final-norm hiddens ``[B, L, D]`` for ``tokens`` ``[B, L]`` written at ``offset``.

        ``mask`` is additive, ``[B, L, offset+L]``."""
        batch, length = tokens.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        rep = nh // nkv
        # Rows flattened to 2-D: numpy runs ``[B, L, D] @ W`` as B separate products.
        x = self.embed[tokens.reshape(-1)]
        end = offset + length
        bias = mask[:, None, None]  # [B, 1, 1, L, S]
        cos, sin = self._rope_table(offset, length)
        for w, kv in zip(self.layers, cache, strict=True):
            h = rms_forward(x, w["ln1"], self.eps)[0] @ w["qkv"]
            if "qkv_b" in w:
                h = h + w["qkv_b"]
            q = h[:, : nh * hd].reshape(batch, length, nh, hd).transpose(0, 2, 1, 3)
            k = h[:, nh * hd : (nh + nkv) * hd].reshape(batch, length, nkv, hd)
            v = h[:, (nh + nkv) * hd :].reshape(batch, length, nkv, hd)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            if "q_norm" in w:
                q = rms_forward(q, w["q_norm"], self.eps)[0]
                k = rms_forward(k, w["k_norm"], self.eps)[0]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kv[0][:, :, offset:end] = k
            kv[1][:, :, offset:end] = v
            keys, values = kv[0][:, :, :end], kv[1][:, :, :end]
            qg = q.reshape(batch, nkv, rep, length, hd) * self.scale
            scores = np.matmul(qg, keys[:, :, None].swapaxes(-1, -2)) + bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            att = np.matmul(scores, values[:, :, None])  # [B, nkv, rep, L, hd]
            att = att.reshape(batch, nh, length, hd).transpose(0, 2, 1, 3)
            o = att.reshape(batch * length, nh * hd) @ w["o"]
            if "o_b" in w:
                o = o + w["o_b"]
            x = x + o
            xn = rms_forward(x, w["ln2"], self.eps)[0]
            if "moe" in w:
                x = x + moe_forward(w["moe"], xn)
                continue
            gu = xn @ w["gate_up"]
            if "gate_up_b" in w:
                gu = gu + w["gate_up_b"]
            d = swiglu(gu) @ w["down"]
            if "down_b" in w:
                d = d + w["down_b"]
            x = x + d
        out = rms_forward(x, self.norm, self.eps)[0].astype(np.float32)
        return out.reshape(batch, length, -1)
