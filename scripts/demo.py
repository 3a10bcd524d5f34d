"""Chat with the runner the way a host does: spawn it, write JSON lines, stream the answer.

    python scripts/demo.py                                  # the embedded default model
    python scripts/demo.py --model path/to/model.gguf --prompt "Why is the sky blue?"
    python scripts/demo.py --follow-up "And at sunset?"     # a second turn: prefix cache hit

Prints the answer as it streams, then the done statistics: tokens per second, how much of the
prompt came from the prefix cache, and what speculation did. Runner logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def chatml(turns: list[tuple[str, str]]) -> str:
    """ChatML for (role, text) turns, ending with an open assistant turn."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


class Runner:
    """A runner child process spoken to over its pipes."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def frames(self):
        for line in self.proc.stdout:
            yield json.loads(line)

    def wait_ready(self) -> dict:
        for frame in self.frames():
            if frame["type"] == "progress":
                print(
                    f"loading: {frame['stage']} {frame['done']}/{frame['total']}", file=sys.stderr
                )
            elif frame["type"] == "ready":
                return frame
            elif frame["type"] == "error":
                raise SystemExit(f"runner failed to start: [{frame['code']}] {frame['message']}")
        raise SystemExit("runner exited before it was ready")

    def close(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait()


def ask(runner: Runner, request_id: str, prompt: str, options: dict) -> tuple[str, dict]:
    """Send one completion; print its text as it streams; return the text and the done frame."""
    runner.send({"type": "completion", "id": request_id, "prompt": prompt, "options": options})
    parts = []
    for frame in runner.frames():
        if frame.get("id") != request_id:
            continue
        if frame["type"] == "token":
            parts.append(frame["content"])
            print(frame["content"], end="", flush=True)
        elif frame["type"] == "error":
            print(f"\n[error {frame['code']}] {frame['message']}", file=sys.stderr)
        elif frame["type"] == "done":
            print()
            return "".join(parts), frame
    raise SystemExit("runner exited mid-answer")


def describe(done: dict) -> str:
    seconds = done["eval_ns"] / 1e9
    rate = done["eval_tokens"] / seconds if seconds > 0 else 0.0
    lines = [
        f"--- {done['done_reason']}: {done['eval_tokens']} tokens in {seconds:.2f} s "
        f"({rate:.1f} tokens/s)",
        f"prompt: {done['prompt_tokens']} tokens, {done['prompt_cached_tokens']} from the prefix "
        f"cache, evaluated in {done['prompt_eval_ns'] / 1e9:.2f} s",
    ]
    spec = done["speculation"]
    if spec["rounds"]:
        rate = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
        lines.append(
            f"speculation: {spec['rounds']} rounds, {spec['accepted']}/{spec['drafted']} drafts "
            f"accepted ({rate:.0%}), per depth {spec['accepted_per_depth']}, "
            f"final depth {spec['final_depth']}"
        )
    else:
        lines.append("speculation: none this request")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model path (default: the embedded default model)")
    p.add_argument("--draft", help="MTP head sidecar directory")
    p.add_argument("--no-draft", action="store_true", help="plain decoding only")
    p.add_argument("--prompt", default=DEFAULT_QUESTION, help="the user's question")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--follow-up", default=None, help="a second question in the same chat")
    p.add_argument("--num-predict", type=int, default=256, help="token budget per answer")
    p.add_argument("--temperature", type=float, default=None, help="default: the runner's")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--runner-arg", action="append", default=[], help="extra runner flag (repeatable)"
    )
    args = p.parse_args(argv)

    command = [sys.executable, "-m", "runner", "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    if args.draft:
        command += ["--draft", args.draft]
    if args.no_draft:
        command.append("--no-draft")
    command += args.runner_arg

    options: dict = {"num_predict": args.num_predict}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.seed is not None:
        options["seed"] = args.seed

    runner = Runner(command)
    started = time.perf_counter()
    ready = runner.wait_ready()
    print(
        f"model {ready['model']} ready in {time.perf_counter() - started:.1f} s "
        f"(context {ready['context_length']}, MTP: {ready['mtp_detail']})",
        file=sys.stderr,
    )
    turns = [("system", args.system)] if args.system else []
    turns.append(("user", args.prompt))
    answer, done = ask(runner, "demo-1", chatml(turns), options)
    print(describe(done))
    if args.follow_up:
        turns += [("assistant", answer), ("user", args.follow_up)]
        _, done = ask(runner, "demo-2", chatml(turns), options)
        print(describe(done))
    status = runner.close()
    return 0 if status == 0 and done["done_reason"] != "error" else 1


if __name__ == "__main__":
    raise SystemExit(main())
