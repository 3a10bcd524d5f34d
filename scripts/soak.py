"""Soak one runner through its pipes for a bounded time, the way a hostile host would.

    python scripts/soak.py [--minutes 10] [--fuzz-per-minute 1000] [--model PATH] [--json PATH]

A mix of valid requests (greedy, seeded sampled, stop strings, logprobs, think budgets, long
prompts, with and without speculation), fuzzed lines (paced to ``--fuzz-per-minute``: 10,000
in the default 10 minutes), random cancels, injected head faults (the runner's hidden
``--inject-fault head-call=N``) and a small ``--cache-bytes``. Checked as it goes:

- every completion gets exactly one ``done`` and nothing after it;
- streamed generated ids equal ``eval_tokens`` (forced close markers aside; a stop string's
  cut tokens are counted but not streamed, so there the stream may be shorter);
- greedy and seeded requests repeat exactly, whether speculative or not, cached or not;
- every fuzzed line gets exactly one ``error`` frame, before a ``status`` fence;
- RSS grew < 5% after warm-up (the first fifth of the run), floor against floor: the lowest
  sample of the second fifth against the lowest of the last third. MLX keeps freed buffers
  for reuse, so a single sample can catch a transient peak that the next one gives back; a
  leak raises the floor.

Prints a table, writes JSON under bench-results/ (or ``--json``), exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench.common import (  # noqa: E402
    RESULTS_DIR,
    default_model_path,
    environment,
    markdown_table,
)

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain a hash table in one sentence.",
    "List three prime numbers.",
    "Say hello in Spanish.",
    "What is 12 times 12?",
    "Name a red fruit.",
    "Why is the sky blue?",
]
FILLER = " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, 400))
LONG_CHARS = (3000, 9000)  # long prompts: ~1,000 to ~3,000 tokens
KINDS = {  # kind: weight
    "greedy": 6,
    "seeded": 4,
    "stop": 2,
    "logprobs": 2,
    "think": 2,
    "long": 1,
    "cancel": 2,
    "fuzz": 3,
}


class Runner:
    """The runner process: frames by id from a reader thread; stderr drained to a file."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log
        )
        self.frames: dict[str | None, queue.Queue] = defaultdict(queue.Queue)
        self.order: queue.Queue = queue.Queue()  # (seq, frame) of every frame
        self.violations: list[str] = []
        self.lines = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.take(None, lambda f: f["type"] == "ready", timeout=600)

    def _read(self) -> None:
        for seq, line in enumerate(self.proc.stdout):
            try:
                frame = json.loads(line)
                assert isinstance(frame, dict) and "type" in frame
            except (ValueError, AssertionError):
                self.violations.append(f"not a frame: {line[:120]!r}")
                continue
            self.frames[frame.get("id")].put(frame)
            self.order.put((seq, frame))

    def send(self, request: dict | bytes) -> None:
        data = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()
        self.lines += 1

    def take(self, request_id, pred=lambda f: True, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            frame = self.frames[request_id].get(timeout=max(deadline - time.monotonic(), 0.01))
            if pred(frame):
                return frame

    def completion(self, request_id: str, timeout: float = 300) -> tuple[list[dict], dict]:
        tokens = []
        while True:
            frame = self.take(request_id, timeout=timeout)
            if frame["type"] == "done":
                return tokens, frame
            if frame["type"] != "token":
                raise AssertionError(f"{request_id}: unexpected {frame}")
            tokens.append(frame)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def close(self) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout=120)
        self.log.close()
        return code


def fuzz_line(rng: random.Random) -> bytes:
    """A line that is certainly not a valid request."""
    valid = json.dumps({"type": "completion", "id": "fz", "prompt": "hi"}).encode()
    choice = rng.randrange(10)
    if choice == 0:
        return valid[: rng.randrange(1, len(valid) - 1)]  # truncated
    if choice == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))).replace(b"\n", b"")
    if choice == 2:
        return b"[" * rng.choice([10, 1000, 100000])
    if choice == 3:
        return b'{"type":"tokenize","id":"fz","text":"\\ud8' + b"%02x" % rng.randrange(256) + b'"}'
    if choice == 4:
        kind = rng.choice(["generate", 3, None, "Completion"])
        return json.dumps({"type": kind, "id": "fz"}).encode()
    if choice == 5:
        bad = rng.choice([{"top_p": 7}, {"temperature": -1}, {"num_predict": "x"}, {"stop": [""]}])
        request = {"type": "completion", "id": "fz", "prompt": "x", "options": bad}
        return json.dumps(request).encode()
    if choice == 6:
        return json.dumps({"type": "completion", "prompt": "x"}).encode()  # no id
    if choice == 7:
        return b'{"type":"completion","id":"fz","prompt":"x","options":{"top_k":1e999}}'
    if choice == 8:
        return b" " * rng.randrange(0, 5)  # blank
    return b'{"type":"completion","id":"fz","prompt":"\xff\xfe"}'  # invalid UTF-8


FUZZ_BATCH = (20, 500)  # fuzzed lines per batch: at least (when on pace), at most


class Soak:
    def __init__(
        self, runner: Runner, rng: random.Random, fuzz_lines: int = 0, progress=lambda: 1.0
    ) -> None:
        self.runner, self.rng = runner, rng
        # Fuzzed lines are paced to reach ``fuzz_lines`` by the end (``progress``: the share
        # of the run gone by), however many requests of the other kinds the run gets through.
        self.fuzz_lines, self.progress = fuzz_lines, progress
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.expected: dict[tuple, list[int]] = {}  # request key -> ids of its first run
        self.ids = 0
        self.close_ids = self._tokenize("</think>")

    def _id(self, kind: str) -> str:
        self.ids += 1
        return f"{kind}-{self.ids}"

    def _tokenize(self, text: str) -> list[int]:
        rid = self._id("tok")
        self.runner.send({"type": "tokenize", "id": rid, "text": text})
        return self.runner.take(rid)["tokens"]

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"FAIL: {message}", file=sys.stderr)

    # -- one request of each kind ---------------------------------------------------------
    def run_one(self) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        self.counts[kind] += 1
        getattr(self, f"_{kind}")()

    def _request(self, kind: str, prompt: str, key: tuple | None, **fields) -> tuple:
        rid = self._id(kind)
        fields.setdefault("speculative", self.rng.random() < 0.7)
        self.runner.send({"type": "completion", "id": rid, "prompt": prompt, **fields})
        tokens, done = self.runner.completion(rid)
        ids = [t for f in tokens for t in f["tokens"]]
        forced = len(self.close_ids) if fields.get("think_budget") is not None else 0
        streamed = len(ids)
        ok = done["eval_tokens"] == streamed or (
            forced and done["eval_tokens"] == streamed - forced
        )
        if fields.get("options", {}).get("stop"):
            ok = ok or done["eval_tokens"] >= streamed - forced
        if not ok:
            self.fail(f"{rid}: {streamed} ids streamed, eval_tokens {done['eval_tokens']}")
        if done["speculation"]["accepted"] > done["eval_tokens"]:
            self.fail(f"{rid}: accepted {done['speculation']['accepted']} > eval_tokens")
        if key is not None and done["done_reason"] != "cancelled":
            want = self.expected.setdefault(key, ids)
            if want != ids:
                self.fail(f"{rid}: {kind} output differs from its earlier run ({key[:3]})")
            else:
                self.counts["repeats_checked"] += want is not ids
        return tokens, done

    def _question(self) -> str:
        return CHAT.format(self.rng.choice(QUESTIONS))

    def _greedy(self) -> None:
        prompt, n = self._question(), self.rng.choice([1, 2, 7, 24, 48])
        options = {"temperature": 0, "num_predict": n}
        self._request("greedy", prompt, ("greedy", prompt, n), options=options)

    def _seeded(self) -> None:
        prompt, n, seed = self._question(), self.rng.choice([3, 16, 40]), self.rng.randrange(4)
        options = {"temperature": 0.8, "top_p": 0.95, "seed": seed, "num_predict": n}
        self._request("seeded", prompt, ("seeded", prompt, n, seed), options=options)

    def _stop(self) -> None:
        prompt = self._question()
        options = {"temperature": 0, "num_predict": 40, "stop": [" the", "."]}
        tokens, _ = self._request("stop", prompt, ("stop", prompt), options=options)
        text = "".join(f["content"] for f in tokens)
        if " the" in text or "." in text:
            self.fail(f"stop string streamed: {text!r}")

    def _logprobs(self) -> None:
        prompt, top = self._question(), self.rng.choice([0, 2])
        options = {"temperature": 0, "num_predict": 16}
        tokens, _ = self._request(
            "logprobs",
            prompt,
            ("greedy", prompt, 16),
            options=options,
            logprobs=True,
            top_logprobs=top,
        )
        for frame in tokens:
            entries = frame.get("logprobs") or []
            if [e["id"] for e in entries] != frame["tokens"] or any(
                "bytes" not in e or len(e["top_logprobs"]) != top for e in entries
            ):
                self.fail(f"logprob entries do not match their frame: {frame}")

    def _think(self) -> None:
        prompt, budget = self._question() + "<think>", self.rng.randrange(0, 4)
        options = {"temperature": 0, "num_predict": 12}
        tokens, _ = self._request(
            "think", prompt, ("think", prompt, budget), options=options, think_budget=budget
        )
        text = "".join(f["content"] for f in tokens)
        if budget == 0 and not text.startswith("</think>"):
            self.fail(f"think_budget 0 did not close first: {text[:40]!r}")

    def _long(self, longest: bool = False) -> None:
        start = self.rng.randrange(0, len(FILLER) // 2)
        size = LONG_CHARS[1] if longest else self.rng.randrange(*LONG_CHARS)
        prompt = CHAT.format(FILLER[start : start + size])
        options = {"temperature": 0, "num_predict": 4}
        self._request("long", prompt, ("long", prompt), options=options)

    def _cancel(self) -> None:
        rid = self._id("cancel")
        self.runner.send(
            {
                "type": "completion",
                "id": rid,
                "prompt": self._question(),
                "options": {"temperature": 0, "num_predict": 200},
            }
        )
        time.sleep(self.rng.random() * 0.4)
        self.runner.send({"type": "cancel", "id": rid})
        _, done = self.runner.completion(rid)
        if done["done_reason"] == "cancelled":
            self.counts["cancelled"] += 1
        else:  # it finished first: the cancel gets unknown_id
            try:
                error = self.runner.take(rid)
            except queue.Empty:
                self.fail(f"{rid}: done {done['done_reason']!r} and nothing answered the cancel")
                return
            if error.get("code") != "unknown_id":
                self.fail(f"{rid}: after done, the cancel got {error}")

    def _fuzz(self, count: int | None = None) -> None:
        if count is None:
            behind = int(self.fuzz_lines * self.progress()) - self.counts["fuzzed_lines"]
            count = min(
                max(behind, self.rng.randrange(FUZZ_BATCH[0], 4 * FUZZ_BATCH[0])), FUZZ_BATCH[1]
            )
        lines = [fuzz_line(self.rng) for _ in range(count)]
        for line in lines:
            self.runner.send(line)
        fence = self._id("fence")
        self.runner.send({"type": "status", "id": fence})
        self.runner.take(fence)
        errors = 0
        for request_id in (None, "fz"):
            frames = self.runner.frames[request_id]
            while not frames.empty():
                frame = frames.get()
                if frame["type"] != "error":
                    self.fail(f"fuzzed line answered with {frame}")
                errors += 1
        if errors != len(lines):
            self.fail(f"{len(lines)} fuzzed lines, {errors} error frames")
        self.counts["fuzzed_lines"] += len(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--cache-bytes", type=int, default=48 << 20)
    parser.add_argument("--head-fault-after", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fuzz-per-minute",
        type=int,
        default=1000,
        help="fuzzed lines to send per minute of the run, paced",
    )
    parser.add_argument("--json", default=None, help="where to write the report")
    args = parser.parse_args()

    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cmd = [
        sys.executable,
        "-m",
        "runner",
        "--model",
        args.model or default_model_path(),
        "--cache-bytes",
        str(args.cache_bytes),
        "--inject-fault",
        f"head-call={args.head_fault_after}",
    ]
    runner = Runner(cmd, os.path.join(RESULTS_DIR, f"soak-{stamp}.stderr.log"))
    started = time.monotonic()
    deadline = started + args.minutes * 60
    soak = Soak(
        runner,
        random.Random(args.seed),
        int(args.fuzz_per_minute * args.minutes),
        lambda: min(1.0, (time.monotonic() - started) / (deadline - started)),
    )
    rss: list[tuple[float, int]] = [(0.0, runner.rss())]
    # Warm-up: every kind once (the longest prompt included, so the allocator has seen the
    # largest buffers), then the first fifth of the run; RSS growth is measured from there.
    for kind in KINDS:
        soak.counts[kind] += 1
        getattr(soak, f"_{kind}")(*([True] if kind == "long" else []))
    warm_at = max(time.monotonic(), started + args.minutes * 60 / 5)
    warm_rss = None
    last_sample = started
    while time.monotonic() < deadline:
        soak.run_one()
        now = time.monotonic()
        if now - last_sample >= 10:
            rss.append((round(now - started, 1), runner.rss()))
            last_sample = now
        if warm_rss is None and now >= warm_at:
            warm_rss = runner.rss()
    while soak.counts["fuzzed_lines"] < soak.fuzz_lines:  # the last of the paced lines
        soak._fuzz(min(soak.fuzz_lines - soak.counts["fuzzed_lines"], FUZZ_BATCH[1]))
    final_rss = runner.rss()
    rss.append((round(time.monotonic() - started, 1), final_rss))
    code = runner.close()
    with open(runner.log.name, "rb") as f:
        log = f.read()
    faults = log.count(b"injected draft head fault")
    if code != 0:
        soak.fail(f"runner exited {code}")
    if b"Traceback" in log and faults == 0:
        soak.fail("a traceback in the runner's log")
    soak.failures += runner.violations
    span = rss[-1][0]
    warm_floor = min(
        (b for t, b in rss if span / 5 <= t < 2 * span / 5), default=warm_rss or final_rss
    )
    end_floor = min(b for t, b in rss if t >= 2 * span / 3)
    growth = (end_floor - warm_floor) / warm_floor if warm_floor else 0.0
    if growth >= 0.05:
        soak.fail(f"RSS floor grew {growth:.1%} after warm-up ({warm_floor} -> {end_floor})")

    counts = dict(soak.counts)
    report = {
        "minutes": args.minutes,
        "requests": sum(soak.counts[k] for k in KINDS if k != "fuzz"),
        "lines_sent": runner.lines,
        "head_faults": faults,
        "counts": counts,
        "rss_bytes": rss,
        "rss_growth_after_warmup": growth,
        "failures": soak.failures,
        "environment": environment(),
    }
    rows = [[k, v] for k, v in sorted(counts.items())]
    rows += [
        ["lines sent", runner.lines],
        ["head faults", faults],
        [
            "RSS floor after warm-up -> end (MB)",
            f"{warm_floor / 2**20:.0f} -> {end_floor / 2**20:.0f} ({growth:+.1%}; "
            f"last sample {final_rss / 2**20:.0f})",
        ],
        ["failures", len(soak.failures)],
    ]
    print(markdown_table(["what", "count"], rows))
    path = args.json or os.path.join(RESULTS_DIR, f"soak-{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report: {path}")
    return 1 if soak.failures else 0


if __name__ == "__main__":
    sys.exit(main())
