"""The per-model engine: one loaded model, its caches, prefix cache, draft head and depth
controller; serves one completion at a time on the inference thread.

``run`` is the whole life of a request: restore the longest cached prefix, prefill the rest
in chunks, decode (pipelined plain decoding, or speculative rounds with a draft head), stream
token frames, send one done frame, and close the cache session on every exit path.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from cache.kv import KVCache
from cache.session import CacheDesyncError, PrefixCache
from drafting.depth import DepthController, FixedDepth
from drafting.rounds import RoundDriver
from drafting.session import DraftSession
from drafting.stats import SpecStats
from protocol import frames as pf
from runner import blas
from runner.decoder import Cancelled, Outcome, PlainDecoder, PlainLoop, decode_plain, prefill
from runner.draft_loader import load_draft_head
from runner.emit import OPEN_MARKER, Emitter
from runner.loader import LoadedModel, load_model
from runner.models.layers import add_row_layout
from runner.models.llama import compile_blocks
from runner.sampler import Sampler, SamplingParams
from runner.speculative import MlxRoundOps, decode_speculative, guarded

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
    pack: bool | None = None
    # With a head on a packed model, also keep the [out, in] weights for verify rows
    # (the weights' memory once more; runner.models.layers). None: where the BLAS in use
    # gains from it (blas.row_layout_pays).
    row_layout: bool | None = None
    # Compile the fixed-shape parts of each block for decode and verify rows
    # (runner.models.llama.compile_blocks): pipelined decoding ~1.1x on this CPU.
    compile: bool = True


@dataclass
class EngineInfo:
    model: str
    context_length: int
    vocab_size: int
    mtp: bool
    mtp_detail: str
    blas: str


class RequestError(Exception):
    """A request the engine refuses before starting it (an ``error`` frame, no ``done``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
            path, dtype=options.dtype, keep_quantized=options.keep_quantized,
            pack=options.pack, progress=report,
        )  # fmt: skip
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.caches = self.model.make_caches()
        self.head = None
        mtp_detail = "no draft head (disabled by --no-draft)"
        if options.use_draft:
            self.head, mtp_detail = load_draft_head(self.loaded, options.draft_path, auto=True)
        row_layout = options.row_layout
        if row_layout is None:
            row_layout = blas.row_layout_pays()
        if self.head is not None and row_layout:
            add_row_layout(self.model)
        if options.compile:  # after every weight change above: compiled blocks capture them
            compile_blocks(self.model)
            if self.head is not None:
                compile_blocks(self.head)
            self._warm_up(report)
        self.draft_cache = KVCache() if self.head is not None else None
        self.all_caches = [*self.caches] + ([self.draft_cache] if self.draft_cache else [])
        self.prefix: PrefixCache = self._make_prefix_cache()
        self.info = EngineInfo(
            model=self.loaded.name,
            context_length=self.loaded.context_length,
            vocab_size=self.loaded.vocab_size,
            mtp=self.head is not None,
            mtp_detail=mtp_detail,
            blas=blas.blas_in_use(),
        )
        self.depth = DepthController(max_depth=options.max_draft)
        self.active: str | None = None

    # ----------------------------------------------------------------- set-up helpers
    def _warm_up(self, report: Progress) -> None:
        """Trace the compiled blocks for decode and depth-1 verify rows before the first
        request. The first run on a machine also JIT-compiles their fused CPU kernels
        (~10 s; MLX keeps them under $TMPDIR/mlx for later processes)."""
        report("compile", 0, 1)
        for rows in (1, 2):
            caches = self.model.make_caches()
            hidden = self.model.hidden(mx.zeros((1, rows), dtype=mx.int32), caches)
            outputs = [self.model.unembed(hidden)]
            if self.head is not None:
                outputs.append(self.head(mx.zeros((1, rows), dtype=mx.int32), hidden, KVCache()))
            mx.eval(outputs)
        report("compile", 1, 1)

    def _make_prefix_cache(self) -> PrefixCache:
        budget = self.options.cache_bytes or default_cache_bytes()
        # With a draft KV, keys pair each token with the next so every restore point is
        # valid for the draft cache too (its slot S depends on token S+1).
        return PrefixCache(
            self.all_caches, budget, pair_keys=self.draft_cache is not None,
            enabled=self.options.prefix_cache,
        )  # fmt: skip

    # ----------------------------------------------------------------- any thread
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def status(self) -> dict:
        return {
            "cache_entries": self.prefix.entries,
            "cache_bytes": self.prefix.nbytes,
            "memory_bytes": int(mx.get_active_memory()),
            "speculation_depth": self.depth.scheduled if self.head is not None else 0,
            "speculation": self.depth.state() if self.head is not None else {},
        }

    def prepare(self, request) -> Prepared:
        """Tokenize and validate a ``protocol`` completion (any thread)."""
        if request.tokens is not None:
            prompt = list(request.tokens)
            bad = [t for t in prompt if not 0 <= t < self.info.vocab_size]
            if bad:
                raise RequestError(
                    "bad_request",
                    f"tokens: id {bad[0]} is outside the vocabulary "
                    f"(0..{self.info.vocab_size - 1})",
                )
        else:
            prompt = self.tokenizer.encode(request.prompt or "")
        if not prompt:
            raise RequestError("bad_request", "prompt: empty prompt")
        ctx = self.info.context_length
        if len(prompt) >= ctx:
            raise RequestError(
                "context_overflow",
                f"prompt is {len(prompt)} tokens but the context holds {ctx} "
                f"(at most {ctx - 1} prompt tokens)",
            )
        opts = request.options

        def opt(name: str):
            value = getattr(opts, name, None) if opts is not None else None
            return getattr(_OPTION_DEFAULTS, name) if value is None else value

        seed = getattr(opts, "seed", None) if opts is not None else None
        params = SamplingParams(
            temperature=float(opt("temperature")),
            top_k=int(opt("top_k")),
            top_p=float(opt("top_p")),
            min_p=float(opt("min_p")),
            repeat_penalty=float(opt("repeat_penalty")),
            repeat_last_n=int(opt("repeat_last_n")),
            presence_penalty=float(opt("presence_penalty")),
            frequency_penalty=float(opt("frequency_penalty")),
            seed=None if seed is None or seed < 0 else int(seed),
        )
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
        )

    # ----------------------------------------------------------------- inference thread
    def run(self, req: Prepared, emit: Emit, cancelled: Callable[[], bool]) -> None:
        """Serve one completion: token frames, then exactly one done frame."""
        self.active = req.id
        t0 = time.perf_counter_ns()
        session = self._begin(req.prompt)
        counts = {"prompt_cached": session.cached, "prefill_end": None, "generated": 0}
        stats = SpecStats()
        outcome = Outcome("error")
        try:
            outcome = self._generate(req, session, emit, cancelled, counts, stats)
            if outcome.error is not None:
                emit(pf.Error(id=req.id, code="internal", message=outcome.error))
        except Exception as exc:  # one request's failure never takes the runner down
            log.exception("generation failed for %s", req.id)
            emit(pf.Error(id=req.id, code="internal", message=f"{type(exc).__name__}: {exc}"))
            outcome = Outcome("error")
            self._invalidate_caches()
            session = None
        finally:
            if session is not None:
                self._close_session(session, outcome)
            self.active = None
            # Return freed buffers to the system so a long-lived runner stays flat in memory.
            mx.clear_cache()
        t_end = time.perf_counter_ns()
        t_prefill = counts["prefill_end"] or t_end
        emit(
            pf.Done(
                id=req.id,
                done_reason=outcome.reason,
                prompt_tokens=len(req.prompt),
                prompt_cached_tokens=counts["prompt_cached"],
                prompt_eval_ns=t_prefill - t0,
                eval_tokens=counts["generated"],
                eval_ns=t_end - t_prefill,
                speculation=pf.Speculation(**stats.as_dict()),
            )
        )

    def _begin(self, prompt: list[int]):
        return self.prefix.begin(prompt)

    def _close_session(self, session, outcome: Outcome) -> None:
        tail = list(outcome.fed)
        if outcome.final is not None:
            tail.append(outcome.final)
        # A discarded draft head stops short of the target; keep only what every cache holds.
        level = min(c.offset for c in self.all_caches)
        for c in self.all_caches:
            c.rewind(level)
        session.record(tail)
        try:
            session.close()
        except CacheDesyncError:
            log.exception("cache ledgers disagree; dropping the prefix cache")
            self._invalidate_caches()

    def _invalidate_caches(self) -> None:
        """After a failure mid-forward the live caches cannot be trusted: start over."""
        self.prefix.clear()
        for c in self.all_caches:
            c.reset()

    def _generate(
        self, req: Prepared, session, emit: Emit, cancelled, counts, stats: SpecStats
    ) -> Outcome:
        remaining = session.remaining
        draft = None
        if self.head is not None:
            draft = DraftSession(self.head, self.draft_cache, self.model.unembed)
        on_commit = guarded(draft, "committed")
        try:
            position = prefill(
                self.model, self.caches, remaining[:-1], session.cached,
                chunk=self.options.prefill_chunk, cancelled=cancelled, on_commit=on_commit,
                on_chunk=session.reached,
            )  # fmt: skip
        except Cancelled:
            # Keep what prefill finished; level the draft cache with the next prompt token.
            outcome = Outcome("cancelled", final=req.prompt[self.caches[0].offset])
            self._close_draft(draft, outcome)
            return outcome
        sampler = Sampler(
            req.params,
            history=req.prompt,
            vocab_size=self.info.vocab_size,
            context_length=self.info.context_length,
        )

        def send(content: str, ids: list[int], logprobs: list | None) -> None:
            emit(pf.Token(id=req.id, content=content, tokens=list(ids), logprobs=logprobs))

        # Templates that open the reasoning span themselves end the prompt with <think>.
        opened = self.tokenizer.decode(req.prompt[-8:]).rstrip().endswith(OPEN_MARKER)
        emitter = Emitter(
            self.tokenizer, stop=req.stop, max_tokens=req.max_tokens,
            think_budget=req.think_budget, send=send, prompt_open_think=opened,
        )  # fmt: skip
        decoder = PlainDecoder(
            self.model, self.caches, sampler, position,
            top_logprobs=req.top_logprobs if req.logprobs else None, on_commit=on_commit,
        )  # fmt: skip

        def first_token() -> None:
            counts["prefill_end"] = time.perf_counter_ns()

        loop = PlainLoop(
            decoder, emitter, max_tokens=req.max_tokens,
            context_length=self.info.context_length, logprob_entry=self._logprob_entry,
            on_first_token=first_token,
        )  # fmt: skip
        try:
            if draft is None:
                outcome = decode_plain(loop, remaining[-1], cancelled)
            else:
                # Logprobs are per plain step; such requests park for good but keep the
                # draft KV current.
                speculate = req.speculative and not req.logprobs
                if self.options.draft_depth is not None:
                    depth = FixedDepth(self.options.draft_depth if speculate else 0)
                else:
                    depth = self.depth.session(speculative=speculate)
                ops = MlxRoundOps(self.model, self.caches, draft, sampler)
                driver = RoundDriver(
                    ops, emitter.push, cancelled, depth=depth, budget=req.max_tokens, stats=stats
                )
                outcome = decode_speculative(loop, driver, remaining[-1], cancelled)
        finally:
            counts["generated"] = emitter.generated
        emitter.finish()
        self._close_draft(draft, outcome)
        return outcome

    @staticmethod
    def _close_draft(draft: DraftSession | None, outcome: Outcome) -> None:
        """Complete the last pair with the token after the last fed one and flush, so the
        draft cache rests level with the target."""
        if draft is None:
            return
        if outcome.final is not None:
            guarded(draft, "settle")(outcome.final)
        guarded(draft, "close")()

    def _logprob_entry(self, sampled) -> object | None:
        if sampled.logprobs is None:
            return None
        chosen, top_ids, top_lps = sampled.logprobs
        token = int(sampled.token.item())
        piece = self.tokenizer.piece
        return pf.TokenLogprob(
            token=piece(token),
            id=token,
            logprob=float(chosen.item()),
            top_logprobs=[
                pf.TopLogprob(token=piece(i), id=i, logprob=lp)
                for i, lp in zip(top_ids.tolist(), top_lps.tolist(), strict=True)
            ],
        )
