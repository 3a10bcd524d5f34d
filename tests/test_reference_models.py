"""The runner's models against Hugging Face transformers, on the committed reference fixtures.

Every directory under ``tests/fixtures/reference/`` is a tiny random checkpoint plus what
transformers computed for it (float32, eager attention; see that folder's README.md and
``scripts/fixtures/checkpoints.py``, which is the only place torch and transformers are
used: this file needs neither). For each case and each of three prompts:

- the logits of the last prompt position after a prefill agree within ``ATOL`` (absolute);
- decoding one token at a time through the runner's caches, each step's argmax is the
  reference's greedy token (24 of them) and that token's logit agrees within ``ATOL``; the
  reference tokens are fed back, so once a step disagrees the later steps still say how far
  off they are (the matched count is the greedy prefix a free-running decode would share);
- the logits after the 24th token was fed agree within ``ATOL`` (the deepest position).

Both with the model as ``load_model`` returns it and after ``runner.device.tune`` (the CPU
layout and compiled blocks). A case the runner refuses (a ``LoadError``) fails: it is a model
the runner must support. Quantized cases load the mlx-lm files and are compared with
transformers on the exact float32 dequantization of those files, at the same tolerance, with
the runner's exact quantized products (bit for bit the dequantized weights'); in the default
products (each activation quantized to int8 in two levels, about 15 bits) they must keep
every greedy token, with the logits within ``INT8_ATOL``.

One more test per family runs the real process: ``python -m runner --model DIR --no-draft``,
a ``completion`` with the longest prompt's token ids, greedy, and the streamed token ids must
be the reference's greedy tokens (the fixtures' greedy runs contain no EOS, so all 24 stream).
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from protocol.errors import LoadError
from runner import device
from runner.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "reference"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())
ATOL = 1e-4
# The default quantized products' budget: two int8 levels leave each activation about 2e-5 of
# its block's largest value off, which a few layers bring to ~1e-3 on logits of ~10.
INT8_ATOL = 5e-3
# One case per family for the pipe test: the old (Hub) config layout, the longest prompt
# (past every sliding window and LongRoPE's switch to its long factors).
PIPE_CASES = {
    "llama": "llama_default_old",
    "llama-mlx-quantized": "llama_q_mixed_4_6",
    "mistral": "mistral_sliding",
    "qwen2": "qwen2_sliding_old",
    "qwen3": "qwen3_old",
    "phi3": "phi3_longrope_old",
    "gemma2": "gemma2_old",
    "gemma3_text": "gemma3_text_old",
}
PIPE_PROMPT = 2
PIPE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Reference:
    case: str
    path: Path
    meta: dict
    prompts: list[list[int]]
    prompt_logits: np.ndarray  # [P, V]
    greedy: np.ndarray  # [P, 24]
    step_logit: np.ndarray  # [P, 24]: the chosen token's logit
    final_logits: np.ndarray  # [P, V]: after the 24th greedy token was fed


@functools.cache
def reference(case: str) -> Reference:
    path = FIXTURES / case
    meta = json.loads((path / "reference.json").read_text(encoding="utf-8"))
    with np.load(path / "reference.npz") as npz:
        prompts = [npz[f"prompt_{i}"].tolist() for i in range(len(meta["prompts"]))]
        assert prompts == meta["prompts"]
        return Reference(
            case,
            path,
            meta,
            prompts,
            npz["prompt_logits"],
            npz["greedy"],
            npz["step_logit"],
            npz["final_logits"],
        )


def load_or_fail(case: str):
    """The loaded case; a refusal (or a crash while loading) fails the test: every case is a
    checkpoint the runner must serve."""
    try:
        return load_model(str(FIXTURES / case), dtype="float32")
    except LoadError as exc:
        message = f"{case}: the runner refuses it: {type(exc).__name__}: {exc}"
    except Exception as exc:  # not even a typed refusal
        message = f"{case}: loading crashed (untyped, not a LoadError): {type(exc).__name__}: {exc}"
    pytest.fail(message, pytrace=False)


def last_row(logits: mx.array) -> np.ndarray:
    return np.array(logits[0, -1].astype(mx.float32))


@dataclass
class PromptResult:
    prompt_diff: float  # max |runner - reference| of the last prompt position's logits
    matched: int  # greedy steps, from the first, whose argmax is the reference's token
    first_miss: str  # "step i: runner X, reference Y" or ""
    step_diff: float  # max |runner - reference| of the chosen tokens' logits
    final_diff: float  # max |runner - reference| after the 24th token

    def ok(self, steps: int, atol: float) -> bool:
        return (
            self.matched == steps and max(self.prompt_diff, self.step_diff, self.final_diff) <= atol
        )


def run_prompt(model, ref: Reference, p: int) -> PromptResult:
    """Prefill ``ref.prompts[p]``, then feed the reference's greedy tokens one at a time."""
    caches = model.make_caches()
    logits, _ = model.forward(mx.array([ref.prompts[p]]), caches)
    row = last_row(logits)
    prompt_diff = float(np.abs(row - ref.prompt_logits[p]).max())
    matched, first_miss, step_diff, missed = 0, "", 0.0, False
    for i, token in enumerate(ref.greedy[p].tolist()):
        step_diff = max(step_diff, abs(float(row[token]) - float(ref.step_logit[p, i])))
        pick = int(row.argmax())
        if pick != token and not missed:
            missed = True
            first_miss = f"step {i}: runner {pick}, reference {token}"
        matched += not missed
        logits, _ = model.forward(mx.array([[token]]), caches)
        row = last_row(logits)
    final_diff = float(np.abs(row - ref.final_logits[p]).max())
    return PromptResult(prompt_diff, matched, first_miss, step_diff, final_diff)


def check_model(model, ref: Reference, how: str, atol: float = ATOL) -> None:
    steps = ref.greedy.shape[1]
    results = [run_prompt(model, ref, p) for p in range(len(ref.prompts))]
    if all(r.ok(steps, atol) for r in results):
        return
    lines = [
        f"{ref.case} ({how}) differs from transformers (atol {atol:g}; max |logit| "
        f"{ref.meta['max_abs_logit']:.2f}, smallest greedy margin "
        f"{ref.meta['min_greedy_margin']:.4f}); exercises: {ref.meta['exercises']}"
    ]
    for p, r in enumerate(results):
        lines.append(
            f"  prompt {p} ({len(ref.prompts[p])} tokens): last-prompt logits {r.prompt_diff:.2e}, "
            f"greedy {r.matched}/{steps}{' (' + r.first_miss + ')' if r.first_miss else ''}, "
            f"chosen-token logits {r.step_diff:.2e}, after 24 tokens {r.final_diff:.2e}"
        )
    pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case, exact_products):
    ref = reference(case)
    loaded = load_or_fail(case)
    check_model(loaded.model, ref, "as loaded")


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_tuned(case, exact_products):
    ref = reference(case)
    loaded = load_or_fail(case)
    tuning = device.tune(loaded.model)
    check_model(loaded.model, ref, f"tuned: {tuning.describe()}")


def quantized(case: str) -> bool:
    return "quantization" in json.loads((FIXTURES / case / "config.json").read_text())


@pytest.mark.parametrize("case", [c for c in CASES if quantized(c)])
@pytest.mark.parametrize("tuned", [False, True], ids=["as-loaded", "tuned"])
def test_quantized_cases_in_the_default_products(case, tuned):
    """The products a quantized checkpoint gets by default keep every greedy token."""
    ref = reference(case)
    loaded = load_or_fail(case)
    how = "as loaded, default products"
    if tuned:
        how = (
            f"tuned, default products: {device.tune(loaded.model, exact_products=False).describe()}"
        )
    check_model(loaded.model, ref, how, atol=INT8_ATOL)


def test_fixtures_are_complete():
    """Every case directory has its files and a usable reference (a regeneration that left
    one half-written would otherwise pass unnoticed)."""
    assert len(CASES) >= 20, CASES
    for case in CASES:
        ref = reference(case)
        for name in (
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "model.safetensors",
        ):
            assert (ref.path / name).is_file(), f"{case}: {name} missing"
        assert ref.greedy.shape == (len(ref.prompts), 24), case
        assert ref.meta["eos_token_id"] not in ref.greedy, f"{case}: EOS in the greedy tokens"
        assert ref.meta["min_greedy_margin"] > 10 * ATOL, f"{case}: greedy near tie"
    assert set(PIPE_CASES.values()) <= set(CASES)


# --- through the real pipe


class FrameReader:
    """Line-delimited JSON frames from a process's stdout, with a deadline."""

    def __init__(self, proc: subprocess.Popen, deadline: float) -> None:
        self.fd, self.deadline, self.buffer = proc.stdout.fileno(), deadline, b""

    def until(self, stop) -> list[dict]:
        """Frames up to and including the first for which ``stop`` holds (or end of output)."""
        frames = []
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                frames.append(json.loads(line))
                if stop(frames[-1]):
                    return frames
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {PIPE_TIMEOUT_S} s; last frames: {frames[-3:]}")
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    return frames
                self.buffer += chunk


@pytest.mark.parametrize("family", sorted(PIPE_CASES))
def test_pipe_streams_reference_greedy_tokens(family, tmp_path):
    case = PIPE_CASES[family]
    ref = reference(case)
    prompt, want = ref.prompts[PIPE_PROMPT], ref.greedy[PIPE_PROMPT].tolist()
    stderr = open(tmp_path / "stderr.log", "w+b")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "--model",
            str(ref.path),
            "--no-draft",
            "--dtype",
            "float32",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    deadline = time.monotonic() + PIPE_TIMEOUT_S
    reader = FrameReader(proc, deadline)
    try:
        start = reader.until(lambda f: f["type"] in ("ready", "error"))
        if not start or start[-1]["type"] != "ready":
            pytest.fail(f"{case}: no ready frame, the runner answered {start[-1:]}", pytrace=False)
        request = {
            "type": "completion",
            "id": "x",
            "tokens": prompt,
            "options": {"temperature": 0, "num_predict": len(want), "repeat_penalty": 1.0},
        }
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.close()  # end of input: the runner finishes the completion and exits 0
        frames = reader.until(lambda f: f["type"] == "done" and f.get("id") == "x")
    finally:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.seek(0)
        log = stderr.read().decode(errors="replace")[-2000:]
        stderr.close()
    errors = [f for f in frames if f["type"] == "error"]
    if errors:
        pytest.fail(f"{case}: error frames {errors}\n{log}", pytrace=False)
    got = [t for f in frames if f["type"] == "token" and f["id"] == "x" for t in f["tokens"]]
    done = frames[-1] if frames and frames[-1]["type"] == "done" else None
    eos = ref.meta["eos_token_id"]
    want = want[: want.index(eos)] if eos in want else want  # none do; a regenerated one might
    matched = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )
    if got != want:
        pytest.fail(
            f"{case} through the pipe: {matched}/{len(want)} greedy tokens match\n"
            f"  runner:    {got}\n  reference: {want}\n  done: {done}",
            pytrace=False,
        )
    assert done is not None and done["done_reason"] == "length", done
    assert proc.returncode == 0, log
