"""Frames, runner -> host: one JSON object per line, tagged by its `type` field.

Field order follows docs/PROTOCOL.md, so frames can be built positionally or by keyword.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

DoneReason = Literal["stop", "length", "cancelled", "error"]


class Progress(msgspec.Struct, tag="progress", tag_field="type"):
    """Model loading progress: `done` of `total` units of `stage`."""

    stage: str
    done: int
    total: int


class Ready(msgspec.Struct, tag="ready", tag_field="type"):
    """Sent once, after the model loaded; requests are served from then on."""

    protocol_version: int
    model: str
    context_length: int
    vocab_size: int
    mtp: bool
    mtp_detail: str
    blas: str
    # The model's weights as held in memory (quantized ones as kept: no float copy), bytes.
    weights_bytes: int = 0
    # The drafters speculation uses: "head" (the MTP head), "assistant" (a drafter model over
    # the target's caches, e.g. Gemma 4's assistant), "suffix" (text already seen).
    draft_sources: list[str] = []
    # Whether completions may carry `images` (the model has a vision tower).
    images: bool = False


class TopLogprob(msgspec.Struct):
    token: str
    id: int
    logprob: float
    bytes: list[int] = []  # the token's UTF-8 bytes (text alone cannot carry a byte piece)


class TokenLogprob(msgspec.Struct):
    token: str
    id: int
    logprob: float
    top_logprobs: list[TopLogprob] = []
    bytes: list[int] = []


class Token(msgspec.Struct, tag="token", tag_field="type", omit_defaults=True):
    """Generated text for completion `id`; `logprobs` only when the request asked for them."""

    id: str
    content: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


class SourceCounts(msgspec.Struct):
    """One drafter's share of a completion's speculation."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


class Speculation(msgspec.Struct):
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_depth: list[int] = []
    final_depth: int = 0
    sources: dict[str, SourceCounts] = {}  # per drafter: "head", "assistant", "suffix"


class Done(msgspec.Struct, tag="done", tag_field="type"):
    """The last frame of a completion that started (or was queued and then cancelled)."""

    id: str
    done_reason: DoneReason
    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0
    prompt_eval_ns: int = 0
    eval_tokens: int = 0
    eval_ns: int = 0
    speculation: Speculation = msgspec.field(default_factory=Speculation)
    # Of ``prompt_cached_tokens``, those read from the disk tier (``--cache-dir``) for this one.
    prompt_disk_tokens: int = 0


class Error(msgspec.Struct, tag="error", tag_field="type"):
    """A typed failure; `id` is the request's id when it could be read, else null."""

    id: str | None
    code: str
    message: str


class TokensFrame(msgspec.Struct, tag="tokens", tag_field="type"):
    """Answer to `tokenize`."""

    id: str
    tokens: list[int]


class TextFrame(msgspec.Struct, tag="text", tag_field="type"):
    """Answer to `detokenize`."""

    id: str
    text: str


class StatusFrame(msgspec.Struct, tag="status", tag_field="type"):
    """Answer to `status`; `speculation` is the depth controller's state, free-form."""

    id: str
    queue_length: int
    active: str | None
    cache_entries: int
    cache_bytes: int
    memory_bytes: int
    speculation_depth: int
    speculation: dict[str, Any] = {}
    # Every running completion, oldest first (``--parallel``); ``active`` is the first.
    active_ids: list[str] = []
    # The model's and head's weights as held (as in ``ready``), bytes.
    weights_bytes: int = 0
    # Image pixels and features held by running completions (released once embedded), bytes.
    image_bytes: int = 0
    # The cache slots' key and value buffers (quantized with --kv-bits), bytes.
    kv_bytes: int = 0
    # The prefix cache's disk tier (``--cache-dir``): segments and bytes on disk, and the
    # segments found unusable (damaged, truncated, foreign) since the runner started.
    disk_segments: int = 0
    disk_bytes: int = 0
    disk_skipped: int = 0


Frame = Union[Progress, Ready, Token, Done, Error, TokensFrame, TextFrame, StatusFrame]  # noqa: UP007
