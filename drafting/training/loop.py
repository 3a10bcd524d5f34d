"""One training run, from the cached generation to a written head.

:func:`train_and_write` reads the cached sequences into examples over the draft vocabulary
(:func:`read_data`), builds the head it starts from (:func:`initial_head`: a continued head's
weights, or a fresh one) and the trainer (:func:`make_trainer`: the MLX chain trainer for
chained steps or fused features, else the one-step NumPy trainer of ``train``), runs the
schedule (:class:`TrainingLoop`) and writes the head with its training record.

The loop is resumable: a checkpoint holds the parameters, the optimizer state and the options
that shape the run, and a run resumes only from a checkpoint made with the same options (the
trainers name their parameters differently, and another schedule would train another head).
With a time budget the step count is cut, after a few timed steps, to what the budget leaves
once generation and loading have taken their share; the probe ends inside the warmup, so the
schedule the run follows is the one it announced.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import dataset
from .chain_train import ChainOptions, ChainTrainer
from .config import TrainConfig, TrainingError
from .nphead import Adam, NumpyHead
from .progress import Progress, log
from .sidecar import build_head, match_residual_scale, write_head
from .target import Target, load_head
from .train import Example, NumpyTrainer, choose_vocab, coverage, make_batches, to_example

# Steps timed at the start of a run with a time budget, to cut the step count to it.
BUDGET_PROBE_STEPS = 5


def checkpoint_path(work_dir: str, out: str) -> str:
    """Checkpoint file of the run writing ``out`` (runs into other outputs can share data)."""
    name = os.path.basename(os.path.normpath(out)) or "head"
    return os.path.join(work_dir, f"checkpoint-{name}.npz")


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
    data = read_data(args, target)
    head = initial_head(args, target, data)
    trainer = make_trainer(args, head, target, bool(data.layers))
    loop = TrainingLoop(args, data, trainer, t0)
    if not loop.run():
        return None
    head.load_weights(trainer.to_head_weights(), strict=True)
    record = final_record(args, data, loop)
    write_head(args.out, head, target, record)
    log(
        f"[train] wrote {args.out}: held-out position-1 agreement {loop.final_acc:.4f}, "
        f"{(time.time() - t0) / 60:.1f} min"
    )
    return record


@dataclass
class TrainingData:
    """A run's examples and draft vocabulary, read from the cached generation."""

    train_seqs: list[dataset.Sequence]
    vocab: list[int]
    layers: list[int]  # the fused feature layers ([]: the head reads the final hidden only)
    train_ex: list[Example]
    held_ex: list[Example]
    answer_pairs: int
    cov_held: float  # the draft vocabulary's coverage of the held-out labels
    groups: list[list[int]]  # each training batch's examples
    start_head: Any  # the written head this run continues (``init_head``), or None


def read_data(args: TrainConfig, target: Target) -> TrainingData:
    """The cached sequences as examples over the draft vocabulary (a continued head's own, else
    the most frequent training labels), split into training and held-out."""
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
    return TrainingData(
        train_seqs, vocab, layers, train_ex, held_ex, answer_pairs, cov_held, groups, start_head
    )


def initial_head(args: TrainConfig, target: Target, data: TrainingData) -> nn.Module:
    """The head training starts from: the continued head's weights, or a fresh head (its fc
    seeded, scaled to the last layer's input RMS with ``fc_init`` "residual")."""
    mx.random.seed(args.seed)  # fc's random init
    head = build_head(target, data.vocab, data.layers)
    start_head, layers = data.start_head, data.layers
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
        sample = max(data.train_seqs, key=lambda s: len(s.tokens)).tokens[:256].tolist()
        factor = match_residual_scale(head, target, sample)
        log(f"[train] fc init scaled x{factor:.1f} to the last layer's input RMS")
    return head


def make_trainer(
    args: TrainConfig, head: nn.Module, target: Target, fused: bool
) -> ChainTrainer | NumpyTrainer:
    """The MLX chain trainer for chained steps or fused features, else the one-step NumPy
    trainer (the only one with dropout)."""
    if args.chain_steps > 1 or fused:
        if args.dropout:
            raise TrainingError("dropout is for the one-step trainer (no --chain-steps or --fuse)")
        opts = ChainOptions(args.chain_steps, args.chain_decay, args.loss, args.hidden_loss)
        return ChainTrainer(head, opts, target.training_threads)
    return NumpyTrainer(NumpyHead(head, target), args)


class TrainingLoop:
    """One run's steps: the schedule (epochs of shuffled batches), resumption from the run's
    checkpoint, the cut of the step count to a time budget, held-out measurements and
    checkpoints. The options a checkpoint records must match the run's to resume it."""

    def __init__(
        self, args: TrainConfig, data: TrainingData, trainer: ChainTrainer | NumpyTrainer, t0: float
    ) -> None:
        self.args, self.data, self.trainer = args, data, trainer
        self.held_batches = [
            trainer.collate([data.held_ex[i] for i in g], with_unlabeled=True)
            for g in make_batches(data.held_ex, args.batch)
        ]
        self.steps_per_epoch = len(data.groups)
        self.total = args.steps or max(1, math.ceil(args.epochs * self.steps_per_epoch))
        self.opt = Adam(
            trainer.params,
            args.lr,
            args.warmup,
            self.total,
            weight_decay=args.weight_decay,
            relative=args.lr_mode == "relative",
        )
        self.meta = {
            "vocab": data.vocab,
            "total": self.total,
            "loss": args.loss,
            "seed": args.seed,
            "lr_mode": args.lr_mode,
            "hidden_loss": args.hidden_loss,
            "dropout": args.dropout,
            "init_head": args.init_head,
            "chain_steps": args.chain_steps,
            "chain_decay": args.chain_decay,
            "feature_layers": data.layers,
        }
        self.step, self.elapsed_before = 0, 0.0
        self.ckpt = checkpoint_path(args.work_dir, args.out)
        self.budgeted = args.minutes > 0  # the step count may be cut to the time budget
        if args.resume and os.path.exists(self.ckpt):
            self.resume()
        # Seconds the budget leaves for training: what generation and loading did not take.
        self.left = None
        if self.budgeted:
            generated = dataset.generation_seconds(args.work_dir)
            self.left = args.minutes * 60 - generated - (time.time() - t0)
            self.left -= self.elapsed_before
        self.history: list[float] = []
        self.running, self.pairs_seen = None, 0
        self.start, self.first_step = 0.0, 0  # set when the run starts
        self.final_acc = float("nan")
        self.train_seconds = 0.0

    def set_total(self, total: int) -> None:
        self.total = self.opt.total = self.meta["total"] = total

    def resume(self) -> None:
        """Continue from the checkpoint, which must have been made with the same options."""
        saved = checkpoint_meta(self.ckpt)
        differ = [
            k
            for k in self.meta
            if not (self.budgeted and k == "total")
            and saved.get(k, RECORDED_LATER.get(k)) != self.meta[k]
        ]
        if differ:  # checked before loading: the trainers name their parameters differently
            raise TrainingError(
                f"the checkpoint {self.ckpt} was made with other training options "
                f"({', '.join(differ)}); drop --resume"
            )
        load_checkpoint(self.ckpt, self.trainer, self.opt)
        self.step, self.elapsed_before = saved["step"], saved.get("train_seconds", 0.0)
        if self.budgeted and saved.get("total"):
            self.set_total(int(saved["total"]))
        log(f"[train] resumed at step {self.step}/{self.total}")

    def measure(self) -> list[float]:
        """Held-out agreement per chain step (one pass: step 1's is the first)."""
        if not self.held_batches:
            return [float("nan")]
        return self.trainer.agreement(self.held_batches, self.args.chain_steps)

    @staticmethod
    def described(values: list[float]) -> str:
        chain = "  chain " + " ".join(f"{a:.4f}" for a in values) if len(values) > 1 else ""
        return f"held-out agreement {values[0]:.4f}{chain}"

    def run(self) -> bool:
        """Train to the end of the schedule; False when stopped early (``stop_after``)."""
        self.start, self.first_step = time.time(), self.step
        eval_start = time.time()
        log(f"[train] step {self.step}/{self.total}  {self.described(self.measure())}")
        eval_s = time.time() - eval_start  # what each held-out pass adds to the budget's steps
        probe_start = time.time()
        bar = Progress("train", self.total - self.step, "steps")
        while self.step < self.total:
            self.train_one(bar)
            if self.left is not None and self.step - self.first_step == BUDGET_PROBE_STEPS:
                self.fit_budget(bar, (time.time() - probe_start) / BUDGET_PROBE_STEPS, eval_s)
            stop = self.report_and_save()
            if stop and self.step < self.total:
                bar.close()
                log(f"[train] stopped at step {self.step}; continue with resume")
                return False
        bar.close()
        self.train_seconds = time.time() - self.start + self.elapsed_before
        self.final_acc = self.measure()[0]
        return True

    def train_one(self, bar: Progress) -> None:
        """The next step of the schedule (an epoch visits every batch once, shuffled)."""
        args, step, per_epoch = self.args, self.step, self.steps_per_epoch
        order = epoch_order(per_epoch, step // per_epoch, args.seed)
        members = self.data.groups[order[step % per_epoch]]
        # Rows whose label lies outside the draft vocabulary carry no loss, soft or hard.
        batch = self.trainer.collate([self.data.train_ex[i] for i in members], with_unlabeled=False)
        rng = np.random.default_rng([args.seed, step])  # dropout masks, resumable
        value = self.trainer.step(self.opt, batch, rng)
        self.step += 1
        self.pairs_seen += batch.pairs
        self.running = value if self.running is None else 0.9 * self.running + 0.1 * value
        self.history.append(value)
        bar.update(1, f"loss {self.running:.4f}")

    def fit_budget(self, bar: Progress, per_step: float, eval_s: float) -> None:
        """Cut the step count to what the time budget fits at the probed rate (still inside
        the warmup, so the schedule is unchanged so far)."""
        per_step += eval_s / self.args.eval_every
        fits = self.step + int(max(self.left - (time.time() - self.start), 0.0) / per_step)
        if fits < self.total:
            log(
                f"[train] the time budget fits {fits} of {self.total} steps ({per_step:.2f} s each)"
            )
            self.set_total(max(fits, self.step))
            bar.total = float(self.total - self.first_step)  # the bar's ETA follows the cut

    def report_and_save(self) -> bool:
        """Log the held-out agreement and write the checkpoint when due; whether the run
        stops here (``stop_after``)."""
        args, step, total = self.args, self.step, self.total
        if step % args.eval_every == 0 or step == total:
            minutes = (time.time() - self.start + self.elapsed_before) / 60
            log(
                f"[train] step {step}/{total}  epoch {step / self.steps_per_epoch:.2f}  pairs "
                f"{self.pairs_seen}  loss {self.running:.4f}  {self.described(self.measure())}  "
                f"{minutes:.1f} min"
            )
        stop = bool(args.stop_after) and step >= args.stop_after
        if step % args.checkpoint_every == 0 or step == total or stop:
            spent = time.time() - self.start + self.elapsed_before
            meta = {**self.meta, "train_seconds": spent}
            save_checkpoint(self.ckpt, self.trainer, self.opt, step, meta)
        return stop


def final_record(args: TrainConfig, data: TrainingData, loop: TrainingLoop) -> dict:
    """The training record the written head carries (``training_record`` and the run's
    results; a continued head's time includes the stage it started from)."""
    record = training_record(
        args,
        args.work_dir,
        data.train_ex,
        data.answer_pairs,
        data.vocab,
        data.cov_held,
        data.layers,
    )
    history, total = loop.history, loop.total
    record.update(
        {
            "train_minutes": round(loop.train_seconds / 60, 2),
            "steps": total,
            "epochs": round(total / loop.steps_per_epoch, 2),
            "first_loss": round(float(np.mean(history[:10])), 4) if history else None,
            "final_loss": round(float(np.mean(history[-10:])), 4) if history else None,
            "heldout_acceptance": round(loop.final_acc, 4),
        }
    )
    if data.start_head is not None:  # the written head's time includes the stage it started from
        earlier = data.start_head.config.extra.get("training", {})
        record["train_minutes"] = round(
            record["train_minutes"] + earlier.get("train_minutes", 0), 2
        )
        record["continued_from"] = earlier
    record["minutes"] = round(record["generation_minutes"] + record["train_minutes"], 2)
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
