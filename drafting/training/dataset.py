"""The generation plan, the on-disk cache of generated batches, and loading it back.

Generation is the slow part, so every batch lands in its own file under the work dir
(``gen-00042.npz``, written atomically) and a rerun skips the batches already there.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from .config import TrainingError

PLAN_FILE = "plan.json"


@dataclass
class Job:
    """One answer to generate: a rendered prompt at a temperature (0 = greedy)."""

    prompt_index: int
    temperature: float
    tokens: list[int]
    heldout: bool


@dataclass
class GenSettings:
    target: str
    max_new_tokens: int
    batch_size: int
    top_k: int
    seed: int
    top_p: float = 1.0
    # Residual streams recorded beside the final hidden (k: after k decoder layers).
    feature_layers: list[int] = field(default_factory=list)


def plan_batches(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Group jobs of similar prompt length (less padding); held-out jobs first and apart, so
    that a pilot can train on a partly generated plan and still be measured."""
    batches: list[list[Job]] = []
    for heldout in (True, False):
        part = sorted((j for j in jobs if j.heldout == heldout), key=lambda j: len(j.tokens))
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    return batches


def _key(job: Job) -> tuple:
    return tuple(job.tokens), job.temperature, job.heldout


def prepare_plan(work_dir: str, jobs: list[Job], settings: GenSettings) -> list[list[Job]]:
    """The work dir's plan for ``jobs``: a new one, the recorded one, or the recorded one
    extended by batches for jobs it lacks (prompts added to the set), so that cached batches
    stay valid. A plan made with other generation options, or one that holds jobs no longer
    asked for, is refused rather than mixed."""
    os.makedirs(work_dir, exist_ok=True)
    path = os.path.join(work_dir, PLAN_FILE)
    if not os.path.exists(path):
        batches = plan_batches(jobs, settings.batch_size)
    else:
        old, old_settings = read_plan(work_dir)
        wanted = {_key(j): j for j in jobs}
        have = {_key(j) for b in old for j in b}
        if old_settings != settings or not have <= set(wanted):
            raise TrainingError(
                f"{work_dir} holds data generated with another plan (prompts, template or "
                "generation options differ); use a fresh work dir or delete it"
            )
        # Prompt indices follow the current prompt set; the batches keep their jobs.
        batches = [[wanted[_key(j)] for j in b] for b in old]
        new = [j for k, j in wanted.items() if k not in have]
        batches += plan_batches(new, settings.batch_size)
    plan = {"settings": asdict(settings), "batches": [[asdict(j) for j in b] for b in batches]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan, f)
    return batches


def read_plan(work_dir: str) -> tuple[list[list[Job]], GenSettings]:
    with open(os.path.join(work_dir, PLAN_FILE), encoding="utf-8") as f:
        plan = json.load(f)
    batches = [[Job(**j) for j in b] for b in plan["batches"]]
    return batches, GenSettings(**plan["settings"])


def add_generation_seconds(work_dir: str, seconds: float) -> None:
    """Add to the work dir's record of the time generation took (``gen_stats.json``)."""
    stats_path = os.path.join(work_dir, "gen_stats.json")
    stats = {}
    if os.path.exists(stats_path):
        with open(stats_path, encoding="utf-8") as f:
            stats = json.load(f)
    stats["seconds"] = stats.get("seconds", 0.0) + seconds
    tmp = stats_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(stats, f)
    os.replace(tmp, stats_path)


def generation_seconds(work_dir: str) -> float:
    """The time generation has taken in ``work_dir`` so far (``gen_stats.json``)."""
    stats_path = os.path.join(work_dir, "gen_stats.json")
    if not os.path.exists(stats_path):
        return 0.0
    with open(stats_path, encoding="utf-8") as f:
        return float(json.load(f).get("seconds", 0.0))


def batch_path(work_dir: str, index: int) -> str:
    return os.path.join(work_dir, f"gen-{index:05d}.npz")


def save_batch(path: str, seqs) -> None:
    tmp = path + ".tmp.npz"
    extra = {}
    if seqs and seqs[0].features is not None:
        extra["features"] = np.concatenate([s.features for s in seqs])
    np.savez(
        tmp,
        **extra,
        tokens=np.concatenate([s.tokens for s in seqs]),
        hiddens=np.concatenate([s.hiddens for s in seqs]),
        argmax=np.concatenate([s.argmax for s in seqs]),
        lengths=np.array([len(s.tokens) for s in seqs], dtype=np.int64),
        prompt_lens=np.array([s.prompt_len for s in seqs], dtype=np.int64),
        prompt_index=np.array([s.prompt_index for s in seqs], dtype=np.int64),
        temperature=np.array([s.temperature for s in seqs], dtype=np.float32),
    )
    os.replace(tmp, path)


@dataclass
class Sequence:
    """One prompt + answer, as generation writes it and training and evaluation read it.
    ``tokens[:-1]`` were fed; row t of ``hiddens``/``argmax`` is the target's output after
    feeding ``tokens[t]`` (``argmax`` is -1 inside the prompt, except at its last position)."""

    prompt_index: int
    temperature: float
    prompt_len: int
    tokens: np.ndarray  # int32 [T]
    hiddens: np.ndarray  # float16 [T-1, D]
    argmax: np.ndarray  # int32 [T-1]
    heldout: bool = False
    features: np.ndarray | None = None  # float16 [T-1, F * D]: the plan's feature layers

    @property
    def answer_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def load_sequences(work_dir: str, partial: bool = False) -> list[Sequence]:
    """Every cached sequence, in plan order; a missing batch is an error unless ``partial``."""
    batches, _ = read_plan(work_dir)
    out: list[Sequence] = []
    for i, jobs in enumerate(batches):
        path = batch_path(work_dir, i)
        if not os.path.exists(path):
            if partial:
                continue
            raise TrainingError(f"missing generated batch {path}; run generation first")
        with np.load(path) as z:
            tok_off = np.concatenate([[0], np.cumsum(z["lengths"])])
            hid_off = np.concatenate([[0], np.cumsum(z["lengths"] - 1)])
            tokens, hiddens, argmax = z["tokens"], z["hiddens"], z["argmax"]
            feats = z["features"] if "features" in z.files else None
            for s, job in enumerate(jobs):
                out.append(
                    Sequence(
                        prompt_index=job.prompt_index,
                        temperature=float(z["temperature"][s]),
                        prompt_len=int(z["prompt_lens"][s]),
                        tokens=tokens[tok_off[s] : tok_off[s + 1]],
                        hiddens=hiddens[hid_off[s] : hid_off[s + 1]],
                        argmax=argmax[hid_off[s] : hid_off[s + 1]],
                        heldout=job.heldout,
                        features=None if feats is None else feats[hid_off[s] : hid_off[s + 1]],
                    )
                )
    return out


def cached_batches(work_dir: str) -> int:
    return len(glob.glob(os.path.join(work_dir, "gen-*.npz")))
