"""SmolLM2-135M: the runner's logits against an independent numpy float64 forward pass.

The reference reads the raw GGUF tensors, dequantizes them itself and applies RoPE in the
interleaved form the GGUF Q/K layout was permuted for, so it shares nothing with the runner
but the file.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

# Chosen so that no greedy step within 12 tokens has a near-tie (top-2 gap >= 0.4 in float64).
PROMPT = (
    "<|im_start|>user\nExplain photosynthesis in one sentence.<|im_end|>\n<|im_start|>assistant\n"
)


def _dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    rows, words = packed.shape
    groups = scales.shape[1]
    bits = words * 32 // (groups * 32)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    q = (packed[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(rows, groups, 32).astype(np.float64)
    w = q * scales[:, :, None].astype(np.float64) + biases[:, :, None].astype(np.float64)
    return w.reshape(rows, groups * 32)


class NumpyLlama:
    def __init__(self, path: str):
        raw, meta = mx.load(path, return_metadata=True)
        self.meta = {
            k: (v.item() if isinstance(v, mx.array) and v.size == 1 else v) for k, v in meta.items()
        }
        t = {}
        for name in raw:
            if name.endswith((".scales", ".biases")):
                continue
            stem = name[: -len(".weight")] if name.endswith(".weight") else name
            if f"{stem}.scales" in raw:
                t[stem] = _dequantize(
                    np.array(raw[name]),
                    np.array(raw[f"{stem}.scales"]),
                    np.array(raw[f"{stem}.biases"]),
                )
            else:
                t[stem] = np.array(raw[name].astype(mx.float32), dtype=np.float64)
        self.t = t
        self.layers = int(self.meta["llama.block_count"])
        self.heads = int(self.meta["llama.attention.head_count"])
        self.kv_heads = int(self.meta["llama.attention.head_count_kv"])
        self.eps = float(self.meta["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(self.meta["llama.rope.freq_base"])

    def _norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope_interleaved(self, x):
        # x: [heads, L, d]; GGUF llama weights rotate adjacent pairs (2i, 2i+1).
        _, length, d = x.shape
        inv = self.theta ** (-np.arange(0, d, 2) / d)
        ang = np.arange(length)[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        t = self.t
        x = t["token_embd"][tokens]
        length = len(tokens)
        d = x.shape[1] // self.heads
        causal = np.triu(np.full((length, length), -np.inf), 1)
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, t[p + "attn_norm"])
            q = (h @ t[p + "attn_q"].T).reshape(length, self.heads, d).transpose(1, 0, 2)
            k = (h @ t[p + "attn_k"].T).reshape(length, self.kv_heads, d).transpose(1, 0, 2)
            v = (h @ t[p + "attn_v"].T).reshape(length, self.kv_heads, d).transpose(1, 0, 2)
            q, k = self._rope_interleaved(q), self._rope_interleaved(k)
            rep = self.heads // self.kv_heads
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(d) + causal
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = (scores / scores.sum(-1, keepdims=True)) @ v
            x = x + attn.transpose(1, 0, 2).reshape(length, -1) @ t[p + "attn_output"].T
            h = self._norm(x, t[p + "ffn_norm"])
            gate = h @ t[p + "ffn_gate"].T
            up = h @ t[p + "ffn_up"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "ffn_down"].T
        x = self._norm(x, t["output_norm"])
        head = t.get("output", t["token_embd"])
        return x @ head.T


@pytest.fixture(scope="module")
def reference(default_model):
    return NumpyLlama(default_model)


def test_logits_match_numpy_float64(default_loaded, reference, exact_products):
    """The model's math: the weights kept quantized, multiplied exactly."""
    ids = default_loaded.tokenizer.encode(PROMPT + "Photosynthesis is")[:16]
    assert len(ids) == 16
    model = default_loaded.model
    got = np.array(model.forward(mx.array([ids]), model.make_caches())[0][0], dtype=np.float64)
    want = reference.logits(ids)
    span = want.max() - want.min()
    assert np.abs(got - want).max() < 1e-2 * span
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_int8_activations_keep_the_logits_close(default_loaded, reference):
    """The default products (int8 activations per 32 inputs) stay within a few percent of the
    float64 logits' span and pick the same tokens on this prompt."""
    ids = default_loaded.tokenizer.encode(PROMPT + "Photosynthesis is")[:16]
    model = default_loaded.model
    got = np.array(model.forward(mx.array([ids]), model.make_caches())[0][0], dtype=np.float64)
    want = reference.logits(ids)
    span = want.max() - want.min()
    assert np.abs(got - want).max() < 0.1 * span
    assert np.abs(got - want).mean() < 1e-2 * span
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_greedy_continuation_matches_numpy(default_loaded, reference, product_path):
    model = default_loaded.model
    ids = default_loaded.tokenizer.encode(PROMPT)
    caches = model.make_caches()
    logits = model.forward(mx.array([ids]), caches)[0]
    ours = []
    for _ in range(12):
        nxt = int(mx.argmax(logits[0, -1]).item())
        ours.append(nxt)
        logits = model.forward(mx.array([[nxt]]), caches)[0]
    seq = list(ids)
    theirs = []
    for _ in range(12):
        nxt = int(reference.logits(seq)[-1].argmax())
        theirs.append(nxt)
        seq.append(nxt)
    assert ours == theirs
    assert len(set(ours)) > 3  # a real continuation, not one token repeated
