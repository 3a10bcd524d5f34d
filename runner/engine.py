"""The per-model engine: one loaded model, its cache slots, prefix cache and speculation.

Built once on the inference thread: the model loaded and laid out for its device
(``runner.device.tune``), the MTP head found (``runner.heads``), one ``CacheSlot`` per
completion decoded at once, the prefix cache over them. It prepares requests (any thread,
``runner.prepare``) and opens a ``Stream`` per admitted completion on a slot the scheduler
hands it (``runner.batch``); ``run`` serves one completion alone through a scheduler of its
own, a convenience for tests and benchmarks.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

import cache
import drafting
from cache import disk_format
from cache.disk import DiskCache, cache_kind
from cache.kv import KVCache
from cache.kv_quantized import quantize_caches
from cache.session import PrefixCache
from drafting.depth import SHARED_DRAFT_ROWS
from drafting.speculation import Speculation
from runner import blas, device
from runner.batch import Scheduler
from runner.cache_slot import CacheSlot
from runner.faults import Faults
from runner.heads import load_draft_head
from runner.images import ImageLayout
from runner.loader import LoadedModel, load_model
from runner.models import feed_dependent
from runner.models.attention import ROW_BY_ROW
from runner.models.gemma4_assistant import find_assistant
from runner.prepare import Prepared, RequestError, RequestPreparer
from runner.stream import Stream
from runner.vision_load import load_vision

__all__ = ["Engine", "EngineInfo", "EngineOptions", "Prepared", "RequestError"]

log = logging.getLogger("mtp_runner.engine")

Emit = Callable[[object], None]
Progress = Callable[[str, int, int], None]

GIB = 1 << 30
DISK_BYTES = 10 * GIB  # --cache-disk-bytes' default
# Checkpoint files that decide the cached bits (the tokenizer's do not: keys are token ids).
MODEL_FILES = (".safetensors", ".gguf", ".bin", ".npz", "config.json")


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
    draft_path: str | None = None  # an MTP head sidecar directory or a Gemma 4 assistant
    use_draft: bool = True
    max_draft: int = 8
    draft_depth: int | None = None  # a fixed depth (benchmarks, tests); None = adaptive
    # The drafters: "head" (the MTP head) and "suffix" (drafting.suffix: text already seen).
    draft_sources: tuple[str, ...] = ("head", "suffix")
    recent_outputs: int = 0  # earlier outputs' tokens the suffix drafter drafts from (0: off)
    cache_bytes: int | None = None  # None: default_cache_bytes()
    prefix_cache: bool = True
    cache_dir: str | None = None  # the prefix cache's disk tier (cache.disk); None: off
    cache_disk_bytes: int | None = None  # its budget; None: DISK_BYTES
    disk_fault: str | None = None  # a disk write fault (cache.disk_format.fault_hook): tests
    prefill_chunk: int = 512
    dtype: str = "auto"
    keep_quantized: bool | None = None  # None: where the device has a quantized product
    # Quantized panels multiplied bit-for-bit as their dequantized weight (slower); default:
    # int8 activations per row (runner.native.quantized).
    exact_products: bool = False
    quantize: int | None = None  # 4 or 8: quantize a float checkpoint at load (device.tune)
    quantize_head: bool = True  # the MTP head too
    weight_layout: str = "auto"  # runner.device.LAYOUTS
    # With a head on packed weights, also keep the [out, in] weights of o and down for verify
    # rows (their memory once more). None: where the BLAS in use gains from it.
    row_layout: bool | None = None
    # Compile the fixed-shape parts of each block for decode and verify rows (runner.device).
    compile: bool = True
    # On the CPU, blocks the native build serves run those parts as two native nodes each
    # (runner.models.native_block).
    native_blocks: bool = True
    faults: Faults = field(default_factory=Faults)  # the test seam (runner.faults)
    # Completions decoded at once, rows of one forward (runner.batch); 1: one at a time.
    parallel: int = 1
    # Rows such a forward may feed in all with drafts (runner.batch); 0: none there.
    shared_draft_rows: int = SHARED_DRAFT_ROWS
    # Full-attention layers' keys and values stored quantized (cache.kv_quantized): 4 or 8
    # bits, affine per group of kv_group values; None: float.
    kv_bits: int | None = None
    kv_group: int = 64


@dataclass
class EngineInfo:
    model: str
    context_length: int
    vocab_size: int
    mtp: bool
    mtp_detail: str
    blas: str
    tuning: str  # what runner.device.tune applied
    weights_bytes: int = 0  # the target's and head's weights as held (runner.device)
    draft_sources: tuple[str, ...] = ()  # the drafters in use
    images: bool = False  # completions may carry images (a vision tower is loaded)


class Engine:
    def __init__(self, options: EngineOptions, progress: Progress | None = None) -> None:
        self.options = options
        report = progress or (lambda stage, done, total: None)
        path = options.model_path
        if path is None:
            from runner.default_model import ensure_default_model

            path = ensure_default_model(report)
        self.loaded: LoadedModel = self._load(path, report)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.vision, no_images = load_vision(self.loaded)
        self.open_images: weakref.WeakSet[ImageLayout] = weakref.WeakSet()
        self.preparer = RequestPreparer(
            self.tokenizer,
            vocab_size=self.loaded.vocab_size,
            context_length=self.loaded.context_length,
            chat_template=self.loaded.chat_template,
            model_path=self.loaded.path,
            images=self.vision.prompts if self.vision is not None else None,
            no_images=no_images,
        )
        self.kv_bits = self._kv_bits()  # --kv-bits, where the model's attention reads it
        self.caches = self.make_caches()
        # A feed-dependent model (dynamic or longrope RoPE) computes what its reference
        # computes only when every prompt is one forward and decoding one token per forward:
        # no speculation, no prefix cache, no prefill chunks.
        self.feed_dependent = feed_dependent(self.model)
        self.assistant = None  # a Gemma 4 assistant drafting instead of a head (self._head)
        head, mtp_detail = self._head()
        self.tuning = device.tune(
            self.model,
            head,
            layout=options.weight_layout,
            row_layout=options.row_layout,
            compile=options.compile,
            native_blocks=options.native_blocks,
            exact_products=options.exact_products,
            quantize=options.quantize,
            quantize_head=options.quantize_head,
        )
        if self.vision is not None:
            self.vision.tune(self.tuning)
        self.speculation: Speculation | None = None
        # Drafting from the text already seen needs nothing from the model: every model whose
        # decoding is feed-independent speculates with it, with or without a head.
        suffix = "suffix" in options.draft_sources and options.use_draft and not self.feed_dependent
        if head is not None or suffix or self.assistant is not None:
            self.speculation = Speculation(
                head,
                max_depth=options.max_draft,
                fixed_depth=options.draft_depth,
                request_head=options.faults.request_head(),
                suffix=suffix,
                assistant=self.assistant,
                recent_tokens=options.recent_outputs,
            )
        log.info("device tuning: %s", self.tuning.describe())
        self.parallel, self.parallel_detail = self._parallel(options.parallel)
        # Shared forwards carry drafts from text already seen (no head step there) where the
        # model takes several rows per sequence in them.
        shared = options.shared_draft_rows if suffix else 0
        self.shared_draft_rows = min(shared, getattr(self.model, "ragged_rows", 0))
        if self.tuning.compiled:
            self._warm_up(report)
        self.slots = self._make_slots()
        self.all_caches = self.slots[0].all
        self.info = EngineInfo(
            model=self.loaded.name,
            context_length=self.loaded.context_length,
            vocab_size=self.loaded.vocab_size,
            mtp=head is not None,
            mtp_detail=mtp_detail,
            blas=blas.blas_in_use(),
            tuning=self.tuning.describe(),
            weights_bytes=device.weight_bytes(self.model, head),
            draft_sources=tuple(self.speculation.sources) if self.speculation else (),
            images=self.vision is not None,
        )

    def _load(self, path: str, report: Progress) -> LoadedModel:
        """The target as this engine serves it (``runner.distributed`` loads one rank's
        layers instead)."""
        options = self.options
        return load_model(
            path, dtype=options.dtype, keep_quantized=options.keep_quantized, progress=report
        )

    def _head(self) -> tuple[object | None, str]:
        """The MTP head to serve (or None) and the ready frame's word on it."""
        if self.feed_dependent:
            detail = "no speculation: the model's RoPE depends on how tokens are fed"
            log.info("%s; prefix cache and prefill chunks off too", detail)
            return None, detail
        if not self.options.use_draft:
            return None, "no draft head (disabled by --no-draft)"
        if "head" not in self.options.draft_sources:
            return None, "no draft head (not in --draft-sources)"
        loaded, draft_path = self.loaded, self.options.draft_path
        self.assistant, detail = find_assistant(loaded.model, loaded.path, draft_path, loaded.dtype)
        if detail is not None:
            return None, detail
        head, detail = load_draft_head(self.loaded, self.options.draft_path)
        if head is not None and head.config.feature_layers:  # rows carry the fused streams
            self.model.use_draft_features(tuple(head.config.feature_layers))
        return head, detail

    def _make_slots(self) -> list[CacheSlot]:
        """One cache slot per completion decoded at once, all on one prefix cache: slot 0
        holds the caches warmed up and measured at load."""
        slots = [CacheSlot(0, self.caches, self.draft_cache)]
        self.prefix: PrefixCache = self._make_prefix_cache(slots[0].all)
        for index in range(1, self.parallel):
            draft = KVCache() if self.draft_cache is not None else None
            slot = CacheSlot(index, self.make_caches(), draft)
            self.prefix.add_slot(slot.all)
            slots.append(slot)
        for slot in slots:
            slot.prefix = self.prefix
        return slots

    def make_caches(self) -> list:
        """One set of the model's caches, full-attention layers quantized with --kv-bits."""
        return quantize_caches(self.model.make_caches(), self.kv_bits, self.options.kv_group)

    def _kv_bits(self) -> int | None:
        """--kv-bits where the model's attention reads packed rows (``served_kv_bits``)."""
        return served_kv_bits(self.model, self.options.kv_bits, self.options.kv_group)

    @property
    def chunk(self) -> int:
        """Prefill chunk length (a feed-dependent model: the whole prompt in one forward)."""
        if self.feed_dependent:
            return self.loaded.context_length
        return self.options.prefill_chunk

    @property
    def opening(self) -> int:
        """Where every prompt's first prefill chunk ends (``runner.prefill.chunk_ends``): the
        rows a short feed attends row by row, so a cached chat-template opening holds the bits
        any prompt computes cold; 0 for a feed-dependent model (its prompt goes in one
        forward, and it keeps no prefix cache)."""
        return 0 if self.feed_dependent else ROW_BY_ROW

    def _parallel(self, wanted: int) -> tuple[int, str]:
        """How many completions decode at once, and why fewer than ``wanted``."""
        if wanted <= 1:
            return 1, "one completion at a time"
        refusal = self.model.rows_refusal()
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
            caches = self.make_caches()
            hidden = self.model.hidden(mx.zeros((1, rows), dtype=mx.int32), caches)
            outputs = [self.model.unembed(hidden)]
            if self.head is not None and rows <= 2:
                outputs.append(self.head(mx.zeros((1, rows), dtype=mx.int32), hidden, KVCache()))
            mx.eval(outputs)
        report("compile", 1, 1)

    def _make_prefix_cache(self, caches: list) -> PrefixCache:
        budget = self.options.cache_bytes or default_cache_bytes()
        # With a draft KV, keys pair each token with the next so every restore point is
        # valid for the draft cache too (its slot S depends on token S+1).
        pair_keys = self.draft_cache is not None
        enabled = self.options.prefix_cache and not self.feed_dependent
        return PrefixCache(
            caches,
            budget,
            pair_keys=pair_keys,
            enabled=enabled,
            disk=self._disk_tier(caches, pair_keys) if enabled else None,
        )

    def _disk_tier(self, caches: list, pair_keys: bool) -> DiskCache | None:
        """The disk tier under ``--cache-dir`` (None without it, or where the directory
        cannot be used); a directory another live runner holds is a load error."""
        options = self.options
        if options.cache_dir is None:
            return None
        try:
            return DiskCache(
                options.cache_dir,
                self._fingerprint(caches, pair_keys),
                [cache_kind(c) for c in caches],
                options.cache_disk_bytes or DISK_BYTES,
                pair_keys=pair_keys,
                hook=disk_format.fault_hook(options.disk_fault),
            )
        except OSError as exc:
            log.warning("--cache-dir %s unusable (%s): no disk tier", options.cache_dir, exc)
            return None

    def _fingerprint(self, caches: list, pair_keys: bool) -> str:
        """What decides the bits a cache holds for given keys: the checkpoint's files (sizes,
        headers, sampled blocks), the weights and head as laid out, the dtype, the device
        tuning, BLAS (its threads too), MLX and the device, the options that change
        products or chunking, the runner's own code, the caches' kinds and the key scheme."""
        options, path = self.options, self.loaded.path
        files = [path]
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if n.endswith(MODEL_FILES))
            files = [os.path.join(path, n) for n in names]
        head = self.head
        # The packages whose code computes cached arrays (runner: device.py's directory).
        code = [os.path.dirname(m.__file__) for m in (cache, drafting, device)]
        return disk_format.fingerprint(
            {
                "model": disk_format.files_print(files),
                "weights": disk_format.arrays_print(tree_flatten(self.model.parameters())),
                "head": disk_format.arrays_print(tree_flatten(head.parameters())) if head else None,
                "dtype": str(self.loaded.dtype),
                "tuning": self.tuning.describe(),
                "blas": blas.blas_in_use(),
                "mlx": [mx.__version__, str(mx.default_device())],
                "options": [
                    options.exact_products,
                    options.quantize,
                    options.quantize_head,
                    options.keep_quantized,
                    options.weight_layout,
                    options.row_layout,
                    options.compile,
                    options.native_blocks,
                    options.prefill_chunk,
                    self.kv_bits,
                    options.kv_group,
                ],
                "code": disk_format.sources_print(code),
                "caches": [[type(c).__name__, c.window_lo(1 << 40)] for c in caches],
                "pair_keys": pair_keys,
            }
        )

    # ----------------------------------------------------------------- any thread
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tokenize_request(self, request) -> list[int]:
        """The ids of a ``protocol`` tokenize request: its text, or its rendered messages."""
        return self.preparer.tokenize_request(request)

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
            "weights_bytes": self.info.weights_bytes,
            "image_bytes": sum(layout.nbytes for layout in list(self.open_images)),
            "kv_bytes": sum(c.nbytes for slot in self.slots for c in slot.all),
            **(self.prefix.disk.status() if self.prefix.disk is not None else {}),
            **speculation,
        }

    def image_layout(self, req: Prepared) -> ImageLayout | None:
        """The position layout of a prompt with images (None: text only), counted in
        ``status`` while its request runs."""
        if not req.images:
            return None
        layout = ImageLayout(len(req.prompt), req.images, self.vision.encode)
        self.open_images.add(layout)
        return layout

    def precheck(self, request) -> None:
        """Refuse a prompt whose length alone proves it cannot fit (reader thread)."""
        self.preparer.precheck(request)

    def prepare(self, request) -> Prepared:
        """Tokenize and validate a ``protocol`` completion (any thread)."""
        return self.preparer.prepare(request)

    # ----------------------------------------------------------------- inference thread
    def run(self, req: Prepared, emit: Emit, cancelled: Callable[[], bool]) -> None:
        """Serve one completion alone: token frames, then exactly one done frame."""
        Scheduler(self).run(req, emit, cancelled)

    def open_stream(
        self,
        req: Prepared,
        emit: Emit,
        cancelled: Callable[[], bool],
        slot: CacheSlot,
        on_close: Callable[[Stream], None] = lambda stream: None,
    ) -> Stream:
        """A request on ``slot``: its prefix restored, its sessions open (runner.stream)."""
        return Stream(self, req, emit, cancelled, slot, on_close)


def served_kv_bits(model, bits: int | None, group: int) -> int | None:
    """``bits`` where every full-attention cache of ``model`` is read by the llama family's
    attention (the one that reads packed rows) with heads a multiple of ``group``; otherwise
    None, with a warning (float KV)."""
    if not bits:
        return None
    from runner.models.llama import Attention

    caches = model.make_caches()
    readers = [getattr(layer, "self_attn", None) for layer in getattr(model, "layers", [])]
    if len(readers) != len(caches) or any(
        type(c) is KVCache and not isinstance(a, Attention)
        for c, a in zip(caches, readers, strict=True)
    ):
        log.warning("--kv-bits: this model's attention reads float caches only: float KV")
        return None
    if any(type(c) is KVCache and a.head_dim % group for c, a in zip(caches, readers, strict=True)):
        log.warning("--kv-bits: heads are not a multiple of --kv-group %d: float KV", group)
        return None
    return bits
