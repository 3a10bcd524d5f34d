"""The MTP head's forward and backward pass in NumPy, for training on CPU.

MLX's CPU backend evaluates ``exp`` one element at a time, and a head training step is full
of it (attention softmax, SwiGLU, the softmax over the draft vocabulary, in both directions):
here that made an MLX step slower than this one (measured again with the runner's compiled
kernels: the MLX step, on the differentiable composition, takes 1.07-1.25x this one's time).
This module does the same computation as ``drafting.head.MTPHead`` + the target's decoder layer
(whole sequences, causal attention from position 0) with hand-written gradients; a test
checks them against MLX autograd. Parameters are kept as float32 arrays in the layout the
products want (``x @ W``) and converted to and from the head's Hugging Face names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from .npops import rms_forward, rope_periods, rope_rotate, rope_table
from .target import Target, as_numpy

# head parameter name -> (numpy key, transposed?) for the weights that are matrices
_LINEARS = {
    "fc.weight": "fc",
    "layers.0.self_attn.o_proj.weight": "o",
    "layers.0.mlp.down_proj.weight": "down",
}
_NORMS = {
    "pre_fc_norm_embedding.weight": "norm_e",
    "pre_fc_norm_hidden.weight": "norm_h",
    "layers.0.input_layernorm.weight": "ln1",
    "layers.0.post_attention_layernorm.weight": "ln2",
    "norm.weight": "norm",
    "layers.0.self_attn.q_norm.weight": "q_norm",
    "layers.0.self_attn.k_norm.weight": "k_norm",
}
_BIASES = {"layers.0.self_attn.o_proj.bias": "o_b", "layers.0.mlp.down_proj.bias": "down_b"}


def linear_backward(p: dict, grads: dict, name: str, x: np.ndarray, dy: np.ndarray):
    """Store the gradients of ``y = x @ p[name] (+ p[name_b])`` in ``grads``; return dL/dx."""
    grads[name] = x.T @ dy
    if f"{name}_b" in p:
        grads[f"{name}_b"] = dy.sum(axis=0)
    return dy @ p[name].T


def rms_backward(dy: np.ndarray, x: np.ndarray, r: np.ndarray, w: np.ndarray):
    """Gradients of ``x * r * w`` for the input and the gain."""
    xr = x * r
    dw = (dy * xr).reshape(-1, x.shape[-1]).sum(axis=0)
    g = dy * w
    dx = r * (g - xr * np.mean(g * xr, axis=-1, keepdims=True))
    return dx, dw


def dropped(
    x: np.ndarray, rate: float, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` with a fraction ``rate`` of its entries zeroed and the rest rescaled, and the
    mask that did it (None, and ``x`` itself, for no dropout)."""
    if not rate:
        return x, None
    keep = (rng.random(x.shape, dtype=np.float32) >= rate) / np.float32(1 - rate)
    return x * keep, keep


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class NumpyHead:
    """Trainable copy of an MTP head; ``embed`` and ``out_t`` (the frozen shared embedding
    and the draft-vocabulary output matrix, ``[D, Vd]``) come from the target."""

    def __init__(self, head, target: Target) -> None:
        args = target.model.args
        self.eps = float(head.config.rms_norm_eps)
        self.n_heads, self.n_kv, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.scale = np.float32(args.head_dim**-0.5)
        rope = head.layers[0].self_attn.rope
        self.rope_dims, self.traditional = rope.dims, rope.traditional
        self.periods, self.pos_scale = rope_periods(rope)
        self.embed = target.embedding_table()
        self.out_t = np.ascontiguousarray(as_numpy(head.draft_out_t))
        self.params = self._from_head(head, target)

    # -- parameters <-> the MLX head -------------------------------------------------------

    def _from_head(self, head, target: Target) -> dict[str, np.ndarray]:
        p = target.numpy_layer(head.layers[0])
        p["fc"] = np.ascontiguousarray(as_numpy(head.fc.weight).T)
        p["norm_e"] = as_numpy(head.pre_fc_norm_embedding.weight)
        p["norm_h"] = as_numpy(head.pre_fc_norm_hidden.weight)
        p["norm"] = as_numpy(head.norm.weight)
        return p

    def to_head_weights(self) -> list[tuple[str, mx.array]]:
        """The parameters under the head's names, for ``MTPHead.load_weights``."""
        return [(k, mx.array(v)) for k, v in self.named(self.params).items()]

    def named(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Parameters (or their gradients) under the head's names, in the ``[out, in]`` layout."""
        out = {}
        for name, key in {**_NORMS, **_BIASES}.items():
            if key in arrays:
                out[name] = arrays[key]
        for name, key in _LINEARS.items():
            out[name] = arrays[key].T
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        att = "layers.0.self_attn."
        for n, lo, hi in (("q", 0, nq), ("k", nq, nq + nkv), ("v", nq + nkv, nq + 2 * nkv)):
            out[f"{att}{n}_proj.weight"] = arrays["qkv"][:, lo:hi].T
            if "qkv_b" in arrays:
                out[f"{att}{n}_proj.bias"] = arrays["qkv_b"][lo:hi]
        inter = arrays["gate_up"].shape[1] // 2
        out["layers.0.mlp.gate_proj.weight"] = arrays["gate_up"][:, :inter].T
        out["layers.0.mlp.up_proj.weight"] = arrays["gate_up"][:, inter:].T
        if "gate_up_b" in arrays:
            out["layers.0.mlp.gate_proj.bias"] = arrays["gate_up_b"][:inter]
            out["layers.0.mlp.up_proj.bias"] = arrays["gate_up_b"][inter:]
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    # -- rotary embeddings -----------------------------------------------------------------

    def _rope_table(self, length: int):
        return rope_table(0, length, self.pos_scale, self.periods)

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return rope_rotate(x, cos, sin, self.rope_dims, self.traditional)

    # -- forward / backward ----------------------------------------------------------------

    def forward(
        self,
        tokens: np.ndarray,
        hiddens: np.ndarray,
        rows: np.ndarray,
        dropout: float = 0.0,
        rng: np.random.Generator | None = None,
    ) -> tuple[np.ndarray, dict]:
        """Draft-vocabulary logits ``[N, Vd]`` at flat positions ``rows`` of ``[B, L]``, and
        the activations the backward pass needs. ``dropout`` (training only) zeroes that
        fraction of the attention output and of the MLP's hidden units, rescaling the rest
        (the attention's mask drawn first)."""
        drop = functools.partial(dropped, rate=dropout, rng=rng)
        cache: dict = {"shape": tokens.shape, "rows": rows}
        x0 = self._fused_input(tokens, hiddens, cache)
        x1 = self._attention(x0, drop, cache)
        x2 = self._mlp(x1, drop, cache)
        x2r = x2[rows]
        y, r_y = rms_forward(x2r, self.params["norm"], self.eps)
        cache.update(x2r=x2r, r_y=r_y, y=y)
        return y @ self.out_t, cache

    def _fused_input(self, tokens: np.ndarray, hiddens: np.ndarray, cache: dict) -> np.ndarray:
        """``fc([norm_e(embed(tokens)), norm_h(hiddens)])``, the block's input ``[B * L, D]``."""
        p, eps = self.params, self.eps
        batch, length = tokens.shape
        e = self.embed[tokens.reshape(-1)]
        h = hiddens.reshape(batch * length, -1).astype(np.float32)
        en, r_e = rms_forward(e, p["norm_e"], eps)
        hn, r_h = rms_forward(h, p["norm_h"], eps)
        c = np.concatenate([en, hn], axis=-1)
        x0 = c @ p["fc"]
        cache.update(e=e, h=h, r_e=r_e, r_h=r_h, c=c, x0=x0)
        return x0

    def _queries_keys_values(
        self, a: np.ndarray, cache: dict
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v ``[B, heads, L, hd]`` of the normed rows ``a``, q and k normed per head
        (where the layer has q/k norms) and rotated."""
        p, eps = self.params, self.eps
        batch, length = cache["shape"]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        qkv = a @ p["qkv"]
        if "qkv_b" in p:
            qkv = qkv + p["qkv_b"]
        q = qkv[:, : nh * hd].reshape(batch, length, nh, hd).transpose(0, 2, 1, 3)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(batch, length, nkv, hd).transpose(0, 2, 1, 3)
        v = qkv[:, (nh + nkv) * hd :].reshape(batch, length, nkv, hd).transpose(0, 2, 1, 3)
        qn_state = kn_state = None
        if "q_norm" in p:
            q_pre, k_pre = q, k
            q, r_q = rms_forward(q, p["q_norm"], eps)
            k, r_k = rms_forward(k, p["k_norm"], eps)
            qn_state, kn_state = (q_pre, r_q), (k_pre, r_k)
        cos, sin = self._rope_table(length)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        cache.update(q=q, k=k, v=v, qn=qn_state, kn=kn_state, cos=cos, sin=sin)
        return q, k, v

    def _attention(self, x0: np.ndarray, drop: Callable, cache: dict) -> np.ndarray:
        """The residual stream after the attention: ``x0 + o_proj(attention(ln1(x0)))``,
        grouped-query and causal from position 0."""
        p = self.params
        batch, length = cache["shape"]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        a, r_1 = rms_forward(x0, p["ln1"], self.eps)
        q, k, v = self._queries_keys_values(a, cache)
        qg = q.reshape(batch, nkv, nh // nkv, length, hd)
        kg, vg = k[:, :, None], v[:, :, None]
        scores = np.matmul(qg, kg.swapaxes(-1, -2)) * self.scale
        causal = np.triu(np.full((length, length), -np.inf, dtype=np.float32), 1)
        scores += causal
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        att = np.matmul(probs, vg)  # [B, nkv, rep, L, hd]
        o_in = att.reshape(batch, nh, length, hd).transpose(0, 2, 1, 3).reshape(batch * length, -1)
        o_in, keep_o = drop(o_in)
        x1 = x0 + o_in @ p["o"]
        if "o_b" in p:
            x1 = x1 + p["o_b"]
        cache.update(r_1=r_1, a=a, probs=probs, o_in=o_in, x1=x1, keep_o=keep_o)
        return x1

    def _mlp(self, x1: np.ndarray, drop: Callable, cache: dict) -> np.ndarray:
        """The residual stream after the SwiGLU MLP: ``x1 + down(silu(gate) * up)``."""
        p = self.params
        m, r_2 = rms_forward(x1, p["ln2"], self.eps)
        gu = m @ p["gate_up"]
        if "gate_up_b" in p:
            gu = gu + p["gate_up_b"]
        inter = gu.shape[1] // 2
        g, u = gu[:, :inter], gu[:, inter:]
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + np.exp(-g))
        act = g * sig * u
        act, keep_act = drop(act)
        x2 = x1 + act @ p["down"]
        if "down_b" in p:
            x2 = x2 + p["down_b"]
        cache.update(m=m, r_2=r_2, g=g, u=u, sig=sig, act=act, keep_act=keep_act)
        return x2

    def backward(
        self, dlogits: np.ndarray, cache: dict, dy_extra: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Gradients of every parameter given the loss gradient w.r.t. the logits (and, for
        a loss on the head's output rows themselves, w.r.t. those: ``dy_extra``)."""
        p, s = self.params, cache
        batch, length = s["shape"]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        rep = nh // nkv
        grads: dict[str, np.ndarray] = {}
        dy = dlogits @ self.out_t.T
        if dy_extra is not None:
            dy = dy + dy_extra
        dx2r, grads["norm"] = rms_backward(dy, s["x2r"], s["r_y"], p["norm"])
        dx2 = np.zeros((batch * length, dy.shape[1]), dtype=np.float32)
        np.add.at(dx2, s["rows"], dx2r)
        # MLP
        dact = linear_backward(p, grads, "down", s["act"], dx2)
        if s["keep_act"] is not None:
            dact *= s["keep_act"]
        g, u, sig = s["g"], s["u"], s["sig"]
        du = dact * g * sig
        dg = dact * u * sig * (1.0 + g * (1.0 - sig))
        dgu = np.concatenate([dg, du], axis=1)
        dm = linear_backward(p, grads, "gate_up", s["m"], dgu)
        dx1_norm, grads["ln2"] = rms_backward(dm, s["x1"], s["r_2"], p["ln2"])
        dx1 = dx2 + dx1_norm
        # attention
        d_oin = linear_backward(p, grads, "o", s["o_in"], dx1)
        if s["keep_o"] is not None:
            d_oin *= s["keep_o"]
        datt = d_oin.reshape(batch, length, nh, hd).transpose(0, 2, 1, 3)
        datt = datt.reshape(batch, nkv, rep, length, hd)
        probs = s["probs"]
        vg = s["v"][:, :, None]
        dv = np.matmul(probs.swapaxes(-1, -2), datt).sum(axis=2)
        dprobs = np.matmul(datt, vg.swapaxes(-1, -2))
        dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
        dscores *= self.scale
        qg = s["q"].reshape(batch, nkv, rep, length, hd)
        dq = np.matmul(dscores, s["k"][:, :, None]).reshape(batch, nh, length, hd)
        dk = np.matmul(dscores.swapaxes(-1, -2), qg).sum(axis=2)
        cos, sin = s["cos"], s["sin"]
        dq, dk = self._rotate(dq, cos, -sin), self._rotate(dk, cos, -sin)
        if s["qn"] is not None:
            dq, grads["q_norm"] = rms_backward(dq, s["qn"][0], s["qn"][1], p["q_norm"])
            dk, grads["k_norm"] = rms_backward(dk, s["kn"][0], s["kn"][1], p["k_norm"])
        dqkv = np.concatenate(
            [t.transpose(0, 2, 1, 3).reshape(batch * length, -1) for t in (dq, dk, dv)], axis=1
        )
        da = linear_backward(p, grads, "qkv", s["a"], dqkv)
        dx0_norm, grads["ln1"] = rms_backward(da, s["x0"], s["r_1"], p["ln1"])
        dx0 = dx1 + dx0_norm
        # fc and the input norms (the embedding and the target hidden are frozen)
        dc = linear_backward(p, grads, "fc", s["c"], dx0)
        dim = dc.shape[1] // 2
        _, grads["norm_e"] = rms_backward(dc[:, :dim], s["e"], s["r_e"], p["norm_e"])
        _, grads["norm_h"] = rms_backward(dc[:, dim:], s["h"], s["r_h"], p["norm_h"])
        return grads


def loss_and_grad(logits, labels, target_logits, kind: str) -> tuple[float, np.ndarray]:
    """Loss over the loss rows and its gradient w.r.t. the head's logits.

    ``ce``: cross-entropy on the target's argmax (rows whose label lies outside the draft
    vocabulary, -1, are skipped); ``kl``: KL(target || head) over the draft vocabulary, the
    target's logits renormalised there; ``mix``: the mean of both."""
    logq = log_softmax(logits.astype(np.float32))
    q = np.exp(logq)
    total, grad = 0.0, np.zeros_like(logits, dtype=np.float32)
    weight = 0.5 if kind == "mix" else 1.0
    if kind in ("ce", "mix"):
        valid = labels >= 0
        n = max(int(valid.sum()), 1)
        idx = np.nonzero(valid)[0]
        total += weight * float(-logq[idx, labels[idx]].sum() / n)
        g = q.copy()
        g[idx, labels[idx]] -= 1.0
        g[~valid] = 0.0
        grad += weight * g / n
    if kind in ("kl", "mix"):
        logp = log_softmax(target_logits.astype(np.float32))
        pt = np.exp(logp)
        n = max(len(logits), 1)
        total += weight * float((pt * (logp - logq)).sum() / n)
        grad += weight * (q - pt) / n
    return total, grad


def hidden_regression(y: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean squared error between the head's output rows and the target's next hidden (the
    row the target's own logits come from), and its gradient. A dense signal per pair, and
    it keeps the output a hidden the next chained draft step can be fed."""
    diff = y - target
    n = diff.size
    return float(np.square(diff).sum() / n), (2.0 / n) * diff


class Adam:
    """AdamW with bias correction, global-norm clipping and a warmup + cosine schedule.

    ``relative``: each tensor's step is ``lr`` times its initial RMS (at least 0.01), so the
    copied layer, the rescaled fc and the norm gains all change by about the same fraction
    per step instead of by the same absolute amount."""

    def __init__(
        self,
        params: dict[str, np.ndarray],
        lr: float,
        warmup: int,
        total: int,
        weight_decay: float = 0.0,
        clip: float = 1.0,
        relative: bool = False,
    ) -> None:
        self.lr, self.warmup, self.total = lr, max(warmup, 1), max(total, 1)
        self.weight_decay, self.clip = weight_decay, clip
        self.b1, self.b2, self.eps = 0.9, 0.999, 1e-8
        self.step = 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.scale = {
            k: max(float(np.sqrt(np.mean(np.square(v)))), 0.01) if relative else 1.0
            for k, v in params.items()
        }

    def rate(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (0.01 + 0.99 * step / self.warmup)
        frac = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        end = 0.05 * self.lr
        return end + 0.5 * (self.lr - end) * (1.0 + np.cos(np.pi * frac))

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> float:
        """One step in place; returns the gradient norm before clipping."""
        norm = float(np.sqrt(sum(float(np.square(g).sum()) for g in grads.values())))
        scale = min(1.0, self.clip / (norm + 1e-12)) if self.clip else 1.0
        lr = self.rate(self.step)
        self.step += 1
        c1, c2 = 1.0 - self.b1**self.step, 1.0 - self.b2**self.step
        for k, g in grads.items():
            g = g * scale
            m, v = self.m[k], self.v[k]
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * np.square(g)
            update = (m / c1) / (np.sqrt(v / c2) + self.eps)
            if self.weight_decay and params[k].ndim == 2:
                update = update + self.weight_decay * params[k]
            params[k] -= np.float32(lr * self.scale[k]) * update.astype(np.float32)
        return norm

    def state(self) -> dict[str, np.ndarray]:
        out = {f"m.{k}": v for k, v in self.m.items()}
        out.update({f"v.{k}": v for k, v in self.v.items()})
        out.update({f"s.{k}": np.array(v) for k, v in self.scale.items()})
        out["step"] = np.array(self.step)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.step = int(state["step"])
        for k in self.m:
            self.scale[k] = float(state[f"s.{k}"])
            self.m[k] = state[f"m.{k}"].astype(np.float32)
            self.v[k] = state[f"v.{k}"].astype(np.float32)
