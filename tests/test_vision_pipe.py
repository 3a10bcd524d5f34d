"""Images over a real runner's pipes: ``ready`` says the model takes them, every bad image
gets a ``bad_request`` naming it, and the runner serves the next request; a text-only model
refuses images by name."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from tests.conformance.harness import RunnerProcess, own_command

pytestmark = pytest.mark.asyncio(loop_scope="module")

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "reference" / "vision" / "qwen3_5_vision"
GREEDY = {"temperature": 0, "num_predict": 4}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encoded(size: tuple[int, int], fmt: str) -> str:
    """A random RGB image ``size`` (width, height) in ``fmt``, base64."""
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return b64(out.getvalue())


A = b64((FIXTURE / "images" / "A.png").read_bytes())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runner():
    process = await RunnerProcess.start(own_command(str(FIXTURE)))
    yield process
    await process.stop()
    assert not process.violations, process.violations[:5]


BAD = [
    ({"prompt": "a [img-0]", "images": [b64(b"not an image at all")]}, "images[0]"),
    ({"prompt": "a [img-0]", "images": ["***"]}, "images[0]"),
    ({"prompt": "a [img-0]", "images": [encoded((16, 16), "BMP")]}, "BMP"),
    ({"prompt": "a [img-0]", "images": [encoded((16, 16), "TIFF")]}, "TIFF"),
    ({"prompt": "a [img-0] [img-1]", "images": [A]}, "[img-1]"),  # a tag without its image
    ({"prompt": "a [img-0]", "images": [A, A]}, "images[1]"),  # an image without its tag
    ({"prompt": "a [img-0]", "images": [encoded((5000, 10), "PNG")]}, "aspect"),
    ({"prompt": "a <|image_pad|> b", "images": [A]}, "image pad"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}], "images": [A, A]},
            ]
        },
        "messages[0]",
    ),
    ({"messages": [{"role": "user", "content": "hi", "images": [b64(b"GIF89a")]}]}, "images[0]"),
    ({"tokens": [1, 2], "images": [A]}, "images"),
]


async def test_ready_says_the_model_takes_images(runner):
    assert runner.ready["images"] is True


async def test_every_bad_image_is_refused_by_name_and_the_runner_serves_on(runner):
    for n, (fields, needle) in enumerate(BAD):
        rid = f"bad{n}"
        await runner.send({"type": "completion", "id": rid, "options": GREEDY, **fields})
        frame = await runner.reply(rid)
        assert frame["type"] == "error" and frame["code"] == "bad_request", (fields, frame)
        assert needle.lower() in frame["message"].lower(), (needle, frame["message"])
    good = {"type": "completion", "id": "good", "prompt": "a [img-0] b", "images": [A]}
    await runner.send({**good, "options": GREEDY})
    tokens, done = await runner.completion("good")
    assert done["done_reason"] == "length" and done["eval_tokens"] == 4
    assert done["prompt_tokens"] > 12  # the image's 12 pads, its start and end, the text
    await runner.send({"type": "status", "id": "s"})
    status = await runner.reply("s")
    assert status["image_bytes"] == 0  # released with the request


async def test_the_same_image_twice_hits_the_prefix_cache(runner):
    request = {"type": "completion", "prompt": "x [img-0] y", "images": [A], "options": GREEDY}
    await runner.send({**request, "id": "first"})
    _, first = await runner.completion("first")
    await runner.send({**request, "id": "again"})
    _, again = await runner.completion("again")
    assert again["prompt_cached_tokens"] == again["prompt_tokens"] - 1
    other = {**request, "images": [encoded((64, 48), "PNG")], "id": "other"}
    await runner.send(other)
    _, done = await runner.completion("other")
    assert done["prompt_cached_tokens"] <= 3  # the text before the image at most


async def test_a_text_only_model_refuses_images(checkpoint_factory):
    process = await RunnerProcess.start(own_command(checkpoint_factory("llama")))
    try:
        assert process.ready["images"] is False
        await process.send(
            {"type": "completion", "id": "i", "prompt": "[img-0]", "images": [A], "options": GREEDY}
        )
        frame = await process.reply("i")
        assert frame["code"] == "bad_request" and "no vision tower" in frame["message"]
        await process.send({"type": "completion", "id": "t", "prompt": "hi", "options": GREEDY})
        _, done = await process.completion("t")
        assert done["eval_tokens"] >= 1
    finally:
        await process.stop()
