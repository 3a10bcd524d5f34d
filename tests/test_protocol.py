"""Unit tests of the wire (protocol/), the server's moving parts in-process, and the CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import tracemalloc

import msgspec
import pytest

import protocol
from protocol import (
    Cancel,
    Completion,
    Detokenize,
    Done,
    Error,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    Speculation,
    Status,
    StatusFrame,
    TextFrame,
    Token,
    Tokenize,
    TokenLogprob,
    TokensFrame,
    TopLogprob,
    decode_frame,
    decode_request,
    encode_frame,
)
from protocol.errors import CodedError
from protocol.schema import render
from runner.cli import build_parser, parse_bytes
from runner.noop_engine import NoopEngine
from runner.server import TOO_LONG, FrameWriter, Server, split_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def line(**fields) -> bytes:
    return json.dumps(fields).encode()


def refusal(raw: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(raw)
    return info.value


# ---------------------------------------------------------------------------- requests
def test_each_request_type_decodes_to_its_struct():
    assert decode_request(line(type="completion", id="a", prompt="hi")) == Completion(
        id="a", prompt="hi", options=protocol.Options()
    )
    assert decode_request(line(type="completion", id="b", tokens=[1, 2])).tokens == [1, 2]
    assert decode_request(line(type="cancel", id="a")) == Cancel("a")
    assert decode_request(line(type="tokenize", id="t", text="x")) == Tokenize("t", "x")
    assert decode_request(line(type="detokenize", id="d", tokens=[3])) == Detokenize("d", [3])
    assert decode_request(line(type="status", id="s")) == Status("s")
    assert decode_request(line(type="shutdown")) == Shutdown()


def test_completion_fields_and_defaults():
    request = decode_request(
        line(
            type="completion",
            id="a",
            prompt="p",
            logprobs=True,
            top_logprobs=5,
            speculative=False,
            think_budget=0,
            options={
                "temperature": 0.7,
                "top_k": 40,
                "top_p": 0.9,
                "min_p": 0.05,
                "seed": 42,
                "num_predict": -1,
                "stop": ["\n", "END"],
                "repeat_penalty": 1.1,
                "repeat_last_n": -1,
                "presence_penalty": -0.5,
                "frequency_penalty": 0.5,
            },
        )
    )
    assert (request.logprobs, request.top_logprobs, request.speculative) == (True, 5, False)
    assert request.think_budget == 0
    o = request.options
    assert (o.temperature, o.top_k, o.top_p, o.min_p, o.seed) == (0.7, 40, 0.9, 0.05, 42)
    assert (o.num_predict, o.stop) == (-1, ["\n", "END"])
    assert (o.repeat_penalty, o.repeat_last_n) == (1.1, -1)
    assert (o.presence_penalty, o.frequency_penalty) == (-0.5, 0.5)
    bare = decode_request(line(type="completion", id="a", prompt="p"))
    assert (bare.logprobs, bare.top_logprobs, bare.speculative, bare.think_budget) == (
        False,
        0,
        True,
        None,
    )
    assert all(getattr(bare.options, f) is None for f in bare.options.__struct_fields__)


def test_unknown_fields_are_ignored_at_every_level():
    request = decode_request(
        line(
            type="completion",
            id="a",
            prompt="p",
            stream=True,
            keep_alive=[{"x": [1]}],
            options={"num_ctx": 8192, "mirostat": 2, "top_k": 7, "use_mmap": None},
        )
    )
    assert request.options.top_k == 7


@pytest.mark.parametrize("seed", [-1, -(2**63)])
def test_negative_seed_means_unseeded(seed):
    request = decode_request(line(type="completion", id="a", prompt="p", options={"seed": seed}))
    assert request.options.seed is None


@pytest.mark.parametrize(
    ("fragment", "field"),
    [
        ('"options": {"temperature": -0.01}', "options.temperature"),
        ('"options": {"temperature": 1e309}', "options.temperature"),
        ('"options": {"top_k": -1}', "options.top_k"),
        ('"options": {"top_k": 1.5}', "options.top_k"),
        ('"options": {"top_p": 1.0001}', "options.top_p"),
        ('"options": {"min_p": -0.1}', "options.min_p"),
        ('"options": {"repeat_penalty": 0}', "options.repeat_penalty"),
        ('"options": {"repeat_last_n": -2}', "options.repeat_last_n"),
        ('"options": {"num_predict": -2}', "options.num_predict"),
        ('"options": {"seed": 1e2}', "options.seed"),
        ('"options": {"seed": 9223372036854775808}', "options.seed"),
        ('"options": {"stop": "END"}', "options.stop"),
        ('"options": {"stop": [""]}', "options.stop[0]"),
        ('"options": {"stop": [' + ",".join(['"s"'] * 17) + "]}", "options.stop"),
        ('"options": {"presence_penalty": "0"}', "options.presence_penalty"),
        ('"top_logprobs": 21', "top_logprobs"),
        ('"top_logprobs": -1', "top_logprobs"),
        ('"think_budget": -1', "think_budget"),
        ('"logprobs": "true"', "logprobs"),
        ('"speculative": null', "speculative"),
    ],
)
def test_out_of_range_or_mistyped_fields_name_the_field(fragment, field):
    error = refusal(f'{{"type": "completion", "id": "r", "prompt": "p", {fragment}}}'.encode())
    assert (error.code, error.id) == ("bad_request", "r")
    assert error.message.startswith(field + ":") or error.message.startswith(field + "[")
    assert "$" not in error.message


@pytest.mark.parametrize("tokens", ["[-1]", "[2147483648]", "[1.0]", '["1"]', "[]", "[[1]]"])
def test_token_ids_are_non_negative_32_bit_ints(tokens):
    error = refusal(f'{{"type": "completion", "id": "r", "tokens": {tokens}}}'.encode())
    assert error.code == "bad_request" and error.message.startswith("tokens")


@pytest.mark.parametrize(
    "fields", [{}, {"prompt": "a", "tokens": [1]}, {"prompt": None, "tokens": None}]
)
def test_exactly_one_of_prompt_and_tokens(fields):
    error = refusal(line(type="completion", id="r", **fields))
    assert error.code == "bad_request" and "prompt" in error.message and "tokens" in error.message


@pytest.mark.parametrize(
    ("raw", "code", "request_id"),
    [
        (b"", "bad_json", None),
        (b" \t\r", "bad_json", None),
        (b'{"type": "status", "id": "s"', "bad_json", None),
        (b"{'type': 'status'}", "bad_json", None),
        (b'{"type": "status", "id": "s", "x": NaN}', "bad_json", None),
        (b'{"type": "status", "id": "s", "pad": "\xff"}', "bad_json", None),
        (b'{"type": "status", "id": "s", "p\xc3": 1}', "bad_json", None),
        (b'{"type": "status", "id": "s"} {}', "bad_json", None),
        (
            b'{"type": "status", "id": "s", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            "bad_json",
            None,
        ),
        (b"[" * 100000 + b"]" * 100000, "bad_json", None),  # too deep, whatever the type
        (b"[1, 2", "bad_json", None),
        (b"[]", "unknown_type", None),
        (b"null", "unknown_type", None),
        (b'"status"', "unknown_type", None),
        (b'{"id": "s"}', "unknown_type", "s"),
        (b'{"type": null, "id": "s"}', "unknown_type", "s"),
        (b'{"type": "generate", "id": "s"}', "unknown_type", "s"),
        (b'{"type": 3, "id": "s"}', "unknown_type", "s"),
        (b'{"type": "status"}', "bad_request", None),
        (b'{"type": "status", "id": 5}', "bad_request", None),
        (b'{"type": "status", "id": ""}', "bad_request", None),
        (b'{"type": "tokenize", "id": "t"}', "bad_request", "t"),
    ],
)
def test_refusals_are_classified(raw, code, request_id):
    error = refusal(raw)
    assert (error.code, error.id) == (code, request_id), error.message
    assert error.frame() == Error(request_id, code, error.message)


@pytest.mark.parametrize(
    ("text", "unit", "half"),
    [
        (b"\\ud800", "d800", "high"),  # at the end of the string (msgspec: "truncated")
        (b"ab\\udc00cd", "dc00", "low"),
        (b"\\ud83dx", "d83d", "high"),
        (b"\\ud800\\u0041", "d800", "high"),  # a pair whose second half is not a low one
    ],
)
def test_lone_surrogate_escapes_are_bad_json_naming_the_escape(text, unit, half):
    raw = b'{"type": "tokenize", "id": "t", "text": "' + text + b'"}'
    error = refusal(raw)
    assert error.code == "bad_json"
    assert f"lone UTF-16 surrogate escape \\u{unit} ({half} half" in error.message
    assert f"at byte {raw.index(b'u' + unit.encode()) - 1}" in error.message


def test_escaped_backslashes_and_real_pairs_are_not_surrogate_errors():
    assert decode_request(b'{"type":"tokenize","id":"t","text":"\\\\ud800"}').text == "\\ud800"
    pair = b'{"type":"tokenize","id":"t","text":"\\ud83d\\ude00"}'
    assert decode_request(pair).text == "\U0001f600"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"type": "completion", "prompt": "x"}', "id: missing required field"),
        (b'{"type": "cancel"}', "id: missing required field"),
        (b'{"type": "tokenize", "id": "t"}', "text, messages: give exactly one of them"),
        (b'{"type": "detokenize", "id": "d"}', "tokens: missing required field"),
    ],
)
def test_missing_fields_are_named_first(raw, message):
    error = refusal(raw)
    assert error.code == "bad_request" and error.message == message


# ---------------------------------------------------------------------------- frames
FRAMES = [
    Progress("weights", 3, 10),
    Ready(1, "m", 2048, 320, True, "head: 1 layer", "openblas"),
    Token("a", 'hi\n"there"', [5, 6]),
    Token("a", "x", [7], [TokenLogprob("x", 7, -0.5, [TopLogprob("x", 7, -0.5)])]),
    Done("a", "length", 3, 1, 100, 4, 200, Speculation(2, 6, 4, [2, 2], 3)),
    Done("a", "cancelled"),
    Error(None, "bad_json", "empty line"),
    TokensFrame("t", [1, 2, 3]),
    TextFrame("d", "text"),
    StatusFrame("s", 0, None, 1, 2, 3, 4, {"depth": 2, "ewma": [0.5]}),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_frames_are_one_line_and_round_trip(frame):
    encoded = encode_frame(frame)
    assert encoded.endswith(b"\n") and encoded.count(b"\n") == 1
    assert decode_frame(encoded) == frame
    assert json.loads(encoded)["type"] == frame.__struct_config__.tag


def test_frame_keys_hosts_rely_on():
    assert "logprobs" not in json.loads(encode_frame(Token("a", "x", [1])))
    assert json.loads(encode_frame(Error(None, "internal", "m")))["id"] is None
    done = json.loads(encode_frame(Done("a", "stop")))
    assert set(done) == {
        "type",
        "id",
        "done_reason",
        "prompt_tokens",
        "prompt_cached_tokens",
        "prompt_eval_ns",
        "eval_tokens",
        "eval_ns",
        "speculation",
        "prompt_disk_tokens",
    }
    assert set(done["speculation"]) == {
        "rounds",
        "drafted",
        "accepted",
        "accepted_per_depth",
        "final_depth",
        "sources",
    }
    assert json.loads(encode_frame(StatusFrame("s", 0, None, 0, 0, 0, 0)))["active"] is None


def test_decode_frame_is_strict():
    with pytest.raises(msgspec.ValidationError):
        decode_frame(b'{"type": "done", "id": "a", "done_reason": "finished"}')
    with pytest.raises(msgspec.ValidationError):
        decode_frame(b'{"type": "token", "id": "a", "content": 5, "tokens": []}')


# ---------------------------------------------------------------------------- schema
def test_committed_schema_matches_the_code():
    with open(os.path.join(ROOT, "docs", "protocol.schema.json")) as f:
        committed = f.read()
    assert committed == render(), "run: python -m protocol.schema > docs/protocol.schema.json"


def test_schema_covers_every_message():
    schema = json.loads(render())

    def refs(part: str) -> set[str]:
        return {item["$ref"].rsplit("/", 1)[1] for item in schema[part]["anyOf"]}

    requests = {"Completion", "Cancel", "Tokenize", "Detokenize", "Status", "Shutdown"}
    assert refs("request") == requests
    assert refs("frame") == {
        "Progress",
        "Ready",
        "Token",
        "Done",
        "Error",
        "TokensFrame",
        "TextFrame",
        "StatusFrame",
    }
    options = schema["$defs"]["Options"]["properties"]
    assert options["top_p"]["anyOf"][0] == {"maximum": 1.0, "minimum": 0.0, "type": "number"}
    assert set(schema["error_codes"]) == set(protocol.ERROR_CODES)


def test_protocol_imports_nothing_of_the_runner():
    code = (
        "import sys, protocol, protocol.schema; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'runner', 'cache', 'drafting', "
        "'mlx', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


# ---------------------------------------------------------------------------- split_lines
def chunked(data: bytes, size: int):
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    return lambda _n: chunks.pop(0) if chunks else b""


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 64])
def test_split_lines_across_chunk_boundaries(size):
    data = b"one\n\ntwo three\n" + b"x" * 20 + b"\nfour\nlast"
    got = list(split_lines(chunked(data, size), max_line=12, chunk=size))
    assert got == [b"one", b"", b"two three", TOO_LONG, b"four", b"last"]


def test_an_oversized_line_is_reported_once_and_never_held():
    limit, chunk, total = 1 << 20, 1 << 16, 64 << 20
    served = {"n": 0}

    def read(_n: int) -> bytes:
        served["n"] += chunk
        if served["n"] <= total:
            return b"a" * chunk
        if served["n"] == total + chunk:
            return b"\nnext\n"
        return b""

    tracemalloc.start()
    got = list(split_lines(read, max_line=limit, chunk=chunk))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == [TOO_LONG, b"next"]
    assert peak < 4 * limit, peak


# ---------------------------------------------------------------------------- server
class RecordingStream(io.RawIOBase):
    """Stdout stand-in that records each write and flush."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.flushes = 0
        self.broken = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.broken:
            raise BrokenPipeError(32, "Broken pipe")
        self.writes.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        self.flushes += 1

    def frames(self) -> list[dict]:
        return [json.loads(w) for w in self.writes]


def serve(engine, lines: list[bytes], **server_args) -> list[dict]:
    """Run a server on `engine` over the given input lines; return the frames it wrote."""
    out = RecordingStream()
    server = Server(FrameWriter(out), **server_args)
    r, w = os.pipe()
    os.write(w, b"".join(raw + b"\n" for raw in lines))
    os.close(w)
    try:
        assert server.serve(lambda progress: engine, lambda n: os.read(r, n)) == 0
    finally:
        os.close(r)
    return out.frames()


def completion_line(request_id: str, n: int = 3) -> bytes:
    return line(type="completion", id=request_id, prompt="abc", options={"num_predict": n})


def test_writer_sends_each_frame_with_one_write_and_one_flush():
    out = RecordingStream()
    writer = FrameWriter(out)
    for frame in FRAMES:
        writer.write(frame)
    assert out.writes == [encode_frame(f) for f in FRAMES]
    assert out.flushes == len(FRAMES)


def test_writer_goes_quiet_and_reports_a_broken_pipe_once():
    out, calls = RecordingStream(), []
    writer = FrameWriter(out)
    writer.on_closed = lambda: calls.append(1)
    out.broken = True
    assert writer.write(Done("a", "stop")) is False
    assert writer.write(Done("b", "stop")) is False
    assert calls == [1] and writer.closed


class FailingEngine(NoopEngine):
    """Fault injection: `run` fails in the ways a buggy engine could."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def run(self, prepared, emit, cancelled) -> None:
        if prepared.id == "victim":
            emit(Token(prepared.id, "a", [97]))
            if self.mode == "raise":
                raise RuntimeError("boom")
            if self.mode == "extra":
                emit(Done(prepared.id, "stop"))
                emit(Token(prepared.id, "late", [1]))
            return  # mode "no-done": returns without a done frame
        super().run(prepared, emit, cancelled)


@pytest.mark.parametrize("mode", ["raise", "no-done"])
def test_engine_failure_is_internal_error_then_done_error_and_serving_goes_on(mode):
    frames = serve(FailingEngine(mode), [completion_line("victim"), completion_line("next")])
    victim = [f for f in frames if f.get("id") == "victim"]
    assert [f["type"] for f in victim] == ["token", "error", "done"]
    assert victim[1]["code"] == "internal" and victim[2]["done_reason"] == "error"
    nxt = [f for f in frames if f.get("id") == "next"]
    assert [f["type"] for f in nxt] == ["token"] * 3 + ["done"]


def test_frames_after_done_are_dropped():
    frames = serve(FailingEngine("extra"), [completion_line("victim")])
    assert [f["type"] for f in frames if f.get("id") == "victim"] == ["token", "done"]


class RefusingEngine(NoopEngine):
    def prepare(self, request):
        if request.id == "typed":
            from protocol.errors import CodedError

            raise CodedError("prompt is 9 tokens but the context holds 8", code="context_overflow")
        if request.id == "bug":
            raise KeyError("oops")
        return super().prepare(request)


def test_a_broken_pipe_while_cancelling_does_not_deadlock():
    out = RecordingStream()
    writer = FrameWriter(out)
    server = Server(writer)
    server.engine = NoopEngine()  # no inference loop: the completions stay queued
    for i in range(3):
        assert server.handle_line(completion_line(f"q{i}"))
    out.broken = True
    cancelling = threading.Thread(target=server.cancel_all, daemon=True)
    cancelling.start()
    cancelling.join(10)
    assert not cancelling.is_alive() and writer.closed


def test_refused_completions_get_one_error_and_no_done():
    frames = serve(RefusingEngine(), [completion_line("typed"), completion_line("bug")])
    assert [(f["type"], f["id"], f["code"]) for f in frames[1:]] == [
        ("error", "typed", "context_overflow"),
        ("error", "bug", "internal"),
    ]


def test_ready_then_answers_in_order_and_shutdown_stops_reading():
    frames = serve(
        NoopEngine(),
        [
            line(type="tokenize", id="t", text="hé"),
            line(type="detokenize", id="d", tokens=[104, 195, 169]),
            completion_line("c", 2),
            line(type="shutdown"),
            line(type="status", id="never"),
        ],
    )
    assert frames[0]["type"] == "ready" and frames[0]["protocol_version"] == 1
    assert frames[1] == {"type": "tokens", "id": "t", "tokens": [104, 195, 169]}
    assert frames[2] == {"type": "text", "id": "d", "text": "hé"}
    assert [f["type"] for f in frames[3:]] == ["token", "token", "done"]


def test_queue_limit_refuses_with_overloaded():
    gate = threading.Event()

    class Slow(NoopEngine):
        def run(self, prepared, emit, cancelled):
            gate.wait(10)
            super().run(prepared, emit, cancelled)

    lines = [completion_line(f"c{i}", 1) for i in range(5)]
    timer = threading.Timer(1.0, gate.set)
    timer.start()
    frames = serve(Slow(), lines, queue_limit=2)
    timer.cancel()
    refused = [f["id"] for f in frames if f["type"] == "error"]
    done = [f["id"] for f in frames if f["type"] == "done"]
    assert all(f["code"] == "overloaded" for f in frames if f["type"] == "error")
    assert sorted(refused + done) == [f"c{i}" for i in range(5)]
    assert 2 <= len(refused) <= 3  # c0 may still be queued or already running


def test_load_failure_is_one_error_frame_and_status_one():
    from protocol.errors import ModelFileMissing as Missing

    out = RecordingStream()
    server = Server(FrameWriter(out))

    def load(progress):
        progress("weights", 0, 2)
        raise Missing("no such file: /x/model.gguf")

    assert server.serve(load, lambda n: b"") == 1
    assert out.frames() == [
        {"type": "progress", "stage": "weights", "done": 0, "total": 2},
        {
            "type": "error",
            "id": None,
            "code": "model_file_missing",
            "message": "no such file: /x/model.gguf",
        },
    ]


def test_an_untyped_load_failure_is_load_error():
    out = RecordingStream()

    def load(progress):
        raise RuntimeError("pip download failed")

    assert Server(FrameWriter(out)).serve(load, lambda n: b"") == 1
    assert [(f["code"], f["message"]) for f in out.frames()] == [
        ("load_error", "pip download failed")
    ]


# ---------------------------------------------------------------------------- cli
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1024", 1024),
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("1.5g", 3 << 29),
        ("64KiB", 64 << 10),
        ("3 MB", 3 << 20),
        ("1T", 1 << 40),
    ],
)
def test_cache_bytes_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "M", "-1G", "12Q", "1e9"])
def test_cache_bytes_rejects_nonsense(text):
    with pytest.raises(Exception, match="not a size"):
        parse_bytes(text)


def test_cli_defaults_and_flags():
    args = build_parser().parse_args([])
    assert (args.model, args.draft, args.no_draft, args.max_draft) == (None, None, False, 8)
    assert (args.cache_bytes, args.prefill_chunk, args.dtype, args.queue_limit) == (
        None,
        512,
        "auto",
        64,
    )
    args = build_parser().parse_args(
        [
            "--model",
            "m.gguf",
            "--cache-bytes",
            "512M",
            "--no-prefix-cache",
            "--keep-quantized",
            "--weight-layout",
            "hf",
            "--dtype",
            "float16",
            "--queue-limit",
            "3",
            "--max-draft",
            "0",
        ]
    )
    assert (args.model, args.cache_bytes, args.no_prefix_cache) == ("m.gguf", 512 << 20, True)
    assert (args.keep_quantized, args.weight_layout, args.dtype) == (True, "hf", "float16")
    assert (args.queue_limit, args.max_draft) == (3, 0)
    from runner.device import LAYOUTS

    layouts = next(a.choices for a in build_parser()._actions if a.dest == "weight_layout")
    assert tuple(layouts) == LAYOUTS
    # The verify-row layout: auto (None) unless forced either way.
    assert args.row_layout is None
    assert build_parser().parse_args(["--row-layout"]).row_layout is True
    assert build_parser().parse_args(["--no-row-layout"]).row_layout is False


def test_draft_sources_flag():
    assert build_parser().parse_args([]).draft_sources == ("head", "suffix")
    assert build_parser().parse_args(["--draft-sources", "suffix"]).draft_sources == ("suffix",)
    assert build_parser().parse_args(["--draft-sources", "suffix,head"]).draft_sources == (
        "suffix",
        "head",
    )
    for bad in ("", "head,head", "ngram", "head,,lookup"):
        out = subprocess.run(
            [sys.executable, "-m", "runner", "--noop-model", "--draft-sources", bad],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and "--draft-sources" in out.stderr, bad
        assert "head, suffix" in out.stderr, bad


def test_only_frames_reach_stdout_after_claiming_it():
    code = (
        "import os\n"
        "from runner.cli import claim_stdout\n"
        "frames = claim_stdout()\n"
        "print('a stray print')\n"
        "os.write(1, b'a C-level write\\n')\n"
        'frames.write(b\'{"type": "frame"}\\n\')\n'
        "frames.flush()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == '{"type": "frame"}\n'
    assert "a stray print" in out.stderr and "a C-level write" in out.stderr


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "runner", "--version"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    assert out.stdout.strip() == f"mtp-runner 0.1.0 (protocol {protocol.PROTOCOL_VERSION})"


class LateCancelEngine(NoopEngine):
    """A cancel the reader takes after the engine's last check of the mark: the engine then
    finishes as if uncancelled (``length``)."""

    server: Server | None = None

    def run(self, prepared, emit, cancelled) -> None:
        emit(Token(prepared.id, "a", [97]))
        assert not cancelled()
        self.server._cancel(prepared.id)  # what the reader thread does on a cancel line
        emit(Done(prepared.id, "length", eval_tokens=1))


def test_a_cancel_taken_after_the_engines_last_check_still_gets_a_cancelled_done():
    """A running job's cancel is answered by a cancelled done, never by silence: the race
    between a cancel line and the end of its completion cannot lose both answers."""
    out = RecordingStream()
    server = Server(FrameWriter(out))
    engine = LateCancelEngine()
    engine.server = server
    r, w = os.pipe()
    os.write(w, completion_line("late") + b"\n")
    os.close(w)
    try:
        assert server.serve(lambda progress: engine, lambda n: os.read(r, n)) == 0
    finally:
        os.close(r)
    frames = [f for f in out.frames() if f.get("id") == "late"]
    assert [f["type"] for f in frames] == ["token", "done"]
    assert frames[-1]["done_reason"] == "cancelled" and frames[-1]["eval_tokens"] == 1


def test_the_noop_engine_takes_tokens_and_refuses_what_it_cannot_do():
    engine = NoopEngine()
    assert engine.prepare(Completion(id="t", tokens=[104, 105])).prompt == [104, 105]
    assert engine.prepare(Completion(id="p", prompt="hi")).prompt == [104, 105]
    for fields, needle in (
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages: "),
        ({"tokens": [104], "format": "json"}, "format: "),
    ):
        with pytest.raises(CodedError) as raised:
            engine.prepare(Completion(id="x", **fields))
        assert raised.value.code == "bad_request" and str(raised.value).startswith(needle)
