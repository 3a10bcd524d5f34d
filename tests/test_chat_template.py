"""Chat messages through the model's own template: the runner's rendering against
transformers' ``apply_chat_template`` (fixtures from ``scripts/fixtures/templates.py``), the
template's sources in a checkpoint, and ``messages`` over real pipes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import pytest_asyncio

from runner.chat_template import ChatTemplate, TemplateError, from_directory
from runner.loader import load_model
from tests.conformance.harness import RunnerProcess, ids_of, own_command, text_of

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "templates")
NAMES = ("llama3", "qwen2_5", "qwen3", "mistral", "smollm2")


def fixture(name: str) -> tuple[str, dict]:
    with open(os.path.join(FIXTURES, f"{name}.jinja"), encoding="utf-8") as f:
        template = f.read()
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        return template, json.load(f)


def render(template: ChatTemplate, case: dict) -> str:
    return template.render(
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case.get("add_generation_prompt", True),
        template_kwargs=case.get("template_kwargs"),
    )


def check(template: ChatTemplate, case: dict) -> None:
    """``case`` renders as transformers rendered it, or is refused where transformers raised."""
    if "error" in case:
        with pytest.raises(TemplateError):
            render(template, case)
    else:
        assert render(template, case) == case["expected"], case["messages"]


def has_null_key(case: dict) -> bool:
    return any(value is None for m in case["messages"] for value in m.values())


@pytest.mark.parametrize("name", NAMES)
def test_rendering_equals_transformers_on_every_conversation(name):
    text, record = fixture(name)
    template = ChatTemplate(name, {"default": text}, record["special_tokens"])
    assert len(record["cases"]) == 13
    for case in record["cases"]:
        check(template, case)


@pytest.mark.parametrize("name", NAMES)
def test_null_message_keys_render_as_transformers_renders_them(name):
    """Hosts send ``content: null`` on a tool-call turn and ``name``/``tool_calls`` null on
    plain ones; a null passed through made Llama 3 raise and SmolLM2 print ``None``."""
    text, record = fixture(name)
    template = ChatTemplate(name, {"default": text}, record["special_tokens"])
    cases = [c for c in record["cases"] if has_null_key(c)]
    assert len(cases) == 3
    for case in cases:
        check(template, case)
        assert "None" not in case.get("expected", "")
    refused = [c for c in cases if "error" in c]  # the template itself needs that content
    assert len(refused) == (1 if name in ("qwen3", "smollm2") else 0)
    if name != "smollm2":
        tool_turn = next(c for c in cases if c.get("tools"))
        assert tool_turn["messages"][1]["content"] is None
        assert ("error" in tool_turn) == (name == "qwen3")


def test_only_a_messages_own_null_keys_are_dropped():
    """As transformers: the message's null keys go (before reasoning is aliased), nulls inside
    content parts and tool calls stay, and the caller's messages are left as they were."""
    messages = [
        {"role": "system", "content": "s", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "hi", "image": None}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": None,
            "thinking": "t",
            "tool_calls": [{"id": None, "function": {"name": "f", "arguments": {"x": None}}}],
        },
        {"role": "tool", "content": "r", "name": None, "tool_call_id": None},
    ]
    before = json.dumps(messages)
    seen = json.loads(ChatTemplate("t", {"default": "{{ messages | tojson }}"}).render(messages))
    assert seen == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi", "image": None}]},
        {
            "thinking": "t",
            "role": "assistant",
            "tool_calls": [{"id": None, "function": {"name": "f", "arguments": {"x": None}}}],
            "reasoning_content": "t",
        },
        {"role": "tool", "content": "r"},
    ]
    assert json.dumps(messages) == before


def test_a_null_key_reads_as_absent_never_as_none():
    """Templates test keys with ``in`` or ``is defined``: a null passed through would print
    ``None`` (transformers renders ``hi|bob: yo|`` here)."""
    text = "{% for m in messages %}{% if 'name' in m %}{{ m.name }}: {% endif %}{{ m.content }}|"
    template = ChatTemplate("t", {"default": text + "{% endfor %}"})
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "user", "content": "yo", "name": "bob"},
    ]
    assert template.render(messages) == "hi|bob: yo|"


def with_template(checkpoint: str, tmp_path, name: str, how: str) -> str:
    """A copy of ``checkpoint`` carrying template ``name`` the way ``how`` says."""
    path = tmp_path / f"{name}-{how}"
    shutil.copytree(checkpoint, path)
    text, record = fixture(name)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(record["special_tokens"])
    if how == "config":
        config["chat_template"] = text
    elif how == "named":
        config["chat_template"] = [
            {"name": "default", "template": "{{ 'plain' }}"},
            {"name": "tool_use", "template": text},
        ]
    elif how == "jinja":
        (path / "chat_template.jinja").write_text(text, encoding="utf-8")
        config["chat_template"] = "{{ 'the jinja file wins' }}"
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("how", ["config", "jinja"])
def test_a_checkpoints_template_is_found_and_renders_the_same(tiny_checkpoint, tmp_path, how):
    path = with_template(tiny_checkpoint, tmp_path, "qwen3", how)
    loaded = load_model(path)
    _, record = fixture("qwen3")
    assert loaded.chat_template is not None
    where = "chat_template.jinja" if how == "jinja" else "tokenizer_config.json (chat_template)"
    assert loaded.chat_template.source.endswith(where)
    for case in record["cases"]:
        check(loaded.chat_template, case)


def test_named_templates_take_tool_use_for_tools(tiny_checkpoint, tmp_path):
    template = from_directory(with_template(tiny_checkpoint, tmp_path, "qwen2_5", "named"))
    _, record = fixture("qwen2_5")
    with_tools = next(c for c in record["cases"] if c.get("tools"))
    assert render(template, with_tools) == with_tools["expected"]
    assert template.render([{"role": "user", "content": "hi"}]) == "plain"


def test_a_template_that_refuses_says_why():
    text, record = fixture("mistral")
    template = ChatTemplate("mistral", {"default": text}, record["special_tokens"])
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="alternate"):
        template.render(two_users)
    broken = ChatTemplate("broken", {"default": "{{ messages[0].content.nope() }}"})
    with pytest.raises(TemplateError):
        broken.render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("escape", {"default": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(TemplateError):
        sandboxed.render([{"role": "user", "content": "x"}])


@pytest.mark.default_model
def test_the_default_models_template_renders_like_transformers(default_model):
    loaded = load_model(default_model)
    text, record = fixture("smollm2")
    assert loaded.chat_template is not None
    assert loaded.chat_template.templates["default"] == text
    for case in record["cases"]:
        check(loaded.chat_template, case)


# ---------------------------------------------------------------------------- over the pipes


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_runner(checkpoint_factory, tmp_path_factory):
    base = checkpoint_factory("llama", max_position_embeddings=4096)
    path = with_template(base, tmp_path_factory.mktemp("chat"), "smollm2", "config")
    runner = await RunnerProcess.start(own_command(path, "--no-draft"))
    plain = await RunnerProcess.start(own_command(base, "--no-draft"))
    yield runner, plain
    await runner.stop()
    await plain.stop()
    assert not runner.violations and not plain.violations


TURN1 = [{"role": "user", "content": "hello there"}]


@pytest.mark.asyncio(loop_scope="module")
async def test_messages_complete_as_their_rendered_prompt_does(chat_runner):
    runner, _ = chat_runner
    _, record = fixture("smollm2")
    rendered = ChatTemplate("s", {"default": fixture("smollm2")[0]}, record["special_tokens"])
    prompt = rendered.render(TURN1)
    await runner.send({"type": "tokenize", "id": "t1", "messages": TURN1})
    ids = (await runner.reply("t1"))["tokens"]
    await runner.send({"type": "tokenize", "id": "t2", "text": prompt})
    assert ids == (await runner.reply("t2"))["tokens"]
    greedy = {"temperature": 0, "num_predict": 6}
    await runner.send({"type": "completion", "id": "m", "messages": TURN1, "options": greedy})
    await runner.send({"type": "completion", "id": "p", "tokens": ids, "options": greedy})
    by_messages, done = await runner.completion("m")
    by_tokens, _ = await runner.completion("p")
    assert ids_of(by_messages) == ids_of(by_tokens)
    assert done["prompt_tokens"] == len(ids)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_second_turn_reuses_the_first_turns_cache(chat_runner):
    runner, _ = chat_runner
    greedy = {"temperature": 0, "num_predict": 5}
    first = [{"role": "user", "content": "the capital of France"}]
    await runner.send({"type": "completion", "id": "c1", "messages": first, "options": greedy})
    frames, done1 = await runner.completion("c1")
    answer = text_of(frames)
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and of Italy"},
    ]
    await runner.send({"type": "completion", "id": "c2", "messages": second, "options": greedy})
    _, done2 = await runner.completion("c2")
    assert done2["prompt_cached_tokens"] >= done1["prompt_tokens"]


@pytest.mark.asyncio(loop_scope="module")
async def test_bad_messages_get_an_error_frame_and_the_runner_serves_on(chat_runner):
    runner, plain = chat_runner
    cases = [
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": TURN1, "prompt": "x"}, "give exactly one"),
        ({"messages": []}, "messages"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "only with messages"),
        ({"messages": TURN1, "format": {"type": "nonsense"}}, "format: "),
        ({"prompt": "x", "format": "yaml"}, 'format: expected "json"'),
    ]
    for n, (fields, needle) in enumerate(cases):
        await runner.send({"type": "completion", "id": f"bad{n}", **fields})
        frame = await runner.reply(f"bad{n}")
        assert frame["type"] == "error" and frame["code"] == "bad_request", frame
        assert needle in frame["message"], frame
    await plain.send({"type": "completion", "id": "none", "messages": TURN1})
    frame = await plain.reply("none")
    assert frame["code"] == "bad_request" and "has no chat template" in frame["message"]
    assert "tokenizer_config.json" in frame["message"]
    await plain.send({"type": "tokenize", "id": "none-t", "messages": TURN1})
    assert (await plain.reply("none-t"))["code"] == "bad_request"
    await runner.send(
        {"type": "completion", "id": "ok", "messages": TURN1, "options": {"num_predict": 2}}
    )
    _, done = await runner.completion("ok")
    assert done["eval_tokens"] >= 1
    # Constrained on the small random model too: whatever it writes is the start of an object.
    await runner.send(
        {
            "type": "completion",
            "id": "fmt",
            "messages": TURN1,
            "format": "json",
            "options": {"num_predict": 12, "temperature": 0.9, "seed": 1},
        }
    )
    frames, done = await runner.completion("fmt")
    assert text_of(frames).lstrip().startswith("{") and done["eval_tokens"] >= 1
