"""Families with per-sequence state beyond a plain cache in shared forwards (``--parallel``):
sliding-window layers (Mistral, Qwen2, Gemma 2 / 3: each sequence's rows masked to its own
window over its own rotating cache), the Qwen3.5 hybrid (each sequence's recurrent states fed
its own rows, a prompt with images at its own positions) and RoPEs whose rotation depends on
where a feed ends (Phi-3's longrope: each sequence's rows rotated as its own). Every stream
gives what it gives alone, greedy and seeded, with drafts verified in the shared forwards
where the family takes several rows a sequence."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from tests.test_batch import equal_alone
from tests.test_shared_rounds import drafts_pay  # noqa: F401 (a fixture)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
SLIDING = [
    "mistral_sliding",
    "qwen2_sliding_new",
    "gemma2_new",
    "gemma3_text_new",
    "gemma4/gemma4_dense",
    "gemma4/gemma4_e",  # layers reading other layers' keys and values, per-layer inputs
    "gemma4/gemma4_moe",  # an expert block beside the MLP
]
SEEDED = {"temperature": 0.8, "top_k": 40, "seed": 7}


def requests(tag: str, count: int, **options) -> list[Completion]:
    """Prompts of different lengths whose answers run past the fixtures' 16-token windows;
    the odd ones repeat a phrase, so the suffix drafter has text to draft from."""
    reqs = []
    for i in range(count):
        phrase = [11 + 3 * i, 40 + i, 77, 5 + 2 * i, 120 - i]
        tokens = phrase * (3 if i % 2 else 1) + list(range(30 + i, 36 + 2 * i))
        opts = Options(**{"temperature": 0.0, "num_predict": 36 + 5 * i, **options})
        reqs.append(Completion(id=f"{tag}{i}", tokens=tokens, options=opts))
    return reqs


@pytest.mark.parametrize("case", SLIDING)
def test_sliding_window_streams_in_shared_forwards_equal_alone(case, drafts_pay):  # noqa: F811
    """Four streams of a sliding-window family decode in shared forwards past their windows,
    each with its drafts verified there: the same tokens as alone, greedy and seeded."""
    engine = Engine(EngineOptions(model_path=str(FIXTURES / case), parallel=4))
    assert engine.parallel == 4, engine.parallel_detail
    assert engine.shared_draft_rows > 0
    _, greedy = equal_alone(engine, requests("g", 5))
    assert greedy.shared_rounds > 0
    equal_alone(engine, requests("s", 5, **SEEDED))


@pytest.mark.parametrize(
    "case", ["hybrid/qwen3_5_text", "hybrid/qwen3_5_vl", "moe/qwen3_5_moe", "moe/qwen3_next_moe"]
)
def test_hybrid_streams_in_shared_forwards_equal_alone(case, drafts_pay):  # noqa: F811
    """The Qwen3.5 / Qwen3-Next hybrids (dense and MoE) decode several streams in one
    forward, each sequence's recurrent states fed its own rows, drafts verified there (their
    states kept for the rollback); a stream left alone speculates with the checkpoint's own
    head again. The same tokens as alone, greedy and seeded."""
    path = str(FIXTURES / case)
    # Random weights seldom repeat themselves: the together runs draft from the outputs
    # their solo runs left in the recent outputs' index.
    engine = Engine(EngineOptions(model_path=path, parallel=3, recent_outputs=2048))
    assert engine.parallel == 3, engine.parallel_detail
    assert engine.shared_draft_rows > 0
    _, greedy = equal_alone(engine, requests("g", 4))
    assert greedy.shared_rounds > 0
    equal_alone(engine, requests("s", 4, **SEEDED))


def test_an_image_prompt_in_shared_forwards_equals_alone():
    """A prompt with an image shares forwards with text prompts: its rows keep the image's
    positions and feature rows, and every stream gives what it gives alone."""
    fixture = FIXTURES / "vision" / "qwen3_5_vision"
    image = base64.b64encode((fixture / "images" / "A.png").read_bytes()).decode()
    engine = Engine(EngineOptions(model_path=str(fixture), parallel=3))
    assert engine.parallel == 3, engine.parallel_detail
    reqs = [
        Completion(
            id=f"v{i}",
            prompt=f"look {i} [img-0] and say" if i != 1 else "no image here, just text",
            images=[image] if i != 1 else None,
            options=Options(temperature=0.0, num_predict=20 + 4 * i),
        )
        for i in range(3)
    ]
    equal_alone(engine, reqs)


def test_longrope_streams_in_shared_forwards_equal_alone():
    """Each sequence's rows rotate as a feed of its own rotates them (Phi-3's longrope takes
    its long factors once a feed ends past 32 positions, so the streams in one forward rotate
    with different factors): the same tokens as alone, greedy and seeded, past the switch."""
    engine = Engine(EngineOptions(model_path=str(FIXTURES / "phi3_longrope_new"), parallel=4))
    assert engine.parallel == 4, engine.parallel_detail
    equal_alone(engine, requests("g", 5))
    equal_alone(engine, requests("s", 5, **SEEDED))
