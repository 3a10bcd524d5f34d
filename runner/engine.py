"""The per-model engine: one loaded model, its caches, prefix cache and speculation; serves
one completion at a time on the inference thread.

``run`` is the whole life of a request: restore the longest cached prefix, prefill the rest
in chunks, decode (pipelined plain decoding, or speculative rounds with a draft head), stream
token frames, send one done frame, and close the cache and speculation sessions on every exit
path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from cache.kv import KVCache
from cache.ledger import Outcome
from cache.session import CacheDesyncError, CacheSession, PrefixCache, level_caches
from drafting.logprobs import LogprobEntry
from drafting.speculation import Speculation
from protocol import frames as pf
from protocol.codes import BAD_REQUEST, CONTEXT_OVERFLOW
from protocol.errors import CodedError
from runner import blas, device
from runner.chat_template import TemplateError
from runner.constraint import AfterThinking, Constraint, FormatError, Grammars
from runner.emit import OPEN_MARKER
from runner.heads import load_draft_head
from runner.loader import LoadedModel, load_model
from runner.models import feed_dependent
from runner.sampler import SamplingParams
from runner.stream import Slot, Stream

log = logging.getLogger("mtp_runner.engine")

Emit = Callable[[object], None]
Progress = Callable[[str, int, int], None]

GIB = 1 << 30


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def default_cache_bytes() -> int:
    """2 GiB, never more than a quarter of physical memory."""
    return min(2 * GIB, physical_memory() // 4)


@dataclass
class EngineOptions:
    model_path: str | None = None  # None: the embedded default model
    draft_path: str | None = None  # an MTP head sidecar directory
    use_draft: bool = True
    max_draft: int = 8
    draft_depth: int | None = None  # a fixed depth (benchmarks, tests); None = adaptive
    cache_bytes: int | None = None  # None: default_cache_bytes()
    prefix_cache: bool = True
    prefill_chunk: int = 512
    dtype: str = "auto"
    keep_quantized: bool | None = None
    weight_layout: str = "auto"  # runner.device.LAYOUTS
    # With a head on packed weights, also keep the [out, in] weights of o and down for verify
    # rows (their memory once more). None: where the BLAS in use gains from it.
    row_layout: bool | None = None
    # Compile the fixed-shape parts of each block for decode and verify rows (runner.device).
    compile: bool = True
    head_fault_after: int | None = None  # test hook: the head fails on its n-th call a request
    # Completions decoded at once, rows of one forward (runner.batch); 1: one at a time.
    parallel: int = 1


@dataclass
class EngineInfo:
    model: str
    context_length: int
    vocab_size: int
    mtp: bool
    mtp_detail: str
    blas: str
    tuning: str  # what runner.device.tune applied


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
    constraint: Constraint | None = None


_OPTION_DEFAULTS = SamplingParams()


class Engine:
    def __init__(self, options: EngineOptions, progress: Progress | None = None) -> None:
        self.options = options
        report = progress or (lambda stage, done, total: None)
        path = options.model_path
        if path is None:
            from runner.default_model import ensure_default_model

            path = ensure_default_model(report)
        self.loaded: LoadedModel = load_model(
            path, dtype=options.dtype, keep_quantized=options.keep_quantized, progress=report
        )
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.grammars: Grammars | None = None  # built at the first ``format``
        self._token_texts: list[str] | None = None
        self.caches = self.model.make_caches()
        head, mtp_detail = None, "no draft head (disabled by --no-draft)"
        # A feed-dependent model (dynamic or longrope RoPE) computes what its reference
        # computes only when every prompt is one forward and decoding one token per forward:
        # no speculation, no prefix cache, no prefill chunks.
        self.feed_dependent = feed_dependent(self.model)
        if self.feed_dependent:
            mtp_detail = "no speculation: the model's RoPE depends on how tokens are fed"
            log.info("%s; prefix cache and prefill chunks off too", mtp_detail)
        elif options.use_draft:
            head, mtp_detail = load_draft_head(self.loaded, options.draft_path)
        if head is not None and head.config.feature_layers:  # rows carry the fused streams
            self.model.use_draft_features(tuple(head.config.feature_layers))
        self.tuning = device.tune(
            self.model,
            head,
            layout=options.weight_layout,
            row_layout=options.row_layout,
            compile=options.compile,
        )
        self.speculation: Speculation | None = None
        if head is not None:
            self.speculation = Speculation(
                head,
                max_depth=options.max_draft,
                fixed_depth=options.draft_depth,
                fault_after=options.head_fault_after,
            )
        log.info("device tuning: %s", self.tuning.describe())
        self.parallel, self.parallel_detail = self._parallel(options.parallel)
        if self.tuning.compiled:
            self._warm_up(report)
        self.slots = [Slot(0, self.caches, self.draft_cache)]
        self.all_caches = self.slots[0].all
        self.prefix: PrefixCache = self._make_prefix_cache()
        for index in range(1, self.parallel):
            draft = KVCache() if self.draft_cache is not None else None
            slot = Slot(index, self.model.make_caches(), draft)
            self.prefix.add_slot(slot.all)
            self.slots.append(slot)
        self.streams: list[Stream] = []  # the active ones (runner.batch)
        self.info = EngineInfo(
            model=self.loaded.name,
            context_length=self.loaded.context_length,
            vocab_size=self.loaded.vocab_size,
            mtp=head is not None,
            mtp_detail=mtp_detail,
            blas=blas.blas_in_use(),
            tuning=self.tuning.describe(),
        )
        self.active: str | None = None

    @property
    def chunk(self) -> int:
        """Prefill chunk length (a feed-dependent model: the whole prompt in one forward)."""
        if self.feed_dependent:
            return self.loaded.context_length
        return self.options.prefill_chunk

    def _parallel(self, wanted: int) -> tuple[int, str]:
        """How many completions decode at once, and why fewer than ``wanted``."""
        if wanted <= 1:
            return 1, "one completion at a time"
        refusal = getattr(self.model, "rows_refusal", lambda: "no batched forward")()
        if refusal is None and self.feed_dependent:
            refusal = "the RoPE depends on how tokens are fed"
        if refusal is not None:
            log.warning("--parallel %d: %s; serving one completion at a time", wanted, refusal)
            return 1, f"one completion at a time ({refusal})"
        return wanted, f"up to {wanted} completions at once"

    @property
    def head(self):
        return self.speculation.head if self.speculation is not None else None

    @property
    def draft_cache(self) -> KVCache | None:
        return self.speculation.cache if self.speculation is not None else None

    # ----------------------------------------------------------------- set-up helpers
    def _warm_up(self, report: Progress) -> None:
        """Trace the compiled blocks for decode and depth-1 verify rows before the first
        request. The first run on a machine also JIT-compiles their fused CPU kernels
        (MLX keeps them under $TMPDIR/mlx for later processes)."""
        report("compile", 0, 1)
        # A shared decode forward over R sequences runs the blocks at R rows as well.
        for rows in range(1, max(2, self.parallel) + 1):
            caches = self.model.make_caches()
            hidden = self.model.hidden(mx.zeros((1, rows), dtype=mx.int32), caches)
            outputs = [self.model.unembed(hidden)]
            if self.head is not None and rows <= 2:
                outputs.append(self.head(mx.zeros((1, rows), dtype=mx.int32), hidden, KVCache()))
            mx.eval(outputs)
        report("compile", 1, 1)

    def _make_prefix_cache(self) -> PrefixCache:
        budget = self.options.cache_bytes or default_cache_bytes()
        # With a draft KV, keys pair each token with the next so every restore point is
        # valid for the draft cache too (its slot S depends on token S+1).
        return PrefixCache(
            self.all_caches,
            budget,
            pair_keys=self.draft_cache is not None,
            enabled=self.options.prefix_cache and not self.feed_dependent,
        )

    # ----------------------------------------------------------------- any thread
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tokenize_request(self, request) -> list[int]:
        """The ids of a ``protocol`` tokenize request: its text, or its rendered messages."""
        if request.messages is not None:
            return self._chat_tokens(request)
        return self.tokenizer.encode(request.text)

    def _chat_tokens(self, request) -> list[int]:
        """``messages`` through the model's chat template, encoded without an added BOS (the
        template writes its own); a missing template or one that refuses is a bad request."""
        template = self.loaded.chat_template
        if template is None:
            raise RequestError(
                BAD_REQUEST,
                f"messages: the model has no chat template ({self.loaded.path} has no "
                "chat_template.jinja, chat_template.json or tokenizer_config.json "
                "chat_template; GGUF: no tokenizer.chat_template): send a templated prompt",
            )
        try:
            text = template.render(
                request.messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.template_kwargs,
            )
        except TemplateError as exc:
            message = f"messages: the chat template refused them: {exc}"
            raise RequestError(BAD_REQUEST, message) from None
        return self.tokenizer.encode(text, add_bos=False)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def status(self) -> dict:
        speculation = {"speculation_depth": 0, "speculation": {}}
        if self.speculation is not None:
            speculation = self.speculation.status()
        return {
            "cache_entries": self.prefix.entries,
            "cache_bytes": self.prefix.nbytes,
            "memory_bytes": int(mx.get_active_memory()),
            **speculation,
        }

    def precheck(self, request) -> None:
        """Refuse, without tokenizing, a prompt whose length alone proves it cannot fit
        (the reader thread calls this, so it must stay cheap)."""
        ctx = self.info.context_length
        if request.tokens is not None:
            if len(request.tokens) >= ctx:
                raise self._overflow(f"prompt is {len(request.tokens)} tokens", ctx)
            return
        if request.prompt is None:  # messages: sized once rendered
            return
        at_least = self.tokenizer.min_tokens(request.prompt or "")
        if at_least is not None and at_least >= ctx:
            raise self._overflow(
                f"prompt is at least {at_least} tokens ({len(request.prompt.encode())} bytes, "
                f"at most {self.tokenizer.max_token_bytes} per token)",
                ctx,
            )

    @staticmethod
    def _overflow(size: str, ctx: int) -> RequestError:
        return RequestError(
            CONTEXT_OVERFLOW,
            f"{size} but the context holds {ctx} (at most {ctx - 1} prompt tokens)",
        )

    def prepare(self, request) -> Prepared:
        """Tokenize and validate a ``protocol`` completion (any thread)."""
        if request.tokens is not None:
            prompt = list(request.tokens)
            bad = [t for t in prompt if not 0 <= t < self.info.vocab_size]
            if bad:
                raise RequestError(
                    BAD_REQUEST,
                    f"tokens: id {bad[0]} is outside the vocabulary "
                    f"(0..{self.info.vocab_size - 1})",
                )
        elif request.messages is not None:
            prompt = self._chat_tokens(request)
        else:
            prompt = self.tokenizer.encode(request.prompt or "")
        if not prompt:
            raise RequestError(BAD_REQUEST, "prompt: empty prompt")
        ctx = self.info.context_length
        if len(prompt) >= ctx:
            raise self._overflow(f"prompt is {len(prompt)} tokens", ctx)
        opts = request.options

        def opt(name: str):
            value = getattr(opts, name, None) if opts is not None else None
            return getattr(_OPTION_DEFAULTS, name) if value is None else value

        params = SamplingParams(
            temperature=float(opt("temperature")),
            top_k=int(opt("top_k")),
            top_p=float(opt("top_p")),
            min_p=float(opt("min_p")),
            repeat_penalty=float(opt("repeat_penalty")),
            repeat_last_n=int(opt("repeat_last_n")),
            presence_penalty=float(opt("presence_penalty")),
            frequency_penalty=float(opt("frequency_penalty")),
            seed=getattr(opts, "seed", None) if opts is not None else None,
        )
        constraint = None if request.format is None else self._constraint(request, prompt)
        num_predict = getattr(opts, "num_predict", None) if opts is not None else None
        room = ctx - len(prompt)
        max_tokens = room if not num_predict or num_predict < 0 else min(num_predict, room)
        stop = list(getattr(opts, "stop", None) or []) if opts is not None else []
        return Prepared(
            id=request.id,
            prompt=prompt,
            params=params,
            stop=stop,
            max_tokens=max_tokens,
            logprobs=bool(request.logprobs or request.top_logprobs),
            top_logprobs=int(request.top_logprobs or 0),
            speculative=bool(request.speculative),
            think_budget=request.think_budget,
            constraint=constraint,
        )

    def _constraint(self, request, prompt: list[int]) -> Constraint | AfterThinking:
        """``format`` compiled for this model's tokenizer; what it cannot enforce (yet) is a
        bad request naming it. After a prompt that opens ``<think>`` the constraint starts
        once the span closes (by the model, or by the think budget)."""
        opens = self._opens_think(prompt)
        if self.grammars is None:
            self.grammars = Grammars(
                self.tokenizer.hf.to_str(), self.info.vocab_size, sorted(self.tokenizer.eos_ids)
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
        """Every token's own text (once per engine; ``format`` with a think span)."""
        if self._token_texts is None:
            piece = self.tokenizer.piece
            self._token_texts = [piece(t) for t in range(self.info.vocab_size)]
        return self._token_texts

    def _opens_think(self, prompt: list[int]) -> bool:
        """Templates that open the reasoning span themselves end the prompt with <think>."""
        return self.tokenizer.decode(prompt[-8:]).rstrip().endswith(OPEN_MARKER)

    # ----------------------------------------------------------------- inference thread
    def run(self, req: Prepared, emit: Emit, cancelled: Callable[[], bool]) -> None:
        """Serve one completion alone: token frames, then exactly one done frame."""
        self.active = req.id
        stream = self.open_stream(req, emit, cancelled, self.slots[0])
        try:
            if stream.prefill():
                while not stream.step():
                    pass
        except Exception as exc:  # one request's failure never takes the runner down
            stream.fail(exc)
        finally:
            self.active = None

    def open_stream(
        self, req: Prepared, emit: Emit, cancelled: Callable[[], bool], slot: Slot
    ) -> Stream:
        """A request on ``slot``: its prefix restored, its sessions open (runner.stream)."""
        stream = Stream(self, req, emit, cancelled, slot)
        self.streams.append(stream)
        return stream

    def stream_closed(self, stream: Stream) -> None:
        """Before its done frame: with nothing else running, return freed buffers to the
        system so a long-lived runner stays flat in memory."""
        if stream in self.streams:
            self.streams.remove(stream)
        if not self.streams:
            device.release_memory()

    def _close_session(self, session: CacheSession, outcome: Outcome, slot: Slot) -> None:
        tail = list(outcome.fed)
        if outcome.final is not None:
            tail.append(outcome.final)
        # A discarded draft head stops short of the target; keep only what every cache holds
        # (recurrent layers: a position they kept, cache.session.level_caches).
        level_caches(slot.all)
        session.record(tail)
        try:
            session.close()
        except CacheDesyncError:
            log.exception("cache ledgers disagree; dropping the prefix cache")
            self._invalidate_caches(slot)

    def _invalidate_caches(self, slot: Slot) -> None:
        """After a failure mid-forward a slot's caches cannot be trusted: they start over, and
        the prefix cache forgets everything (its ranges may live in them)."""
        self.prefix.clear()
        for c in slot.all:
            c.reset()

    def _logprob_frame(self, entry: LogprobEntry) -> pf.TokenLogprob:
        """One token's logprob entry for a frame, with each token's text and UTF-8 bytes (a
        byte piece's text alone is U+FFFD; its bytes let a host rebuild the text)."""
        token_bytes = self.tokenizer.token_bytes
        piece = self.tokenizer.piece
        return pf.TokenLogprob(
            token=piece(entry.token),
            id=entry.token,
            logprob=entry.logprob,
            bytes=list(token_bytes(entry.token)),
            top_logprobs=[
                pf.TopLogprob(token=piece(i), id=i, logprob=lp, bytes=list(token_bytes(i)))
                for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)
            ],
        )
