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
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 150}},
    "required": ["name", "age"],
}  # fmt: skip
SCHEMAS = [
    ("a person", PERSON),
    ("a city and its country", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}),
    ("three colours", {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                   "minItems": 3, "maxItems": 3}},
        "required": ["colours"]}),
    ("the weather today", {
        "type": "object",
        "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                       "celsius": {"type": "number", "minimum": -40, "maximum": 50}},
        "required": ["sky", "celsius"]}),
    ("a book with its author", {
        "type": "object",
        "properties": {"title": {"type": "string"},
                       "author": {"type": "object", "properties": {"first": {"type": "string"},
                                                                   "last": {"type": "string"}},
                                  "required": ["first", "last"]}},
        "required": ["title", "author"]}),
    ("a list of two people", {
        "type": "object",
        "properties": {"people": {"type": "array", "items": PERSON, "minItems": 2,
                                  "maxItems": 2}},
        "required": ["people"]}),
    ("a yes or no answer to: is water wet?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"]}),
    ("an id that is a number or a short code", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999},
                                        {"type": "string", "pattern": "^[A-Z]{3}$"}]}},
        "required": ["id"]}),
    ("a rating of a film", {
        "type": "object",
        "properties": {"film": {"type": "string", "maxLength": 40},
                       "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
        "required": ["film", "stars"]}),
    ("a shopping list", {
        "type": "array",
        "items": {"type": "object",
                  "properties": {"item": {"type": "string", "maxLength": 20},
                                 "count": {"type": "integer", "minimum": 1, "maximum": 12}},
                  "required": ["item", "count"]},
        "minItems": 1, "maxItems": 3}),
]  # fmt: skip


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
def test_json_mode_gives_an_object_and_speculation_changes_nothing(engines):
    plain, speculative = engines
    text, done, _ = run(plain, "a person with a name and an age", "json", temperature=0.0)
    assert done.done_reason == "stop" and isinstance(json.loads(text), dict)
    for topic, schema in SCHEMAS[:3]:
        for sampling in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 5}):
            _, _, off = run(plain, topic, schema, **sampling)
            _, _, on = run(speculative, topic, schema, **sampling)
            assert on == off, topic


@pytest.mark.default_model
def test_what_cannot_be_enforced_is_refused_by_name(engines):
    plain, _ = engines
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"format": {"type": "nonsense"}}, "format: "),
        ({"format": PERSON, "think_budget": 4}, "format: constrained output after a <think>"),
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
