"""A model-free engine for protocol tests and the protocol benchmark (`--noop-model`).

Tokens are the UTF-8 bytes of the text (vocabulary 256). A completion replays its prompt's
tokens cyclically, one token frame each, until `num_predict` (default 16; -1: until
cancelled), so the server, the pipes and the host can be measured without any model cost.

It serves through the same scheduler as the real engine (one cache slot): its streams have
no prefill and no forwards to interleave, so a stream's one step runs the whole completion
(``run``), checking for a cancel before every token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol import Completion, Done, Token
from protocol.codes import BAD_REQUEST, CONTEXT_OVERFLOW
from protocol.errors import CodedError, error_frame

VOCAB_SIZE = 256
CONTEXT_LENGTH = 4096
DEFAULT_NUM_PREDICT = 16


@dataclass
class NoopInfo:
    model: str = "noop"
    context_length: int = CONTEXT_LENGTH
    vocab_size: int = VOCAB_SIZE
    mtp: bool = False
    mtp_detail: str = "no-op model: no draft head"
    blas: str = "none"
    weights_bytes: int = 0
    draft_sources: tuple[str, ...] = ()
    images: bool = False


@dataclass
class NoopPrepared:
    id: str
    prompt: list[int]
    limit: int  # tokens to generate; -1: until cancelled


@dataclass
class NoopSlot:
    index: int = 0


class NoopStream:
    """One completion on the model-free engine, as the scheduler sees a stream."""

    prefilling = False
    speculates = False

    def __init__(self, engine: NoopEngine, req: NoopPrepared, emit, cancelled, slot) -> None:
        self.engine, self.req, self.emit, self.cancelled = engine, req, emit, cancelled
        self.slot = slot
        self.finished = False

    def cancel_if_asked(self) -> bool:
        return False

    def prefill(self, budget_s: float | None = None) -> bool:
        return True

    def alone_again(self) -> None:
        pass

    def step(self) -> bool:
        self.finished = True  # whatever run does: the server checks that a done went out
        self.engine.run(self.req, self.emit, self.cancelled)
        return True

    def fail(self, exc: BaseException) -> None:
        self.finished = True
        self.emit(error_frame(self.req.id, exc))
        self.emit(Done(self.req.id, "error"))


class NoopEngine:
    model = None  # no shared forwards: one slot

    def __init__(self, delay_s: float = 0.0) -> None:
        self.info = NoopInfo()
        self.delay_s = delay_s  # per token, so cancel tests need not flood the pipe
        self.slots = [NoopSlot()]

    def open_stream(self, req, emit, cancelled, slot, on_close=None) -> NoopStream:
        return NoopStream(self, req, emit, cancelled, slot)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_request(self, request) -> list[int]:
        if request.messages is not None:
            raise CodedError("messages: the no-op model has no chat template", code=BAD_REQUEST)
        return self.tokenize(request.text)

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def status(self) -> dict:
        return {
            "cache_entries": 0,
            "cache_bytes": 0,
            "memory_bytes": 0,
            "speculation_depth": 0,
            "speculation": {},
        }

    def precheck(self, request: Completion) -> None:
        if request.prompt is None and request.tokens is None:
            return  # messages: refused by prepare
        size = len(request.tokens) if request.tokens is not None else len(request.prompt.encode())
        if size >= CONTEXT_LENGTH:
            raise CodedError(
                f"prompt is {size} tokens but the context holds {CONTEXT_LENGTH}",
                code=CONTEXT_OVERFLOW,
            )

    def prepare(self, request: Completion) -> NoopPrepared:
        if request.format is not None:  # never ignored: an unenforced constraint is an error
            raise CodedError("format: the no-op model cannot enforce a format", code=BAD_REQUEST)
        if request.images:
            raise CodedError("images: the no-op model takes no images", code=BAD_REQUEST)
        if request.tokens is not None:
            prompt = list(request.tokens)
        elif request.messages is not None:
            raise CodedError("messages: the no-op model has no chat template", code=BAD_REQUEST)
        else:
            prompt = self.tokenize(request.prompt)
        if not prompt:
            raise CodedError("prompt: empty prompt", code=BAD_REQUEST)
        if any(t >= VOCAB_SIZE for t in prompt):
            raise CodedError(f"tokens: ids must be below {VOCAB_SIZE}", code=BAD_REQUEST)
        if len(prompt) >= CONTEXT_LENGTH:
            raise CodedError(
                f"prompt is {len(prompt)} tokens but the context holds {CONTEXT_LENGTH}",
                code=CONTEXT_OVERFLOW,
            )
        num_predict = request.options.num_predict if request.options else None
        limit = DEFAULT_NUM_PREDICT if num_predict is None else num_predict
        return NoopPrepared(request.id, prompt, limit)

    def run(
        self, prepared: NoopPrepared, emit: Callable[[object], None], cancelled: Callable[[], bool]
    ) -> None:
        start = time.perf_counter_ns()
        prompt, count, reason = prepared.prompt, 0, "length"
        while prepared.limit < 0 or count < prepared.limit:
            if cancelled():
                reason = "cancelled"
                break
            token = prompt[count % len(prompt)]
            emit(Token(prepared.id, self.detokenize([token]), [token]))
            count += 1
            if self.delay_s:
                time.sleep(self.delay_s)
        emit(
            Done(
                prepared.id,
                reason,
                prompt_tokens=len(prompt),
                eval_tokens=count,
                eval_ns=time.perf_counter_ns() - start,
            )
        )
