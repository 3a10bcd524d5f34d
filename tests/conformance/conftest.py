"""Fixtures for the conformance suite: runner processes driven through their pipes.

The runner under test is MTP_RUNNER_CMD (a shell-style command line) when set, else this
repository's runner on a small random checkpoint, on the checkpoint named by
MTP_RUNNER_CONFORMANCE_MODEL (a directory or GGUF file, e.g. a hybrid fixture under
tests/fixtures/reference/hybrid/), or on the no-op model when MTP_RUNNER_CONFORMANCE_NOOP=1.
Tests that need this runner's hidden hooks or its CLI skip for an external command.
"""

from __future__ import annotations

import os

import pytest
import pytest_asyncio

from tests.conformance.harness import RunnerProcess, external_command, own_command

NOOP = os.environ.get("MTP_RUNNER_CONFORMANCE_NOOP") == "1"
MODEL = os.environ.get("MTP_RUNNER_CONFORMANCE_MODEL") or None
# Own runner only: fail the request with this id after its first token (internal error path).
FAULT_ID = "conformance-fault"


@pytest.fixture(scope="session")
def conformance_model(request) -> str | None:
    """The checkpoint our runner serves in these tests (None: the no-op model)."""
    if NOOP or external_command():
        return None
    if MODEL is not None:
        if not os.path.exists(MODEL):
            pytest.fail(f"MTP_RUNNER_CONFORMANCE_MODEL={MODEL}: no such checkpoint")
        return os.path.abspath(MODEL)
    # Longer context than the default tiny model so a greedy completion runs for seconds (it
    # decodes thousands of tokens a second: a long completion must outlast a test's setup).
    return request.getfixturevalue("checkpoint_factory")("llama", max_position_embeddings=65536)


@pytest.fixture(scope="session")
def own_runner() -> bool:
    return external_command() is None


@pytest.fixture(scope="session")
def runner_cmd(conformance_model):
    """runner_cmd(*extra_flags) -> argv; extra flags only reach this repository's runner."""
    external = external_command()
    if external:
        return lambda *extra: list(external)
    pacing = ("--noop-delay-ms", "1") if conformance_model is None else ()
    return lambda *extra: own_command(conformance_model, *pacing, *extra)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_runner(runner_cmd):
    """One runner for a whole module: tests use their own ids and do not interfere."""
    runner = await RunnerProcess.start(runner_cmd("--inject-fault", f"token-frame={FAULT_ID}"))
    yield runner
    await runner.stop()
    assert not runner.violations, runner.violations[:5]


@pytest_asyncio.fixture(loop_scope="module")
async def spawn(runner_cmd):
    """spawn(*extra_flags, wait_ready=True) -> a fresh RunnerProcess, reaped after the test."""
    started: list[RunnerProcess] = []

    async def start(*extra: str, wait_ready: bool = True, cmd: list[str] | None = None):
        runner = await RunnerProcess.start(cmd or runner_cmd(*extra), wait_ready=wait_ready)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        await runner.stop()
        assert not runner.violations, runner.violations[:5]


@pytest.fixture(scope="session")
def head_args(default_model, tmp_path_factory) -> list[str]:
    """Runner flags for the default model's head: none for the shipped head, else a random
    head written as a sidecar (speculation must be lossless either way)."""
    import mlx.core as mx

    from runner.default_model import HEAD_DIR

    if os.path.exists(os.path.join(HEAD_DIR, "config.json")):
        return []
    from runner.loader import load_model
    from tests.heads import write_head

    loaded = load_model(default_model)
    directory = write_head(str(tmp_path_factory.mktemp("random-head")), loaded)
    del loaded
    mx.clear_cache()
    return ["--draft", directory]
