"""End to end on the default model and its head through real pipes: with a seed, sampled
output does not depend on speculation. For 5 prompts x temperature {0.7, 1.0} x three filter
settings x 2 seeds, ``speculative: true`` gives token for token what ``speculative: false``
gives with the adaptive depth (the same request repeated after requests that moved the depth
controller); at fixed depths 1, 2 and 4, and with a draft head that fails mid-request, it does
for half of them each (one seed: every prompt, temperature and filter), so that each half
meets two fixed depths and the suite stays within the CI's time."""

from __future__ import annotations

import itertools
import sys

import pytest
import pytest_asyncio

from tests.conformance.harness import RunnerProcess, ids_of, unique_id
from tests.conformance.test_default_speculation import CHAT, PROMPTS

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTIONS = PROMPTS[:5]
TEMPERATURES = (0.7, 1.0)
FILTERS = (
    {"top_k": 40, "top_p": 0.9},  # Ollama's defaults
    {"top_k": 0, "top_p": 1.0},
    {"top_k": 0, "top_p": 1.0, "min_p": 0.05},
)
SEEDS = (1234, 7)
TOKENS = 16
REQUESTS = [
    (q, {"temperature": t, "seed": s, "num_predict": TOKENS, "repeat_penalty": 1.0, **f})
    for q, t, f, s in itertools.product(QUESTIONS, TEMPERATURES, FILTERS, SEEDS)
]


async def start(default_model: str, extra: list[str], head: list[str]) -> RunnerProcess:
    cmd = [sys.executable, "-m", "runner", "--model", default_model, *extra, *head]
    runner = await RunnerProcess.start(cmd)
    assert runner.ready["mtp"], runner.ready["mtp_detail"]
    return runner


async def complete(runner: RunnerProcess, question: str, options: dict, speculative: bool):
    rid = unique_id("spec" if speculative else "plain")
    await runner.send(
        {
            "type": "completion",
            "id": rid,
            "prompt": CHAT.format(question),
            "speculative": speculative,
            "options": options,
        }
    )
    tokens, done = await runner.completion(rid, timeout=300)
    return ids_of(tokens), done


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain_outputs(default_model, head_args):
    """Every request's output without speculation, and the adaptive runner's checks."""
    runner = await start(default_model, [], head_args)
    try:
        plain, drafted = {}, 0
        for i, (question, options) in enumerate(REQUESTS):
            plain[i], done = await complete(runner, question, options, False)
            assert done["speculation"]["rounds"] == 0
            spec, done = await complete(runner, question, options, True)
            assert spec == plain[i], (question, options)
            drafted += done["speculation"]["drafted"]
        assert drafted > 0  # the controller really speculated
        # The same request five times, each after requests that move the depth controller.
        question, options = REQUESTS[0]
        for round_ in range(5):
            for other_q, other_o in REQUESTS[1 + round_ :: 15]:
                await complete(runner, other_q, other_o, True)
            again, _ = await complete(runner, question, options, True)
            assert again == plain[0], round_
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:5]
    return plain


@pytest.mark.parametrize(
    ("extra", "seed"),
    [
        (["--draft-depth", "1"], SEEDS[0]),
        (["--draft-depth", "2"], SEEDS[1]),
        (["--draft-depth", "4"], SEEDS[0]),
        (["--draft-depth", "3", "--inject-fault", "head-call=6"], SEEDS[1]),
    ],
    ids=["depth-1", "depth-2", "depth-4", "head-fault"],
)
async def test_seeded_output_does_not_depend_on_speculation(
    default_model,
    head_args,
    plain_outputs,
    extra,  # noqa: F811
    seed,
):
    runner = await start(default_model, extra, head_args)
    try:
        drafted = 0
        for i, (question, options) in enumerate(REQUESTS):
            if options["seed"] != seed:
                continue
            got, done = await complete(runner, question, options, True)
            assert got == plain_outputs[i], (question, options)
            drafted += done["speculation"]["drafted"]
        assert drafted > 0
    finally:
        await runner.stop()
    assert not runner.violations, runner.violations[:5]
