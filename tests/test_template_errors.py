"""Chat templates that cannot render: one that does not compile, or that raises something
other than its own ``raise_exception`` while rendering (division by zero, recursion, a type
error, runaway output), is refused as ``bad_request`` like a template that refuses the
messages, and the model still loads and serves everything else."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import pytest_asyncio

from protocol.requests import Completion, Tokenize
from runner.chat_template import ChatTemplate, TemplateError, from_directory
from runner.loader import load_model
from runner.prepare import RequestError, RequestPreparer
from tests.conformance.harness import RunnerProcess, own_command

USER = [{"role": "user", "content": "hello"}]
SYNTAX_ERROR = "{% for m in messages %}{{ m.content }"
DIVIDE_BY_ZERO = "{{ messages | length / 0 }}"
# Renders plain turns; divides by zero when the first message says "divide".
CHAT = (
    "{% if messages[0].content == 'divide' %}{{ 1 / (messages | length - 1) }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

FAILING = {
    "division by zero": (DIVIDE_BY_ZERO, "ZeroDivisionError"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "type error": ("{{ messages[0].content + 1 }}", "TypeError"),
    "undefined": ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    "huge repeat": ("{{ 'x' * 10000000000 }}", "OverflowError"),
    "huge power": ("{{ 7 ** 100000000 }}", "OverflowError"),
    "huge range": ("{{ range(10 ** 9) | length }}", "OverflowError"),
}


def one_warning(caplog, needle: str) -> None:
    """Exactly one log line about the template, naming ``needle``, with no traceback."""
    records = [r for r in caplog.records if r.name == "mtp_runner.chat_template"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert needle in records[0].getMessage()
    caplog.clear()


def test_a_template_that_does_not_compile_is_refused_at_every_render(caplog):
    template = ChatTemplate("broken.jinja", {"default": SYNTAX_ERROR})
    for _ in range(3):
        with pytest.raises(TemplateError, match=r"broken.jinja does not compile") as info:
            template.render(USER)
        assert "TemplateSyntaxError" in str(info.value) and "line 1" in str(info.value)
    one_warning(caplog, "TemplateSyntaxError")  # logged once, at the first render


@pytest.mark.parametrize("case", FAILING)
def test_a_template_that_fails_while_rendering_is_a_template_error(case, caplog):
    text, kind = FAILING[case]
    template = ChatTemplate("failing.jinja", {"default": text})
    with pytest.raises(TemplateError, match=rf"failing.jinja failed on them \({kind}"):
        template.render(USER)
    one_warning(caplog, kind)
    with pytest.raises(TemplateError, match=kind):  # and again: nothing was left broken
        template.render(USER)


def test_output_past_the_cap_is_refused_as_it_is_produced(caplog):
    loop = (
        "{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}{% endfor %}"
    )
    template = ChatTemplate("loop.jinja", {"default": loop})
    with pytest.raises(TemplateError, match="loop.jinja rendered more than 1000 characters"):
        template.render(USER, max_chars=1000)
    one_warning(caplog, "rendered more than")
    assert ChatTemplate("x", {"default": "{{ 'ab' * 3 }}"}).render(USER, max_chars=6) == "ababab"


def test_the_templates_own_refusal_keeps_its_message_and_logs_nothing(caplog):
    template = ChatTemplate("t", {"default": "{{ raise_exception('only one user turn') }}"})
    with pytest.raises(TemplateError) as info:
        template.render(USER)
    assert str(info.value) == "only one user turn"
    assert not [r for r in caplog.records if r.name == "mtp_runner.chat_template"]


def test_only_the_broken_named_template_fails():
    template = ChatTemplate("t", {"default": CHAT, "tool_use": SYNTAX_ERROR})
    assert template.render(USER) == "<|user|>hello\n<|assistant|>"
    with pytest.raises(TemplateError, match="t template 'tool_use' does not compile"):
        template.render(USER, tools=[{"type": "function"}])
    assert template.render(USER) == "<|user|>hello\n<|assistant|>"


def with_templates(checkpoint: str, path, templates: dict[str, str]) -> str:
    """A copy of ``checkpoint`` whose tokenizer_config.json carries ``templates`` (named)."""
    shutil.copytree(checkpoint, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("text", [SYNTAX_ERROR, DIVIDE_BY_ZERO], ids=["syntax", "divide"])
def test_the_preparer_refuses_as_bad_request(tiny_checkpoint, tmp_path, text):
    path = with_templates(tiny_checkpoint, tmp_path / "ckpt", {"default": text})
    loaded = load_model(path)  # loading never compiles the template
    assert loaded.chat_template.templates == from_directory(path).templates == {"default": text}
    preparer = RequestPreparer(
        loaded.tokenizer,
        vocab_size=loaded.vocab_size,
        context_length=256,
        chat_template=loaded.chat_template,
        model_path=path,
    )
    kind = "TemplateSyntaxError" if text == SYNTAX_ERROR else "ZeroDivisionError"
    for request in (Completion(id="c", messages=USER), Tokenize(id="t", messages=USER)):
        with pytest.raises(RequestError, match=kind) as info:
            if isinstance(request, Completion):
                preparer.prepare(request)
            else:
                preparer.tokenize_request(request)
        assert info.value.code == "bad_request"
    assert preparer.prepare(Completion(id="p", prompt="hello")).prompt


# ---------------------------------------------------------------------------- over the pipes


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def broken_runner(checkpoint_factory, tmp_path_factory):
    """A runner whose default template divides by zero on "divide" and whose tool_use
    template does not compile."""
    base = checkpoint_factory("llama", max_position_embeddings=4096)
    where = tmp_path_factory.mktemp("broken") / "ckpt"
    path = with_templates(base, where, {"default": CHAT, "tool_use": SYNTAX_ERROR})
    runner = await RunnerProcess.start(own_command(path, "--no-draft"))
    yield runner
    await runner.stop()
    assert not runner.violations


DIVIDE = [{"role": "user", "content": "divide"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.asyncio(loop_scope="module")
async def test_broken_templates_give_bad_request_and_the_runner_serves_on(broken_runner):
    runner = broken_runner
    cases = [
        ({"messages": DIVIDE}, "ZeroDivisionError"),
        ({"messages": USER, "tools": TOOLS}, "TemplateSyntaxError"),
    ]
    for n, (fields, needle) in enumerate(cases * 2):  # twice: the second finds the same
        await runner.send({"type": "completion", "id": f"bad{n}", **fields})
        frame = await runner.reply(f"bad{n}")
        assert frame["type"] == "error" and frame["code"] == "bad_request", frame
        assert needle in frame["message"] and "messages" in frame["message"], frame
    greedy = {"temperature": 0, "num_predict": 3}
    await runner.send({"type": "completion", "id": "chat", "messages": USER, "options": greedy})
    _, done = await runner.completion("chat")
    assert done["done_reason"] in ("stop", "length") and done["eval_tokens"] >= 1
    await runner.send({"type": "completion", "id": "text", "prompt": "hi", "options": greedy})
    _, done = await runner.completion("text")
    assert done["eval_tokens"] >= 1
    log = runner.stderr.decode("utf-8", "replace")
    assert "Traceback" not in log, log
    assert log.count("does not compile") == 1, log  # one line, at the first render
    assert log.count("ZeroDivisionError") == 2, log  # one line per refused request


@pytest.mark.asyncio(loop_scope="module")
async def test_broken_templates_refuse_tokenize_too(broken_runner):
    runner = broken_runner
    for n, fields in enumerate(({"messages": DIVIDE}, {"messages": USER, "tools": TOOLS})):
        await runner.send({"type": "tokenize", "id": f"tok{n}", **fields})
        frame = await runner.reply(f"tok{n}")
        assert frame["type"] == "error" and frame["code"] == "bad_request", frame
    await runner.send({"type": "tokenize", "id": "ok", "messages": USER})
    assert (await runner.reply("ok"))["tokens"]
