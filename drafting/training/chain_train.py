"""Training-time test: the head trained along its own chain of drafts, in MLX.

At inference, draft step 1 runs the frontier pair (token t_{i+1}, target row at i); step j > 1
runs (token t_{i+j}, the head's own output of step j-1) at position i + j - 1, attending to
the committed pairs 0..i and to the chain's earlier steps at i. Trained on step 1 alone, a head
never sees its own outputs as input and its later drafts fall away. Here every sequence runs
``steps`` chained steps at once: step j's query at i sees step 1's keys 0..i (causal) and the
keys of steps 2..j at i only (one diagonal per step), exactly the draft cache at frontier i.
Step j's loss (weight ``decay ** (j - 1)``) is on the target's argmax after t_{i+j}; rows whose
label lies outside the draft vocabulary carry no loss (the head cannot draft it), for the soft
labels too. Gradients flow through the chain (the outputs fed forward and the keys).

The step runs on MLX autograd over the head's own modules (its input, the block's projections,
RoPE and MLP), with the attention composed here so that its mask is the chain's. A fused-feature
head (``HeadConfig.feature_layers``) trains here as well, whatever the steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .nphead import Adam


@dataclass
class ChainBatch:
    """Right-padded sequences with ``steps - 1`` columns of look-ahead for the chain."""

    tokens: np.ndarray  # int32 [B, L + S - 1]: pair i's token t_{i+1} (0 past the end)
    rows: np.ndarray  # float16 [B, L, W]: pair i's target row (the fused streams, or h_i)
    labels: np.ndarray  # int32 [B, L + S - 1]: pair i's draft-vocab label, -1 OOV, -2 padding
    next_hiddens: np.ndarray  # float16 [B, L + S - 1, D]: h_{i+1}, the soft label's source
    first_loss: np.ndarray  # int64 [B]: pairs before it are prompt context
    pairs: int


def collate_chain(examples: list, steps: int) -> ChainBatch:
    width = max(len(e.tokens) for e in examples)
    extra = steps - 1
    batch = len(examples)
    dim = examples[0].next_hiddens.shape[1]
    row_width = examples[0].hiddens.shape[1]
    tokens = np.zeros((batch, width + extra), dtype=np.int32)
    rows = np.zeros((batch, width, row_width), dtype=np.float16)
    labels = np.full((batch, width + extra), -2, dtype=np.int32)
    nxt = np.zeros((batch, width + extra, dim), dtype=np.float16)
    for b, e in enumerate(examples):
        n = len(e.tokens)
        tokens[b, :n], rows[b, :n], labels[b, :n], nxt[b, :n] = (
            e.tokens,
            e.hiddens,
            e.labels,
            e.next_hiddens,
        )
    return ChainBatch(
        tokens=tokens,
        rows=rows,
        labels=labels,
        next_hiddens=nxt,
        first_loss=np.array([e.first_loss for e in examples], dtype=np.int64),
        pairs=int(sum(len(e.tokens) for e in examples)),
    )


def chain_mask(length: int, step: int) -> mx.array:
    """Additive ``[L, (step + 1) * L]`` mask of chain step ``step`` (0-based): step 0's keys
    causally, each later step's key at the query's own position only."""
    rows = np.arange(length)[:, None]
    cols = np.arange(length)[None, :]
    blocks = [cols <= rows] + [cols == rows] * step
    ok = np.concatenate(blocks, axis=1)
    return mx.array(np.where(ok, 0.0, -np.inf).astype(np.float32))


def _attend(attn, q: mx.array, k: mx.array, v: mx.array, mask: mx.array) -> mx.array:
    batch, heads, length, dim = q.shape
    groups = k.shape[1]
    per_group = heads // groups
    q = (q * attn.scale).reshape(batch, groups, per_group, length, dim)
    scores = q @ k[:, :, None].swapaxes(-1, -2) + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v[:, :, None]).reshape(batch, heads, length, dim)


def _after_attention(layer, x: mx.array, attended: mx.array) -> mx.array:
    """The block after attention, its SwiGLU through ``nn.silu``: the runner's fast SiLU for
    long feeds is built from integer kernels that have no gradient."""
    h = x + layer.self_attn.output(attended)
    mlp = layer.mlp
    m = layer.post_attention_layernorm(h)
    return h + mlp.down_proj(nn.silu(mlp.gate_proj(m)) * mlp.up_proj(m))


@dataclass
class ChainOptions:
    steps: int = 3
    decay: float = 0.8  # step j's loss weight: decay ** (j - 1)
    loss: str = "ce"  # ce, kl or mix (the mean of both)
    hidden_loss: float = 0.0  # weight of the outputs' regression onto the target's next hidden


def chain_outputs(head, batch: dict, steps: int):
    """Yield ``(j, y)`` for chain steps j = 0..steps-1: the head's normed outputs ``[B, L, D]``."""
    tokens, rows = batch["tokens"], batch["rows"]
    length = rows.shape[1]
    layer = head.layers[0]
    hidden, keys, values = rows, None, None
    for j in range(steps):
        x = head.input(tokens[:, j : j + length], hidden)
        rope = layer.self_attn.rope.tables(j, length, x.dtype)
        q, k, v = layer.before_cache(x, *rope)
        keys = k if keys is None else mx.concatenate([keys, k], axis=2)
        values = v if values is None else mx.concatenate([values, v], axis=2)
        attended = _attend(layer.self_attn, q, keys, values, batch["masks"][j])
        y = head.norm(_after_attention(layer, x, attended))
        yield j, y
        hidden = y


def to_device(batch: ChainBatch, steps: int) -> dict:
    """The batch as MLX arrays, with each step's loss rows (flat ``b * L + i``) and labels."""
    length = batch.rows.shape[1]
    cols = np.arange(length)[None, :]
    context = cols >= batch.first_loss[:, None]
    out = {
        "tokens": mx.array(batch.tokens),
        "rows": mx.array(batch.rows).astype(mx.float32),
        "masks": [chain_mask(length, j) for j in range(steps)],
        "loss_rows": [],
        "labels": [],
        "next": [],
        "answer_rows": [],  # per step: rows with a label, in the draft vocabulary or not
    }
    dim = batch.next_hiddens.shape[-1]
    for j in range(steps):
        labels = batch.labels[:, j : j + length]
        flat = np.nonzero(((labels >= 0) & context).reshape(-1))[0]
        out["loss_rows"].append(mx.array(flat.astype(np.int32)))
        out["answer_rows"].append(int(((labels >= -1) & context).sum()))
        out["labels"].append(mx.array(labels.reshape(-1)[flat]))
        nxt = batch.next_hiddens[:, j : j + length].reshape(-1, dim)[flat]
        out["next"].append(mx.array(nxt).astype(mx.float32))
    return out


def chain_loss(head, batch: dict, opts: ChainOptions) -> mx.array:
    total = mx.array(0.0)
    for j, y in chain_outputs(head, batch, opts.steps):
        rows = batch["loss_rows"][j]
        if rows.size == 0:
            continue
        out = y.reshape(-1, y.shape[-1])[rows]
        logq = nn.log_softmax(out @ head.draft_out_t, axis=-1)
        parts = []
        if opts.loss in ("ce", "mix"):
            labels = batch["labels"][j]
            parts.append(-mx.take_along_axis(logq, labels[:, None], axis=-1).mean())
        if opts.loss in ("kl", "mix"):
            logp = nn.log_softmax(batch["next"][j] @ head.draft_out_t, axis=-1)
            parts.append((mx.exp(logp) * (logp - logq)).sum(axis=-1).mean())
        step_loss = sum(parts) / len(parts)
        if opts.hidden_loss:
            step_loss = step_loss + opts.hidden_loss * mx.mean(mx.square(out - batch["next"][j]))
        total = total + (opts.decay**j) * step_loss
    return total


class ChainTrainer:
    """Trains an MLX head by training-time test; its parameters live as float32 NumPy arrays
    under the head's own names (what ``Adam`` and the checkpoints hold)."""

    def __init__(self, head, opts: ChainOptions, threads=contextlib.nullcontext) -> None:
        """``threads``: a context factory for the steps' products (``Target.training_threads``)."""
        self.head, self.opts, self.threads = head, opts, threads
        self.params = {
            k: np.array(v, dtype=np.float32) for k, v in tree_flatten(head.trainable_parameters())
        }
        self._grad = nn.value_and_grad(head, lambda b: chain_loss(head, b, opts))

    def _load(self) -> None:
        self.head.update(tree_unflatten([(k, mx.array(v)) for k, v in self.params.items()]))

    def collate(self, examples: list, with_unlabeled: bool = False) -> ChainBatch:
        return collate_chain(examples, self.opts.steps)

    def step(self, opt: Adam, batch: ChainBatch, rng=None) -> float:
        self._load()
        with self.threads():
            loss, grads = self._grad(to_device(batch, self.opts.steps))
            mx.eval(loss, grads)
        opt.update(self.params, {k: np.array(g) for k, g in tree_flatten(grads)})
        return float(loss.item())

    def agreement(self, batches: list[ChainBatch], steps: int = 1) -> list[float]:
        """Per chain step, the share of answer rows whose draft-vocab argmax is the label (a
        label outside the draft vocabulary is a miss; the chain is fed the sequences' own
        tokens, which in greedy answers are the target's argmax)."""
        self._load()
        hits, totals = np.zeros(steps), np.zeros(steps)
        for b in batches:
            dev = to_device(b, steps)
            for j, y in chain_outputs(self.head, dev, steps):
                rows = dev["loss_rows"][j]
                if rows.size == 0:
                    continue
                pred = mx.argmax(y.reshape(-1, y.shape[-1])[rows] @ self.head.draft_out_t, axis=-1)
                hits[j] += int((pred == dev["labels"][j]).sum().item())
                totals[j] += dev["answer_rows"][j]
        return [float(h / max(t, 1)) for h, t in zip(hits, totals, strict=True)]

    def to_head_weights(self) -> list[tuple[str, mx.array]]:
        return [(k, mx.array(v)) for k, v in self.params.items()]
