"""The trainer's options as dataclasses (the CLI fills them; library code takes them), and the
error its library code raises instead of exiting."""

from __future__ import annotations

import os
from dataclasses import dataclass

PROMPT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts")
# The share of a time budget (``TrainConfig.minutes``) generation may take; training has the rest.
GEN_SHARE = 0.6


class TrainingError(Exception):
    """A training or evaluation run cannot go on (a message for the user, no traceback)."""


@dataclass
class TrainConfig:
    """One head-training run: where, which data, and how to train."""

    target: str  # the target model's path (what the generation plan records)
    out: str  # the sidecar directory to write
    work_dir: str  # generated batches and checkpoints
    stage: str = "all"  # all, generate or train
    resume: bool = False
    # data
    prompts_dir: str = PROMPT_DIR
    # "model" (the target's own chat template), a name in prompts.CHAT_TEMPLATES, or a format
    # string containing {prompt}
    template: str = "model"
    max_per_template: int = 60
    # The whole run's time budget, generation included: the held-out answers (generated first)
    # time the target, the training prompts are as many as GEN_SHARE of it allows, and the
    # training steps stop where it ends. 0: no budget (max_prompts and epochs decide alone).
    minutes: float = 180.0
    max_prompts: int = 0  # training prompts at most, round-robin across templates (0: all)
    max_heldout: int = 48
    temperatures: tuple[float, ...] = (0.0, 0.7)
    top_k: int = 40
    top_p: float = 0.9
    max_new_tokens: int = 128
    gen_batch: int = 96
    gen_workers: int = 1
    seed: int = 0
    # Residual streams recorded for a fused-feature head: auto, none or "k1,k2" (layer counts);
    # empty: auto with ``fuse``, none without (they triple the cached data).
    feature_layers: str = ""
    # training
    draft_vocab: int = 4096
    loss: str = "ce"  # ce, kl or mix
    init_head: str | None = None
    fc_init: str = "residual"  # residual or default
    hidden_loss: float = 1.0
    dropout: float = 0.0
    # Training-time test: chained draft steps per pair (1: the first draft only) and the
    # loss weight's decay per step.
    chain_steps: int = 3
    chain_decay: float = 0.8
    fuse: bool = False  # fuse the recorded feature layers' streams into the head's input
    epochs: float = 4.0
    steps: int = 0  # overrides epochs when > 0
    batch: int = 1024  # pairs per step
    lr: float = 0.04
    lr_mode: str = "relative"  # relative or absolute
    warmup: int = 50
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    stop_after: int = 0
    partial: bool = False

    def __post_init__(self) -> None:
        choices = {
            "stage": ("all", "generate", "train"),
            "loss": ("ce", "kl", "mix"),
            "fc_init": ("residual", "default"),
            "lr_mode": ("relative", "absolute"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise TrainingError(f"{name} must be one of {', '.join(allowed)}")
        for name in (
            "gen_batch",
            "gen_workers",
            "batch",
            "max_new_tokens",
            "draft_vocab",
            "chain_steps",
        ):
            if getattr(self, name) < 1:
                raise TrainingError(f"{name} must be at least 1")
        if self.minutes < 0:
            raise TrainingError("minutes must be >= 0 (0: no time budget)")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise TrainingError("temperatures must be one or more values >= 0")
        self.temperatures = tuple(sorted({float(t) for t in self.temperatures}))


@dataclass
class EvalConfig:
    """One held-out evaluation of a written head."""

    target: str
    head: str
    work_dir: str  # the cache of generated held-out answers
    json_path: str | None = None  # the report (default: printed only)
    prompts_dir: str = PROMPT_DIR
    template: str = "model"
    max_prompts: int = 72  # held-out prompts (0: all)
    max_new_tokens: int = 160
    depth: int = 4
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.9
    gen_batch: int = 24
    timing_reps: int = 30
    seed: int = 1
