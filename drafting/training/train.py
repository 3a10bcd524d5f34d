"""Training data, loss and steps for one MTP head (``loop`` runs them).

Pair i of a sequence is (token t_{i+1}, target hidden h_i); its label is the target's argmax
after t_{i+1}, i.e. the target's own choice for token i+2. Every pair of the sequence runs
through the head (prompt pairs too: they are context in the draft KV at inference), but only
pairs from the last prompt position on carry a loss: those are the ones the runner drafts from.
The steps run in NumPy (``nphead``); the MLX functions here are the reference the tests
check it against and the way a loaded head is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import dataset
from .config import TrainConfig, TrainingError
from .nphead import Adam, NumpyHead, hidden_regression, loss_and_grad


class WholeSequenceCache:
    """Stand-in KV cache for training: the head sees a whole sequence in one call, so there
    is nothing to keep; positions start at 0 and attention is causal over the call."""

    offset = 0
    layout = None  # training text has no images

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


@dataclass
class Example:
    """One sequence's pairs: inputs, the loss positions and their labels."""

    tokens: np.ndarray  # int32 [n]: token t_{i+1}
    hiddens: np.ndarray  # float16 [n, D]: h_i
    next_hiddens: np.ndarray  # float16 [n, D]: h_{i+1} (the target's distribution for KL)
    labels: np.ndarray  # int32 [n]: draft-vocab index of the label, -1 outside the vocab
    first_loss: int  # pairs before this index are prompt context


def to_example(
    seq: dataset.Sequence, vocab_index: np.ndarray, fused: bool = False
) -> Example | None:
    """``fused``: the pairs' target rows are the recorded streams and the final hidden,
    concatenated (what a fused-feature head reads)."""
    n = len(seq.tokens) - 2
    if n < seq.prompt_len:  # no answer pair with a label
        return None
    labels = seq.argmax[1 : n + 1]
    rows = seq.hiddens[:n]
    if fused:
        if seq.features is None:
            raise TrainingError(
                f"the answer to prompt {seq.prompt_index} has no recorded streams: a fused-feature "
                "head needs data generated with --fuse or --feature-layers"
            )
        rows = np.concatenate([seq.features[:n], rows], axis=1)
    return Example(
        tokens=seq.tokens[1 : n + 1].astype(np.int32),
        hiddens=rows,
        next_hiddens=seq.hiddens[1 : n + 1],
        labels=np.where(labels >= 0, vocab_index[np.maximum(labels, 0)], -1).astype(np.int32),
        first_loss=seq.prompt_len - 1,
    )


def choose_vocab(seqs: list[dataset.Sequence], size: int, vocab_size: int, always: list[int]):
    """The ``size`` most frequent answer labels (plus ``always``), most frequent first."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        labels = s.argmax[s.prompt_len :]
        np.add.at(counts, labels[labels >= 0], 1)
    order = np.argsort(-counts, kind="stable")
    chosen = [int(t) for t in always if 0 <= t < vocab_size]
    seen = set(chosen)
    for t in order[: size + len(chosen)].tolist():
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    return chosen


def coverage(seqs: list[dataset.Sequence], vocab: list[int], vocab_size: int) -> float:
    inside = np.zeros(vocab_size, dtype=bool)
    inside[vocab] = True
    hits = total = 0
    for s in seqs:
        labels = s.argmax[s.prompt_len :]
        labels = labels[labels >= 0]
        hits += int(inside[labels].sum())
        total += len(labels)
    return hits / max(total, 1)


@dataclass
class Batch:
    tokens: np.ndarray  # int32 [B, L]
    hiddens: np.ndarray  # float16 [B, L, D]
    rows: np.ndarray  # int64 [N] flat positions (b * L + i) that carry a loss
    labels: np.ndarray  # int32 [N] draft-vocab index or -1
    next_hiddens: np.ndarray  # float16 [N, D]
    pairs: int


def make_batches(examples: list[Example], budget: int) -> list[list[int]]:
    """Group examples of similar length so that ``count * longest <= budget`` pairs."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    groups, cur = [], []
    for i in order:
        longest = len(examples[i].tokens)
        if cur and (len(cur) + 1) * longest > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def collate(examples: list[Example], with_unlabeled: bool) -> Batch:
    """Right-pad to the longest example: causal attention never lets a real pair see a pad."""
    width = max(len(e.tokens) for e in examples)
    dim = examples[0].hiddens.shape[1]
    tokens = np.zeros((len(examples), width), dtype=np.int32)
    hiddens = np.zeros((len(examples), width, dim), dtype=np.float16)
    rows, labels, nxt = [], [], []
    for b, e in enumerate(examples):
        n = len(e.tokens)
        tokens[b, :n] = e.tokens
        hiddens[b, :n] = e.hiddens
        pos = np.arange(e.first_loss, n)
        if not with_unlabeled:
            pos = pos[e.labels[pos] >= 0]
        rows.append(b * width + pos)
        labels.append(e.labels[pos])
        nxt.append(e.next_hiddens[pos])
    return Batch(
        tokens=tokens,
        hiddens=hiddens,
        rows=np.concatenate(rows).astype(np.int64),
        labels=np.concatenate(labels).astype(np.int32),
        next_hiddens=np.concatenate(nxt),
        pairs=int(sum(len(e.tokens) for e in examples)),
    )


def head_logits(head, batch: Batch) -> mx.array:
    """The MLX head's draft-vocab logits ``[N, Vd]`` at the batch's loss positions."""
    hid = mx.array(batch.hiddens).astype(mx.float32)
    y = head(mx.array(batch.tokens), hid, WholeSequenceCache(), mask="causal")
    y = y.reshape(-1, y.shape[-1])[mx.array(batch.rows)]
    return head.logits(y, None)


def loss_fn(head, batch: Batch, kind: str) -> mx.array:
    """The training loss in MLX (reference for ``nphead.loss_and_grad``)."""
    logq = nn.log_softmax(head_logits(head, batch), axis=-1)
    labels = mx.array(batch.labels)
    valid = labels >= 0
    ce = -mx.take_along_axis(logq, mx.maximum(labels, 0)[:, None], axis=-1)[:, 0]
    ce = (ce * valid).sum() / mx.maximum(valid.sum(), 1)
    if kind == "ce":
        return ce
    target = mx.array(batch.next_hiddens).astype(mx.float32) @ head.draft_out_t
    logp = nn.log_softmax(target, axis=-1)
    kl = (mx.exp(logp) * (logp - logq)).sum(axis=-1).mean()
    return kl if kind == "kl" else 0.5 * (ce + kl)


def agreement(head, batches: list[Batch]) -> float:
    """Position-1 greedy agreement of an MLX head: its draft-vocab argmax equals the target's
    argmax (a label outside the draft vocabulary counts as a miss)."""
    hits = total = 0
    for b in batches:
        pred = np.array(mx.argmax(head_logits(head, b), axis=-1))
        hits += int(((pred == b.labels) & (b.labels >= 0)).sum())
        total += len(b.labels)
    return hits / max(total, 1)


def np_agreement(head: NumpyHead, batches: list[Batch]) -> float:
    """The same for the NumPy head being trained."""
    hits = total = 0
    for b in batches:
        logits, _ = head.forward(b.tokens, b.hiddens, b.rows)
        pred = logits.argmax(axis=-1)
        hits += int(((pred == b.labels) & (b.labels >= 0)).sum())
        total += len(b.labels)
    return hits / max(total, 1)


def train_step(
    head: NumpyHead,
    opt: Adam,
    batch: Batch,
    kind: str,
    reg: float = 0.0,
    dropout: float = 0.0,
    rng: np.random.Generator | None = None,
) -> float:
    logits, cache = head.forward(batch.tokens, batch.hiddens, batch.rows, dropout, rng)
    nxt = batch.next_hiddens.astype(np.float32)
    target = nxt @ head.out_t if kind != "ce" else None
    loss, dlogits = loss_and_grad(logits, batch.labels, target, kind)
    dy = None
    if reg:
        mse, dy = hidden_regression(cache["y"], nxt)
        loss, dy = loss + reg * mse, reg * dy
    grads = head.backward(dlogits, cache, dy)
    opt.update(head.params, grads)
    return loss


class NumpyTrainer:
    """The one-step NumPy path (``nphead``) behind the interface ``ChainTrainer`` has."""

    def __init__(self, head: NumpyHead, args: TrainConfig) -> None:
        self.head, self.args = head, args

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self.head.params

    @params.setter
    def params(self, value: dict[str, np.ndarray]) -> None:
        self.head.params = value

    def collate(self, examples: list[Example], with_unlabeled: bool = False) -> Batch:
        return collate(examples, with_unlabeled)

    def step(self, opt: Adam, batch: Batch, rng: np.random.Generator | None = None) -> float:
        a = self.args
        return train_step(self.head, opt, batch, a.loss, a.hidden_loss, a.dropout, rng)

    def agreement(self, batches: list[Batch], steps: int = 1) -> list[float]:
        return [np_agreement(self.head, batches)]

    def to_head_weights(self) -> list[tuple[str, mx.array]]:
        return self.head.to_head_weights()
