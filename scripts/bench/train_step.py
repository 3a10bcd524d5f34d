"""One head-training step on the default model, per trainer and recipe, interleaved.

The sides: the one-step NumPy trainer (``nphead``, hand-written gradients), the MLX trainer
(``chain_train``, autograd) at one chained step, at three (training-time test), and at three
with fused features; all on the same batches of generated data, in one process, rep after rep,
so that the machine's load hits every side alike. Prints a table (median seconds per step and
per thousand pairs, the ratio to NumPy) and writes ``bench-results/train-step.json``.

    python scripts/bench/train_step.py --work-dir DIR [--batches 4] [--reps 3]

``DIR`` is a ``train-head`` work dir of the default model generated with feature layers (the
default), e.g. after ``mtp-runner train-head MODEL --out x --stage generate --max-prompts 60``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, default_model_path, environment, markdown_table, write_json

sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="pairs per step")
    args = parser.parse_args(argv)

    import numpy as np

    from drafting.training import chain_train, dataset, train
    from drafting.training.config import TrainConfig
    from drafting.training.nphead import Adam, NumpyHead
    from drafting.training.sidecar import build_head
    from runner.training_target import load_target

    target = load_target(default_model_path())
    seqs = [s for s in dataset.load_sequences(args.work_dir, partial=True) if not s.heldout]
    layers = dataset.read_plan(args.work_dir)[1].feature_layers
    if not layers:
        raise SystemExit(f"{args.work_dir} was generated without feature layers")
    vocab = train.choose_vocab(seqs, 4096, target.model.args.vocab_size, [])
    index = np.full(target.model.args.vocab_size, -1, dtype=np.int64)
    index[vocab] = np.arange(len(vocab))
    plain = [e for e in (train.to_example(s, index) for s in seqs) if e is not None]
    fused = [e for e in (train.to_example(s, index, True) for s in seqs) if e is not None]
    groups = train.make_batches(plain, args.batch)
    picked = [groups[i] for i in np.linspace(0, len(groups) - 1, args.batches).astype(int)]

    cfg = TrainConfig(target="", out="", work_dir=args.work_dir, minutes=0)
    sides = {}
    head = build_head(target, vocab)
    numpy_trainer = train.NumpyTrainer(NumpyHead(head, target), cfg)
    sides["numpy, 1 step"] = (numpy_trainer, plain)
    for steps in (1, 3):
        opts = chain_train.ChainOptions(steps=steps, hidden_loss=1.0)
        trainer = chain_train.ChainTrainer(build_head(target, vocab), opts, target.training_threads)
        sides[f"mlx, {steps} chained step{'s' if steps > 1 else ''}"] = (trainer, plain)
    opts = chain_train.ChainOptions(steps=3, hidden_loss=1.0)
    fused_head = build_head(target, vocab, layers)
    sides["mlx, 3 steps, fused features"] = (
        chain_train.ChainTrainer(fused_head, opts, target.training_threads),
        fused,
    )
    times: dict[str, list[float]] = {name: [] for name in sides}
    pairs = sum(sum(len(plain[i].tokens) for i in g) for g in picked)
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, (trainer, examples) in sides.items():
            opt = Adam(trainer.params, 1e-4, 1, 10)
            batches = [trainer.collate([examples[i] for i in g]) for g in picked]
            start = time.perf_counter()
            for b in batches:
                trainer.step(opt, b)
            if rep:
                times[name].append((time.perf_counter() - start) / len(batches))
        print(f"rep {rep} done", file=sys.stderr)
    base = statistics.median(times["numpy, 1 step"])
    rows, results = [], {}
    for name, ts in times.items():
        med = statistics.median(ts)
        per_k = med / (pairs / len(picked)) * 1000
        rows.append([name, f"{med:.2f}", f"{per_k:.3f}", f"{med / base:.2f}x"])
        results[name] = {"seconds_per_step": ts, "median": med, "ratio_to_numpy": med / base}
    print(f"{len(picked)} batches of ~{pairs // len(picked)} pairs, {args.reps} reps")
    print(markdown_table(["trainer", "s / step", "s / 1k pairs", "vs numpy"], rows))
    path = write_json(
        "train-step.json",
        {"environment": environment(), "pairs_per_step": pairs / len(picked), "sides": results},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
