#!/usr/bin/env python
"""Train an MTP draft head for a Llama-family model (dense, or with Qwen-style softmax-routed
MoE MLPs: qwen3_moe) by self-distillation.

    python scripts/train_mtp_head.py TARGET --out DIR [--work-dir W] [--resume]

1. generate: the target answers the prompt set (scripts/prompts/) greedily and at T=0.7 in
   left-padded batches, recording its post-norm hidden and argmax at every position; batches
   are cached under the work dir (not the repo) so training can rerun without regenerating.
2. train: a head (fc + the target's last decoder layer, copied, + the target's final norm;
   the target stays frozen) learns to predict the target's own argmax for token t+2 from the
   hidden at t and token t+1, over a reduced vocabulary of the most frequent labels, as a
   causal sequence model over whole answers (its attention sees earlier pairs, exactly like
   the draft KV cache at inference). For a MoE target the copied layer's MLP is dense,
   started from the last layer's first routed expert (one row per draft, no routing).
3. write: DIR/config.json + DIR/mtp.safetensors in the Qwen3-Next naming (float16).

Prompts from the held-out templates are never trained on; they measure agreement.
Generation and training run in NumPy on CPU; OPENBLAS_NUM_THREADS sets the BLAS threads of
training (generation workers use one each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_training import dataset, prompts  # noqa: E402
from mtp_training import generate as generation  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("target", help="model path (Hugging Face directory or GGUF file)")
    p.add_argument("--out", required=True, help="sidecar directory to write")
    p.add_argument("--work-dir", help="cache for generated data and checkpoints "
                   "(default ~/.cache/mtp-runner/train/<target name>)")  # fmt: skip
    p.add_argument("--stage", choices=["all", "generate", "train"], default="all")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    g = p.add_argument_group("data")
    g.add_argument("--prompts-dir", default=prompts.PROMPT_DIR)
    g.add_argument("--template", default="chatml-smollm",
                   help=f"chat template: {', '.join(prompts.CHAT_TEMPLATES)} or a format "
                   "string containing {prompt}")  # fmt: skip
    g.add_argument("--max-per-template", type=int, default=30)
    g.add_argument("--max-prompts", type=int, default=1600,
                   help="cap on training prompts, taken round-robin across templates (0: all); "
                   "the default keeps a 2-core run under 90 minutes")  # fmt: skip
    g.add_argument("--max-heldout", type=int, default=48, help="held-out prompts for monitoring")
    g.add_argument("--temperatures", default="0,0.7",
                   help="an answer per prompt at each temperature (0: greedy)")  # fmt: skip
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--gen-batch", type=int, default=48)
    g.add_argument("--gen-workers", type=int, default=2, help="processes, one BLAS thread each")
    g.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("training")
    t.add_argument("--draft-vocab", type=int, default=4096, help="reduced output vocabulary")
    t.add_argument("--loss", choices=["ce", "kl", "mix"], default="ce",
                   help="ce: argmax labels; kl: the target's distribution over the draft "
                   "vocabulary; mix: both")  # fmt: skip
    t.add_argument("--init-head", help="start from this sidecar (and its draft vocabulary)")
    t.add_argument("--fc-init", choices=["residual", "default"], default="residual",
                   help="scale fc's random init to the RMS of the residual stream entering "
                   "the target's last layer (residual) or keep nn.Linear's")  # fmt: skip
    t.add_argument("--hidden-loss", type=float, default=1.0,
                   help="weight of an extra MSE between the head's output and the target's "
                   "next hidden (the row the target's logits come from)")  # fmt: skip
    t.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on the attention output and MLP hidden (training)")  # fmt: skip
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs)")
    t.add_argument("--batch", type=int, default=1024, help="pairs per step (whole sequences)")
    t.add_argument("--lr", type=float, default=0.04)
    t.add_argument("--lr-mode", choices=["absolute", "relative"], default="relative",
                   help="relative: per-tensor steps of lr x the tensor's initial RMS")  # fmt: skip
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--eval-every", type=int, default=100, help="steps between held-out checks")
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--stop-after", type=int, default=0,
                   help="checkpoint and stop at this step (then --resume)")  # fmt: skip
    t.add_argument("--partial", action="store_true",
                   help="train on the batches generated so far (pilot runs)")  # fmt: skip
    return p.parse_args(argv)


def select_prompts(items: list[prompts.Prompt], cap: int) -> list[prompts.Prompt]:
    """At most ``cap`` prompts, taken round-robin across templates so small runs stay diverse."""
    if cap <= 0 or cap >= len(items):
        return items
    by_template: dict[str, list[prompts.Prompt]] = {}
    for it in items:
        by_template.setdefault(it.template, []).append(it)
    queues = list(by_template.values())
    picked: list[prompts.Prompt] = []
    depth = 0
    while len(picked) < cap:
        for q in queues:
            if depth < len(q) and len(picked) < cap:
                picked.append(q[depth])
        depth += 1
    return sorted(picked, key=lambda it: it.index)


def build_jobs(args, tokenizer) -> tuple[list[dataset.Job], dict]:
    """The generation jobs and the record of which prompts and templates they use."""
    all_prompts = prompts.load_prompt_set(args.prompts_dir, args.max_per_template, args.seed)
    train, heldout = prompts.split_prompts(all_prompts)
    train = select_prompts(train, args.max_prompts)
    heldout = select_prompts(heldout, args.max_heldout)
    temps = sorted({float(t) for t in args.temperatures.split(",")})
    jobs = []
    for p in train:
        ids = tokenizer.encode(prompts.render(args.template, p.text))
        jobs += [dataset.Job(p.index, t, ids, False) for t in temps]
    for p in heldout:  # greedy only: held-out agreement during training
        ids = tokenizer.encode(prompts.render(args.template, p.text))
        jobs.append(dataset.Job(p.index, 0.0, ids, True))
    record = {
        "train": prompts.describe(train),
        "heldout": prompts.describe(heldout),
        "template": args.template,
    }
    return jobs, record


def default_work_dir(target: str) -> str:
    from runner.default_model import home

    name = os.path.basename(os.path.normpath(target))
    return os.path.join(home(), "train", name.removesuffix(".gguf"))


def generate(args, work_dir: str) -> dict:
    from runner.loader import load_model

    tokenizer = load_model(args.target).tokenizer
    jobs, record = build_jobs(args, tokenizer)
    settings = dataset.GenSettings(
        target=os.path.abspath(os.path.expanduser(args.target)),
        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch,
        top_k=args.top_k, seed=args.seed, top_p=args.top_p,
    )  # fmt: skip
    batches = dataset.prepare_plan(work_dir, jobs, settings)
    with open(os.path.join(work_dir, "prompts.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    have = dataset.cached_batches(work_dir)
    print(
        f"[gen] {record['train']['prompts']} training prompts from "
        f"{record['train']['templates']} templates, {record['heldout']['prompts']} held-out; "
        f"{len(jobs)} answers in {len(batches)} batches ({have} cached)",
        flush=True,
    )
    seconds = generation.run_generation(work_dir, args.gen_workers)
    stats_path = os.path.join(work_dir, "gen_stats.json")
    stats = {}
    if os.path.exists(stats_path):
        with open(stats_path, encoding="utf-8") as f:
            stats = json.load(f)
    stats["seconds"] = stats.get("seconds", 0.0) + seconds
    with open(stats_path, "w", encoding="utf-8") as f:
        json.dump(stats, f)
    print(f"[gen] done in {seconds / 60:.1f} min", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = os.path.expanduser(args.work_dir or default_work_dir(args.target))
    os.makedirs(work_dir, exist_ok=True)
    start = time.time()
    if args.stage in ("all", "generate"):
        generate(args, work_dir)
    if args.stage in ("all", "train"):
        from mtp_training.train import train_and_write

        train_and_write(args, work_dir)
    print(f"total {(time.time() - start) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
