"""The prompt set (``prompts/`` beside this file, package data): slot templates expanded
deterministically, plus hand-written prompts. Files marked ``"heldout": true`` (and
``heldout_*.txt``) are never used for training; evaluation reads only them, so it measures
prompts from unseen templates.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import random
from dataclasses import dataclass

from .config import PROMPT_DIR

CHATML_SMOL = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
)
CHAT_TEMPLATES = {
    "chatml-smollm": CHATML_SMOL,
    "chatml": "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    "none": "{prompt}",
}


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    template: str
    category: str
    heldout: bool


def expand_template(template: dict, max_fills: int, seed: int = 0) -> list[str]:
    """Fill ``template["text"]`` with slot combinations; at most ``max_fills`` of them,
    picked by a seeded shuffle so that every run gets the same prompts."""
    names = sorted(template.get("slots", {}))
    values = [template["slots"][n] for n in names]
    combos = list(itertools.product(*values)) if names else [()]
    rng = random.Random(f"{seed}:{template['id']}")
    rng.shuffle(combos)
    return [template["text"].format(**dict(zip(names, c, strict=True))) for c in combos[:max_fills]]


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    return [ln.replace("\\n", "\n") for ln in lines if ln.strip() and not ln.startswith("#")]


def load_prompt_set(
    directory: str = PROMPT_DIR, max_per_template: int = 30, seed: int = 0
) -> list[Prompt]:
    """Every prompt of the set, training ones first, each tagged with its template id."""
    items: list[tuple[str, str, str, bool]] = []
    for path in sorted(glob.glob(os.path.join(directory, "templates_*.json"))):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        heldout = bool(spec.get("heldout", False))
        for t in spec["templates"]:
            for text in expand_template(t, max_per_template, seed):
                items.append((text, t["id"], spec.get("category", ""), heldout))
    for path in sorted(glob.glob(os.path.join(directory, "*.txt"))):
        name = os.path.splitext(os.path.basename(path))[0]
        heldout = name.startswith("heldout")
        for text in _read_lines(path):
            items.append((text, name, "hand-written", heldout))
    items.sort(key=lambda it: it[3])  # stable: training prompts first
    return [Prompt(i, *it) for i, it in enumerate(items)]


def split_prompts(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    return [p for p in prompts if not p.heldout], [p for p in prompts if p.heldout]


def describe(prompts: list[Prompt]) -> dict:
    """Counts for the sidecar's training record."""
    templates = sorted({p.template for p in prompts})
    return {"prompts": len(prompts), "templates": len(templates), "template_ids": templates}


def render(template: str, prompt: str) -> str:
    """Wrap a user prompt in a chat template (a name from CHAT_TEMPLATES or a format string)."""
    fmt = CHAT_TEMPLATES.get(template, template)
    if "{prompt}" not in fmt:
        raise ValueError("a chat template must contain {prompt}")
    return fmt.replace("{prompt}", prompt)
