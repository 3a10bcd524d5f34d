"""`mtp-runner` / `python -m runner`: parse arguments, claim stdout for frames, serve.

Stdout carries protocol frames only: the real stdout descriptor is kept for the frame writer
and descriptor 1 is pointed at stderr, so stray prints (ours or a library's, Python or C)
land in the log instead of corrupting the stream.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, BinaryIO

import protocol
from drafting.depth import MAX_DRAFT_DEPTH, SHARED_DRAFT_ROWS
from drafting.suffix import RECENT_TOKENS
from runner import __version__
from runner.faults import Faults

if TYPE_CHECKING:
    from runner.engine import EngineOptions

log = logging.getLogger("mtp_runner.cli")

_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'512M' -> 536870912; accepts K/M/G/T with optional 'B'/'iB' (binary units) or plain bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 2G)")
    return int(float(match[1]) * _SUFFIXES[match[2].lower()])


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def at_least_two(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2: {text}")
    return value


def fault_spec(text: str) -> str:
    """One ``--inject-fault`` spec, checked (``runner.faults.Faults.parse``)."""
    try:
        Faults.parse([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0: {text}")
    return value


DRAFT_SOURCES = ("head", "suffix")


def recent_tokens(text: str) -> int:
    """``--recent-outputs``: 0 to ``RECENT_TOKENS``."""
    value = non_negative_int(text)
    if value > RECENT_TOKENS:
        raise argparse.ArgumentTypeError(f"at most {RECENT_TOKENS} tokens, not {value}")
    return value


def draft_sources(text: str) -> tuple[str, ...]:
    """``head,suffix``: known drafter names, at least one, each once."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in DRAFT_SOURCES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of {', '.join(DRAFT_SOURCES)}, each at most once"
        )
    return names


def draft_depth(text: str) -> int:
    """A draft depth: 0 up to ``MAX_DRAFT_DEPTH``, the deepest round the verify paths serve
    (argparse names the flag in front of the message)."""
    value = non_negative_int(text)
    if value > MAX_DRAFT_DEPTH:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_DRAFT_DEPTH} (the draft depth ceiling): {text}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtp-runner",
        description="Serve a language model over line-delimited JSON on stdin/stdout "
        "(docs/PROTOCOL.md). Logs go to stderr.",
        epilog="Head trainer: mtp-runner train-head MODEL --out DIR, mtp-runner eval-head MODEL "
        "--head DIR (each with --help).",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="HF directory or GGUF file "
        "(default: the embedded SmolLM2-135M-Instruct, downloaded on first use)",
    )
    p.add_argument(
        "--draft", metavar="PATH", help="MTP draft head sidecar or Gemma 4 assistant directory"
    )
    p.add_argument("--no-draft", action="store_true", help="never speculate")
    p.add_argument(
        "--draft-sources",
        type=draft_sources,
        default=DRAFT_SOURCES,
        metavar="LIST",
        help="drafters to speculate with, comma-separated: head (the MTP head), suffix (text "
        "already seen in the prompt and the answer) (default: head,suffix)",
    )
    count = functools.partial(p.add_argument, metavar="N")  # an integer option
    count(
        "--recent-outputs",
        type=recent_tokens,
        default=0,
        help="tokens of earlier requests' outputs the suffix drafter also drafts from, the "
        f"oldest out (0, off: done frames would tell a client whether another sent the same "
        f"prompt; at most {RECENT_TOKENS})",
    )
    count(
        "--max-draft",
        type=draft_depth,
        default=8,
        help=f"deepest speculation depth (8; at most {MAX_DRAFT_DEPTH})",
    )
    count(
        "--parallel",
        type=positive_int,
        default=4,
        help="completions decoded at once, one row each in a shared forward; the rest queue "
        "(4; 1 = one at a time)",
    )
    count(
        "--shared-draft-rows",
        type=non_negative_int,
        default=SHARED_DRAFT_ROWS,
        help="rows a forward shared by several completions may feed in all with the drafts "
        f"of those whose text was seen before ({SHARED_DRAFT_ROWS}, the most; 0: they draft "
        "only while decoding alone)",
    )
    count(
        "--draft-depth",
        type=draft_depth,
        help="draft exactly N tokens per round instead of the adaptive depth (benchmarks)",
    )
    p.add_argument(
        "--cache-bytes",
        type=parse_bytes,
        default=None,
        metavar="N",
        help="prefix cache budget, e.g. 512M or 2G "
        "(default 2G, at most a quarter of physical memory)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keep prefix-cache segments in DIR, so a restarted runner restores prompts from "
        "disk (a subdirectory per model and settings; off by default)",
    )
    p.add_argument(
        "--cache-disk-bytes",
        type=parse_bytes,
        default=None,
        metavar="N",
        help="disk budget of --cache-dir, least recently used segments deleted first (10G)",
    )
    count(
        "--prefill-chunk",
        type=positive_int,
        default=512,
        help="prompt tokens per prefill forward (512)",
    )
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    p.add_argument(
        "--keep-quantized",
        action="store_true",
        default=None,
        help="run quantized weights as stored (the default where the device can: MLX's "
        "products on a GPU, runner.native's quantized panels on the CPU)",
    )
    p.add_argument(
        "--dequantize",
        dest="keep_quantized",
        action="store_false",
        default=None,
        help="dequantize quantized weights to float at load (more memory, slower on the CPU)",
    )
    p.add_argument(
        "--quantize",
        choices=("q4", "q8"),
        help="quantize float weights at load (affine, groups of 64; the head's too): a quarter "
        "(q8) or an eighth (q4) of float32's memory, faster products on the CPU",
    )
    p.add_argument(
        "--float-head",
        action="store_true",
        help="keep the MTP head's weights in float (with --quantize, or beside a quantized "
        "checkpoint, whose float head is otherwise quantized to 8 bits)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="store full-attention layers' keys and values quantized to 8 or 4 bits (affine "
        "per group, as mlx-lm's quantized cache; about 0.28x or 0.16x float32's memory)",
    )
    count(
        "--kv-group",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="with --kv-bits, values per scale and bias (default 64)",
    )
    p.add_argument(
        "--exact-products",
        action="store_true",
        help="multiply quantized weights bit-for-bit as their dequantized float32 values "
        "(slower; default: activations quantized to int8 per row, as llama.cpp does)",
    )
    p.add_argument(
        "--weight-layout",
        choices=("auto", "hf", "packed", "panels"),  # runner.device.LAYOUTS (no mlx import here)
        default="auto",
        help="how weights are stored for the device: panels (the native few-row product's "
        "column panels, q/k/v and gate/up fused), packed (transposed for the BLAS, fused) or "
        "hf (as loaded); auto: panels on the CPU (packed without runner.native), hf on a GPU",
    )
    count(
        "--queue-limit",
        type=positive_int,
        default=64,
        help="completions that may wait; more are refused (default 64)",
    )
    count(
        "--ranks",
        type=at_least_two,
        help="split the model's layers over N processes on this machine (MLX's ring backend "
        "on loopback); rank 0 serves the pipes. No disk tier or --kv-bits yet",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="run as one rank of a group mlx.launch started (its environment says which); "
        "rank 0 serves the pipes",
    )
    p.add_argument(
        "--rank-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --ranks or --distributed: seconds rank 0 waits for the other ranks to answer "
        "one command before it gives up and exits (300)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error", "critical")
    )
    version = f"mtp-runner {__version__} (protocol {protocol.PROTOCOL_VERSION})"
    p.add_argument("--version", action="version", version=version)
    # Hidden benchmark knobs: the verify-row layout forced either way, blocks run eagerly.
    p.add_argument(
        "--row-layout",
        dest="row_layout",
        action="store_const",
        const=True,
        default=None,
        help=argparse.SUPPRESS,
    )
    p.add_argument(
        "--no-row-layout",
        dest="row_layout",
        action="store_const",
        const=False,
        help=argparse.SUPPRESS,
    )
    p.add_argument("--no-compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-native-blocks", action="store_true", help=argparse.SUPPRESS)
    # Hidden test seams: a model-free engine (protocol tests, benchmark) and fault injection
    # (runner.faults: head-call=N, token-frame=ID).
    p.add_argument("--noop-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--noop-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--inject-fault", action="append", type=fault_spec, help=argparse.SUPPRESS)
    # A disk-tier write fault (cache.disk_format.fault_hook: kill|full:segment|renamed|index).
    p.add_argument("--cache-dir-fault", help=argparse.SUPPRESS)
    p.add_argument(
        "--max-line-bytes",
        type=positive_int,
        default=protocol.MAX_LINE_BYTES,
        help=argparse.SUPPRESS,
    )
    return p


def engine_factory(args: argparse.Namespace):
    """A callable (progress) -> engine, run on the inference thread."""
    if args.noop_model:
        from runner.noop_engine import NoopEngine

        return lambda progress: NoopEngine(delay_s=args.noop_delay_ms / 1000)

    def load(progress):
        from runner.engine import Engine

        return Engine(engine_options(args), progress=progress)

    return load


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The ``runner.engine.EngineOptions`` the command line gives."""
    from runner.engine import EngineOptions

    return EngineOptions(
        model_path=args.model,
        draft_path=args.draft,
        use_draft=not args.no_draft,
        max_draft=args.max_draft,
        draft_depth=args.draft_depth,
        draft_sources=args.draft_sources,
        recent_outputs=args.recent_outputs,
        cache_bytes=args.cache_bytes,
        prefix_cache=not args.no_prefix_cache,
        cache_dir=args.cache_dir,
        cache_disk_bytes=args.cache_disk_bytes,
        disk_fault=args.cache_dir_fault,
        prefill_chunk=args.prefill_chunk,
        dtype=args.dtype,
        keep_quantized=args.keep_quantized,
        exact_products=args.exact_products,
        quantize={"q4": 4, "q8": 8}.get(args.quantize),
        quantize_head=not args.float_head,
        weight_layout=args.weight_layout,
        row_layout=args.row_layout,
        compile=not args.no_compile,
        native_blocks=not args.no_native_blocks,
        faults=Faults.parse(args.inject_fault),
        parallel=args.parallel,
        shared_draft_rows=args.shared_draft_rows,
        kv_bits=args.kv_bits,
        kv_group=args.kv_group,
    )


def claim_stdout() -> BinaryIO:
    """Keep the real stdout for frames; send everything else written to fd 1 to stderr."""
    sys.stdout.flush()
    frames_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(frames_fd, "wb")


TRAINER_COMMANDS = ("train-head", "eval-head")


def trainer_main(argv: list[str]) -> int:
    """``train-head`` / ``eval-head``: the trainer (``drafting.training``) on a target loaded
    with the runner's model code; its progress and log on stderr."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    from drafting.training import cli as training_cli
    from runner.default_model import home
    from runner.training_target import load_target

    return training_cli.main(argv, load_target, home())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TRAINER_COMMANDS:
        return trainer_main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.ranks or args.distributed:
        from runner.distributed.main import main as distributed_main

        return distributed_main(args, argv, build_parser(), engine_options, claim_stdout())
    from runner.server import FrameWriter, Server

    writer = FrameWriter(claim_stdout())
    server = Server(
        writer,
        queue_limit=args.queue_limit,
        max_line_bytes=args.max_line_bytes,
        faults=Faults.parse(args.inject_fault),
    )
    stdin_fd = sys.stdin.fileno()
    status = server.serve(engine_factory(args), lambda n: os.read(stdin_fd, n), handle_signals=True)
    log.info("exiting with status %d", status)
    return status
