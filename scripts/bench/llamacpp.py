"""This runner against llama.cpp on the same GGUF file: decode, prefill, memory, greedy agreement.

Both sides load the same file (by default the runner's embedded SmolLM2-135M-Instruct Q4_1
GGUF) and see the same prompt token ids, made by the runner's tokenizer:

- llama.cpp through ``llama-cpp-python``, built from its PyPI sdist (which compiles llama.cpp
  with ``CMAKE_ARGS``, default ``-DGGML_NATIVE=ON``) in its own venv, ``.venv-llamacpp``,
  created on first use and reused after; never a project dependency. It runs once per
  ``--threads`` value (``n_threads`` = ``n_threads_batch``). Greedy is the argmax of the last
  row of logits after each ``Llama.eval``, one token fed per step, llama.cpp's sampler unused;
- the runner: its Engine in process, built from a command line parsed by the runner's own CLI
  parser (``--model FILE`` plus every ``--runner-arg``), so the engine is configured exactly
  as ``python -m runner`` with those flags would be. It decodes each prompt plainly
  (``speculative: false``) and with its MTP head (the default, adaptive depth), temperature 0,
  no repeat penalty; it picks its own threads (see README: ``MTP_RUNNER_DECODE_THREADS``).

Measures, per side:

- decode tok/s: ``--tokens`` greedy tokens after a chat prompt; the tokens after the first
  over the time between the first and the last token (no prefill, no end-of-request work);
  an end-of-turn token ends decoding on both sides;
- prefill tok/s at each ``--prompt-lengths``: a window of the corpus text
  (``common.corpus_text``), a different one per length and round, so no cache holds it; time
  from the request to its first token (the runner's ``prompt_eval_ns``; llama.cpp's ``eval``
  over the prompt plus one argmax). Both prefill in chunks of 512 (runner ``prefill_chunk``,
  llama.cpp ``n_batch``);
- memory: the process's VmRSS after load and VmHWM (peak resident) at the end, from
  /proc/self/status; llama.cpp maps the file, so its RSS counts the mapped weights it touched;
- agreement: each side's greedy ids against the runner's plain ids: the share of tokens
  before the first divergence, and of identical positions overall.

Every side runs in a fresh process per round (load, one untimed short decode, then timed
work); ``--rounds`` rounds alternate which side goes first. Reports medians, the runner's
ratios to the best llama.cpp thread count, and writes raw JSON under bench-results/. Usage:

    .venv/bin/python scripts/bench/llamacpp.py [--rounds 3] [--tokens 128]
        [--prompt-lengths 512,1500] [--threads 1,2] [--runner-arg=--keep-quantized ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as bc  # noqa: E402

LLAMA_VENV = os.path.join(bc.ROOT, ".venv-llamacpp")
LLAMA_PYTHON = os.path.join(LLAMA_VENV, "bin", "python")
RUNNER_PYTHON = os.path.join(bc.ROOT, ".venv", "bin", "python")
if not os.path.exists(RUNNER_PYTHON):  # a checkout set up another way: this interpreter
    RUNNER_PYTHON = sys.executable
LLAMA_CPP_SPEC = "llama-cpp-python==0.3.36"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# A request the model answers at length (checked on every run: a side that stops early is
# reported with the tokens it generated).
DECODE_QUESTION = (
    "Write a long, detailed story about an old lighthouse keeper who records the weather, the "
    "ships and the birds in his notebooks for forty years."
)
WARMUP_TOKENS = 16
WARMUP_PREFILL = 512
RUNNER, MTP = "runner", "runner MTP"
HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------- both workers
def proc_memory() -> dict:
    """This process's resident memory in MiB (VmRSS, VmHWM = peak, RssAnon, RssFile)."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields


# ----------------------------------------------------------------------------- llama.cpp
def ensure_llama_venv(skip_build: bool) -> str:
    """The python of .venv-llamacpp with llama_cpp importable; builds it when missing."""
    probe = [LLAMA_PYTHON, "-c", "import llama_cpp"]
    if os.path.exists(LLAMA_PYTHON) and subprocess.run(probe, capture_output=True).returncode == 0:
        return LLAMA_PYTHON
    if skip_build:
        raise SystemExit(f"--skip-build: no usable llama-cpp-python in {LLAMA_VENV}")
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON")
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    print(f"creating {LLAMA_VENV} (python {sys.version.split()[0]})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", LLAMA_VENV], check=True)
    print(
        f"building {LLAMA_CPP_SPEC} from source with CMAKE_ARGS={env['CMAKE_ARGS']!r}: it "
        "compiles llama.cpp, which takes many minutes on few cores; compiler lines follow",
        file=sys.stderr,
    )
    started = time.perf_counter()
    cmd = [LLAMA_PYTHON, "-m", "pip", "install", "-v", "--no-binary", "llama-cpp-python"]
    with subprocess.Popen(
        [*cmd, LLAMA_CPP_SPEC], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as pip:
        for raw in pip.stdout:
            line = raw.decode(errors="replace").strip()
            # Ninja's "[k/n]" lines are the compile progress; the rest is pip's chatter.
            if line.startswith("[") or line.startswith(("Successfully", "ERROR", "error")):
                elapsed = time.perf_counter() - started
                print(f"  {elapsed:6.0f} s  {line[:100]}", file=sys.stderr)
    if pip.returncode != 0:
        raise SystemExit(f"pip install {LLAMA_CPP_SPEC} failed (exit {pip.returncode})")
    print(f"built in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return LLAMA_PYTHON


def llama_worker(model: str, threads: int, n_ctx: int, flash_attn: bool) -> None:
    """Runs inside .venv-llamacpp: llama.cpp's forward, greedy by argmax over its logits."""
    import ctypes

    import llama_cpp
    import numpy as np

    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=512,
        flash_attn=flash_attn,
        verbose=False,
    )
    load_s = time.perf_counter() - started
    n_vocab = llm.n_vocab()
    logits_type = ctypes.POINTER(ctypes.c_float)

    def greedy() -> int:
        # The logits of the last row evaluated, read in place from llama.cpp's buffer.
        pointer = ctypes.cast(llama_cpp.llama_get_logits_ith(llm.ctx, -1), logits_type)
        return int(np.argmax(np.ctypeslib.as_array(pointer, shape=(n_vocab,))))

    def decode(command: dict) -> dict:
        eos = set(command["eos"])
        llm.reset()  # the next eval drops every cached position from 0 on
        t0 = time.perf_counter()
        llm.eval(command["prompt"])
        token = greedy()
        tokens: list[tuple[float, list[int]]] = []
        while token not in eos:
            tokens.append((time.perf_counter() - t0, [token]))
            if len(tokens) == command["n"]:
                break
            llm.eval([token])
            token = greedy()
        return {"tokens": tokens, "done_reason": "length" if token not in eos else "stop"}

    def prefill(command: dict) -> dict:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(command["prompt"])
        greedy()
        return {"seconds": time.perf_counter() - t0, "cached": 0}

    def handle(command: dict) -> dict:
        if command["op"] == "memory":
            return proc_memory()
        return decode(command) if command["op"] == "decode" else prefill(command)

    info = {
        "load_s": load_s,
        "memory_after_load": proc_memory(),
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "n_ctx": n_ctx,
        "threads": threads,
        "flash_attn": flash_attn,
    }
    bc.serve_worker(info, handle)


# ----------------------------------------------------------------------------- runner
def tokenizer_worker(model: str) -> None:
    """Runs in .venv: the runner's tokenizer for the prompts both sides are given."""
    import logging

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    sys.path.insert(0, bc.ROOT)
    from runner.loader import load_model

    tokenizer = load_model(model).tokenizer

    def handle(command: dict) -> dict:
        return {"tokens": [tokenizer.encode(text) for text in command["texts"]]}

    bc.serve_worker({"eos": sorted(tokenizer.eos_ids)}, handle)


def runner_worker(model: str, runner_args: list[str]) -> None:
    """Runs in .venv: the Engine the runner's CLI builds from ``--model`` and ``runner_args``."""
    import logging

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    sys.path.insert(0, bc.ROOT)
    import msgspec

    import runner
    from protocol import frames as pf
    from protocol.requests import Completion
    from runner import cli

    args = cli.build_parser().parse_args(["--model", model, *runner_args])
    started = time.perf_counter()
    engine = cli.engine_factory(args)(lambda stage, done, total: None)
    load_s = time.perf_counter() - started

    def complete(request: dict) -> tuple[list[tuple[float, list[int]]], dict]:
        prepared = engine.prepare(msgspec.convert(request, Completion))
        tokens: list[tuple[float, list[int]]] = []
        done: dict = {}
        errors: list[str] = []
        t0 = time.perf_counter()

        def emit(frame) -> None:
            if isinstance(frame, pf.Token):
                tokens.append((time.perf_counter() - t0, list(frame.tokens)))
            elif isinstance(frame, pf.Done):
                done.update(msgspec.to_builtins(frame))
            elif isinstance(frame, pf.Error):
                errors.append(f"{frame.code}: {frame.message}")

        engine.run(prepared, emit, lambda: False)
        if errors:
            raise RuntimeError(f"engine error: {errors[0]}")
        return tokens, done

    def handle(command: dict) -> dict:
        if command["op"] == "memory":
            return proc_memory()
        n = command.get("n", 1)
        options = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": n}
        request = {
            "id": "bench",
            "tokens": command["prompt"],
            "options": options,
            "speculative": command.get("speculative", False),
        }
        tokens, done = complete(request)
        if command["op"] == "prefill":
            seconds = done["prompt_eval_ns"] / 1e9
            return {"seconds": seconds, "cached": done["prompt_cached_tokens"]}
        return {"tokens": tokens, "done_reason": done["done_reason"], "done": done}

    info = {
        "load_s": load_s,
        "memory_after_load": proc_memory(),
        "runner_args": runner_args,
        "blas": runner.blas.blas_in_use(),
        "tuning": engine.info.tuning,
        "mtp": engine.head is not None,
        "mtp_detail": engine.info.mtp_detail,
    }
    bc.serve_worker(info, handle)


# ----------------------------------------------------------------------------- one process
def side_names(threads: list[int]) -> list[str]:
    return [f"llama.cpp {t}T" for t in threads] + [RUNNER]


def start_side(side: str, args: argparse.Namespace, n_ctx: int, tag: str) -> bc.Worker:
    if side == RUNNER:
        argv = [RUNNER_PYTHON, HERE, "--runner-worker", args.model]
        argv += ["--runner-args-json", json.dumps(args.runner_arg)]
        return bc.Worker(argv, f"llamacpp-runner-{tag}.log")
    threads = int(side.split()[1].rstrip("T"))
    argv = [LLAMA_PYTHON, HERE, "--llama-worker", args.model, str(threads), str(n_ctx)]
    if args.llama_flash_attn:
        argv.append("--llama-flash-attn")
    return bc.Worker(argv, f"llamacpp-llama{threads}-{tag}.log")


def decode_result(reply: dict) -> dict:
    result = {
        "ids": bc.flatten_ids(reply["tokens"]),
        "first_token_s": reply["tokens"][0][0] if reply["tokens"] else float("nan"),
        "wall_tps": bc.interval_rate(reply["tokens"]),
        "done_reason": reply["done_reason"],
    }
    if "done" in reply:
        done = reply["done"]
        result["reported_tps"] = (
            done["eval_tokens"] / done["eval_ns"] * 1e9 if done["eval_ns"] else 0
        )
        result["speculation"] = done.get("speculation")
    return result


def run_side(side: str, args, n_ctx: int, prompts: dict, round_no: int) -> dict:
    """One fresh process: load, warm up, decode (runner: plain and MTP), prefill, memory."""
    started = time.perf_counter()
    worker = start_side(side, args, n_ctx, f"r{round_no}")
    try:
        out: dict = {"info": worker.info, "load": bc.machine_load()}
        decode = {"op": "decode", "prompt": prompts["decode"], "eos": prompts["eos"]}
        worker.call({**decode, "n": WARMUP_TOKENS})  # untimed: first-call allocations
        if side == RUNNER:
            arms = [False, True] if worker.info["mtp"] else [False]
            if round_no % 2:
                arms.reverse()  # which arm runs first alternates with the rounds too
            for speculative in arms:
                reply = worker.call({**decode, "n": args.tokens, "speculative": speculative})
                out[MTP if speculative else RUNNER] = decode_result(reply)
        else:
            out["decode"] = decode_result(worker.call({**decode, "n": args.tokens}))
        # Untimed: the first full-chunk forward allocates what every later chunk reuses.
        worker.call({"op": "prefill", "prompt": prompts["warmup_prefill"][round_no]})
        out["prefill"] = {}
        for length, prompt in prompts["prefill"][round_no].items():
            reply = worker.call({"op": "prefill", "prompt": prompt})
            reply["tps"] = int(length) / reply["seconds"]
            out["prefill"][length] = reply
        out["memory_end"] = worker.call({"op": "memory"})
    finally:
        worker.close()
    out["process_s"] = time.perf_counter() - started
    return out


# ----------------------------------------------------------------------------- prompts
def make_prompts(args: argparse.Namespace) -> dict:
    """The decode prompt and, per round and length, a corpus window no other prompt shares."""
    worker = bc.Worker([RUNNER_PYTHON, HERE, "--tokenizer-worker", args.model], "llamacpp-tok.log")
    try:
        texts = [CHAT.format(DECODE_QUESTION), bc.corpus_text()]
        decode, corpus = worker.call({"texts": texts})["tokens"]
        eos = worker.info["eos"]
    finally:
        worker.close()
    need = args.rounds * sum(n + 1 for n in [WARMUP_PREFILL, *args.prompt_lengths])
    if need > len(corpus):
        raise SystemExit(f"the corpus has {len(corpus)} tokens; these rounds need {need}")
    cursor, prefill, warmup = 0, [], []
    for _ in range(args.rounds):
        warmup.append(corpus[cursor : cursor + WARMUP_PREFILL])
        cursor += WARMUP_PREFILL + 1
        windows = {}
        for n in args.prompt_lengths:
            windows[str(n)] = corpus[cursor : cursor + n]
            cursor += n + 1  # a gap, so no window continues the one before it
        prefill.append(windows)
    return {"decode": decode, "eos": eos, "prefill": prefill, "warmup_prefill": warmup}


# ----------------------------------------------------------------------------- report
def agreement(reference: list[int], ids: list[int]) -> dict:
    """Share of the reference's tokens before the first divergence, and overall."""
    n = max(len(reference), len(ids), 1)
    prefix = 0
    for a, b in zip(reference, ids, strict=False):
        if a != b:
            break
        prefix += 1
    same = sum(a == b for a, b in zip(reference, ids, strict=False))
    return {"prefix": prefix / n, "overall": same / n, "first_divergence": prefix, "len": len(ids)}


def summarize(args, sides: list[str], runs: dict[str, list[dict]]) -> dict:
    rows: dict[str, dict] = {}
    llamas = [s for s in sides if s != RUNNER]
    arms = [RUNNER] + ([MTP] if MTP in runs[RUNNER][0] else [])
    reference = [r[RUNNER]["ids"] for r in runs[RUNNER]]
    for side in llamas + arms:
        process = RUNNER if side in arms else side
        decodes = [r[side] if side in arms else r["decode"] for r in runs[process]]
        agree = [agreement(ref, d["ids"]) for ref, d in zip(reference, decodes, strict=True)]
        rows[side] = {
            "decode_tps": bc.median([d["wall_tps"] for d in decodes]),
            "prefill_tps": {
                str(n): bc.median([r["prefill"][str(n)]["tps"] for r in runs[process]])
                for n in args.prompt_lengths
            },
            "rss_after_load_mib": bc.median(
                [r["info"]["memory_after_load"]["VmRSS"] for r in runs[process]]
            ),
            "peak_rss_mib": bc.median([r["memory_end"]["VmHWM"] for r in runs[process]]),
            "tokens": [len(d["ids"]) for d in decodes],
            "agreement_prefix": bc.median([a["prefix"] for a in agree]),
            "agreement_overall": bc.median([a["overall"] for a in agree]),
            "agreement_runs": agree,
            "stable_across_rounds": all(d["ids"] == decodes[0]["ids"] for d in decodes),
        }
    best = {"decode": max(rows[s]["decode_tps"] for s in llamas)}
    for n in args.prompt_lengths:
        best[str(n)] = max(rows[s]["prefill_tps"][str(n)] for s in llamas)
    for side in arms:
        rows[side]["x_best_llama_decode"] = rows[side]["decode_tps"] / best["decode"]
        rows[side]["x_best_llama_prefill"] = {
            k: rows[side]["prefill_tps"][k] / best[k] for k in rows[side]["prefill_tps"]
        }
        # Paired: each round's runner number over that round's best llama.cpp number.
        paired = []
        for i, r in enumerate(runs[RUNNER]):
            best_here = max(runs[s][i]["decode"]["wall_tps"] for s in llamas)
            paired.append(r[side]["wall_tps"] / best_here)
        rows[side]["x_best_llama_decode_paired"] = bc.median(paired)
    return rows


def print_report(args, rows: dict, runs: dict, sides: list[str]) -> None:
    lengths = [str(n) for n in args.prompt_lengths]
    headers = ["side", "decode tok/s", *[f"prefill {n} tok/s" for n in lengths]]
    headers += ["RSS after load MiB", "peak RSS MiB", "agreement prefix / overall", "tokens"]
    table = []
    for side, row in rows.items():
        ratio = "x_best_llama_decode" in row
        cells = [side, f"{row['decode_tps']:.2f}"]
        if ratio:
            cells[1] += f" ({row['x_best_llama_decode']:.2f}x)"
        for n in lengths:
            cell = f"{row['prefill_tps'][n]:.1f}"
            if ratio and side == RUNNER:
                cell += f" ({row['x_best_llama_prefill'][n]:.2f}x)"
            cells.append(cell if side != MTP else "-")
        memory = [f"{row['rss_after_load_mib']:.0f}", f"{row['peak_rss_mib']:.0f}"]
        cells += memory if side != MTP else ["-", "-"]
        cells.append(f"{row['agreement_prefix']:.3f} / {row['agreement_overall']:.3f}")
        cells.append("/".join(str(t) for t in sorted(set(row["tokens"]))))
        table.append(cells)
    print()
    print(bc.markdown_table(headers, table))
    print()
    print(
        f"medians of {args.rounds} rounds, each side a fresh process per round; (Nx) = runner / "
        "best llama.cpp thread count; agreement = share of the runner's plain greedy ids "
        "matched before the first divergence / at the same positions"
    )
    print(bc.describe_load([r["load"] for s in sides for r in runs[s]]))
    info = runs[RUNNER][0]["info"]
    print(f"runner: args {info['runner_args']}; {info['tuning']}; blas {info['blas']}")
    print(f"runner head: {info['mtp_detail']}")
    llama_info = runs[sides[0]][0]["info"]
    print(f"llama-cpp-python {llama_info['llama_cpp_python']}: {llama_info['system_info']}")
    for side, row in rows.items():
        if not row["stable_across_rounds"]:
            print(f"WARNING: {side} generated different ids in different rounds")
        if any(t != args.tokens for t in row["tokens"]):
            print(f"WARNING: {side} stopped before {args.tokens} tokens: {row['tokens']}")
    if MTP in rows and rows[MTP]["agreement_overall"] != 1.0:
        print("WARNING: the runner's MTP ids differ from its plain ids")


# ----------------------------------------------------------------------------- main
def comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side (3)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens to decode (128)")
    parser.add_argument(
        "--prompt-lengths",
        type=comma_ints,
        default=[512, 1500],
        help="prompt lengths to prefill, comma list (512,1500)",
    )
    parser.add_argument(
        "--threads", type=comma_ints, default=[1, 2], help="llama.cpp thread counts (1,2)"
    )
    parser.add_argument(
        "--runner-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="a runner CLI argument for its engine (repeatable; write --runner-arg=--flag)",
    )
    parser.add_argument(
        "--skip-build", action="store_true", help="fail instead of building .venv-llamacpp"
    )
    parser.add_argument(
        "--llama-flash-attn", action="store_true", help="llama.cpp with flash attention on"
    )
    parser.add_argument("--out", default="llamacpp.json", help="file name under bench-results/")
    parser.add_argument("--llama-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--runner-worker", help=argparse.SUPPRESS)
    parser.add_argument("--runner-args-json", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.llama_worker:
        model, threads, n_ctx = args.llama_worker
        llama_worker(model, int(threads), int(n_ctx), args.llama_flash_attn)
        return 0
    if args.runner_worker:
        runner_worker(args.runner_worker, json.loads(args.runner_args_json))
        return 0
    if args.tokenizer_worker:
        tokenizer_worker(args.tokenizer_worker)
        return 0

    args.model = os.path.abspath(args.model or bc.default_model_path())
    if not os.path.isfile(args.model):
        raise SystemExit(f"llama.cpp reads GGUF files only: {args.model}")
    ensure_llama_venv(args.skip_build)
    prompts = make_prompts(args)
    longest = max([len(prompts["decode"]) + args.tokens + 1, *args.prompt_lengths])
    n_ctx = -(-longest // 256) * 256  # room for every prompt; llama.cpp allocates all of it
    sides = side_names(args.threads)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    started = time.perf_counter()
    for round_no in range(args.rounds):
        order = sides if round_no % 2 == 0 else sides[::-1]
        for side in order:
            r = run_side(side, args, n_ctx, prompts, round_no)
            runs[side].append(r)
            decode = [round(r[k]["wall_tps"], 2) for k in ("decode", RUNNER, MTP) if k in r]
            prefill = [round(p["tps"], 1) for p in r["prefill"].values()]
            print(
                f"round {round_no} {side:14s} decode {decode} tok/s, "
                f"prefill {prefill} tok/s, peak {r['memory_end']['VmHWM']:.0f} MiB, "
                f"load {r['load']['loadavg_1m']:.2f}",
                file=sys.stderr,
            )
    rows = summarize(args, sides, runs)
    print_report(args, rows, runs, sides)
    path = bc.write_json(
        args.out,
        {
            "model": args.model,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "prompt_lengths": args.prompt_lengths,
            "threads": args.threads,
            "runner_args": args.runner_arg,
            "n_ctx": n_ctx,
            "decode_prompt": prompts["decode"],
            "environment": bc.environment(),
            "summary": rows,
            "runs": runs,
            "elapsed_s": time.perf_counter() - started,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
