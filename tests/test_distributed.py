"""A model split across ranks (runner.distributed): the split, each rank's stage, and real
runners over MLX's ring backend on loopback, compared token for token with one process (the
prefix cache across ranks: tests/test_distributed_cache.py; speculation:
tests/test_distributed_speculation.py; lost, failing and signalled ranks:
tests/test_distributed_faults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from protocol.errors import CodedError, LoadError
from runner import blas, device
from runner.cli import build_parser
from runner.distributed import follower, ranks, stage
from runner.distributed.channel import Command, Op, RankReport
from runner.distributed.engine import PipelineEngine
from runner.distributed.main import given_options, refusal
from runner.distributed.split import plan_layers
from runner.loader import load_model
from runner.models.llama import Model
from tests.conformance.harness import RunnerProcess
from tests.test_gguf_families import write_pair
from tests.test_gguf_hybrid import write_pair as write_hybrid_pair
from tests.test_gguf_models import LEGACY, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = os.path.join(ROOT, "tests", "fixtures", "reference", "moe")
HYBRID = os.path.join(ROOT, "tests", "fixtures", "reference", "hybrid")
LAYERS = 4
LONG_PROMPT = " ".join(
    ["The quick brown fox jumps over the lazy dog; the capital of France is Paris."] * 6
)
REQUESTS = [  # greedy, seeded, and a prompt of several prefill chunks (--prefill-chunk 32)
    {"prompt": "The quick brown fox", "options": {"temperature": 0, "num_predict": 12}},
    {"prompt": "Once upon a time", "options": {"temperature": 0.9, "seed": 11, "num_predict": 12}},
    {"prompt": LONG_PROMPT, "options": {"temperature": 0.7, "seed": 3, "num_predict": 8}},
    {"prompt": LONG_PROMPT, "options": {"temperature": 0, "num_predict": 8}},
]


def noop(*_args) -> None:
    return None


@pytest.fixture(scope="module")
def deep_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama", num_hidden_layers=LAYERS)


# ---------------------------------------------------------------------------- the split
def test_the_split_minimises_the_largest_share_and_gives_every_rank_a_layer():
    plan = plan_layers([10, 10, 10, 10, 10, 10], first=5, ranks=3)
    assert plan.ranges == (range(0, 2), range(2, 4), range(4, 6))
    assert plan.shares == (25, 20, 20)
    plan = plan_layers([10, 30, 10, 10, 10, 10], first=5, ranks=2)
    assert plan.ranges == (range(0, 2), range(2, 6)) and plan.shares == (45, 40)
    # A heavy first rank still keeps one layer: every hop of the pipeline does work.
    assert plan_layers([1, 1, 1], first=1000, ranks=3).ranges == (
        range(0, 1),
        range(1, 2),
        range(2, 3),
    )
    with pytest.raises(ValueError, match="cannot be split"):
        plan_layers([1, 1], first=0, ranks=3)


def test_spawned_ranks_run_distributed_in_place_of_ranks():
    argv = ["--model", "m", "--ranks", "3", "--log-level", "debug", "--ranks=2"]
    assert ranks.follower_argv(argv) == ["--model", "m", "--log-level", "debug", "--distributed"]


def test_spawned_ranks_share_the_cores_unless_the_user_set_a_share(monkeypatch):
    names = (ranks.CORES, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ranks, "usable_cores", lambda: 4)
    assert ranks.thread_environment(2) == dict.fromkeys(names, "2")
    assert ranks.thread_environment(3) == dict.fromkeys(names, "1")
    assert ranks.thread_environment(8) == dict.fromkeys(names, "1")  # one thread at least
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a pool the user sized stays theirs
    assert ranks.thread_environment(2) == {ranks.CORES: "2", "OPENBLAS_NUM_THREADS": "2"}
    monkeypatch.setenv(ranks.CORES, "4")  # a share the user set: every rank runs with it
    assert ranks.thread_environment(2) == {}
    limited = []
    monkeypatch.setattr(blas, "limit_cores", limited.append)
    ranks.share_cores()
    monkeypatch.setenv(ranks.CORES, "none")
    ranks.share_cores()
    monkeypatch.delenv(ranks.CORES)
    ranks.share_cores()
    assert limited == [4]


def test_a_ranks_share_of_the_cores_narrows_its_blas_threads():
    counts = blas.thread_counts()
    if counts is None:
        pytest.skip("the runner does not set this BLAS's thread counts")
    try:
        blas.limit_cores(1)
        assert blas.thread_counts() == (1, 1)
        assert "threads 1/1" in blas.blas_in_use()
    finally:
        blas.limit_cores(counts[1])
    assert blas.thread_counts() == counts


def _refusal(*argv: str) -> str | None:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    return refusal(args, given_options(parser, args, list(argv)))


def test_options_the_pipeline_does_not_serve_are_refused_by_name(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    assert _refusal("--model", "m", "--ranks", "2") is None  # defaults are turned off instead
    assert _refusal("--model", "m", "--ranks", "2", "--parallel", "2") is None  # shared forwards
    assert _refusal("--model", "m", "--ranks", "2", "--draft-depth", "2", "--draft", "d") is None
    assert "--cache-dir" in _refusal("--model", "m", "--ranks", "2", "--cache-dir", "/tmp/x")
    assert _refusal("--model", "m", "--ranks", "2", "--cache-bytes", "64M") is None
    assert _refusal("--model", "m", "--ranks", "2", "--kv-bits", "8") is None
    assert "--model" in _refusal("--ranks", "2")
    assert "mlx.launch" in _refusal("--model", "m", "--distributed")
    # Repeatable options are told apart from their absence too.
    assert _refusal("--model", "m", "--ranks", "2", "--inject-fault", "head-call=1") is None


def test_a_family_the_pipeline_does_not_split_is_refused_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    with pytest.raises(Exception, match="not split across ranks yet") as info:
        stage.read_checkpoint(str(tmp_path), noop)
    assert info.value.code == "unsupported_architecture"


def test_more_ranks_than_layers_is_a_load_error_naming_the_limit(deep_checkpoint):
    checkpoint = stage.read_checkpoint(deep_checkpoint, noop)
    with pytest.raises(LoadError, match=f"use at most {LAYERS} ranks"):
        stage.plan(checkpoint, LAYERS + 1, *stage.held_as(stage.StageLoad()))


def test_rank_0_refuses_a_rank_that_failed_or_disagrees_before_ready():
    plan = plan_layers([10, 10, 10, 10], first=5, ranks=2)
    ours = RankReport(True, plan.ranges[0], 0, 0)
    check = PipelineEngine._check
    check([ours, RankReport(True, plan.ranges[1], 40, 0)], plan)  # agrees: no refusal
    failed = RankReport(False, plan.ranges[1], code="missing_tensor", message="no such tensor")
    with pytest.raises(
        CodedError, match="rank 1 could not load layers 2-3: no such tensor"
    ) as info:
        check([ours, failed], plan)
    assert info.value.code == "missing_tensor"
    with pytest.raises(LoadError, match="same --dtype"):
        check([ours, RankReport(True, plan.ranges[1], 40, 2)], plan)
    with pytest.raises(LoadError, match="split the model differently"):
        check([ours, RankReport(True, range(1, 4), 40, 0)], plan)


# ---------------------------------------------------------------------------- the stages
def _stages(path: str, size: int) -> tuple[list[Model], stage.LayerPlan]:
    options = stage.StageLoad()
    plan = stage.plan(stage.read_checkpoint(path, noop), size, *stage.held_as(options))
    models = []
    for rank, run in enumerate(plan.ranges):
        checkpoint = stage.read_checkpoint(path, noop)
        model = stage.load_stage(checkpoint, run, rank == 0, options, noop).model
        stage.tune_stage(model, options)
        models.append(model)
    return models, plan


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("llama", {"quantize_bits": 4}),
        ("mistral", {"sliding_window": 6}),  # the 20-row feed slides past the window
    ],
    ids=["llama", "qwen3", "llama-q4", "mistral-window"],
)
@pytest.mark.parametrize("size", [2, 3])
def test_stages_in_turn_compute_the_whole_models_bits(checkpoint_factory, model_type, extra, size):
    _check_stages(checkpoint_factory(model_type, num_hidden_layers=LAYERS, **extra), size)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_fused"])
@pytest.mark.parametrize("size", [2, 3])
def test_moe_stages_in_turn_compute_the_whole_models_bits(case, size):
    # Three layers, the middle one dense: each stage keeps its layers' own kind.
    _check_stages(os.path.join(MOE, case), size)


@pytest.mark.parametrize("case", ["qwen3_5_text", "qwen3_5_mlx", "qwen3_next_dense"])
@pytest.mark.parametrize("size", [2, 3])
def test_hybrid_stages_in_turn_compute_the_whole_models_bits(case, size):
    # Gated DeltaNet layers then one attention layer: each stage keeps its layers' own kind,
    # and the later stages take the rows as their input.
    path = os.path.join(HYBRID, case)
    if case == "qwen3_5_mlx" and size == 3:  # the last stage would hold only attention
        with pytest.raises(LoadError, match="only attention layers of an mlx-lm"):
            _stages(path, size)
        return
    _check_stages(path, size)


def _check_stages(path: str, size: int) -> None:
    whole = load_model(path).model
    device.tune(whole, None)
    models, _ = _stages(path, size)
    whole_caches = whole.make_caches()
    caches = [m.make_caches() for m in models]
    for feed in (
        [5, 9, 14, 3, 7, 22, 1, 8, 30, 2, 4, 6, 11, 12, 13, 15, 16, 17, 18, 19],
        [40],
        [41],
    ):
        tokens = mx.array([feed], dtype=mx.int32)
        expected = whole.hidden(tokens, whole_caches)
        rows = models[0].hidden(tokens, caches[0], prenorm=True)
        for model, own in zip(models[1:], caches[1:], strict=True):
            rows = model.hidden(rows, own, prenorm=True)
        got = models[0].model.norm(rows)
        assert mx.array_equal(got, expected).item(), feed


@pytest.mark.parametrize("size", [2, 3])
def test_each_rank_holds_only_its_share_of_the_weights(deep_checkpoint, size):
    options = stage.StageLoad()
    plan = stage.plan(stage.read_checkpoint(deep_checkpoint, noop), size, *stage.held_as(options))
    assert [i for run in plan.ranges for i in run] == list(range(LAYERS))
    assert all(len(run) >= 1 for run in plan.ranges)
    for rank, run in enumerate(plan.ranges):
        checkpoint = stage.read_checkpoint(deep_checkpoint, noop)
        mx.clear_cache()
        before = mx.get_active_memory()
        model = stage.load_stage(checkpoint, run, rank == 0, options, noop).model
        stage.tune_stage(model, options)
        grown = mx.get_active_memory() - before
        held = device.weight_bytes(model)
        assert held <= plan.shares[rank] * 1.1, (rank, held, plan.shares)
        assert grown <= plan.shares[rank] * 1.1, (rank, grown, plan.shares)
        del model


# ---------------------------------------------------------------------------- the commands
class ScriptedChannel:
    """A later rank's channel with rank 0's side scripted: commands and the rows that follow
    them go in, the rows the rank hands on are kept."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.sent: list[mx.array] = []
        self.passed: list[Command] = []

    def recv_command(self) -> Command:
        return self.script.pop(0)

    def send_command(self, command: Command) -> None:
        self.passed.append(command)

    def recv_rows(self, count: int, dtype: mx.Dtype) -> mx.array:
        rows = self.script.pop(0)
        assert rows.shape[1] == count and rows.dtype == dtype
        return rows

    def send_rows(self, rows: mx.array) -> None:
        self.sent.append(rows)

    def recv_table(self, shape: tuple[int, int]) -> list[list[int]]:
        table = self.script.pop(0)
        assert (len(table), len(table[0])) == shape
        return table

    def send_table(self, table: list[list[int]]) -> None:
        self.passed.append(table)


def _later_stage(path: str) -> Model:
    options = stage.StageLoad()
    plan = stage.plan(stage.read_checkpoint(path, noop), 2, *stage.held_as(options))
    checkpoint = stage.read_checkpoint(path, noop)
    model = stage.load_stage(checkpoint, plan.ranges[1], False, options, noop).model
    stage.tune_stage(model, options)
    return model


def test_a_later_rank_rewinds_and_resets_its_caches_as_rank_0_commands(deep_checkpoint):
    model = _later_stage(deep_checkpoint)
    width = model.args.hidden_size
    first = mx.random.normal((1, 5, width), key=mx.random.key(1))
    second = mx.random.normal((1, 2, width), key=mx.random.key(2))
    channel = ScriptedChannel(
        [
            Command(Op.FORWARD, 1, 5, 0),
            first,
            Command(Op.REWIND, 1, 3),
            Command(Op.FORWARD, 1, 2, 3),
            second,
            Command(Op.RESET, 1),
            Command(Op.FORWARD, 1, 2, 0),
            second,
            Command(Op.SHUTDOWN),
        ]
    )
    follower.follow(channel, model)
    assert [c.op for c in channel.passed][-1] is Op.SHUTDOWN  # every command passed on
    caches = model.make_caches()
    mx.eval(model.hidden(first[:, :3], caches, prenorm=True))
    expected = model.hidden(second, caches, prenorm=True)
    assert mx.array_equal(channel.sent[1], expected).item()
    assert mx.array_equal(
        channel.sent[2], model.hidden(second, model.make_caches(), prenorm=True)
    ).item()


def test_a_later_rank_out_of_step_with_rank_0_stops(deep_checkpoint):
    model = _later_stage(deep_checkpoint)
    rows = mx.zeros((1, 2, model.args.hidden_size))
    channel = ScriptedChannel([Command(Op.FORWARD, 1, 2, 0), rows, Command(Op.FORWARD, 1, 2, 5)])
    with pytest.raises(follower.OutOfStep, match="rest at 2"):
        follower.follow(channel, model)


def test_a_later_rank_gives_each_set_of_a_shared_forward_its_own_rows_bits(deep_checkpoint):
    model = _later_stage(deep_checkpoint)
    width = model.args.hidden_size
    prompts = [mx.random.normal((1, n, width), key=mx.random.key(n)) for n in (3, 5)]
    shared = mx.random.normal((1, 2, width), key=mx.random.key(7))
    channel = ScriptedChannel(
        [
            Command(Op.FORWARD, 1, 3, 0),
            prompts[0],
            Command(Op.FORWARD, 2, 5, 0),
            prompts[1],
            Command(Op.FORWARD_ROWS, rows=2),
            [[2, 1], [5, 3]],  # set 2's row first: rows follow the table, not set order
            shared,
            Command(Op.FORWARD_ROWS, rows=2),
            [[1, 2], [4, 5]],  # set 2 rests at 6 now: out of step
            Command(Op.SHUTDOWN),
        ]
    )
    with pytest.raises(follower.OutOfStep, match="caches 2 rest at 6"):
        follower.follow(channel, model)
    assert channel.passed[3] == [[2, 1], [5, 3]]  # the table is passed down the chain
    for row, (prompt, index) in enumerate(((prompts[1], 1), (prompts[0], 0))):
        caches = model.make_caches()
        mx.eval(model.hidden(prompt, caches, prenorm=True))
        alone = model.hidden(shared[:, row : row + 1], caches, prenorm=True)
        assert mx.array_equal(channel.sent[2][:, row : row + 1], alone).item(), index


# ---------------------------------------------------------------------------- real runners
def _runner(path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", "--model", path, "--prefill-chunk", "32", *extra]


async def endless(runner: RunnerProcess, request_id: str, prompt: str) -> None:
    """Start a greedy completion with no practical end and wait for its first token."""
    options = {"temperature": 0, "num_predict": 1_000_000}
    await runner.send(
        {"type": "completion", "id": request_id, "prompt": prompt, "options": options}
    )
    assert (await runner.reply(request_id))["type"] == "token"


async def _outputs(
    cmd: list[str],
    requests: list[dict] = REQUESTS,
    shared: bool = False,
    cached: list[int] | None = None,
) -> list[list[int]]:
    """Each request's tokens, after a completion cancelled mid-decode. ``shared``: every
    request sent at once, and the first two must overlap (the second streamed a token before
    the first was done: they shared forwards). ``cached`` gets each request's
    ``prompt_cached_tokens``."""
    runner = await RunnerProcess.start(cmd)
    try:
        # A completion cancelled mid-decode first: its caches rest where it stopped, and the
        # next request starts them over (rank 0 commands the other ranks to).
        await endless(runner, "cancelled", "Once upon a time")
        await runner.send({"type": "cancel", "id": "cancelled"})
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == "cancelled")
        assert done["done_reason"] == "cancelled"
        outputs = []
        for index, request in enumerate(requests):
            await runner.send({"type": "completion", "id": f"r{index}", **request})
            if shared and index < len(requests) - 1:
                continue  # all of them first
            for pending in range(len(outputs), index + 1):
                tokens, done = await runner.completion(f"r{pending}", 120)
                assert done["done_reason"] == "length", done
                outputs.append([t for frame in tokens for t in frame["tokens"]])
                if cached is not None:
                    cached.append(done["prompt_cached_tokens"])
        # A shutdown request, not the end of stdin: mlx.launch never closes the ranks' stdin.
        await runner.send({"type": "shutdown"})
        assert await runner.wait_exit() == 0, runner.stderr_tail()
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:3]
    if shared:
        order = [(f.get("id"), f["type"]) for f in runner.frames]
        assert order.index(("r1", "token")) < order.index(("r0", "done")), order
    return outputs


def _launched(path: str) -> list[str]:
    """The runner as two ranks ``mlx.launch`` starts on loopback (ring backend)."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if not os.path.exists(launcher):
        pytest.skip("mlx.launch is not installed next to this interpreter")
    port = ranks.free_ports(1)[0]  # the launcher gives rank r port + r
    return [
        launcher,
        *("--backend", "ring", "--hosts", ranks.LOOPBACK, "-n", "2"),
        *("--starting-port", str(port), "--python", sys.executable),
        *_runner(path, "--distributed")[1:],
    ]


async def test_ranks_give_one_process_output_token_for_token(deep_checkpoint):
    expected = await _outputs(_runner(deep_checkpoint))
    assert all(len(tokens) > 0 for tokens in expected)
    for size in (2, 3):
        assert await _outputs(_runner(deep_checkpoint, "--ranks", str(size))) == expected, size
    # Under mlx.launch every rank's stdout reaches the host: only rank 0's frames may.
    assert await _outputs(_launched(deep_checkpoint)) == expected


async def test_ranks_split_a_moe_model_as_one_process_runs_it():
    path = os.path.join(MOE, "qwen3_moe")
    # Its context is 256 positions: the long prompt at half its length (still several chunks).
    prompt = LONG_PROMPT[: len(LONG_PROMPT) // 2]
    requests = [*_longer(REQUESTS[:2]), *({**r, "prompt": prompt} for r in REQUESTS[2:])]
    hits: list[int] = []
    expected = await _outputs(_runner(path), requests, cached=hits)
    assert hits[-1] > 0, hits  # the long prompt again: a prefix-cache hit
    ranked: list[int] = []
    assert await _outputs(_runner(path, "--ranks", "3"), requests, cached=ranked) == expected
    assert ranked == hits
    assert (
        await _outputs(_runner(path, "--ranks", "2", "--parallel", "2"), requests, True) == expected
    )


async def test_ranks_split_a_gguf_file_as_one_process_runs_it(tmp_path):
    # The older 32-element types with a tied Q8_0 embedding: each rank maps the file and
    # keeps its own layers' quantized matrices, rank 0 the embedding and output product.
    path = write_model(tmp_path / "legacy.gguf", LEGACY)
    expected = await _outputs(_runner(path), REQUESTS[:2])
    assert all(len(tokens) > 0 for tokens in expected)
    assert await _outputs(_runner(path, "--ranks", "2"), REQUESTS[:2]) == expected


async def test_ranks_split_a_gguf_moe_file_as_one_process_runs_it(tmp_path):
    # Its stacked experts stay one quantized matrix per expert until a stage loads its own
    # layers (as expert panels): no rank unpacks another's.
    _, path = write_pair(tmp_path, "qwen3moe")
    checkpoint = stage.read_checkpoint(path, noop)
    stacks = [v for k, v in checkpoint.tensors.items() if ".switch_mlp." in k]
    assert stacks and all(isinstance(v, list) for v in stacks)
    requests = [{"prompt": "the cat", "options": {"temperature": 0, "num_predict": 8}}]
    expected = await _outputs(_runner(path), requests)
    assert await _outputs(_runner(path, "--ranks", "2"), requests) == expected


async def test_ranks_split_a_hybrid_gguf_with_fused_experts_as_one_process_runs_it(tmp_path):
    # The converter's fused gate-up stack: each expert's halves are views of its rows.
    _, path = write_hybrid_pair(tmp_path, "qwen35moe-fused")
    requests = [{"prompt": "the cat", "options": {"temperature": 0, "num_predict": 8}}]
    expected = await _outputs(_runner(path), requests)
    assert await _outputs(_runner(path, "--ranks", "2"), requests) == expected


def _longer(requests: list[dict]) -> list[dict]:
    """Completions long enough that the second joins the first's forwards."""
    return [{**r, "options": {**r["options"], "num_predict": 24}} for r in requests]


async def test_ranks_share_forwards_between_requests_as_one_process_runs_each(deep_checkpoint):
    requests = [*_longer(REQUESTS[:2]), *REQUESTS[2:]]
    expected = await _outputs(_runner(deep_checkpoint), requests)
    for size in (2, 3):
        cmd = _runner(deep_checkpoint, "--ranks", str(size), "--parallel", "2")
        assert await _outputs(cmd, requests, shared=True) == expected, size


async def test_ranks_share_a_hybrids_forwards_as_one_process_runs_each():
    # Every rank's Gated DeltaNet layers step each sequence's own state in a shared forward.
    path = os.path.join(HYBRID, "qwen3_5_text")
    requests = [  # prompts whose answers run to their length on this fixture (256 positions)
        {"prompt": "In the beginning", "options": {"temperature": 0, "num_predict": 24}},
        {"prompt": "a b c d", "options": {"temperature": 0.9, "seed": 11, "num_predict": 24}},
        {"prompt": "Tell me", "options": {"temperature": 0.7, "seed": 3, "num_predict": 8}},
        {"prompt": "xyz", "options": {"temperature": 0, "num_predict": 8}},
    ]
    expected = await _outputs(_runner(path), requests)
    cmd = _runner(path, "--ranks", "2", "--parallel", "2")
    assert await _outputs(cmd, requests, shared=True) == expected


async def test_later_ranks_sliding_windows_keep_one_completion_at_a_time(checkpoint_factory):
    # Rank 0's layers attend in full; the second rank's slide a window, which one process
    # does not batch either: refused where the ranks are linked, said in the log.
    path = checkpoint_factory(
        "qwen2",
        num_hidden_layers=LAYERS,
        use_sliding_window=True,
        max_window_layers=2,
        sliding_window=6,
    )
    runner = await RunnerProcess.start(_runner(path, "--ranks", "2", "--parallel", "2"))
    try:
        await runner.send({"type": "shutdown"})
        assert await runner.wait_exit() == 0, runner.stderr_tail()
    finally:
        await runner.stop()
    log = runner.stderr.decode()
    assert "sliding-window layers are not batched across sequences" in log, log[-2000:]
    assert "across 2 ranks: one completion at a time" in log, log[-2000:]


def test_an_option_the_ranks_do_not_serve_is_refused_before_anything_starts(deep_checkpoint):
    out = subprocess.run(
        _runner(deep_checkpoint, "--ranks", "2", "--cache-disk-bytes", "1G"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "--cache-disk-bytes" in out.stderr
