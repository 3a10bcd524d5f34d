"""The model's own chat template: ``messages`` rendered to a prompt as ``transformers``'
``apply_chat_template`` renders them.

The template comes with the checkpoint (``chat_template.jinja``, ``chat_template.json`` or the
``chat_template`` field of ``tokenizer_config.json`` in a directory; ``tokenizer.chat_template``
in a GGUF file) and runs in a sandboxed Jinja environment with the helpers Hugging Face
templates use: ``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``,
``namespace`` (refusing underscore names) and the special tokens as strings (``bos_token``,
``eos_token``, ...). The rendered text already holds the template's BOS, so it is encoded
without adding one.

Message keys whose value is null are dropped before rendering, as transformers drops them:
OpenAI-style hosts send ``"content": null`` on a tool-call turn and ``"tool_calls": null`` or
``"name": null`` on plain ones, and templates test such keys with ``is defined`` or ``in``, so a
null would reach ``length``, ``+`` or ``{{ }}`` (an error, or a literal ``None``). Only a
message's own keys are dropped; nulls inside tool calls or content parts are data.

A template is compiled at its first render, never at load: one that does not compile, or that
fails while rendering (an undefined name, a division by zero, runaway recursion, output past
``MAX_RENDERED_CHARS``), is a :class:`TemplateError` naming the template and the exception, as
is one that refuses the messages with ``raise_exception``. The model loads and serves prompts
and token ids either way.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

log = logging.getLogger("mtp_runner.chat_template")

# The most text one render may produce: four times the longest request line the protocol
# takes by default (16 MiB), room for a template that repeats the tools or a system message;
# past it the template is looping, not formatting.
MAX_RENDERED_CHARS = 64 * 1024 * 1024
# The largest integer ``**`` computes (in bits): beyond it one expression runs for minutes.
_MAX_POWER_BITS = 1 << 16

# Names a message's reasoning may come under: templates read reasoning_content, gpt-oss ones
# thinking (as transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed on it."""


@dataclass
class ChatTemplate:
    """A checkpoint's chat template(s): ``default`` and any named ones (``tool_use``)."""

    source: str  # the file (and field) it was read from
    templates: dict[str, str]
    special_tokens: dict[str, str] = field(default_factory=dict)
    _compiled: dict[str, Any] = field(default_factory=dict, repr=False)

    def pick(self, tools: list | None) -> str:
        """The template's name for a conversation: ``tool_use`` when tools are given and the
        checkpoint has one, else ``default`` (or the only one)."""
        if tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        if len(self.templates) == 1:
            return next(iter(self.templates))
        raise TemplateError(
            f"{self.source} has several chat templates ({', '.join(sorted(self.templates))}) "
            "and none named default"
        )

    def render(
        self,
        messages: list[dict],
        *,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        max_chars: int = MAX_RENDERED_CHARS,
    ) -> str:
        """The prompt text for ``messages`` (as transformers' ``apply_chat_template`` with
        ``tokenize=False``); raises :class:`TemplateError` with the template's own message
        when it refuses them, or naming the exception when it cannot render them."""
        name = self.pick(tools)
        compiled = self._compile(name)
        chat = [_aliased(_without_nulls(m, i)) for i, m in enumerate(messages)]
        kwargs = {**self.special_tokens, **(template_kwargs or {})}
        pieces = compiled.generate(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        # Rendered piece by piece so that a template looping over its output is stopped at
        # max_chars rather than when memory runs out; the pieces (often a few characters
        # each) are joined as they come, so holding them costs about their text.
        text, pending, size = [], [], 0
        try:
            for piece in pieces:
                size += len(piece)
                if size > max_chars:
                    raise self._failure(name, f"rendered more than {max_chars} characters")
                pending.append(piece)
                if len(pending) == 4096:
                    text.append("".join(pending))
                    pending.clear()
        except TemplateError:  # the template's own raise_exception, or the cap above
            raise
        except Exception as exc:  # whatever the template's code raised
            raise self._failure(name, "failed on them", exc) from None
        finally:
            pieces.close()
        return "".join(text) + "".join(pending)

    def _compile(self, name: str):
        """The compiled template ``name``; one that does not compile raises the same message
        at every render (logged once, at the first)."""
        compiled = self._compiled.get(name)
        if compiled is None:
            try:
                compiled = _environment().from_string(self.templates[name])
            except Exception as exc:  # a syntax error, nesting too deep, ...
                compiled = str(self._failure(name, "does not compile", exc))
            self._compiled[name] = compiled
        if isinstance(compiled, str):  # a fresh error each time: no traceback piling up
            raise TemplateError(compiled)
        return compiled

    def _named(self, name: str) -> str:
        return self.source if name == "default" else f"{self.source} template {name!r}"

    def _failure(self, name: str, what: str, exc: BaseException | None = None) -> TemplateError:
        """A template that fails (rather than refuses) is the checkpoint's fault, not the
        host's: one log line for the operator, no traceback, and the error for the request."""
        message = f"{self._named(name)} {what}"
        if exc is not None:
            message += f" ({_describe(exc)})"
        log.warning("chat template %s", message)
        return TemplateError(message)


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message`` and the template line where Jinja knows it."""
    lines = str(exc).splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    lineno = getattr(exc, "lineno", None)
    return f"{text}, line {lineno}" if isinstance(lineno, int) else text


def _without_nulls(message: object, index: int) -> dict:
    """The message without its null-valued keys (transformers' normalization before it
    renders; a template handles a missing key, where a null crashes it or prints ``None``)."""
    if not isinstance(message, dict):
        raise TemplateError(f"messages[{index}]: expected an object")
    return {key: value for key, value in message.items() if value is not None}


def _aliased(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


_ENV = None


def _environment():
    """The sandboxed environment transformers renders chat templates in (one per process;
    Jinja is imported on the first render)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Environment(ImmutableSandboxedEnvironment):
        """Refuses ``*`` and ``**`` whose result alone would be huge (``'x' * 10**10``): one
        expression that would take the memory or the time of the process. Intercepted
        operators are also never folded at compile time, so compiling cannot hang on one."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                _check_repeat(left, right)
                _check_repeat(right, left)
            elif _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                if left.bit_length() * right > _MAX_POWER_BITS:
                    raise OverflowError(f"{left} ** {right} is too large for a chat template")
            return super().call_binop(context, operator, left, right)

    env = Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_extension()],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_namespace_class(),
    )
    _ENV = env
    return env


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_repeat(sequence: object, times: object) -> None:
    if isinstance(sequence, (str, list, tuple)) and _is_int(times):
        if len(sequence) * times > MAX_RENDERED_CHARS:
            raise OverflowError(
                f"a {type(sequence).__name__} of {len(sequence)} repeated {times} times is "
                "too large for a chat template"
            )


# --- the helpers Hugging Face templates call (transformers' own, as it defines them)


def _raise_exception(message):
    # transformers raises Jinja's TemplateError; this one is the runner's, so that render
    # tells the template's own refusal from a failure (both reach the host the same way).
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    """``namespace`` for templates: Jinja's, refusing underscore attribute names."""
    import jinja2.exceptions
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, dict(*args, **kwargs))

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the underscore attribute {name!r}"
                )

    return TemplateNamespace


def _generation_extension() -> type:
    """``{% generation %}...{% endgeneration %}`` (marks for training masks): the body."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks for training masks): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            node = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return node.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _templates(value: object, source: str) -> dict[str, str]:
    """A ``chat_template`` field: one string, or a list of ``{name, template}``."""
    if isinstance(value, str):
        return {"default": value}

    def named(t: object) -> bool:
        return isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("name", "template"))

    if isinstance(value, list) and value and all(named(t) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{source}: chat_template is neither a string nor a list of named templates")


def from_directory(directory: str) -> ChatTemplate | None:
    """The template of a Hugging Face directory, None when it has none."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_path) if os.path.exists(config_path) else {}
    special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return ChatTemplate(jinja_path, {"default": f.read()}, special)
    json_path = os.path.join(directory, "chat_template.json")
    if os.path.exists(json_path):
        value = _read_json(json_path).get("chat_template")
        if value is not None:
            return ChatTemplate(json_path, _templates(value, json_path), special)
    if config.get("chat_template") is not None:
        source = f"{config_path} (chat_template)"
        return ChatTemplate(source, _templates(config["chat_template"], source), special)
    return None


def from_gguf(path: str, meta: dict, tokens: list[str] | None) -> ChatTemplate | None:
    """The template in GGUF metadata (``tokenizer.chat_template``, named ones as
    ``tokenizer.chat_template.<name>``), with BOS/EOS as their token strings."""
    templates = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template" and isinstance(value, str):
            templates["default"] = value
        elif key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    if not templates:
        return None
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        index = int(index.item()) if hasattr(index, "item") else index
        if isinstance(index, int) and tokens is not None and 0 <= index < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"
            special[key] = tokens[index]
    return ChatTemplate(f"{path} (tokenizer.chat_template)", templates, special)
