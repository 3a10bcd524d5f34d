"""``format``: JSON and JSON-Schema constrained output on the default model, greedy and
sampled; every output parses and validates, the grammar's end is a ``stop``, and what the
engine cannot enforce is refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from protocol.requests import Completion, Options
from runner.engine import Engine, EngineOptions, RequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}
SCHEMAS = [
    ("a person", PERSON),
    (
        "a city and its country",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "three colours",
        {
            "type": "object",
            "properties": {
                "colours": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["colours"],
        },
    ),
    (
        "the weather today",
        {
            "type": "object",
            "properties": {
                "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                "celsius": {"type": "number", "minimum": -40, "maximum": 50},
            },
            "required": ["sky", "celsius"],
        },
    ),
    (
        "a book with its author",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "author": {
                    "type": "object",
                    "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                    "required": ["first", "last"],
                },
            },
            "required": ["title", "author"],
        },
    ),
    (
        "a list of two people",
        {
            "type": "object",
            "properties": {
                "people": {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}
            },
            "required": ["people"],
        },
    ),
    (
        "a yes or no answer to: is water wet?",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "an id that is a number or a short code",
        {
            "type": "object",
            "properties": {
                "id": {
                    "anyOf": [
                        {"type": "integer", "minimum": 1, "maximum": 999},
                        {"type": "string", "pattern": "^[A-Z]{3}$"},
                    ]
                }
            },
            "required": ["id"],
        },
    ),
    (
        "a rating of a film",
        {
            "type": "object",
            "properties": {
                "film": {"type": "string", "maxLength": 40},
                "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
            },
            "required": ["film", "stars"],
        },
    ),
    (
        "a shopping list",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string", "maxLength": 20},
                    "count": {"type": "integer", "minimum": 1, "maximum": 12},
                },
                "required": ["item", "count"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
    ),
]


def closed(schema):
    """Every object in ``schema`` without properties beyond its own (as structured-output APIs
    ask): a small model left free to add fields can spend its budget inventing them."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


SCHEMAS = [(topic, closed(schema)) for topic, schema in SCHEMAS]


@pytest.fixture(scope="module")
def engines(default_model):
    plain = Engine(EngineOptions(model_path=default_model, use_draft=False))
    speculative = Engine(EngineOptions(model_path=default_model))
    return plain, speculative


@pytest.fixture(scope="module")
def deep(default_model):
    """Three drafts every round: masks along the draft chain and rollbacks on every round."""
    return Engine(EngineOptions(model_path=default_model, draft_depth=3))


def run(engine: Engine, topic: str, fmt, **options) -> tuple[str, object, list[int]]:
    schema = f" matching this JSON Schema: {json.dumps(fmt)}" if isinstance(fmt, dict) else ""
    messages = [{"role": "user", "content": f"Reply with JSON only{schema}. Give {topic}."}]
    opts = Options(num_predict=160, repeat_penalty=1.0, **options)
    request = Completion(id="f", messages=messages, format=fmt, options=opts)
    frames: list = []
    engine.run(engine.prepare(request), frames.append, lambda: False)
    tokens = [f for f in frames if type(f).__name__ == "Token"]
    return "".join(f.content for f in tokens), frames[-1], [t for f in tokens for t in f.tokens]


@pytest.mark.default_model
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_output_parses_and_validates(engines, mode):
    plain, _ = engines
    sampling = {"temperature": 0.0} if mode == "greedy" else {"temperature": 0.7, "seed": 11}
    for topic, schema in SCHEMAS:
        text, done, _ = run(plain, topic, schema, **sampling)
        assert done.done_reason == "stop", (topic, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.default_model
def test_json_mode_gives_an_object_and_speculation_changes_nothing(engines, deep):
    """Speculation under the constraint: the head drafts through the matcher's masks, the
    verify rows are masked, the matcher rolls back to what was accepted; the output is plain
    constrained decoding's, token for token, greedy and seeded, adaptive depth or three."""
    plain, speculative = engines
    text, done, _ = run(plain, "a person with a name and an age", "json", temperature=0.0)
    assert done.done_reason == "stop" and isinstance(json.loads(text), dict)
    accepted = 0
    for i, (topic, schema) in enumerate(SCHEMAS):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.7, "seed": 5}
        _, _, off = run(plain, topic, schema, **sampling)
        for engine in (speculative, deep) if i < 5 else (deep,):
            text, done, on = run(engine, topic, schema, **sampling)
            assert on == off, topic
            jsonschema.validate(json.loads(text), schema)
            accepted += done.speculation.accepted
    assert accepted > 0  # drafts were accepted under the constraint


@pytest.mark.default_model
def test_what_cannot_be_enforced_is_refused_by_name(engines):
    plain, _ = engines
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"format": {"type": "nonsense"}}, "format: "),
    ]
    for fields, needle in cases:
        with pytest.raises(RequestError) as raised:
            plain.prepare(Completion(id="x", messages=messages, **fields))
        assert str(raised.value).startswith(needle) or needle in str(raised.value)
    text, done, _ = run(plain, "a person", PERSON, temperature=0.0)  # still serving
    assert done.done_reason == "stop" and json.loads(text)


def test_a_tokenizer_the_grammar_engine_cannot_use_is_named():
    from runner.constraint import FormatError, Grammars

    with pytest.raises(FormatError, match="tokenizer cannot drive a grammar"):
        Grammars("{not a tokenizer", 320, [0]).compile("json")


def think_run(engine: Engine, prompt: str, budget: int) -> tuple[str, object, list[int]]:
    """A PERSON-constrained greedy completion of a raw ``prompt`` with a think budget."""
    request = Completion(
        id="t",
        prompt=prompt,
        format=PERSON,
        think_budget=budget,
        options=Options(temperature=0.0, num_predict=120, repeat_penalty=1.0),
    )
    frames: list = []
    engine.run(engine.prepare(request), frames.append, lambda: False)
    tokens = [f for f in frames if type(f).__name__ == "Token"]
    return "".join(f.content for f in tokens), frames[-1], [t for f in tokens for t in f.tokens]


@pytest.mark.default_model
def test_the_constraint_starts_after_the_reasoning_closes(engines, deep):
    """A prompt that opens <think> and a think budget: the span is free text, the budget
    closes it, and what follows the marker is JSON matching the schema; speculation (whose
    rollbacks may cross the marker) gives the same tokens."""
    plain, speculative = engines
    prompt = "<|im_start|>user\nGive a person as JSON.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    outputs = []
    for engine in (plain, speculative, deep):
        # One cache history for the three: a prompt whose prefix was cached by other tests'
        # requests prefills its rest in another split than a cold prompt, which may round
        # differently; what is compared here is speculation against none.
        engine.prefix.clear()
        for budget in (0, 5):
            text, done, ids = think_run(engine, prompt, budget)
            assert done.done_reason == "stop", text
            _, _, after = text.partition("</think>")
            jsonschema.validate(json.loads(after), PERSON)
            outputs.append(ids)
    assert outputs[0:2] == outputs[2:4] == outputs[4:6]


@pytest.fixture(scope="module")
def deferred(default_loaded):
    """deferred(opened) -> an AfterThinking over PERSON for the default model's vocabulary."""
    from runner.constraint import AfterThinking, Grammars

    tok = default_loaded.tokenizer
    grammars = Grammars(tok.hf.to_str(), default_loaded.vocab_size, sorted(tok.eos_ids))
    pieces = [tok.piece(t) for t in range(default_loaded.vocab_size)]
    openings = grammars.openings(lambda: pieces)
    eos = sorted(tok.eos_ids)

    def make(opened: bool) -> AfterThinking:
        return AfterThinking(grammars.compile(PERSON), tok.decode, openings, eos, opened=opened)

    return make


def test_after_thinking_passes_the_span_and_rolls_back_across_the_marker(default_loaded, deferred):
    """The deferred matcher: free text until </think>, the grammar after it; a rollback over
    the marker reopens the span, and the matcher's own state follows."""
    tok, eos = default_loaded.tokenizer, sorted(default_loaded.tokenizer.eos_ids)

    c = deferred(True)
    assert not bool(c.mask()[eos[0]])  # the answer must come: no EOS inside the span

    def free(mask) -> bool:  # everything but the stop tokens
        return int(mask.sum().item()) == default_loaded.vocab_size - len(eos)

    span = tok.encode("some thoughts </think>", add_bos=False)
    json_ids = tok.encode('{"name": "Ann", "age": 3}', add_bos=False)
    for t in span[:-1]:
        assert free(c.mask()) and c.allows(t)
    assert not c.active
    c.consume(span[-1])  # completes the marker
    assert c.active and not free(c.mask())
    assert not c.allows(tok.encode("hello", add_bos=False)[0])  # the grammar has it now
    for t in json_ids[:3]:
        assert c.allows(t)
    c.rollback(3 + 1)  # the JSON tokens and the marker's end: back inside the span
    assert not c.active and free(c.mask())
    for t in span[-1:] + json_ids:
        c.consume(t)
    assert c.active
    allowed, only = c.mask_or_only()
    assert only in tok.eos_ids and bool(allowed[only])  # complete: only EOS is left

    # A reply that may open the span itself (a think budget, a prompt that did not open it).
    undecided = deferred(False)
    first = undecided.mask()
    brace = tok.encode('{"', add_bos=False)[0]
    lt = tok.encode("<", add_bos=False)[0]
    assert bool(first[brace]) and bool(first[lt]) and not undecided.active
    assert undecided.allows(lt) and not undecided.allows(brace)  # on its way to <think>
    for t in tok.encode("think>plan</think>", add_bos=False):
        assert undecided.allows(t)
    assert undecided.active and undecided.allows(brace)
    undecided.rollback(len(undecided._before) + 1)  # back to the undecided start
    assert not undecided.active and undecided.allows(brace) and undecided.active  # no span


@pytest.mark.default_model
def test_a_think_budget_without_an_opened_span_constrains_from_the_reply_start(engines):
    """The model may open <think> itself; this one answers straight away, and the answer is
    JSON matching the schema, speculation or not."""
    plain, speculative = engines
    prompt = "<|im_start|>user\nGive a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    outputs = []
    for engine in (plain, speculative):
        text, done, ids = think_run(engine, prompt, 4)
        assert done.done_reason == "stop", text
        _, _, answer = text.rpartition("</think>")
        jsonschema.validate(json.loads(answer), PERSON)
        outputs.append(ids)
    assert outputs[0] == outputs[1]


def test_an_undecided_reply_follows_the_emitters_rule_for_the_open_marker(default_loaded, deferred):
    """Up to 64 bytes of whitespace may lead <think> (as the think budget counts a span) and
    no more; inside the span EOS is masked, so the answer must come."""
    tok, eos = default_loaded.tokenizer, sorted(default_loaded.tokenizer.eos_ids)

    # The emitter's rule: up to 64 bytes of whitespace may lead the marker, and no more.
    newline = tok.encode("\n", add_bos=False)[0]
    lead = deferred(False)
    for _ in range(30):
        assert lead.allows(newline)
    for t in tok.encode("<think>", add_bos=False):
        assert lead.allows(t)
    assert not lead.active and not bool(lead.mask()[eos[0]])  # a span, 30 newlines in
    capped = deferred(False)
    for _ in range(64):
        assert capped.allows(newline)
    assert not bool(capped.mask()[newline]) and not capped.allows(newline)
