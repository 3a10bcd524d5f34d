"""Training data, loss and loop for one MTP head.

Pair i of a sequence is (token t_{i+1}, target hidden h_i); its label is the target's argmax
after t_{i+1}, i.e. the target's own choice for token i+2. Every pair of the sequence runs
through the head (prompt pairs too: they are context in the draft KV at inference), but only
pairs from the last prompt position on carry a loss: those are the ones the runner drafts from.
The steps run in NumPy (``nphead``); the MLX functions here are the reference the tests
check it against and the way a loaded head is measured.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import dataset
from .chain_train import ChainOptions, ChainTrainer
from .config import TrainConfig, TrainingError
from .nphead import Adam, NumpyHead, hidden_regression, loss_and_grad
from .progress import Progress, log
from .sidecar import build_head, match_residual_scale, write_head
from .target import Target, load_head

# Steps timed at the start of a run with a time budget, to cut the step count to it.
BUDGET_PROBE_STEPS = 5


def checkpoint_path(work_dir: str, out: str) -> str:
    """Checkpoint file of the run writing ``out`` (runs into other outputs can share data)."""
    name = os.path.basename(os.path.normpath(out)) or "head"
    return os.path.join(work_dir, f"checkpoint-{name}.npz")


class WholeSequenceCache:
    """Stand-in KV cache for training: the head sees a whole sequence in one call, so there
    is nothing to keep; positions start at 0 and attention is causal over the call."""

    offset = 0

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
    target = mx.array(batch.next_hiddens).astype(mx.float32) @ head._sub_t
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


def save_checkpoint(path: str, head: NumpyHead, opt: Adam, step: int, meta: dict) -> None:
    """Parameters, optimizer state and the run's options (as JSON) in one file, atomically."""
    arrays = {f"p.{k}": v for k, v in head.params.items()}
    arrays.update({f"o.{k}": v for k, v in opt.state().items()})
    arrays["meta"] = np.array(json.dumps({**meta, "step": step}))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


# Options checkpoints record since a later version, with the value older ones trained with.
RECORDED_LATER = {"chain_steps": 1, "chain_decay": 0.8, "feature_layers": []}


def checkpoint_meta(path: str) -> dict:
    with np.load(path) as z:
        return json.loads(str(z["meta"]))


def load_checkpoint(path: str, head: NumpyHead, opt: Adam) -> dict:
    with np.load(path) as z:
        head.params = {k[2:]: z[k] for k in z.files if k.startswith("p.")}
        opt.load_state({k[2:]: z[k] for k in z.files if k.startswith("o.")})
        return json.loads(str(z["meta"]))


def epoch_order(n_batches: int, epoch: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_batches)


def train_and_write(args: TrainConfig, target: Target) -> dict | None:
    """Train a head on the cached data in ``args.work_dir`` and write the sidecar to
    ``args.out``; None when stopped early (``stop_after``: continue with ``resume``)."""
    t0 = time.time()
    work_dir, model = args.work_dir, target.model
    seqs = dataset.load_sequences(work_dir, partial=args.partial)
    train_seqs = [s for s in seqs if not s.heldout]
    held_seqs = [s for s in seqs if s.heldout]
    vocab_size = model.args.vocab_size
    start_head = None
    if args.init_head:  # continue training a written head, on its own draft vocabulary
        start_head, _ = load_head(target, args.init_head)
        vocab = list(start_head.config.draft_vocab)
    else:
        eos = sorted(target.tokenizer.eos_ids)
        vocab = choose_vocab(train_seqs, args.draft_vocab, vocab_size, eos)
    index = np.full(vocab_size, -1, dtype=np.int64)
    index[vocab] = np.arange(len(vocab))
    layers = dataset.read_plan(work_dir)[1].feature_layers if args.fuse else []
    if args.fuse and not layers:
        raise TrainingError(f"{work_dir} holds no feature layers to fuse (--feature-layers)")
    fused = bool(layers)
    train_ex = [e for e in (to_example(s, index, fused) for s in train_seqs) if e is not None]
    held_ex = [e for e in (to_example(s, index, fused) for s in held_seqs) if e is not None]
    answer_pairs = sum(len(e.tokens) - e.first_loss for e in train_ex)
    cov_train = coverage(train_seqs, vocab, vocab_size)
    cov_held = coverage(held_seqs, vocab, vocab_size) if held_seqs else float("nan")
    log(
        f"[train] {len(train_ex)} sequences, {answer_pairs} training pairs; draft vocab "
        f"{len(vocab)} covers {cov_train:.3f} of training labels, {cov_held:.3f} held-out"
    )
    groups = make_batches(train_ex, args.batch)
    steps_per_epoch = len(groups)
    total = args.steps or max(1, math.ceil(args.epochs * steps_per_epoch))

    mx.random.seed(args.seed)  # fc's random init
    head = build_head(target, vocab, layers)
    if start_head is not None:
        started = list(start_head.config.feature_layers)
        if started and started != list(layers):
            raise TrainingError(
                f"the head in {args.init_head} fuses the streams after layers {started}: "
                f"continue it with --fuse on data recorded with --feature-layers "
                f"{','.join(map(str, started))}"
            )
        # A fused head grown from a final-hidden one keeps its fusion's pass-through init.
        head.load_weights(list(tree_flatten(start_head.parameters())), strict=started == layers)
        log(f"[train] starting from the head in {args.init_head}")
    elif args.fc_init == "residual":
        sample = max(train_seqs, key=lambda s: len(s.tokens)).tokens[:256].tolist()
        factor = match_residual_scale(head, target, sample)
        log(f"[train] fc init scaled x{factor:.1f} to the last layer's input RMS")
    if args.chain_steps > 1 or fused:
        if args.dropout:
            raise TrainingError("dropout is for the one-step trainer (no --chain-steps or --fuse)")
        opts = ChainOptions(args.chain_steps, args.chain_decay, args.loss, args.hidden_loss)
        trainer = ChainTrainer(head, opts, target.training_threads)
    else:
        trainer = NumpyTrainer(NumpyHead(head, target), args)
    held_batches = [
        trainer.collate([held_ex[i] for i in g], with_unlabeled=True)
        for g in make_batches(held_ex, args.batch)
    ]
    opt = Adam(
        trainer.params,
        args.lr,
        args.warmup,
        total,
        weight_decay=args.weight_decay,
        relative=args.lr_mode == "relative",
    )
    meta = {
        "vocab": vocab,
        "total": total,
        "loss": args.loss,
        "seed": args.seed,
        "lr_mode": args.lr_mode,
        "hidden_loss": args.hidden_loss,
        "dropout": args.dropout,
        "init_head": args.init_head,
        "chain_steps": args.chain_steps,
        "chain_decay": args.chain_decay,
        "feature_layers": layers,
    }
    step, elapsed_before = 0, 0.0
    ckpt = checkpoint_path(work_dir, args.out)
    budgeted = args.minutes > 0  # the step count may be cut to the time budget
    if args.resume and os.path.exists(ckpt):
        saved = checkpoint_meta(ckpt)
        differ = [
            k
            for k in meta
            if not (budgeted and k == "total") and saved.get(k, RECORDED_LATER.get(k)) != meta[k]
        ]
        if differ:  # checked before loading: the trainers name their parameters differently
            raise TrainingError(
                f"the checkpoint {ckpt} was made with other training options "
                f"({', '.join(differ)}); drop --resume"
            )
        load_checkpoint(ckpt, trainer, opt)
        step, elapsed_before = saved["step"], saved.get("train_seconds", 0.0)
        if budgeted and saved.get("total"):
            total = opt.total = meta["total"] = int(saved["total"])
        log(f"[train] resumed at step {step}/{total}")
    # Seconds the budget leaves for training: what generation and loading did not take.
    left = None
    if budgeted:
        left = args.minutes * 60 - dataset.generation_seconds(work_dir) - (time.time() - t0)
        left -= elapsed_before
    history = []
    start = time.time()
    first_step = step
    running, pairs_seen = None, 0

    def measure() -> list[float]:
        """Held-out agreement per chain step (one pass: step 1's is the first)."""
        if not held_batches:
            return [float("nan")]
        return trainer.agreement(held_batches, args.chain_steps)

    def described(values: list[float]) -> str:
        chain = "  chain " + " ".join(f"{a:.4f}" for a in values) if len(values) > 1 else ""
        return f"held-out agreement {values[0]:.4f}{chain}"

    eval_start = time.time()
    log(f"[train] step {step}/{total}  {described(measure())}")
    eval_s = time.time() - eval_start  # what each held-out pass adds to the budget's steps
    probe_start = time.time()
    bar = Progress("train", total - step, "steps")
    while step < total:
        order = epoch_order(steps_per_epoch, step // steps_per_epoch, args.seed)
        members = groups[order[step % steps_per_epoch]]
        # Rows whose label lies outside the draft vocabulary carry no loss, soft or hard.
        batch = trainer.collate([train_ex[i] for i in members], with_unlabeled=False)
        rng = np.random.default_rng([args.seed, step])  # dropout masks, resumable
        value = trainer.step(opt, batch, rng)
        step += 1
        pairs_seen += batch.pairs
        running = value if running is None else 0.9 * running + 0.1 * value
        history.append(value)
        bar.update(1, f"loss {running:.4f}")
        if left is not None and step - first_step == BUDGET_PROBE_STEPS:
            # Still inside the warmup, so the schedule is unchanged so far.
            per_step = (time.time() - probe_start) / BUDGET_PROBE_STEPS
            per_step += eval_s / args.eval_every
            fits = step + int(max(left - (time.time() - start), 0.0) / per_step)
            if fits < total:
                log(f"[train] the time budget fits {fits} of {total} steps ({per_step:.2f} s each)")
                total = opt.total = meta["total"] = max(fits, step)
                bar.total = float(total - first_step)  # the bar's ETA follows the cut
        if step % args.eval_every == 0 or step == total:
            minutes = (time.time() - start + elapsed_before) / 60
            log(
                f"[train] step {step}/{total}  epoch {step / steps_per_epoch:.2f}  pairs "
                f"{pairs_seen}  loss {running:.4f}  {described(measure())}  {minutes:.1f} min"
            )
        stop = bool(args.stop_after) and step >= args.stop_after
        if step % args.checkpoint_every == 0 or step == total or stop:
            spent = time.time() - start + elapsed_before
            save_checkpoint(ckpt, trainer, opt, step, {**meta, "train_seconds": spent})
        if stop and step < total:
            bar.close()
            log(f"[train] stopped at step {step}; continue with resume")
            return None
    bar.close()
    train_seconds = time.time() - start + elapsed_before
    final_acc = measure()[0]
    head.load_weights(trainer.to_head_weights(), strict=True)
    record = training_record(args, work_dir, train_ex, answer_pairs, vocab, cov_held, layers)
    record.update(
        {
            "train_minutes": round(train_seconds / 60, 2),
            "steps": total,
            "epochs": round(total / steps_per_epoch, 2),
            "first_loss": round(float(np.mean(history[:10])), 4) if history else None,
            "final_loss": round(float(np.mean(history[-10:])), 4) if history else None,
            "heldout_acceptance": round(final_acc, 4),
        }
    )
    if start_head is not None:  # the written head's time includes the stage it started from
        earlier = start_head.config.extra.get("training", {})
        record["train_minutes"] = round(
            record["train_minutes"] + earlier.get("train_minutes", 0), 2
        )
        record["continued_from"] = earlier
    record["minutes"] = round(record["generation_minutes"] + record["train_minutes"], 2)
    write_head(args.out, head, target, record)
    log(
        f"[train] wrote {args.out}: held-out position-1 agreement {final_acc:.4f}, "
        f"{(time.time() - t0) / 60:.1f} min"
    )
    return record


def training_record(args, work_dir, train_ex, answer_pairs, vocab, cov_held, layers) -> dict:
    with open(os.path.join(work_dir, "prompts.json"), encoding="utf-8") as f:
        prompts_used = json.load(f)
    gen_seconds = dataset.generation_seconds(work_dir)
    return {
        "minutes_budget": args.minutes or None,
        "pairs": int(answer_pairs),
        "sequences": len(train_ex),
        "prompts": prompts_used["train"]["prompts"],
        "templates": prompts_used["train"]["templates"],
        "heldout_prompts": prompts_used["heldout"]["prompts"],
        "heldout_templates": prompts_used["heldout"]["template_ids"],
        "chat_template": prompts_used["template"],
        "loss": args.loss,
        "draft_vocab": len(vocab),
        "draft_vocab_heldout_coverage": round(cov_held, 4),
        "lr": args.lr,
        "lr_mode": args.lr_mode,
        "hidden_loss": args.hidden_loss,
        "dropout": args.dropout,
        "fc_init": args.fc_init,
        "chain_steps": args.chain_steps,
        "chain_decay": args.chain_decay,
        "feature_layers": layers,
        "batch_pairs": args.batch,
        "generation_minutes": round(gen_seconds / 60, 2),
    }
