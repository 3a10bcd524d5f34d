"""The trainer's two commands as library calls: ``train_head`` (generate the target's answers,
then train and write a head) and ``eval_head`` (a written head on the held-out prompts)."""

from __future__ import annotations

import json
import os
import time

from . import dataset, prompts
from .chain import SamplingOptions, evaluate_chain
from .config import GEN_SHARE, EvalConfig, TrainConfig, TrainingError
from .generate import run_generation
from .loop import train_and_write
from .progress import log
from .target import LoadTarget, Target, load_head


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


def prompt_ids(template: str, text: str, target: Target) -> list[int]:
    """A user prompt as the target is asked it: through its own chat template (``model``;
    encoded without an added BOS, the template writes its own) or a named or given one."""
    if template != "model":
        return target.tokenizer.encode(prompts.render(template, text))
    rendered = target.chat_prompt(text)
    if rendered is None:
        raise TrainingError(
            f"{target.path} has no chat template: pass --template (chatml, chatml-smollm, none "
            "or a format string containing {prompt})"
        )
    return target.tokenizer.encode(rendered, add_bos=False)


def load_prompts(cfg: TrainConfig) -> list[prompts.Prompt]:
    return prompts.load_prompt_set(cfg.prompts_dir, cfg.max_per_template, cfg.seed)


def build_jobs(
    cfg: TrainConfig, target: Target, max_prompts: int | None = None
) -> tuple[list[dataset.Job], dict]:
    """The generation jobs and the record of which prompts and templates they use
    (``max_prompts``: the training prompts at most, by default ``cfg.max_prompts``)."""
    train, heldout = prompts.split_prompts(load_prompts(cfg))
    train = select_prompts(train, cfg.max_prompts if max_prompts is None else max_prompts)
    heldout = select_prompts(heldout, cfg.max_heldout)
    jobs = []
    for p in heldout:  # greedy only: held-out agreement during training
        ids = prompt_ids(cfg.template, p.text, target)
        jobs.append(dataset.Job(p.index, 0.0, ids, True))
    for p in train:
        ids = prompt_ids(cfg.template, p.text, target)
        jobs += [dataset.Job(p.index, t, ids, False) for t in cfg.temperatures]
    record = {
        "train": prompts.describe(train),
        "heldout": prompts.describe(heldout),
        "template": cfg.template,
    }
    return jobs, record


def _settings(
    target: str,
    max_new_tokens: int,
    batch: int,
    top_k: int,
    seed: int,
    top_p: float,
    feature_layers: tuple[int, ...] = (),
):
    return dataset.GenSettings(
        target=os.path.abspath(os.path.expanduser(target)),
        max_new_tokens=max_new_tokens,
        batch_size=batch,
        top_k=top_k,
        seed=seed,
        top_p=top_p,
        feature_layers=list(feature_layers),
    )


def feature_layers(spec: str, layers: int) -> tuple[int, ...]:
    """The residual streams a fused-feature head reads besides the final hidden: ``auto`` is
    a low and a middle one (after 2 and L/2 layers; none for targets under 8 layers),
    ``none`` none, or a comma-separated list of layer counts in 1..L-1."""
    if spec == "none":
        return ()
    if spec == "auto":
        return (2, layers // 2) if layers >= 8 else ()
    try:
        picked = tuple(sorted({int(k) for k in spec.split(",") if k.strip()}))
    except ValueError as exc:
        raise TrainingError(f"feature layers must be auto, none or numbers: {spec!r}") from exc
    if not picked or any(not 1 <= k < layers for k in picked):
        raise TrainingError(f"feature layers must lie in 1..{layers - 1}: {spec!r}")
    return picked


def budget_prompts(cfg: TrainConfig, target: Target, settings) -> int:
    """The training prompts that fit the time budget (``cfg.minutes``), 0 meaning all.

    The held-out answers are generated first, on their own, and timed: at that rate, the
    answers GEN_SHARE of the budget leaves make the prompt count (an answer per temperature
    each), at most ``cfg.max_prompts``. Decided once per work dir (``budget.json``), so a
    resumed or repeated run plans the same prompts."""
    path = os.path.join(cfg.work_dir, "budget.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return int(json.load(f)["prompts"])
    heldout_jobs, _ = build_jobs(cfg, target, max_prompts=-1)
    heldout_jobs = [j for j in heldout_jobs if j.heldout]
    dataset.prepare_plan(cfg.work_dir, heldout_jobs, settings)
    seconds = max(run_generation(cfg.work_dir, target), 1e-3)
    rate = len(heldout_jobs) / seconds  # answers per second
    left = max(GEN_SHARE * cfg.minutes * 60 - seconds, 0.0)
    count = max(int(left * rate / len(cfg.temperatures)), 1)
    if cfg.max_prompts > 0:
        count = min(count, cfg.max_prompts)
    log(
        f"[gen] budget {cfg.minutes:g} min: {rate:.2f} answers/s on the held-out prompts, so "
        f"{count} training prompts in {GEN_SHARE:.0%} of it"
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"minutes": cfg.minutes, "answers_per_second": rate, "prompts": count}, f)
    return count


def topped_up_prompts(cfg: TrainConfig, planned: int, answers: int, seconds: float) -> int:
    """The training prompts once the planned batches have run: ``planned``, or more when
    the generation share of the budget has at least a batch's time left at the rate those
    batches ran (the held-out timing, one small batch, undersells a larger ``gen_batch``);
    at most the prompt set (and ``cfg.max_prompts``). Recorded in ``budget.json``, so a
    rerun plans the same prompts."""
    available = len(prompts.split_prompts(load_prompts(cfg))[0])
    if cfg.max_prompts > 0:
        available = min(available, cfg.max_prompts)
    if answers <= 0 or seconds <= 0 or planned >= available:
        return planned
    rate = answers / seconds
    left = GEN_SHARE * cfg.minutes * 60 - dataset.generation_seconds(cfg.work_dir)
    extra = int(left * rate / len(cfg.temperatures))
    if extra * len(cfg.temperatures) < cfg.gen_batch:
        return planned
    count = min(planned + extra, available)
    log(
        f"[gen] the training batches ran at {rate:.2f} answers/s: {count - planned} more "
        f"prompts fit the generation share ({count} in all)"
    )
    path = os.path.join(cfg.work_dir, "budget.json")
    with open(path, encoding="utf-8") as f:
        budget = json.load(f)
    budget.update(prompts=count, topped_up_at=rate)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(budget, f)
    return count


def generate(cfg: TrainConfig, target: Target) -> dict:
    """Fill the work dir with the target's answers to the training and held-out prompts;
    with a time budget, prompts are added while the generation share has time left."""
    spec = cfg.feature_layers or ("auto" if cfg.fuse else "none")
    layers = feature_layers(spec, target.model.args.num_hidden_layers)
    settings = _settings(
        cfg.target, cfg.max_new_tokens, cfg.gen_batch, cfg.top_k, cfg.seed, cfg.top_p, layers
    )
    count = budget_prompts(cfg, target, settings) if cfg.minutes > 0 else None
    while True:
        jobs, record = build_jobs(cfg, target, max_prompts=count)
        batches = dataset.prepare_plan(cfg.work_dir, jobs, settings)
        with open(os.path.join(cfg.work_dir, "prompts.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        have = dataset.cached_batches(cfg.work_dir)
        log(
            f"[gen] {record['train']['prompts']} training prompts from "
            f"{record['train']['templates']} templates, {record['heldout']['prompts']} held-out; "
            f"{len(jobs)} answers in {len(batches)} batches ({have} cached)"
        )
        missing = sum(
            len(b)
            for i, b in enumerate(batches)
            if not os.path.exists(dataset.batch_path(cfg.work_dir, i))
        )
        seconds = run_generation(cfg.work_dir, target)
        log(f"[gen] done in {seconds / 60:.1f} min")
        if count is None:
            return record
        more = topped_up_prompts(cfg, count, missing, seconds)
        if more == count:
            return record
        count = more


def train_head(cfg: TrainConfig, load_target: LoadTarget) -> dict | None:
    """Generate (``stage`` all/generate) and train (all/train); the training record of the
    written head, or None when no head was written (generation only, or stopped early)."""
    os.makedirs(cfg.work_dir, exist_ok=True)
    start = time.time()
    target = load_target(cfg.target)
    if cfg.stage in ("all", "generate"):
        generate(cfg, target)
    record = train_and_write(cfg, target) if cfg.stage in ("all", "train") else None
    log(f"total {(time.time() - start) / 60:.1f} min")
    return record


def heldout_answers(cfg: EvalConfig, target: Target, layers: tuple[int, ...] = ()):
    """The target's greedy and sampled answers to the held-out prompts (cached), with the
    streams after ``layers`` layers (a fused-feature head's; cached apart)."""
    items = prompts.load_prompt_set(cfg.prompts_dir)
    _, heldout = prompts.split_prompts(items)
    heldout = select_prompts(heldout, cfg.max_prompts)
    jobs = []
    for p in heldout:
        ids = prompt_ids(cfg.template, p.text, target)
        jobs += [dataset.Job(p.index, t, ids, True) for t in (0.0, cfg.temperature)]
    settings = _settings(
        cfg.target, cfg.max_new_tokens, cfg.gen_batch, cfg.top_k, cfg.seed, cfg.top_p, layers
    )
    work_dir = os.path.normpath(cfg.work_dir)
    work_dir += "".join(f"-{k}" for k in layers)  # streams cached apart
    dataset.prepare_plan(work_dir, jobs, settings)
    seconds = run_generation(work_dir, target)
    seqs = dataset.load_sequences(work_dir)
    log(
        f"held-out: {len(heldout)} prompts from {len({p.template for p in heldout})} "
        f"templates ({seconds / 60:.1f} min generating)"
    )
    return heldout, seqs


def eval_head(cfg: EvalConfig, load_target: LoadTarget) -> dict:
    """Acceptance per draft position, greedy and sampled, and the draft step's cost."""
    start = time.time()
    target = load_target(cfg.target, tune=False)
    head, description = load_head(target, cfg.head)
    log(description)
    heldout, seqs = heldout_answers(cfg, target, tuple(head.config.feature_layers))
    greedy = [s for s in seqs if s.temperature == 0.0]
    sampled = [s for s in seqs if s.temperature > 0.0]
    sampling = SamplingOptions(cfg.temperature, cfg.top_k, cfg.top_p)
    report = {
        "target": os.path.abspath(os.path.expanduser(cfg.target)),
        "head": os.path.abspath(cfg.head),
        "head_description": description,
        "depth": cfg.depth,
        "heldout_prompts": len(heldout),
        "heldout_templates": sorted({p.template for p in heldout}),
        "sampling": vars(sampling),
        "greedy": evaluate_chain(head, target, greedy, cfg.depth, None),
        "sampled": evaluate_chain(head, target, sampled, cfg.depth, sampling),
        "timing": target.time_steps(head, cfg.timing_reps),
    }
    with open(os.path.join(cfg.head, "config.json"), encoding="utf-8") as f:
        report["training"] = json.load(f).get("training", {})
    report["minutes"] = round((time.time() - start) / 60, 2)
    return report


def format_report(report: dict) -> str:
    """The evaluation as a table: per position, conditional and cumulative acceptance and
    tokens per round, greedy and sampled; then the draft step's cost."""
    depth = report["depth"]
    lines = ["", f"{'':28}" + "".join(f"{'pos ' + str(j + 1):>9}" for j in range(depth))]
    for mode in ("greedy", "sampled"):
        r = report[mode]
        for kind in ("conditional", "cumulative", "tokens_per_round"):
            vals = "".join(f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in r[kind])
            lines.append(f"{mode + ' ' + kind:28}{vals}")
    t = report["timing"]
    lines.append(
        f"\ndraft step {t['draft_step_ms']:.2f} ms = {t['draft_cost']:.3f} x target decode step "
        f"({t['target_step_ms']:.1f} ms); full-vocab head {t['draft_cost_full_vocab']:.3f} x"
    )
    return "\n".join(lines)
