"""Speculation across ranks (runner.distributed): the suffix drafter and an MTP head on rank 0,
verify feeds through the pipeline and rewinds of the rejected rows, compared token for token
with one process run with the same options."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from protocol.errors import DraftHeadError
from runner.distributed import follower, stage
from runner.distributed.channel import Command, Op
from runner.distributed.pipeline import PipelineModel
from runner.loader import load_model
from runner.models import layers
from tests.conformance.harness import RunnerProcess
from tests.heads import echo_head, write_head
from tests.test_distributed import HYBRID, LAYERS, MOE, ScriptedChannel, _runner, noop
from tests.test_head import random_head

# Copy-heavy: the text repeats, so the suffix drafter finds earlier matches to draft from.
COPY = " ".join(["alpha beta gamma delta epsilon zeta eta theta iota kappa"] * 4)
REQUESTS = [
    {"prompt": COPY, "options": {"temperature": 0, "num_predict": 24}},
    {"prompt": COPY, "options": {"temperature": 0.8, "seed": 5, "num_predict": 24}},
    {"prompt": "The quick brown fox", "options": {"temperature": 0, "num_predict": 16}},
]


@pytest.fixture(scope="module")
def deep_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def head_dirs(deep_checkpoint, tmp_path_factory) -> dict[str, str]:
    """An echo head (right where the target repeats itself), a head fusing the stream after
    layer 1 (rank 0's first layer, for either split) and one fusing a later rank's stream."""
    loaded = load_model(deep_checkpoint)
    made = tmp_path_factory.mktemp("heads")
    return {
        "echo": write_head(str(made / "echo"), loaded, echo_head(loaded)),
        "fused": write_head(
            str(made / "fused"), loaded, random_head(loaded, seed=2, feature_layers=[1])
        ),
        "fused-late": write_head(
            str(made / "late"), loaded, random_head(loaded, seed=2, feature_layers=[LAYERS - 1])
        ),
    }


async def _speculating(cmd: list[str]) -> tuple[list[list[int]], list[dict]]:
    """Each request's ids and ``done.speculation``; a speculating completion cancelled
    mid-decode first and again in the middle (the next requests start the ranks' caches
    over from where it stopped)."""
    runner = await RunnerProcess.start(cmd)
    outputs, speculation = [], []

    async def cancelled(name: str) -> None:
        options = {"temperature": 0, "num_predict": 1_000_000}
        await runner.send({"type": "completion", "id": name, "prompt": COPY, "options": options})
        assert (await runner.reply(name))["type"] == "token"
        await runner.send({"type": "cancel", "id": name})
        done = await runner.take(lambda f: f["type"] == "done" and f["id"] == name)
        assert done["done_reason"] == "cancelled"

    try:
        await cancelled("first")
        for index, request in enumerate(REQUESTS + REQUESTS[:1]):
            if index == len(REQUESTS):
                await cancelled("again")
            await runner.send({"type": "completion", "id": f"r{index}", **request})
            tokens, done = await runner.completion(f"r{index}")
            assert done["done_reason"] == "length", done
            outputs.append([t for frame in tokens for t in frame["tokens"]])
            speculation.append(done["speculation"])
        await runner.send({"type": "shutdown"})
        assert await runner.wait_exit() == 0, runner.stderr_tail()
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:3]
    assert outputs[-1] == outputs[0]  # after the second cancel: the same again
    return outputs, speculation


async def _check_against_one_process(path: str, *options: str) -> list[dict]:
    expected, _ = await _speculating(_runner(path, *options))
    for size in (2, 3):
        got, speculation = await _speculating(_runner(path, *options, "--ranks", str(size)))
        assert got == expected, (options, size)
    return speculation


@pytest.mark.parametrize("depth", [(), ("--draft-depth", "3")], ids=["adaptive", "fixed"])
async def test_ranks_speculate_from_the_text_as_one_process_does(deep_checkpoint, depth):
    speculation = await _check_against_one_process(
        deep_checkpoint, "--draft-sources", "suffix", *depth
    )
    assert sum(s["drafted"] for s in speculation) > 0, speculation


async def test_ranks_with_sliding_windows_rewind_rejected_rows_as_one_process(checkpoint_factory):
    # The later ranks' windows slide past the copy-heavy prompt: each rewind of a verify's
    # rejected rows lands where their rotating caches still hold the window.
    path = checkpoint_factory("mistral", num_hidden_layers=LAYERS, sliding_window=6)
    speculation = await _check_against_one_process(path, "--draft-depth", "3")
    assert sum(s["drafted"] - s["accepted"] for s in speculation) > 0, speculation


@pytest.mark.parametrize(
    "depth",
    [
        (),
        ("--draft-depth", "2"),
        ("--draft-depth", "2", "--weight-layout", "packed", "--row-layout"),
    ],
    ids=["adaptive", "fixed", "packed"],  # packed: every rank adds the verify-row layout
)
async def test_ranks_speculate_with_a_head_on_rank_0_as_one_process_does(
    deep_checkpoint, head_dirs, depth
):
    options = ("--draft", head_dirs["echo"], "--draft-sources", "head", *depth)
    speculation = await _check_against_one_process(deep_checkpoint, *options)
    assert sum(s["drafted"] for s in speculation) > 0, speculation
    assert sum(s["accepted"] for s in speculation) > 0, speculation


async def test_a_head_fusing_rank_0s_layers_is_served_across_ranks(deep_checkpoint, head_dirs):
    options = ("--draft", head_dirs["fused"], "--draft-depth", "2")
    speculation = await _check_against_one_process(deep_checkpoint, *options)
    assert sum(s["drafted"] for s in speculation) > 0, speculation


@pytest.mark.parametrize(
    ("case", "options"),
    [
        ("qwen3_5_text", ("--draft-sources", "suffix", "--draft-depth", "3")),
        ("qwen3_5_vl", ("--draft-depth", "2")),  # its inline MTP head, on rank 0
    ],
    ids=["suffix", "inline-head"],
)
async def test_ranks_speculate_over_a_hybrid_as_one_process(case, options):
    # Gated DeltaNet layers on every rank: a verify keeps each prefix's state there too, and
    # a rejected draft rewinds the other ranks to a kept state (rank 0 mirrors which). Fixed
    # depths: whether an adaptive choice drafts depends on the machine's timings.
    speculation = await _check_against_one_process(os.path.join(HYBRID, case), *options)
    assert sum(s["drafted"] for s in speculation) > 0, speculation
    assert sum(s["drafted"] - s["accepted"] for s in speculation) > 0, speculation
    if case == "qwen3_5_vl":
        assert sum(s["sources"].get("head", {}).get("drafted", 0) for s in speculation) > 0


async def test_ranks_speculate_over_a_moe_model_as_one_process(tmp_path):
    # The head's block is the family's own, built from the whole model's arguments.
    path = os.path.join(MOE, "qwen3_moe")
    loaded = load_model(path)
    head = write_head(str(tmp_path / "head"), loaded, random_head(loaded, seed=1))
    speculation = await _check_against_one_process(path, "--draft", head, "--draft-depth", "2")
    assert sum(s["drafted"] for s in speculation) > 0, speculation


async def test_ranks_say_which_drafters_they_use_in_ready(deep_checkpoint, head_dirs):
    runner = await RunnerProcess.start(_runner(deep_checkpoint, "--ranks", "2"))
    try:  # no head beside this checkpoint: the suffix drafter alone
        assert runner.ready["mtp"] is False and runner.ready["draft_sources"] == ["suffix"]
        assert "no MTP head" in runner.ready["mtp_detail"]
    finally:
        await runner.stop()
    cmd = _runner(deep_checkpoint, "--ranks", "2", "--draft", head_dirs["echo"])
    runner = await RunnerProcess.start(cmd)
    try:
        assert runner.ready["mtp"] is True
        assert runner.ready["draft_sources"] == ["head", "suffix"]
    finally:
        await runner.stop()


async def test_a_head_fusing_another_ranks_layers_is_refused_by_name(deep_checkpoint, head_dirs):
    cmd = _runner(deep_checkpoint, "--ranks", "2", "--draft", head_dirs["fused-late"])
    runner = await RunnerProcess.start(cmd, wait_ready=False)
    try:
        error = await runner.take(lambda f: f["type"] in ("error", "ready"), timeout=60)
        assert error["type"] == "error" and error["code"] == "draft_head_error", error
        assert "only those after rank 0's layers" in error["message"]
        assert await runner.wait_exit(timeout=30) == 1
    finally:
        await runner.stop()
    assert not runner.violations


async def test_a_head_found_beside_the_model_fusing_another_ranks_layers_is_skipped(
    checkpoint_factory,
):
    path = checkpoint_factory("llama", num_hidden_layers=LAYERS, seed=7)
    loaded = load_model(path)
    write_head(os.path.join(path, "mtp"), loaded, random_head(loaded, feature_layers=[LAYERS - 1]))
    runner = await RunnerProcess.start(_runner(path, "--ranks", "2"))
    try:  # found, not named: reported and skipped, as one process skips an unusable head
        assert runner.ready["mtp"] is False and runner.ready["draft_sources"] == ["suffix"]
        assert "not usable across ranks" in runner.ready["mtp_detail"]
    finally:
        await runner.stop()


def test_rank_0_keeps_the_streams_of_its_own_layers_only():
    model = PipelineModel.__new__(PipelineModel)
    object.__setattr__(model, "model", type("Stack", (), {"layers": [None, None]})())
    with pytest.raises(DraftHeadError, match=r"only those after rank 0's layers \(1..2\)"):
        model.use_draft_features((1, 3))
    model.use_draft_features((1, 2))  # the stream rank 0 hands on is its own
    assert model.draft_features == (1, 2) and model.draft_stream_layers == {0, 1}


def test_a_later_rank_lays_its_layers_out_for_verify_rows_when_told(deep_checkpoint):
    options = stage.StageLoad(layout="packed")  # the layout rank 0 adds verify rows to
    checkpoint = stage.read_checkpoint(deep_checkpoint, noop)
    model = stage.load_stage(checkpoint, range(2, LAYERS), False, options, noop).model
    stage.tune_stage(model, options)
    rows = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(3))
    before = model.hidden(rows, model.make_caches(), prenorm=True)
    channel = ScriptedChannel([Command(Op.ROW_LAYOUT), Command(Op.SHUTDOWN)])
    follower.follow(channel, model)
    linears = [m for _, m in model.named_modules() if isinstance(m, layers.Linear)]
    assert any("_w_rows" in m for m in linears)
    after = model.hidden(rows, model.make_caches(), prenorm=True)
    assert all(layer.compiled is not None for layer in model.layers)  # compiled afresh
    assert mx.allclose(after, before, atol=1e-4).item()
