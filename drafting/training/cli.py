"""``mtp-runner train-head`` and ``mtp-runner eval-head``: argument parsing into the configs.

The runner's CLI hands over the command line, its target loader and its cache directory;
everything below the parsers takes dataclasses and raises ``TrainingError``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import PROMPT_DIR, EvalConfig, TrainConfig, TrainingError
from .prompts import CHAT_TEMPLATES
from .run import eval_head, format_report, train_head
from .target import LoadTarget

COMMANDS = ("train-head", "eval-head")

TRAIN_HELP = """Train an MTP draft head for a target model by self-distillation.

1. generate: the target answers the prompt set greedily and at the sampling temperatures in
   left-padded batches, recording its post-norm hidden and argmax at every position; batches
   are cached in the work dir, so training can rerun without regenerating.
2. train: a head (fc + a copy of the target's last decoder layer + its final norm; the target
   stays frozen) learns to predict the target's own argmax for token t+2 from the hidden at t
   and token t+1, over a reduced vocabulary of the most frequent labels.
3. write: DIR/config.json + DIR/mtp.safetensors in the Qwen3-Next naming (float16).

Prompts from the held-out templates are never trained on; they measure agreement."""

EVAL_HELP = """Measure an MTP head on the held-out prompts (templates never used in training):
per draft position, greedy acceptance (the head chained on its own drafts against the target's
greedy continuation) and expected acceptance at a temperature, the tokens per round, and the
cost of one draft step against one target decode step."""


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of temperatures: {text!r}") from None


def train_parser() -> argparse.ArgumentParser:
    d = TrainConfig("", "", "")
    p = argparse.ArgumentParser(
        prog="mtp-runner train-head",
        description=TRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="target model (Hugging Face directory or GGUF file)")
    p.add_argument("--out", required=True, help="sidecar directory to write")
    p.add_argument(
        "--work-dir",
        help="generated data and checkpoints (default: the runner's cache dir, train/<model name>)",
    )
    p.add_argument("--stage", choices=["all", "generate", "train"], default=d.stage)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    g = p.add_argument_group("data")
    g.add_argument(
        "--prompts-dir", default=PROMPT_DIR, help="prompt set (default: the bundled one)"
    )
    g.add_argument(
        "--template",
        default=d.template,
        help=f"chat template: model (the target's own, the default), "
        f"{', '.join(CHAT_TEMPLATES)} or a format string "
        "containing {prompt}",
    )
    g.add_argument(
        "--max-per-template",
        type=int,
        default=d.max_per_template,
        help="prompts per slot template at most (the budget takes what fits, "
        "round-robin across templates)",
    )
    g.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="time budget of the whole run, generation included: the training "
        "prompts and steps are what fits (default 180; 0: no budget)",
    )
    g.add_argument(
        "--max-prompts",
        type=int,
        default=d.max_prompts,
        help="training prompts at most, across templates (0: all)",
    )
    g.add_argument("--max-heldout", type=int, default=d.max_heldout)
    g.add_argument(
        "--temperatures",
        type=_temperatures,
        default=d.temperatures,
        help="an answer per prompt at each temperature (0: greedy): 0,0.7",
    )
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--gen-batch", type=int, default=d.gen_batch, help="answers per forward")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--feature-layers",
        default=d.feature_layers,
        help="residual streams recorded for a fused-feature head (auto: after 2 and "
        "L/2 layers; none; or a list like 2,15; default: auto with --fuse)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--draft-vocab", type=int, default=d.draft_vocab)
    t.add_argument(
        "--loss",
        choices=["ce", "kl", "mix"],
        default=d.loss,
        help="ce: argmax labels; kl: the target's distribution over the draft "
        "vocabulary; mix: both",
    )
    t.add_argument("--init-head", help="start from this sidecar (and its draft vocabulary)")
    t.add_argument(
        "--fc-init",
        choices=["residual", "default"],
        default=d.fc_init,
        help="scale fc's init to the RMS of the residual stream entering the "
        "target's last layer (residual) or keep nn.Linear's",
    )
    t.add_argument(
        "--hidden-loss",
        type=float,
        default=d.hidden_loss,
        help="weight of an MSE between the head's output and the target's next hidden",
    )
    t.add_argument("--dropout", type=float, default=d.dropout)
    t.add_argument(
        "--chain-steps",
        type=int,
        default=d.chain_steps,
        help="training-time test: chained draft steps trained per pair",
    )
    t.add_argument(
        "--chain-decay",
        type=float,
        default=d.chain_decay,
        help="loss weight decay per chained step",
    )
    t.add_argument(
        "--fuse",
        action=argparse.BooleanOptionalAction,
        default=d.fuse,
        help="fuse the recorded feature layers into the head's input",
    )
    t.add_argument("--epochs", type=float, default=d.epochs)
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (over --epochs)")
    t.add_argument("--batch", type=int, default=d.batch, help="pairs per step")
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument(
        "--lr-mode",
        choices=["absolute", "relative"],
        default=d.lr_mode,
        help="relative: per-tensor steps of lr x the tensor's initial RMS",
    )
    t.add_argument("--warmup", type=int, default=d.warmup)
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--eval-every", type=int, default=d.eval_every)
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    t.add_argument(
        "--stop-after",
        type=int,
        default=d.stop_after,
        help="checkpoint and stop at this step (then --resume)",
    )
    t.add_argument(
        "--partial", action="store_true", help="train on the batches generated so far (pilot runs)"
    )
    return p


def eval_parser() -> argparse.ArgumentParser:
    d = EvalConfig("", "", "")
    p = argparse.ArgumentParser(prog="mtp-runner eval-head", description=EVAL_HELP)
    p.add_argument("model", help="target model (Hugging Face directory or GGUF file)")
    p.add_argument("--head", required=True, help="sidecar directory")
    p.add_argument(
        "--work-dir",
        help="cache of the generated held-out answers "
        "(default: the runner's cache dir, eval/<model name>)",
    )
    p.add_argument("--json", dest="json_path", help="write the report here too")
    p.add_argument("--prompts-dir", default=PROMPT_DIR)
    p.add_argument("--template", default=d.template, help="as for train-head")
    p.add_argument(
        "--max-prompts", type=int, default=d.max_prompts, help="held-out prompts (0: all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--depth", type=int, default=d.depth)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--timing-reps", type=int, default=d.timing_reps)
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def _work_dir(given: str | None, home: str, kind: str, model: str) -> str:
    if given:
        return os.path.expanduser(given)
    name = os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    return os.path.join(home, kind, name)


def train_config(argv: list[str], home: str) -> TrainConfig:
    ns = vars(train_parser().parse_args(argv))
    model = ns.pop("model")
    ns["work_dir"] = _work_dir(ns["work_dir"], home, "train", model)
    return TrainConfig(target=model, **ns)


def eval_config(argv: list[str], home: str) -> EvalConfig:
    ns = vars(eval_parser().parse_args(argv))
    model = ns.pop("model")
    ns["work_dir"] = _work_dir(ns["work_dir"], home, "eval", model)
    return EvalConfig(target=model, **ns)


def main(argv: list[str], load_target: LoadTarget, home: str) -> int:
    """Run ``argv`` (``train-head ...`` or ``eval-head ...``); 0 on success, 1 on a
    ``TrainingError`` (its message on stderr), 2 on bad arguments (argparse's)."""
    command, rest = argv[0], argv[1:]
    try:
        if command == "train-head":
            train_head(train_config(rest, home), load_target)
        elif command == "eval-head":
            cfg = eval_config(rest, home)
            report = eval_head(cfg, load_target)
            print(format_report(report))
            if cfg.json_path:
                with open(cfg.json_path, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=1)
                print(f"\nwrote {cfg.json_path}")
        else:
            raise TrainingError(f"unknown command {command!r} (one of {', '.join(COMMANDS)})")
    except TrainingError as exc:
        print(f"mtp-runner {command}: {exc}", file=sys.stderr)
        return 1
    return 0
