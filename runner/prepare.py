"""Request preparation: a ``protocol`` completion becomes a ``Prepared`` request, off the
inference thread.

``precheck`` runs on the reader thread and refuses, without tokenizing, a prompt whose byte
length alone proves it cannot fit. ``prepare`` runs on the preparation thread: the prompt
(text, token ids, or messages rendered with the model's chat template), its size against the
context, the sampling options with Ollama's defaults, the token budget, and ``format``
compiled to this request's own matcher. Whatever it refuses is a ``RequestError`` naming the
field, sent as one ``error`` frame and no ``done``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codes import BAD_REQUEST, CONTEXT_OVERFLOW
from protocol.errors import CodedError
from runner.chat_template import ChatTemplate, TemplateError
from runner.constraint import AfterThinking, Constraint, FormatError, Grammars
from runner.emit import OPEN_MARKER
from runner.image_prompt import PromptImages, message_parts
from runner.images import ImageSpan
from runner.sampler import SamplingParams
from runner.tokenizer import Tokenizer
from runner.vision.preprocess import ImageError


class RequestError(CodedError):
    """A request the engine refuses before starting it (an ``error`` frame, no ``done``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


@dataclass
class Prepared:
    id: str
    prompt: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 0  # 0: until EOS or the context ends
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: bool = True
    think_budget: int | None = None
    # ``format``'s matcher (runner.constraint): this request's own, built at prepare.
    constraint: Constraint | AfterThinking | None = None
    opens_think: bool = False  # the prompt ends by opening a reasoning span (<think>)
    # The prompt's images (runner.images), preprocessed, in prompt order; empty: text only.
    images: list[ImageSpan] = field(default_factory=list)


_OPTION_DEFAULTS = SamplingParams()
_SAMPLING = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
}


def overflow(size: str, ctx: int) -> RequestError:
    return RequestError(
        CONTEXT_OVERFLOW, f"{size} but the context holds {ctx} (at most {ctx - 1} prompt tokens)"
    )


class RequestPreparer:
    """Prepares completions for one loaded model (any thread but the inference one)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        context_length: int,
        chat_template: ChatTemplate | None,
        model_path: str,
        images: PromptImages | None = None,
        no_images: str = "no vision tower",
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images  # None: the model takes no images, for the reason ``no_images``
        self.no_images = no_images
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.chat_template = chat_template
        self.model_path = model_path
        self.grammars: Grammars | None = None  # built at the first ``format``
        self._token_texts: list[str] | None = None

    def tokenize_request(self, request) -> list[int]:
        """The ids of a ``protocol`` tokenize request: its text, or its rendered messages
        (images expanded to their pads)."""
        if request.messages is not None:
            try:
                return self.chat_tokens(request)[0]
            except ImageError as exc:
                raise RequestError(BAD_REQUEST, str(exc)) from None
        return self.tokenizer.encode(request.text)

    def chat_tokens(self, request) -> tuple[list[int], list[ImageSpan]]:
        """``messages`` through the model's chat template, encoded without an added BOS (the
        template writes its own), and their images; a missing template or one that refuses
        is a bad request."""
        messages, images = message_parts(request.messages)
        if images:
            self._takes_images("messages")
        template = self.chat_template
        if template is None:
            raise RequestError(
                BAD_REQUEST,
                f"messages: the model has no chat template ({self.model_path} has no "
                "chat_template.jinja, chat_template.json or tokenizer_config.json "
                "chat_template; GGUF: no tokenizer.chat_template): send a templated prompt",
            )
        try:
            text = template.render(
                messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.template_kwargs,
            )
        except TemplateError as exc:
            message = f"messages: the chat template refused them: {exc}"
            raise RequestError(BAD_REQUEST, message) from None
        ids = self.tokenizer.encode(text, add_bos=False)
        if not images:
            return ids, []
        prepared = self.images.prepared(images, "messages")
        return self.images.expand_pads(ids, prepared)

    def _takes_images(self, where: str) -> None:
        if self.images is None:
            raise RequestError(
                BAD_REQUEST, f"{where}: images, but the model takes none ({self.no_images})"
            )

    def precheck(self, request) -> None:
        """Refuse, without tokenizing, a prompt whose length alone proves it cannot fit
        (the reader thread calls this, so it must stay cheap)."""
        ctx = self.context_length
        if request.tokens is not None:
            if len(request.tokens) >= ctx:
                raise overflow(f"prompt is {len(request.tokens)} tokens", ctx)
            return
        if request.prompt is None:  # messages: sized once rendered
            return
        at_least = self.tokenizer.min_tokens(request.prompt or "")
        if at_least is not None and at_least >= ctx:
            size = (
                f"prompt is at least {at_least} tokens ({len(request.prompt.encode())} bytes, "
                f"at most {self.tokenizer.max_token_bytes} per token)"
            )
            raise overflow(size, ctx)

    def prepare(self, request) -> Prepared:
        """Tokenize and validate a ``protocol`` completion (any thread)."""
        try:
            prompt, images = self._prompt(request)
        except ImageError as exc:
            raise RequestError(BAD_REQUEST, str(exc)) from None
        opts = request.options
        num_predict = getattr(opts, "num_predict", None) if opts is not None else None
        room = self.context_length - len(prompt)
        max_tokens = room if not num_predict or num_predict < 0 else min(num_predict, room)
        opens_think = self.opens_think(prompt)
        constraint = None
        if request.format is not None:
            constraint = self._constraint(request, opens_think)
        return Prepared(
            id=request.id,
            prompt=prompt,
            params=sampling_params(opts),
            stop=list(getattr(opts, "stop", None) or []) if opts is not None else [],
            max_tokens=max_tokens,
            logprobs=bool(request.logprobs or request.top_logprobs),
            top_logprobs=int(request.top_logprobs or 0),
            speculative=bool(request.speculative),
            think_budget=request.think_budget,
            constraint=constraint,
            opens_think=opens_think,
            images=images,
        )

    def _prompt(self, request) -> tuple[list[int], list[ImageSpan]]:
        """The prompt's ids, checked against the vocabulary and the context, and its images."""
        images: list[ImageSpan] = []
        if request.tokens is not None:
            prompt = list(request.tokens)
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    BAD_REQUEST,
                    f"tokens: id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                )
        elif request.messages is not None:
            prompt, images = self.chat_tokens(request)
        elif request.images:
            self._takes_images("images")
            prompt, images = self.images.expand_tags(
                request.prompt or "", request.images, self.tokenizer.encode
            )
        else:
            prompt = self.tokenizer.encode(request.prompt or "")
        if not prompt:
            raise RequestError(BAD_REQUEST, "prompt: empty prompt")
        if len(prompt) >= self.context_length:
            raise overflow(f"prompt is {len(prompt)} tokens", self.context_length)
        return prompt, images

    def _constraint(self, request, opens: bool) -> Constraint | AfterThinking:
        """``format`` compiled for this model's tokenizer; what it cannot enforce (yet) is a
        bad request naming it. After a prompt that opens ``<think>`` the constraint starts
        once the span closes (by the model, or by the think budget)."""
        if self.grammars is None:
            self.grammars = Grammars(
                self.tokenizer.hf.to_str(), self.vocab_size, sorted(self.tokenizer.eos_ids)
            )
        try:
            constraint = self.grammars.compile(request.format)
        except FormatError as exc:
            raise RequestError(BAD_REQUEST, f"format: {exc}") from None
        if opens or request.think_budget is not None:
            # The span is the prompt's, or one the model may open: the grammar starts after.
            openings = self.grammars.openings(self._pieces)
            eos = sorted(self.tokenizer.eos_ids)
            return AfterThinking(constraint, self.tokenizer.decode, openings, eos, opened=opens)
        return constraint

    def _pieces(self) -> list[str]:
        """Every token's own text (once per model; ``format`` with a think span)."""
        if self._token_texts is None:
            piece = self.tokenizer.piece
            self._token_texts = [piece(t) for t in range(self.vocab_size)]
        return self._token_texts

    def opens_think(self, prompt: list[int]) -> bool:
        """Templates that open the reasoning span themselves end the prompt with <think>."""
        return self.tokenizer.decode(prompt[-8:]).rstrip().endswith(OPEN_MARKER)


def sampling_params(opts) -> SamplingParams:
    """A completion's ``options`` as sampling parameters, Ollama's defaults for the rest."""

    def opt(name: str):
        value = getattr(opts, name, None) if opts is not None else None
        return getattr(_OPTION_DEFAULTS, name) if value is None else value

    values = {name: kind(opt(name)) for name, kind in _SAMPLING.items()}
    return SamplingParams(**values, seed=getattr(opts, "seed", None) if opts is not None else None)
