"""Acceptance of a head drafting k tokens in a row, measured the way the runner drafts.

At every answer position the draft KV holds the committed pairs (token t+1, target hidden t)
up to the frontier; step 1 runs the frontier pair, step j > 1 feeds the head's own normed
output and the previous draft token, then the cache rewinds to the committed prefix. Greedy:
draft j is accepted when it equals the target's argmax there (and 1..j-1 were). Sampling:
the expected acceptance of draft j is sum_x min(p(x), q(x)) under the sampler's processed
target (p) and draft (q) distributions; drafts 2..k continue along the target's own sampled
continuation (the accepted path) with the head's recycled hiddens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cache.kv import KVCache

from .dataset import Sequence
from .generate import prefill_mask, processed_topk, step_mask


@dataclass
class SamplingOptions:
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.9


def _overlap(p_ids, p_probs, q_ids, q_probs) -> np.ndarray:
    """sum_x min(p(x), q(x)) per row, for sparse distributions ``[N, k]``."""
    same = p_ids[:, :, None] == q_ids[:, None, :]
    mins = np.minimum(p_probs[:, :, None], q_probs[:, None, :])
    return (mins * same).sum(axis=(1, 2))


class ChainResult:
    """Per draft position j: greedy hits, or expected acceptance, with what was counted."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.rows: list[np.ndarray] = []  # each [depth]: per-step score, NaN = no label

    def add(self, scores: np.ndarray) -> None:
        self.rows.append(scores)

    def summary(self) -> dict:
        s = np.array(self.rows, dtype=np.float64).reshape(-1, self.depth)
        out = {
            "positions": int(len(s)),
            "conditional": [],
            "cumulative": [],
            "tokens_per_round": [],
        }
        prefix = np.ones(len(s))
        tokens = 1.0
        for j in range(self.depth):
            have = ~np.isnan(s[:, j])
            cum = prefix * np.where(have, s[:, j], 0.0)
            # conditional on drafts 1..j-1 accepted: sum P(all 1..j) / sum P(all 1..j-1)
            denom = prefix[have].sum()
            out["conditional"].append(float(cum[have].sum() / denom) if denom > 0 else None)
            out["cumulative"].append(float(cum[have].mean()) if have.any() else None)
            tokens += out["cumulative"][-1] or 0.0
            out["tokens_per_round"].append(tokens)
            prefix = cum
        return out


def evaluate_chain(
    head,
    target,
    seqs: list[Sequence],
    depth: int,
    sampling: SamplingOptions | None,
    batch_size: int = 32,
) -> dict:
    """Greedy (``sampling=None``) or expected (sampled) acceptance per draft position."""
    result = ChainResult(depth)
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].prompt_len)
    for start in range(0, len(order), batch_size):
        _run_batch(
            head,
            target,
            [seqs[i] for i in order[start : start + batch_size]],
            depth,
            sampling,
            result,
        )
    return result.summary()


def _target_dists(target, seq: Sequence, sampling: SamplingOptions):
    """Processed target distributions at every fed position of ``seq`` (sparse)."""
    logits = target.logits(seq.hiddens.astype(np.float32))
    return processed_topk(logits, sampling.temperature, sampling.top_k, sampling.top_p)


@dataclass
class _Pairs:
    """A batch's pairs left-padded to its longest prompt, with room for the draft columns."""

    tokens: np.ndarray  # int32 [B, C]: column c holds t_{c+1} of pair c
    rows: np.ndarray  # float32 [B, C, D]: the target rows (fused: the streams, then h)
    pads: np.ndarray  # pad columns ahead of each sequence
    width: int  # the longest prompt


def _padded_pairs(seqs: list[Sequence], depth: int, fused: bool) -> _Pairs:
    """The pairs of ``seqs`` with ``depth`` spare columns after the longest (fused: the
    target rows carry the recorded streams ahead of the hidden)."""
    batch = len(seqs)
    width = max(s.prompt_len for s in seqs)
    pads = np.array([width - s.prompt_len for s in seqs])
    cols = max(pads[b] + len(s.tokens) for b, s in enumerate(seqs))
    rows = [np.concatenate([s.features, s.hiddens], axis=1) if fused else s.hiddens for s in seqs]
    dim = rows[0].shape[1]
    tok = np.zeros((batch, cols + depth), dtype=np.int32)
    hid = np.zeros((batch, cols + depth, dim), dtype=np.float32)
    for b, s in enumerate(seqs):
        tok[b, pads[b] : pads[b] + len(s.tokens)] = s.tokens
        hid[b, pads[b] : pads[b] + len(s.hiddens)] = rows[b]
    return _Pairs(tok, hid, pads, width)


def _run_batch(head, target, seqs, depth, sampling, result: ChainResult) -> None:
    vocab = np.array(head.config.draft_vocab) if head.config.draft_vocab is not None else None
    vocab_ids = head.draft_vocab_ids  # the same ids on the device
    pairs = _padded_pairs(seqs, depth, bool(head.config.feature_layers))
    pads, width = pairs.pads, pairs.width
    dists = [_target_dists(target, s, sampling) for s in seqs] if sampling else None

    def full_vocabulary(y: mx.array) -> mx.array:  # a head without a draft vocabulary
        return mx.array(target.logits(np.array(y, dtype=np.float32)))

    cache = KVCache()
    # Committed pairs before the first frontier: columns 0..width-2 (pair c = (t_{c+1}, h_c)).
    if width > 1:
        mask = mx.array(prefill_mask(pads, width - 1))[:, None]
        tokens, rows = mx.array(pairs.tokens[:, 1:width]), mx.array(pairs.rows[:, : width - 1])
        y = head(tokens, rows, cache, mask)
        mx.eval(y, cache.state)
    last = [pads[b] + len(s.tokens) - 3 for b, s in enumerate(seqs)]  # last frontier column
    for c in range(width - 1, max(last) + 1):
        logits_np = _draft_chain(
            head, pairs, c, depth, cache, bool(sampling), vocab_ids, full_vocabulary
        )
        drafts = _draft_dists(logits_np, sampling, vocab) if sampling else None
        for b, s in enumerate(seqs):
            i = c - pads[b]  # frontier pair index in the sequence
            if c > last[b] or i < s.prompt_len - 1:
                continue
            draft = (drafts[0][b], drafts[1][b], dists[b]) if sampling else None
            result.add(_scores(s, i, depth, logits_np[b], draft, vocab))


def _draft_chain(
    head,
    pairs: _Pairs,
    c: int,
    depth: int,
    cache: KVCache,
    sampled: bool,
    vocab_ids: mx.array | None,
    full_vocabulary: Callable[[mx.array], mx.array],
) -> np.ndarray:
    """The head's logits ``[B, depth, Vd]`` for drafts 1..depth from frontier column ``c``:
    step 1 runs the frontier pair, step j > 1 the head's own output with the previous draft
    token (``sampled``: the target's own next token, the accepted path); the cache rewinds to
    the committed pairs after."""
    steps_logits = []
    token = mx.array(pairs.tokens[:, c + 1 : c + 2])
    hidden = mx.array(pairs.rows[:, c : c + 1])
    for j in range(depth):
        mask = mx.array(step_mask(pairs.pads, c + j + 1))[:, None]
        y = head(token, hidden, cache, mask)
        logits = head.logits(y, full_vocabulary)[:, 0]
        steps_logits.append(logits)
        if sampled:
            token = mx.array(pairs.tokens[:, c + j + 2 : c + j + 3])
        else:
            best = mx.argmax(logits, axis=-1)
            token = (vocab_ids[best] if vocab_ids is not None else best)[:, None]
        hidden = y
    stacked = mx.stack(steps_logits, axis=1)  # [B, depth, Vd]
    mx.eval(stacked)
    cache.rewind(c + 1)
    return np.array(stacked)


def _draft_dists(
    logits_np: np.ndarray, sampling: SamplingOptions, vocab: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The drafts' processed distributions, sparse: ids (full vocabulary) and probabilities
    ``[B, depth, k]``."""
    batch, depth = logits_np.shape[:2]
    flat = logits_np.reshape(batch * depth, -1)
    t, k, p = sampling.temperature, sampling.top_k, sampling.top_p
    q_ids, q_probs = processed_topk(flat, t, k, p)
    if vocab is not None:
        q_ids = vocab[q_ids]
    return q_ids.reshape(batch, depth, -1), q_probs.reshape(batch, depth, -1)


def _scores(
    s: Sequence,
    i: int,
    depth: int,
    logits: np.ndarray,
    draft: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]] | None,
    vocab: np.ndarray | None,
) -> np.ndarray:
    """Drafts 1..depth from frontier pair ``i`` of ``s`` scored against the target (NaN past
    the answer's labels): greedy, a hit when the draft is the target's argmax (``logits``:
    the head's ``[depth, Vd]``); sampled (``draft``: the drafts' distributions and the
    target's at every position), the expected acceptance sum_x min(p(x), q(x))."""
    scores = np.full(depth, np.nan)
    for j in range(depth):
        pos = i + j + 1  # the target's argmax here is the label of draft j+1
        if pos > len(s.tokens) - 2:
            break
        if draft is not None:
            q_ids, q_probs, (p_all, p_all_probs) = draft
            p_ids, p_probs = p_all[pos][None], p_all_probs[pos][None]
            scores[j] = _overlap(p_ids, p_probs, q_ids[j][None], q_probs[j][None])[0]
        else:
            pred = int(np.argmax(logits[j]))
            pred = int(vocab[pred]) if vocab is not None else pred
            scores[j] = float(pred == s.argmax[pos])
    return scores
