"""Images in a request's prompt, on the preparation thread: decoded and preprocessed, and each
one's place in the token ids expanded to its start token, one pad per merged patch block and
its end token.

Two ways to place them, as hosts send them:

- a text ``prompt`` refers to ``images[N]`` by the tag ``[img-N]`` (N from 0). The text between
  tags is tokenized piece by piece (a BOS, where the model adds one, only before the first),
  so a tag never merges with its neighbours' tokens. A tag may repeat; every image must be
  referred to.
- ``messages`` carry their own ``images``: each message's images go before its text as image
  parts of its content (the chat template writes one start, pad, end per image part); a
  content that is already a list of parts keeps its own image parts, filled in order. The
  k-th pad of the rendered prompt is the k-th image of the conversation.

Each image's pad count follows from its preprocessed size, so it is known before anything
runs; the pixels wait in the request until the first forward over one of its rows encodes
them (``runner.images``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runner.images import ImageSpan, image_key
from runner.vision.preprocess import ImageError, ImageSettings, decode_base64, prepare_image

TAG = re.compile(r"\[img-(\d+)\]")


@dataclass(frozen=True)
class ImageTokens:
    """The model's image token ids (its config's ``vision_start_token_id``,
    ``image_token_id``, ``vision_end_token_id``)."""

    start: int
    pad: int
    end: int

    @classmethod
    def from_config(cls, config: dict) -> ImageTokens:
        """The ids a multimodal config names (the released models' where it names none)."""
        return cls(
            start=int(config.get("vision_start_token_id", 248053)),
            pad=int(config.get("image_token_id", 248056)),
            end=int(config.get("vision_end_token_id", 248054)),
        )


class PromptImages:
    """Expands a request's images into its token ids for one model (any thread)."""

    def __init__(self, settings: ImageSettings, tokens: ImageTokens) -> None:
        self.settings = settings
        self.tokens = tokens

    def prepared(self, images: Sequence[str], where: str | None = None) -> list:
        """Every image of ``images`` decoded and preprocessed; an error names it
        (``images[i]``, after ``where``: a conversation's images count across its messages)."""
        out = []
        for i, text in enumerate(images):
            try:
                out.append(prepare_image(decode_base64(text, i), self.settings, i))
            except ImageError as exc:
                if where is None:
                    raise
                raise ImageError(f"{where}: {exc}") from None
        return out

    def expand_tags(
        self, text: str, images: Sequence[str], encode: Callable[[str, bool | None], list[int]]
    ) -> tuple[list[int], list[ImageSpan]]:
        """The ids of a ``prompt`` whose ``[img-N]`` tags place ``images``; ``encode(text,
        add_bos)`` tokenizes a piece (None: the model's own BOS rule)."""
        prepared = self.prepared(images)
        pieces = TAG.split(text)  # text, N, text, N, ..., text
        ids: list[int] = []
        spans: list[ImageSpan] = []
        used = set()
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                part = encode(piece, None if k == 0 else False)
                self._refuse_pads(part, "prompt")
                ids += part
                continue
            n = int(piece)
            if n >= len(prepared):
                raise ImageError(f"prompt: [img-{n}] but the request has {len(prepared)} images")
            used.add(n)
            spans.append(self._place(ids, n, prepared[n]))
        unused = sorted(set(range(len(prepared))) - used)
        if unused:
            raise ImageError(f"images[{unused[0]}]: no [img-{unused[0]}] tag in the prompt")
        return ids, spans

    def expand_pads(
        self, ids: Sequence[int], prepared: Sequence, where: str = "messages"
    ) -> tuple[list[int], list[ImageSpan]]:
        """``ids`` (a rendered chat) with its k-th single pad expanded for ``prepared[k]``."""
        pads = [i for i, t in enumerate(ids) if t == self.tokens.pad]
        if len(pads) != len(prepared):
            raise ImageError(
                f"{where}: the chat template placed {len(pads)} image pads for "
                f"{len(prepared)} images"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        at = 0
        for k, index in enumerate(pads):
            out += ids[at:index]
            if (
                not out
                or out[-1] != self.tokens.start
                or ids[index + 1 : index + 2] != [self.tokens.end]
            ):
                raise ImageError(f"{where}: image {k}'s pad is not between its start and end")
            out.pop()  # _place writes the start token again
            spans.append(self._place(out, k, prepared[k]))
            at = index + 2
        out += ids[at:]
        return out, spans

    def _place(self, ids: list[int], index: int, image) -> ImageSpan:
        """Append one image's start, pads and end to ``ids``; its span."""
        merge = self.settings.merge_size
        grid = (image.grid[0] // merge, image.grid[1] // merge)
        ids.append(self.tokens.start)
        span = ImageSpan(index, len(ids), grid, image_key(image.digest), image)
        ids += [self.tokens.pad] * span.rows
        ids.append(self.tokens.end)
        return span

    def _refuse_pads(self, ids: Sequence[int], where: str) -> None:
        if self.tokens.pad in ids:
            raise ImageError(f"{where}: contains the image pad token; place images with [img-N]")


def message_parts(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """``messages`` with each one's ``images`` turned into image parts of its content (before
    its text), and every image of the conversation in order."""
    out, images = [], []
    for i, message in enumerate(messages):
        own = message.get("images")
        if not own:
            out.append({k: v for k, v in message.items() if k != "images"})
            continue
        content = message.get("content")
        rest = {k: v for k, v in message.items() if k not in ("images", "content")}
        if isinstance(content, list):
            slots = [p for p in content if isinstance(p, dict) and p.get("type") == "image"]
            if slots and len(slots) != len(own):
                raise ImageError(
                    f"messages[{i}]: {len(own)} images for {len(slots)} image parts of its content"
                )
            parts = list(content) if slots else [*({"type": "image"} for _ in own), *content]
        else:
            text = [{"type": "text", "text": content}] if content else []
            parts = [*({"type": "image"} for _ in own), *text]
        out.append({**rest, "content": parts})
        images += own
    return out, images
