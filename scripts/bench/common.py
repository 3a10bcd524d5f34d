"""The benchmarks' shared harness (scripts/bench/*.py; scripts/soak.py uses it too): the
machine's load and environment, the default model, tables and JSON under bench-results/, a
corpus for prompts, and the timed child processes below.

Every timed side runs in a process of its own, loaded once and driven one request at a time,
so configurations can be interleaved (A B C A B C ...) on a shared, noisy machine:

- ``PipeRunner``: ``python -m runner`` spoken to over its pipes, timed as a host sees it;
- ``Worker``: a benchmark worker (this runner's Engine in process, or mlx-lm in its own venv)
  that answers one JSON command per line on a private stdout descriptor.

This module imports neither mlx nor runner at the top: the mlx-lm worker imports it from a
venv that has neither the project installed nor its dependencies.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "bench-results")
BENCH_VENV = os.path.join(ROOT, ".venv-bench")
LOGS_DIR = os.path.join(RESULTS_DIR, "logs")


# ----------------------------------------------------------------------------- machine
def machine_load() -> dict:
    """Load averages and core count: how much else was running while we measured."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": one, "loadavg_5m": five, "loadavg_15m": fifteen, "cpus": os.cpu_count()}


def describe_load(samples: Sequence[dict]) -> str:
    ones = [s["loadavg_1m"] for s in samples]
    cpus = samples[0]["cpus"] if samples else os.cpu_count()
    return (
        f"load average (1 min) during the run: min {min(ones):.2f}, median "
        f"{statistics.median(ones):.2f}, max {max(ones):.2f} on {cpus} CPUs"
    )


def environment() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(), **machine_load()}


def default_model_path() -> str:
    sys.path.insert(0, ROOT)
    from runner.default_model import ensure_default_model

    return ensure_default_model()


# ----------------------------------------------------------------------------- output
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, data: dict) -> str:
    """Write ``data`` to ``name`` under bench-results/ (an absolute path is kept as is)."""
    path = os.path.join(RESULTS_DIR, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return path


def log_file(name: str) -> BinaryIO:
    """A stderr sink for a child process (a piped stderr nobody reads can stall it)."""
    os.makedirs(LOGS_DIR, exist_ok=True)
    return open(os.path.join(LOGS_DIR, name), "wb")


# ----------------------------------------------------------------------------- prompts
def corpus_text() -> str:
    """Plain English-heavy text that ships with Python itself: stable across our commits."""
    import argparse
    import subprocess as sp
    import textwrap
    import typing

    parts = []
    for module in (argparse, textwrap, typing, sp):
        with open(module.__file__, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- runner pipe


def close_child(proc: subprocess.Popen, log) -> None:
    """Close a child's stdin (its signal to exit), wait a minute, kill it if it hangs."""
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


class PipeRunner:
    """``python -m runner`` as a child process; frames are timestamped when read."""

    def __init__(self, args: Sequence[str], log_name: str) -> None:
        cmd = [sys.executable, "-m", "runner", "--log-level", "warning", *args]
        self._log = log_file(log_name)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log
        )
        self.ready: dict = {}

    def wait_ready(self) -> dict:
        for line in self.proc.stdout:
            frame = json.loads(line)
            if frame["type"] == "ready":
                self.ready = frame
                return frame
            if frame["type"] == "error":
                raise RuntimeError(f"runner failed to load: {frame}")
        raise RuntimeError(f"runner exited before ready (log in {self._log.name})")

    def tokenize(self, text: str) -> list[int]:
        self.proc.stdin.write(json.dumps({"type": "tokenize", "id": "tok", "text": text}).encode())
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            frame = json.loads(line)
            if frame.get("id") == "tok":
                if frame["type"] != "tokens":
                    raise RuntimeError(f"tokenize failed: {frame}")
                return frame["tokens"]
        raise RuntimeError("runner exited during tokenize")

    def complete(self, request: dict) -> dict:
        """Send one completion and read its frames; times are seconds since the send."""
        line = json.dumps({"type": "completion", **request}).encode() + b"\n"
        tokens: list[tuple[float, list[int]]] = []
        t0 = time.perf_counter()
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        while True:
            raw = self.proc.stdout.readline()
            now = time.perf_counter() - t0
            if not raw:
                raise RuntimeError(f"runner exited mid-request (log in {self._log.name})")
            frame = json.loads(raw)
            if frame.get("id") != request["id"]:
                continue
            if frame["type"] == "token":
                tokens.append((now, frame["tokens"]))
            elif frame["type"] == "error":
                raise RuntimeError(f"runner refused or failed the request: {frame}")
            elif frame["type"] == "done":
                return {"tokens": tokens, "done_at": now, "done": frame}

    def close(self) -> None:
        close_child(self.proc, self._log)


# ----------------------------------------------------------------------------- workers
class Worker:
    """A child that answers one JSON command per line (see ``serve_worker``)."""

    def __init__(self, argv: Sequence[str], log_name: str, env: dict | None = None) -> None:
        self._log = log_file(log_name)
        self.proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self.info = self.read()

    def read(self) -> dict:
        raw = self.proc.stdout.readline()
        if not raw:
            raise RuntimeError(f"worker exited (log in {self._log.name})")
        reply = json.loads(raw)
        if "error" in reply:
            raise RuntimeError(f"worker failed: {reply['error']}")
        return reply

    def call(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        close_child(self.proc, self._log)


def preload_runner_blas(threads: int | None = None) -> Any:
    """In a reference venv (mlx-lm's), the runner's BLAS preload before mlx is imported, with
    the project's MKL (it lives in .venv, not in the reference venv), so both sides of a
    benchmark multiply with the same library; ``threads`` sets ``MKL_NUM_THREADS`` unless the
    caller's environment did. Returns ``runner.blas``."""
    sys.path.insert(0, ROOT)
    import runner.blas

    mkl = os.path.join(ROOT, ".venv", "lib", "libmkl_rt.so.3")
    if os.path.exists(mkl):
        os.environ.setdefault("MTP_RUNNER_MKL", mkl)
    if threads is not None:
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    runner.blas.preload()
    return runner.blas


def serve_worker(info: dict, handle: Callable[[dict], dict]) -> None:
    """The worker side: print ``info``, then answer each command line with ``handle``.

    Replies go to a private copy of stdout; descriptor 1 is pointed at stderr so that prints
    from libraries cannot corrupt the reply stream.
    """
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply(info)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply(handle(json.loads(line)))
        except Exception as exc:  # report, keep serving: the parent decides what to do
            reply({"error": f"{type(exc).__name__}: {exc}"})


def engine_worker(model_path: str, engine_options: dict) -> None:
    """This runner's Engine in process: ``{"request": {...completion...}}`` -> timings.

    Times are seconds since ``engine.run`` was called, taken in the emit callback, so they
    include everything the engine does but no encoding, pipe or host.
    """
    sys.path.insert(0, ROOT)
    import msgspec

    import runner
    from protocol import frames as pf
    from protocol.requests import Completion
    from runner.engine import Engine, EngineOptions

    engine = Engine(EngineOptions(model_path=model_path, **engine_options))

    def handle(command: dict) -> dict:
        request = msgspec.convert(command["request"], Completion)
        prepared = engine.prepare(request)
        tokens: list[tuple[float, list[int]]] = []
        done: dict = {}
        errors: list[str] = []
        t0 = time.perf_counter()

        def emit(frame) -> None:
            now = time.perf_counter() - t0
            if isinstance(frame, pf.Token):
                tokens.append((now, list(frame.tokens)))
            elif isinstance(frame, pf.Done):
                done.update(msgspec.to_builtins(frame), done_at=now)
            elif isinstance(frame, pf.Error):
                errors.append(f"{frame.code}: {frame.message}")

        engine.run(prepared, emit, lambda: False)
        if errors:
            raise RuntimeError(f"engine error: {errors[0]}")
        return {"tokens": tokens, "done_at": done.pop("done_at"), "done": done}

    serve_worker({"blas": runner.blas.blas_in_use(), "model": engine.info.model}, handle)


# ----------------------------------------------------------------------------- random checkpoints
def write_word_tokenizer(directory: str, vocab_size: int, eos: str) -> None:
    """A word-level tokenizer over a random checkpoint's whole vocabulary (``t0``, ``t1``,
    ...; id 2 is ``eos``): the runner's loader wants one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab[eos] = 2
    del vocab["t2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    meta = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": None,
        "add_bos_token": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)


def random_prompt(length: int, vocab_size: int, seed: int = 7) -> list[int]:
    """Token ids for a random checkpoint (ids 0-2 are left to the special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def runner_and_mlx_lm(script: str, directory: str, name: str, python: str) -> dict[str, Worker]:
    """The two sides of a benchmark against mlx-lm: ``script --runner-worker DIR`` here and
    ``script --mlx-lm-worker DIR`` under ``python`` (a venv with mlx-lm), logs named after
    ``name``."""
    if not os.path.exists(python):
        raise SystemExit(f"{python} (a venv with mlx-lm) is missing")
    env = dict(os.environ, PYTHONPATH=ROOT)
    here = os.path.abspath(script)
    return {
        "runner": Worker(
            [sys.executable, here, "--runner-worker", directory], f"{name}-runner.log", env=env
        ),
        "mlx-lm": Worker(
            [python, here, "--mlx-lm-worker", directory], f"{name}-mlx-lm.log", env=env
        ),
    }


def generation_summary(reply: dict, prompt_len: int) -> dict:
    """A worker's generate reply as rates: prefill and decode tokens per second, the ids."""
    if "error" in reply:
        raise SystemExit(reply["error"])
    return {
        "ids": flatten_ids(reply["tokens"]),
        "prefill_tps": prompt_len / reply["prefill_s"],
        "decode_tps": interval_rate(reply["tokens"]),
        "load": machine_load(),
    }


def engine_generate(engine: Any, prompt: list[int], n: int) -> dict:
    """``n`` greedy tokens after ``prompt`` through the runner's ``Engine`` in process: each
    token frame's arrival time and ids, and the prefill's seconds (the done frame's)."""
    from protocol import frames as pf
    from protocol.requests import Completion, Options

    options = Options(temperature=0, repeat_penalty=1.0, num_predict=n)
    request = Completion(id="b", tokens=prompt, options=options)
    tokens, done = [], {}
    t0 = time.perf_counter()

    def emit(frame) -> None:
        if isinstance(frame, pf.Token):
            tokens.append((time.perf_counter() - t0, list(frame.tokens)))
        elif isinstance(frame, pf.Done):
            done["prefill_s"] = frame.prompt_eval_ns / 1e9

    engine.run(engine.prepare(request), emit, lambda: False)
    return {"tokens": tokens, "prefill_s": done["prefill_s"]}


def mlx_lm_side(directory: str) -> tuple[Any, Callable[[dict], dict], dict]:
    """Inside a venv with mlx-lm: its own model of ``directory``, a greedy ``generate``
    command (``prompt``, ``n``: arrival times and ids, the first token's time as prefill) and
    the worker's info. MKL runs on every core for everything, as mlx-lm runs by default (the
    runner's own split would give it one fewer core for decoding, which it never widens for
    its prefill)."""
    blas = preload_runner_blas(threads=os.cpu_count() or 1)
    import importlib.metadata
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(directory))

    def greedy(logprobs: Any) -> Any:
        return mx.argmax(logprobs, axis=-1)

    def generate(command: dict) -> dict:
        tokens = []
        t0 = time.perf_counter()
        prompt = mx.array(command["prompt"])
        for token, _ in generate_step(prompt, model, max_tokens=command["n"], sampler=greedy):
            tokens.append((time.perf_counter() - t0, [int(token)]))
        return {"tokens": tokens, "prefill_s": tokens[0][0]}

    info = {
        "blas": f"{blas.blas_in_use()}, MKL_NUM_THREADS={os.environ['MKL_NUM_THREADS']}",
        "mlx": mx.__version__,
        "mlx_lm": importlib.metadata.version("mlx-lm"),
    }
    return model, generate, info


# ----------------------------------------------------------------------------- token timing
def flatten_ids(tokens: Sequence[tuple[float, list[int]]]) -> list[int]:
    return [i for _, ids in tokens for i in ids]


def interval_rate(tokens: Sequence[tuple[float, list[int]]]) -> float:
    """Tokens per second between the first and the last token arrival: the ids that arrived
    after the first frame over the time they took (no prefill, no end-of-request work)."""
    if len(tokens) < 2:
        return float("nan")
    span = tokens[-1][0] - tokens[0][0]
    after_first = sum(len(ids) for _, ids in tokens[1:])
    return after_first / span if span > 0 else float("nan")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Where two token sequences first differ (the shorter one's length when one is a prefix
    of the other); None when they are equal."""
    if list(a) == list(b):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def versus_summary(runs: dict[str, list[dict]], keys: Sequence[str]) -> dict[str, dict]:
    """Median of each key per side of a runner / mlx-lm benchmark, and on the runner's side
    the ratio of the medians and the median of the paired (same round) ratios."""
    summary = {side: {k: median([r[k] for r in rows]) for k in keys} for side, rows in runs.items()}
    ours, theirs = summary["runner"], summary["mlx-lm"]
    for key in keys:
        pairs = zip(runs["runner"], runs["mlx-lm"], strict=True)
        ours[f"{key}_paired_ratio"] = median([a[key] / b[key] for a, b in pairs])
        ours[f"{key}_ratio"] = ours[key] / theirs[key]
    return summary


def print_versus_footer(
    info: dict, ids: dict, prompt_len: int, decoded: int, reps: int, elapsed: float
) -> int | None:
    """The closing lines of a runner / mlx-lm benchmark: both sides' set-up and whether their
    greedy tokens agree; returns the first difference."""
    same = first_difference(ids["runner"], ids["mlx-lm"])
    print(
        f"runner: {info['runner']['tuning']}; BLAS runner {info['runner']['blas']}, mlx-lm "
        f"{info['mlx-lm']['blas']}; mlx {info['mlx-lm']['mlx']}, mlx-lm "
        f"{info['mlx-lm']['mlx_lm']}"
    )
    print(
        f"greedy tokens {'identical' if same is None else f'differ from index {same}'} "
        f"({len(ids['runner'])} vs {len(ids['mlx-lm'])}); {prompt_len}-token prompt, "
        f"{decoded} decoded, medians of {reps}; {elapsed:.0f} s in all"
    )
    return same


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def engine_worker_argv(model_path: str, engine_options: dict) -> list[str]:
    """The command line that starts ``engine_worker`` in this interpreter."""
    script = os.path.abspath(__file__)
    return [sys.executable, script, "engine-worker", model_path, json.dumps(engine_options)]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "engine-worker":
        engine_worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        raise SystemExit("usage: common.py engine-worker MODEL OPTIONS_JSON (internal)")
