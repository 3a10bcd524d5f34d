"""The demo host (scripts/demo.py) and the Node example (examples/host.mjs) end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conformance.harness import RunnerProcess, text_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTION = "Name a colour."
CHATML = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
NUM_PREDICT = 12


@pytest.fixture(scope="module")
def model_flags(conformance_model, own_runner) -> list[str]:
    if not own_runner:
        pytest.skip("the example hosts spawn this repository's runner")
    return ["--noop-model"] if conformance_model is None else ["--model", conformance_model]


@pytest.fixture(scope="module")
def expected_text(runner_cmd) -> str:
    """What the runner streams for the hosts' request, asked directly through the pipes."""
    import asyncio

    async def ask() -> str:
        runner = await RunnerProcess.start(runner_cmd())
        try:
            await runner.send(
                {
                    "type": "completion",
                    "id": "x",
                    "prompt": CHATML,
                    "options": {"temperature": 0, "num_predict": NUM_PREDICT},
                }
            )
            tokens, _ = await runner.completion("x")
            return text_of(tokens)
        finally:
            await runner.stop()

    return asyncio.run(ask())


def test_demo_streams_the_answer_then_statistics(model_flags, expected_text):
    model = ["--model", model_flags[1]] if model_flags[0] == "--model" else []
    extra = [f"--runner-arg={flag}" for flag in model_flags if flag == "--noop-model"]
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "demo.py"),
            *model,
            *extra,
            "--prompt",
            QUESTION,
            "--temperature",
            "0",
            "--num-predict",
            str(NUM_PREDICT),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expected_text + "\n")
    stats = out.stdout[len(expected_text) + 1 :]
    assert "tokens/s" in stats and "from the prefix cache" in stats and "speculation" in stats
    assert "ready" in out.stderr


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not on the PATH")
def test_node_host_streams_the_answer_then_statistics(model_flags, expected_text):
    out = subprocess.run(
        [
            "node",
            os.path.join(ROOT, "examples", "host.mjs"),
            "--prompt",
            QUESTION,
            "--temperature",
            "0",
            "--num-predict",
            str(NUM_PREDICT),
            "--python",
            sys.executable,
            "--",
            *model_flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expected_text + "\n---")
    assert "tokens/s" in out.stdout and "from the prefix cache" in out.stdout
