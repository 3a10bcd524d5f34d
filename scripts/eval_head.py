#!/usr/bin/env python
"""Measure an MTP head on held-out prompts (templates never used in training).

    python scripts/eval_head.py TARGET --head DIR [--max-prompts N] [--depth 4]

Reports, per draft position 1..depth, how often the runner's drafts would be accepted:
greedy (the head chained on its own drafts vs the target's greedy continuation) and at
temperature 0.7 (expected acceptance sum_x min(p, q) under the sampler's processed
distributions, top_k 40, top_p 0.9), the expected tokens per round, and the cost of one draft
step relative to one target decode step (median of repeated timings, batch 1, the runner's
packed weights). Prints a table and writes JSON under bench-results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    from mtp_training import prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("target")
    p.add_argument("--head", required=True, help="sidecar directory")
    p.add_argument("--prompts-dir", default=prompts.PROMPT_DIR)
    p.add_argument("--template", default="chatml-smollm")
    p.add_argument("--max-prompts", type=int, default=72, help="held-out prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--gen-batch", type=int, default=24)
    p.add_argument("--gen-workers", type=int, default=2)
    p.add_argument("--timing-reps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work-dir", help="cache of the generated held-out answers "
                   "(default ~/.cache/mtp-runner/eval/<target name>)")  # fmt: skip
    p.add_argument("--json", help="output path (default bench-results/eval_head-<time>.json)")
    return p.parse_args(argv)


def heldout_answers(args, tokenizer, work_dir: str):
    """The target's greedy and sampled answers to the held-out prompts (cached)."""
    from mtp_training import dataset, generate, prompts
    from train_mtp_head import select_prompts

    items = prompts.load_prompt_set(args.prompts_dir)
    _, heldout = prompts.split_prompts(items)
    heldout = select_prompts(heldout, args.max_prompts)
    jobs = []
    for p in heldout:
        ids = tokenizer.encode(prompts.render(args.template, p.text))
        jobs += [dataset.Job(p.index, t, ids, True) for t in (0.0, args.temperature)]
    settings = dataset.GenSettings(
        target=os.path.abspath(os.path.expanduser(args.target)),
        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, top_k=args.top_k,
        seed=args.seed, top_p=args.top_p,
    )  # fmt: skip
    dataset.prepare_plan(work_dir, jobs, settings)
    seconds = generate.run_generation(work_dir, args.gen_workers)
    seqs = dataset.load_sequences(work_dir)
    print(f"held-out: {len(heldout)} prompts from {len({p.template for p in heldout})} "
          f"templates ({seconds / 60:.1f} min generating)", flush=True)  # fmt: skip
    return heldout, seqs


def _median_ms(fn, reps: int) -> float:
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def time_steps(loaded, head, reps: int, context: int = 128) -> dict:
    """One target decode step vs one draft step (batch 1, ``context`` positions cached)."""
    import mlx.core as mx

    from cache.kv import KVCache

    model = loaded.model
    ids = mx.array([[(7 * i) % model.args.vocab_size for i in range(context)]], dtype=mx.int32)
    caches = model.make_caches()
    mx.eval(model.hidden(ids, caches))
    token = mx.array([[11]], dtype=mx.int32)

    def target_step():
        for c in caches:
            c.rewind(context)
        h = model.hidden(token, caches)
        return mx.argmax(model.unembed(h[:, -1]), axis=-1)

    hcache = KVCache()
    hid = mx.random.normal((1, context, model.args.hidden_size))
    mx.eval(head(ids, hid, hcache))
    one_hid = hid[:, :1]

    def draft_step():
        hcache.rewind(context)
        y = head(token, one_hid, hcache)
        return mx.argmax(head.logits(y[:, -1], model.unembed), axis=-1)

    t_target = _median_ms(target_step, reps)
    t_draft = _median_ms(draft_step, reps)
    vocab = head.config.draft_vocab
    head.set_draft_vocab(None)
    t_full = _median_ms(draft_step, reps)
    head.set_draft_vocab(vocab)
    return {
        "target_step_ms": round(t_target, 3),
        "draft_step_ms": round(t_draft, 3),
        "draft_step_full_vocab_ms": round(t_full, 3),
        "draft_cost": round(t_draft / t_target, 4),
        "draft_cost_full_vocab": round(t_full / t_target, 4),
    }


def print_table(report: dict) -> None:
    depth = report["depth"]
    print()
    print(f"{'':28}" + "".join(f"{'pos ' + str(j + 1):>9}" for j in range(depth)))
    for mode in ("greedy", "sampled"):
        r = report[mode]
        for kind in ("conditional", "cumulative", "tokens_per_round"):
            vals = "".join(f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in r[kind])
            print(f"{mode + ' ' + kind:28}{vals}")
    t = report["timing"]
    print(
        f"\ndraft step {t['draft_step_ms']:.2f} ms = {t['draft_cost']:.3f} x target decode step "
        f"({t['target_step_ms']:.1f} ms); full-vocab head {t['draft_cost_full_vocab']:.3f} x"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from mtp_training.chain import SamplingOptions, evaluate_chain
    from mtp_training.npmodel import NumpyOutput

    from runner import device
    from runner.default_model import home
    from runner.heads import load_draft_head
    from runner.loader import load_model

    start = time.time()
    loaded = load_model(args.target)
    head, description = load_draft_head(loaded, args.head)
    device.tune(loaded.model, head, compile=False)  # laid out as the runner runs them
    print(description, flush=True)
    name = os.path.basename(os.path.normpath(args.target)).removesuffix(".gguf")
    work_dir = os.path.expanduser(args.work_dir or os.path.join(home(), "eval", name))
    heldout, seqs = heldout_answers(args, loaded.tokenizer, work_dir)
    target_np = NumpyOutput(loaded.model)  # only the output projection is read
    greedy = [s for s in seqs if s.temperature == 0.0]
    sampled = [s for s in seqs if s.temperature > 0.0]
    sampling = SamplingOptions(args.temperature, args.top_k, args.top_p)
    report = {
        "target": os.path.abspath(os.path.expanduser(args.target)),
        "head": os.path.abspath(args.head),
        "head_description": description,
        "depth": args.depth,
        "heldout_prompts": len(heldout),
        "heldout_templates": sorted({p.template for p in heldout}),
        "sampling": vars(sampling),
        "greedy": evaluate_chain(head, target_np, greedy, args.depth, None),
        "sampled": evaluate_chain(head, target_np, sampled, args.depth, sampling),
        "timing": time_steps(loaded, head, args.timing_reps),
    }
    with open(os.path.join(args.head, "config.json"), encoding="utf-8") as f:
        report["training"] = json.load(f).get("training", {})
    report["minutes"] = round((time.time() - start) / 60, 2)
    print_table(report)
    # By default under the repository's bench-results/, wherever the script runs from.
    default = f"eval_head-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out = bc.write_json(os.path.abspath(args.json) if args.json else default, report)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
