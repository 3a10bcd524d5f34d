"""The model's own chat template: ``messages`` rendered to a prompt as ``transformers``'
``apply_chat_template`` renders them.

The template comes with the checkpoint (``chat_template.jinja``, ``chat_template.json`` or the
``chat_template`` field of ``tokenizer_config.json`` in a directory; ``tokenizer.chat_template``
in a GGUF file) and runs in a sandboxed Jinja environment with the helpers Hugging Face
templates use: ``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``,
``namespace`` (refusing underscore names) and the special tokens as strings (``bos_token``,
``eos_token``, ...). The rendered text already holds the template's BOS, so it is encoded
without adding one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

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
    ) -> str:
        """The prompt text for ``messages`` (as transformers' ``apply_chat_template`` with
        ``tokenize=False``); raises :class:`TemplateError` with the template's own message."""
        import jinja2

        name = self.pick(tools)
        if name not in self._compiled:
            self._compiled[name] = _environment().from_string(self.templates[name])
        chat = [_aliased(dict(m)) for m in messages]
        kwargs = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._compiled[name].render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc) or type(exc).__name__) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateError(f"the template failed on these messages ({exc})") from None


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

    env = ImmutableSandboxedEnvironment(
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


# --- the helpers Hugging Face templates call (transformers' own, as it defines them)


def _raise_exception(message):
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


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
