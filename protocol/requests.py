"""Requests, host -> runner: one JSON object per line, tagged by its `type` field.

Unknown fields are ignored at every level (a host may send a whole Ollama options object);
known fields are checked for type and range, and a failure names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from protocol.codes import MAX_ID_CHARS, MAX_IMAGES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

INT32_MAX = 2**31 - 1

# JSON numbers that overflow a double are rejected by msgspec ("Number out of range") and
# NaN/Infinity are not JSON, so every float that gets through is finite.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]


class Options(msgspec.Struct, omit_defaults=True):
    """Sampling and budget options under Ollama's names; None means the engine's default."""

    temperature: NonNegative | None = None
    top_k: Count | None = None
    top_p: Fraction | None = None
    min_p: Fraction | None = None
    # Negative seeds mean "unseeded", as in Ollama (whose default seed is -1): normalised to None.
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    num_predict: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and self.seed < 0:
            self.seed = None


# A chat message as the model's template reads it: `role` and `content` (a string, a list of
# parts, or null), plus whatever else the template expects (tool_calls, name, ...).
Message = dict[str, Any]
Messages = Annotated[list[Message], msgspec.Meta(min_length=1)]


def check_messages(messages: list[Message] | None, tools: list | None) -> None:
    """Every message an object with a string role; tools a list of objects."""
    for i, message in enumerate(messages or ()):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role: expected a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content: expected a string, a list or null")
        check_images(message.get("images"), f"messages[{i}].images")
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}]: expected an object")


def check_images(images: object, where: str) -> None:
    """None, or a list of at most ``MAX_IMAGES`` base64 strings."""
    if images is None:
        return
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise ValueError(f"{where}: expected a list of base64-encoded images")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{where}: {len(images)} images, at most {MAX_IMAGES} per request")


class ChatFields(msgspec.Struct, kw_only=True):
    """What the model's chat template receives with `messages`."""

    messages: Messages | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] | None = None

    def check_chat(self, *others: tuple[str, object]) -> None:
        """Exactly one of `messages` and the ``others`` (name, value) given."""
        fields = (("messages", self.messages), *others)
        if sum(value is not None for _, value in fields) != 1:
            names = ", ".join(name for name, _ in others)
            raise ValueError(f"{names}, messages: give exactly one of them")
        if self.messages is None and (self.tools is not None or self.template_kwargs is not None):
            raise ValueError("tools, template_kwargs: only with messages")
        check_messages(self.messages, self.tools)


class Completion(ChatFields, tag="completion", tag_field="type"):
    """Generate from `prompt` (already templated text), `tokens`, or `messages` (rendered with
    the model's own chat template): exactly one of the three."""

    id: RequestId
    prompt: str | None = None
    tokens: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    options: Options | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    speculative: bool = True
    think_budget: Count | None = None
    # "json" (any JSON object) or a JSON Schema object: the output is constrained to it.
    format: str | dict[str, Any] | None = None
    # Base64-encoded PNG, JPEG, WebP or GIF bytes, placed in `prompt` by `[img-N]` tags
    # (N from 0); with `messages`, each message carries its own `images`.
    images: list[str] | None = None

    def __post_init__(self) -> None:
        self.check_chat(("prompt", self.prompt), ("tokens", self.tokens))
        check_images(self.images, "images")
        if self.images is not None and self.prompt is None:
            raise ValueError("images: only with prompt (messages carry their own images)")
        if isinstance(self.format, str) and self.format != "json":
            raise ValueError('format: expected "json" or a JSON Schema object')
        if self.options is None:
            self.options = Options()


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    """Cancel a queued or running completion by its id."""

    id: RequestId


class Tokenize(ChatFields, tag="tokenize", tag_field="type"):
    """The ids of `text`, or of `messages` rendered with the model's chat template."""

    id: RequestId
    text: str | None = None

    def __post_init__(self) -> None:
        self.check_chat(("text", self.text))


class Detokenize(msgspec.Struct, tag="detokenize", tag_field="type"):
    id: RequestId
    tokens: list[TokenId]


class Status(msgspec.Struct, tag="status", tag_field="type"):
    id: RequestId


class Shutdown(msgspec.Struct, tag="shutdown", tag_field="type"):
    """Finish what is queued, then exit 0 (the same as closing stdin)."""

    id: RequestId | None = None


Request = Union[Completion, Cancel, Tokenize, Detokenize, Status, Shutdown]  # noqa: UP007
REQUEST_TYPES: dict[str, type] = {
    cls.__struct_config__.tag: cls
    for cls in (Completion, Cancel, Tokenize, Detokenize, Status, Shutdown)
}
