"""Images through the whole runner against transformers: a tiny random Qwen3.5 multimodal
checkpoint (``tests/fixtures/reference/vision/qwen3_5_vision``, written by
``scripts/fixtures/vision.py``): the prompt the chat template and the images expand to, the
3-channel positions, every prompt row's logits (in one forward and in chunks cut inside an
image), 24 greedy tokens, speculation kept lossless across image rows, and the prefix cache
keyed by the image."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from drafting.session import DraftSession, Proposal
from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions
from runner.images import prompt_positions
from runner.prepare import RequestError
from tests.test_engine import complete

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "reference" / "vision" / "qwen3_5_vision"
CASES = ["one", "two", "chunk", "text"]
# Every prompt row (image rows and the rows after them included) and every decode step. Image
# rows also carry the tower's float32 rounding (features about 4e-7 off their float64 values, in
# the runner as in transformers), which the random text stack grows to a few 1e-5 in the logits;
# the fixture draws its final norm gain around 1 (logits near 8) so that stays inside the bound.
ATOL = 1e-4
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}


@functools.cache
def meta() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))


@functools.cache
def ref() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "reference.npz") as npz:
        return {k: npz[k] for k in npz.files}


def image_b64(name: str) -> str:
    path = next(FIXTURE.glob(f"images/{name}.*"))
    return base64.b64encode(path.read_bytes()).decode()


def case_request(case: str, rid: str = "r", **options) -> Completion:
    """The case's conversation as a host sends it: image parts filled by each message's
    ``images`` in order."""
    info = meta()["cases"][case]
    images = [image_b64(name) for name in info["images"]]
    messages = [dict(m) for m in info["messages"]]
    messages[-1]["images"] = images
    speculative = options.pop("speculative", True)
    opts = Options(**{**GREEDY, "num_predict": 24, **options})
    return Completion(id=rid, messages=messages, options=opts, speculative=speculative)


@pytest.fixture(scope="module", params=["as loaded", "tuned"])
def engine(request) -> Engine:
    if request.param == "as loaded":
        options = EngineOptions(model_path=str(FIXTURE), weight_layout="hf", compile=False)
    else:
        options = EngineOptions(model_path=str(FIXTURE))
    return Engine(options)


@pytest.fixture(scope="module")
def tuned() -> Engine:
    return Engine(EngineOptions(model_path=str(FIXTURE), draft_sources=("head",)))


def prompt_logits(engine: Engine, case: str, cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every prompt row's logits, the prompt fed in chunks ending at ``cuts``, and the logits
    of each decode step after it, the reference's greedy tokens fed one at a time."""
    prepared = engine.prepare(case_request(case))
    layout = engine.image_layout(prepared)
    caches = engine.model.make_caches()
    for cache in caches:
        cache.layout = layout

    def feed(ids: list[int]) -> mx.array:
        logits = engine.model.unembed(engine.model.hidden(mx.array([ids]), caches))[0]
        mx.eval(logits)
        return logits

    rows, start = [], 0
    for end in [*cuts, len(prepared.prompt)]:
        rows.append(feed(prepared.prompt[start:end]))
        start = end
    steps = [rows[-1][-1]]
    for token in ref()[f"greedy_{case}"].tolist()[:-1]:
        steps.append(feed([token])[0])
    return np.array(mx.concatenate(rows)), np.array(mx.stack(steps))


def test_ready_and_the_expanded_prompt_match_the_processor(engine):
    assert engine.info.images
    for case in CASES:
        prepared = engine.prepare(case_request(case))
        assert prepared.prompt == ref()[f"ids_{case}"].tolist(), case
        positions, delta = prompt_positions(len(prepared.prompt), prepared.images)
        assert np.array_equal(positions, ref()[f"positions_{case}"]), case
        assert delta == int(ref()[f"delta_{case}"])


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_whole_and_in_chunks(engine, case):
    want, steps = ref()[f"logits_{case}"], ref()[f"step_logits_{case}"]
    spans = meta()["cases"][case]["image_spans"]
    cuts = ref()["cuts_chunk"].tolist() if case == "chunk" else []
    cuts += [(s["pads"][0] + s["pads"][1]) // 2 for s in spans]  # inside every image
    for chunks in ([], sorted(set(cuts))):
        rows, decoded = prompt_logits(engine, case, chunks)
        assert np.abs(rows - want).max() < ATOL  # every prompt row, the image's included
        assert np.abs(decoded - steps).max() < ATOL  # decoding at p + delta


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers(engine, case):
    ids, _, done, _ = complete_request(engine, case_request(case, speculative=False))
    assert ids == ref()[f"greedy_{case}"].tolist()
    assert done.prompt_tokens == len(ref()[f"ids_{case}"])


def complete_request(engine: Engine, request: Completion):
    frames: list = []
    engine.run(engine.prepare(request), frames.append, lambda: False)
    tokens = [f for f in frames if type(f).__name__ == "Token"]
    return [t for f in tokens for t in f.tokens], None, frames[-1], tokens


def fresh(engine: Engine) -> Engine:
    engine.prefix.clear()
    return engine


@pytest.mark.parametrize("case", ["one", "two"])
@pytest.mark.parametrize("depth", [None, 1, 3])
def test_speculation_with_images_is_lossless(tuned, case, depth):
    tuned.speculation.fixed_depth = depth
    try:
        want = ref()[f"greedy_{case}"].tolist()
        assert complete_request(fresh(tuned), case_request(case))[0] == want
        seeded = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 11}
        plain = complete_request(fresh(tuned), case_request(case, speculative=False, **seeded))
        drafted = complete_request(fresh(tuned), case_request(case, **seeded))
        assert drafted[0] == plain[0] and len(plain[0]) == 24
    finally:
        tuned.speculation.fixed_depth = None


def test_scripted_drafts_right_then_an_image_pad_are_judged_like_any_token(tuned, monkeypatch):
    """Drafts from the head after its pairs over the image rows were flushed: the first is the
    reference's next token (accepted), the second the image pad id (rejected: greedy never
    picks it), so every round accepts exactly one and the output is the reference's."""
    want = ref()["greedy_two"].tolist()
    length = len(ref()["ids_two"])
    pad = meta()["special_token_ids"]["<|image_pad|>"]
    original = DraftSession.propose
    seen = []

    def scripted(self, current, k, sampler, *, slot, constrain=None):
        proposal = original(self, current, k, sampler, slot=slot, constrain=constrain)
        if proposal is None:
            return None
        nxt = slot - length
        seen.append((nxt, self.cache.offset))
        tokens = [want[nxt] if nxt < len(want) else pad, *[pad] * (k - 1)]
        return Proposal(tokens=mx.array(tokens[:k], dtype=mx.int32), slot=proposal.slot)

    monkeypatch.setattr(DraftSession, "propose", scripted)
    tuned.speculation.fixed_depth = 2
    try:
        ids, _, done, _ = complete_request(fresh(tuned), case_request("two"))
    finally:
        tuned.speculation.fixed_depth = None
    assert ids == want
    assert seen and seen[0][1] >= length - 1  # the head flushed the whole prompt, images too
    spec = done.speculation
    assert spec.accepted >= spec.rounds - 1 and spec.drafted == 2 * spec.rounds


def test_a_later_turn_restores_the_image_and_another_image_does_not(tuned):
    fresh(tuned)
    first = case_request("one")
    ids, _, done, _ = complete_request(tuned, first)
    assert done.prompt_cached_tokens == 0
    info = meta()["cases"]["one"]
    again = case_request("one")
    again.messages = [
        *again.messages,
        {"role": "assistant", "content": tuned.detokenize(ids)},
        {"role": "user", "content": "and then"},
    ]
    _, _, second, _ = complete_request(tuned, again)
    # The whole first turn (its image included) comes back from the cache.
    assert second.prompt_cached_tokens >= len(ref()["ids_one"]) - 1
    other = case_request("one")
    other.messages[-1]["images"] = [image_b64("D")]  # the same size as A, other pixels
    _, _, third, _ = complete_request(tuned, other)
    start = info["image_spans"][0]["pads"][0]
    assert third.prompt_cached_tokens <= start  # nothing from A's rows is reused
    assert complete_request(fresh(tuned), other)[0] == complete_request(tuned, other)[0]


def test_images_are_released_once_embedded(tuned):
    fresh(tuned)
    request = case_request("two", num_predict=4)
    prepared = tuned.prepare(request)
    frames: list = []
    tuned.run(prepared, frames.append, lambda: False)
    assert all(span.released and span.features is None for span in prepared.images)
    assert tuned.status()["image_bytes"] == 0
    assert all(cache.layout is None for cache in tuned.slots[0].all)


def test_a_text_request_after_an_image_request_is_unchanged(tuned):
    text = Completion(id="t", prompt="the fox was", options=Options(**GREEDY, num_predict=12))
    before = complete_request(fresh(tuned), text)[0]
    complete_request(tuned, case_request("one", num_predict=3))
    assert complete_request(tuned, text)[0] == before
    assert complete(fresh(tuned), "the fox was", **GREEDY, num_predict=12)[0] == before


def test_a_tower_that_cannot_be_used_leaves_a_text_model_that_says_why():
    """The hybrid fixture's multimodal save keeps the released image token ids, outside its
    tiny vocabulary: it serves text, and images are refused with that reason."""
    path = FIXTURE.parent.parent / "hybrid" / "qwen3_5_vl"
    engine = Engine(EngineOptions(model_path=str(path), compile=False))
    assert not engine.info.images
    request = Completion(id="i", prompt="[img-0]", images=[image_b64("A")])
    with pytest.raises(RequestError) as refused:
        engine.prepare(request)
    assert refused.value.code == "bad_request"
    assert "image_token_id" in str(refused.value) or "vocabulary" in str(refused.value)
    assert complete(engine, "the fox", **GREEDY, num_predict=3)[0]
