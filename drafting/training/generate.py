"""Batched generation with the target that records what head training needs on the fly.

Every fed position t yields the target's post-final-norm hidden h_t and its argmax a_t (the
target's own prediction of token t+1), so no separate teacher-forced pass is needed. Prompts
are left-padded into one batch; RoPE is relative, so the padding shift does not change what a
row attends to, and an additive mask hides the pad columns. The forward pass is the
target's own, from the caller (``target.Target``: the runner's model code); the sampling runs
in NumPy. Generation uses every core in one process (the forward's products are threaded).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dataset import Sequence, add_generation_seconds, batch_path, read_plan, save_batch
from .npops import NEG
from .progress import Progress
from .target import Target


def prefill_mask(pads: np.ndarray, length: int) -> np.ndarray:
    """Additive mask ``[B, L, L]``: causal, pad keys hidden (a pad query sees itself)."""
    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    ok = (k <= q)[None] & ((k >= pads[:, None, None]) | (k == q)[None])
    return np.where(ok, 0.0, NEG).astype(np.float32)


def step_mask(pads: np.ndarray, keys: int) -> np.ndarray:
    """Additive mask ``[B, 1, keys]`` for one new query row per sequence."""
    ok = np.arange(keys)[None, :] >= pads[:, None]
    return np.where(ok, 0.0, NEG).astype(np.float32)[:, None]


def processed_topk(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's processed distribution, sparse: top-k -> temperature -> top-p ->
    renormalise. Returns candidate ids ``[N, k]`` and their probabilities (0 where top-p cut)."""
    k = min(top_k or logits.shape[-1], logits.shape[-1])
    cand = np.argpartition(-logits, k - 1, axis=-1)[:, :k] if k < logits.shape[-1] else None
    if cand is None:
        cand = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
    vals = np.take_along_axis(logits, cand, axis=-1).astype(np.float64) / temperature
    order = np.argsort(-vals, axis=-1)
    cand = np.take_along_axis(cand, order, axis=-1)
    vals = np.take_along_axis(vals, order, axis=-1)
    probs = np.exp(vals - vals[:, :1])
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        before = np.cumsum(probs, axis=-1) - probs  # mass strictly before each candidate
        probs = np.where(before < top_p, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return cand, probs


def draw(
    logits: np.ndarray,
    temps: np.ndarray,
    top_k: int,
    rng: np.random.Generator,
    top_p: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy where ``temps`` is 0, else a draw from the processed distribution.

    Returns (tokens, argmax), both int64 ``[B]``."""
    amax = logits.argmax(axis=-1)
    out = amax.copy()
    rows = np.nonzero(temps > 0)[0]
    for t in np.unique(temps[rows]):
        sel = rows[temps[rows] == t]
        cand, probs = processed_topk(logits[sel], float(t), top_k, top_p)
        u = rng.random(len(sel))[:, None]
        pick = np.minimum((probs.cumsum(axis=-1) < u).sum(axis=-1), probs.shape[1] - 1)
        out[sel] = cand[np.arange(len(sel)), pick]
    return out, amax


def generate_batch(
    target: Target,
    prompts: list[list[int]],
    temperatures: list[float],
    *,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    seed: int = 0,
    top_k: int = 40,
    top_p: float = 1.0,
    pad_id: int = 0,
    feature_layers: tuple[int, ...] = (),
) -> list[Sequence]:
    """Generate one answer per prompt (row temperature 0 = greedy), capturing hiddens (and
    the residual streams after ``feature_layers`` layers, for heads that fuse them)."""
    rng = np.random.default_rng(seed)
    padded = PaddedPrompts.of(prompts, prompt_ids, pad_id)
    width, pads = padded.width, padded.pads
    temps = np.asarray(temperatures, dtype=np.float32)
    sample = functools.partial(draw, top_k=top_k, rng=rng, top_p=top_p)
    cache = target.new_cache(len(prompts), width + max_new_tokens)
    layers = tuple(feature_layers)
    hidden, feats = target.hidden_features(padded.grid, cache, 0, prefill_mask(pads, width), layers)
    nxt, first_argmax = sample(target.logits(hidden[:, -1]), temps)
    prompt_h = hidden.astype(np.float16)
    prompt_f = feats.astype(np.float16) if layers else None
    answers = Answers.starting(nxt, eos_ids)
    steps = max_new_tokens - 1
    decode(target, cache, answers, padded, temps, sample, steps, eos_ids, layers)
    return sequences(padded, temps, prompt_h, prompt_f, first_argmax, answers)


@dataclass
class PaddedPrompts:
    """A batch of prompts left-padded to the longest one."""

    tokens: list[list[int]]
    ids: list[int]  # each prompt's index in the plan
    lengths: np.ndarray
    pads: np.ndarray  # pad columns ahead of each prompt
    grid: np.ndarray  # int64 [B, width]

    @classmethod
    def of(cls, prompts: list[list[int]], ids: list[int], pad_id: int) -> PaddedPrompts:
        lengths = np.array([len(p) for p in prompts])
        width = int(lengths.max())
        pads = width - lengths
        grid = np.full((len(prompts), width), pad_id, dtype=np.int64)
        for b, p in enumerate(prompts):
            grid[b, pads[b] :] = p
        return cls(prompts, ids, lengths, pads, grid)

    @property
    def width(self) -> int:
        return self.grid.shape[1]


@dataclass
class Answers:
    """What decoding records per prompt: the answer's tokens, and for every answer token fed
    back its hidden, its streams (fused-feature heads) and its argmax."""

    tokens: list[list[int]]
    hiddens: list[list[np.ndarray]]
    features: list[list[np.ndarray]]
    argmax: list[list[int]]
    done: np.ndarray  # bool [B]: the answer ended with an EOS token

    @classmethod
    def starting(cls, first: np.ndarray, eos_ids: set[int]) -> Answers:
        """Answers holding their first token, drawn after the prompt."""
        batch = len(first)
        tokens = [[int(t)] for t in first]
        done = np.array([tokens[b][0] in eos_ids for b in range(batch)])
        empty = [[] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)]
        return cls(tokens, *empty, done)

    def record(
        self,
        rows: np.ndarray,
        h16: np.ndarray,
        f16: np.ndarray | None,
        amax: np.ndarray,
        nxt: np.ndarray,
        eos_ids: set[int],
    ) -> None:
        """One decode step of the live batch rows (``rows[i]``: row i's prompt)."""
        for i, r in enumerate(rows):
            if self.done[r]:
                continue
            self.hiddens[r].append(h16[i])
            if f16 is not None:
                self.features[r].append(f16[i])
            self.argmax[r].append(int(amax[i]))
            self.tokens[r].append(int(nxt[i]))
            self.done[r] = int(nxt[i]) in eos_ids


def decode(
    target: Target,
    cache: list,
    answers: Answers,
    padded: PaddedPrompts,
    temps: np.ndarray,
    sample: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    steps: int,
    eos_ids: set[int],
    layers: tuple[int, ...],
) -> None:
    """Up to ``steps`` one-token steps after the prompts (``cache`` holds them), until every
    answer has ended; finished rows leave the batch once a quarter of it has finished."""
    rows = np.arange(len(padded.tokens))  # rows[i] = original index of live batch row i
    offset = padded.width
    for _ in range(steps):
        live = ~answers.done[rows]
        if not live.any():
            break
        if live.sum() <= 0.75 * len(rows):  # drop finished rows from the batch
            keep = np.nonzero(live)[0]
            rows = rows[keep]
            target.keep_rows(cache, keep)
        feed = np.array([[answers.tokens[r][-1]] for r in rows], dtype=np.int64)
        mask = step_mask(padded.pads[rows], offset + 1)
        h, f = target.hidden_features(feed, cache, offset, mask, layers)
        h = h[:, 0]
        f16 = f[:, 0].astype(np.float16) if layers else None
        offset += 1
        nxt, amax = sample(target.logits(h), temps[rows])
        answers.record(rows, h.astype(np.float16), f16, amax, nxt, eos_ids)


def sequences(
    padded: PaddedPrompts,
    temps: np.ndarray,
    prompt_h: np.ndarray,
    prompt_f: np.ndarray | None,
    first_argmax: np.ndarray,
    answers: Answers,
) -> list[Sequence]:
    """Each prompt with its answer as a ``Sequence``: the hiddens (and streams) of every fed
    position, pads dropped, and the argmax after the prompt's last token and every answer
    token fed back (-1 inside the prompt)."""
    seqs = []
    for b in range(len(padded.tokens)):
        pad, length = padded.pads[b], int(padded.lengths[b])
        hs = [prompt_h[b, pad:]] + ([np.stack(answers.hiddens[b])] if answers.hiddens[b] else [])
        fs = None
        if prompt_f is not None:
            fs = [prompt_f[b, pad:]]
            fs += [np.stack(answers.features[b])] if answers.features[b] else []
        amax_prompt = np.full(length, -1, dtype=np.int32)
        amax_prompt[-1] = first_argmax[b]
        seqs.append(
            Sequence(
                prompt_index=padded.ids[b],
                temperature=float(temps[b]),
                prompt_len=length,
                tokens=np.array(list(padded.tokens[b]) + answers.tokens[b], dtype=np.int32),
                hiddens=np.concatenate(hs, axis=0),
                argmax=np.concatenate([amax_prompt, np.array(answers.argmax[b], dtype=np.int32)]),
                features=np.concatenate(fs, axis=0) if fs else None,
            )
        )
    return seqs


def run_generation(work_dir: str, target: Target) -> float:
    """Generate the plan's missing batches with ``target``; return the seconds it took."""
    batches, settings = read_plan(work_dir)
    todo = [i for i in range(len(batches)) if not os.path.exists(batch_path(work_dir, i))]
    start = time.time()
    if not todo:
        return 0.0
    eos = set(target.tokenizer.eos_ids)
    bar = Progress("generate", sum(len(batches[i]) for i in todo), "answers")
    made = 0
    for i in todo:
        batch_start = time.time()
        jobs = batches[i]
        seqs = generate_batch(
            target,
            [j.tokens for j in jobs],
            [j.temperature for j in jobs],
            prompt_ids=[j.prompt_index for j in jobs],
            max_new_tokens=settings.max_new_tokens,
            eos_ids=eos,
            seed=settings.seed * 100003 + i,
            top_k=settings.top_k,
            top_p=settings.top_p,
            feature_layers=tuple(settings.feature_layers),
        )
        save_batch(batch_path(work_dir, i), seqs)
        # Recorded batch by batch: an interrupted run keeps the time its batches took.
        add_generation_seconds(work_dir, time.time() - batch_start)
        made += sum(s.answer_len for s in seqs)
        rate = made / max(time.time() - start, 1e-9)
        bar.update(len(jobs), f"{made} answer tokens, {rate:.1f} tok/s")
    bar.close()
    return time.time() - start
