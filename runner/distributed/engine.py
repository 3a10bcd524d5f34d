"""Rank 0's engine: ``runner.engine.Engine`` over the pipelined model.

Everything above the model is the one-process engine's (preparation, the scheduler, streams,
sampling, emission, speculation), so the protocol and the output are the same. Speculation
needs nothing more of the other ranks than a multi-row forward and rewinds: the suffix
drafter reads only the text, and the MTP head lives on rank 0, which holds the embedding and
gets the final hidden rows back (a head fusing residual streams reads only rank 0's layers:
``runner.distributed.pipeline``). The head is built against the whole model's shape (a
sidecar names the target's layer count; rank 0's stage holds only its share), and when
rank 0 lays its layers out for verify rows the other ranks are told to as well
(``Op.ROW_LAYOUT``), so every rank computes what one process computes. Shared forwards
(``--parallel``) cross the ranks as one exchange of a row per sequence (``Op.FORWARD_ROWS``),
each row after its own set of the other ranks' caches; where a later rank's layers slide a
window they are refused as one process refuses them (one completion at a time, the log
says why). ``runner.distributed.main`` refuses the options that ask for what is not served.
The prefix cache is served (``runner.distributed.remote``) where the later ranks' layers
attend in full or are a hybrid's recurrent layers; with a sliding window there it is off,
and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import mlx.core as mx

from cache import kv_quantized
from protocol.errors import CodedError, DraftHeadError, LoadError
from runner.distributed import stage
from runner.distributed.channel import DTYPES, Channel, Command, Op, RankReport, handshake
from runner.distributed.pipeline import PipelineModel, pipeline_class
from runner.distributed.remote import Link
from runner.distributed.split import LayerPlan
from runner.distributed.watchdog import Watchdog
from runner.engine import Engine, EngineOptions, Progress, served_kv_bits
from runner.heads import load_draft_head
from runner.loader import LoadedModel
from runner.models import llama, qwen3_5
from runner.models.gemma4_assistant import is_assistant
from runner.models.llama import Model

log = logging.getLogger("mtp_runner.distributed")


class WholeShape:
    """Rank 0's model as a head sees it: its embedding, output projection and family, with
    the whole model's arguments (a sidecar was made for the whole target's layer count, and
    the head's block is built as one process builds it)."""

    def __init__(self, model: Model, args: llama.ModelArgs) -> None:
        self._model = model
        self.args = args

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)


class PipelineEngine(Engine):
    """The engine of rank 0 in a group of ranks (``group``), each rank holding its run of
    layers by ``runner.distributed.split``."""

    def __init__(
        self,
        options: EngineOptions,
        group: mx.distributed.Group,
        watchdog: Watchdog,
        progress: Progress | None = None,
    ) -> None:
        self.group = group
        self.watchdog = watchdog
        self.whole_args: llama.ModelArgs | None = None  # set by ``_load``
        self.stage_kv_bits: int | None = None  # set by ``_load``
        super().__init__(options, progress)
        log.info("across %d ranks: %s", group.size(), self.parallel_detail)
        if self.tuning.row_layout:  # the other ranks' layers take verify rows as rank 0's do
            self.model.link.command(Command(Op.ROW_LAYOUT))

    def _load(self, path: str, report: Progress) -> LoadedModel:
        """Rank 0's stage, once every rank has loaded its own (refused before ``ready``
        otherwise), linked to the others."""
        options = stage_load(self.options)
        size = self.group.size()
        try:
            checkpoint = stage.read_checkpoint(path, report)
            plan = stage.plan(checkpoint, size, *stage.held_as(options))
            run = plan.ranges[0]
            cls = pipeline_class(checkpoint.model_class)
            loaded = stage.load_stage(checkpoint, run, True, options, report, cls=cls)
        except Exception as exc:
            self._handshake(RankReport(False, code=getattr(exc, "code", ""), message=str(exc)))
            raise
        dtype = DTYPES.index(stage.held_as(options)[0])
        reports = self._handshake(RankReport(True, run, 0, dtype))
        self._check(reports, plan)
        log.info("layer split: %s", plan.describe())
        self.whole_args = checkpoint.args
        channel = Channel(self.group, checkpoint.args.hidden_size)
        later = range(run.stop, plan.ranges[-1].stop)
        recurrent = recurrent_layers(checkpoint.args, later)
        held = DTYPES[dtype]
        own = super(PipelineModel, loaded.model)  # the family's model over rank 0's layers
        self.stage_kv_bits = served_kv_bits(own, options.kv_bits, options.kv_group)
        full = [i for i in later if i not in recurrent]
        packed = (self.stage_kv_bits, options.kv_group) if self.stage_kv_bits else None
        row_bytes = kv_row_bytes(checkpoint.args, full, held, packed)
        each = qwen3_5.state_bytes(checkpoint.args, held) if recurrent else 0
        link = Link(channel, self.watchdog, row_bytes, len(recurrent), len(recurrent) * each)
        loaded.model.link = link
        windowed = windowed_layers(checkpoint.args, later)
        if loaded.model.vision_tensors:
            # A shared forward sends the other ranks each row's offset, not its position: an
            # image request's rows sit past their offsets (``runner.images``).
            loaded.model.later_refusal = "image positions do not cross the ranks in shared forwards"
        if windowed:
            loaded.model.later_refusal = "sliding-window layers are not batched across sequences"
            if self.options.prefix_cache:
                log.info(
                    "no prefix cache: layers %s of the other ranks slide a window (not served "
                    "across ranks yet)",
                    ", ".join(map(str, windowed)),
                )
                self.options = dataclasses.replace(self.options, prefix_cache=False)
        return loaded

    def _kv_bits(self) -> int | None:
        """--kv-bits as rank 0's own layers serve it (every rank decides alike: a stage's
        layers are of the model's one attention kind)."""
        return self.stage_kv_bits

    def _handshake(self, report: RankReport) -> list[RankReport]:
        with self.watchdog.exchange("start-up", timed=False):
            return handshake(self.group, report)

    @staticmethod
    def _check(reports: list[RankReport], plan: LayerPlan) -> None:
        """Refuse before ``ready`` when a rank could not load its layers or holds others than
        rank 0's split gives it."""
        for rank, got in enumerate(reports[1:], start=1):
            span = f"layers {plan.ranges[rank].start}-{plan.ranges[rank].stop - 1}"
            if not got.loaded:
                message = f"rank {rank} could not load {span}: {got.message}"
                raise CodedError(message, code=got.code or LoadError.code)
            log.info("rank %d holds %s: %d weight bytes", rank, span, got.weight_bytes)
            if got.dtype != reports[0].dtype:
                raise LoadError(
                    f"rank {rank} holds the model in {DTYPES[got.dtype]}, rank 0 in "
                    f"{DTYPES[reports[0].dtype]}: pass the same --dtype to every rank"
                )
            if got.layers != plan.ranges[rank]:
                raise LoadError(
                    f"rank {rank} split the model differently ({got.layers} for {span}): "
                    "every rank must run the same checkpoint, options and device kind"
                )

    def _head(self) -> tuple[object | None, str]:
        """The MTP head on rank 0, found and checked as one process finds it, against the
        whole model's shape; a Gemma 4 assistant (it drafts over the target's own caches) is
        refused by name."""
        options = self.options
        if self.feed_dependent or not options.use_draft or "head" not in options.draft_sources:
            return super()._head()  # no head: the one-process engine's reason
        path = options.draft_path
        if path and is_assistant(os.path.expanduser(path)):
            raise DraftHeadError(
                "an assistant model drafts over the target's own caches, which are split "
                "across ranks: not served across ranks yet",
                path=path,
            )
        whole = dataclasses.replace(self.loaded, model=WholeShape(self.model, self.whole_args))
        head, detail = load_draft_head(whole, path)
        if head is not None and head.config.feature_layers:  # rows carry the fused streams
            try:
                self.model.use_draft_features(tuple(head.config.feature_layers))
            except DraftHeadError as exc:
                if path:  # asked for by name: refused, as one process refuses a bad head
                    raise
                log.warning("%s: not usable across ranks: %s", detail, exc)
                return None, f"{detail}: not usable across ranks: {exc}"
        return head, detail

    def _warm_up(self, report: Progress) -> None:
        """Trace rank 0's own compiled blocks for one- and two-row feeds and a shared forward's
        rows (the other ranks trace theirs at load, or on first use): its layers alone, on
        caches of their own."""
        report("compile", 0, 1)
        own = super(PipelineModel, self.model)  # the family's model over rank 0's layers
        for rows in range(1, max(2, self.parallel) + 1):
            caches = own.make_caches()
            mx.eval(own.hidden(mx.zeros((1, rows), dtype=mx.int32), caches))
        report("compile", 1, 1)


def kv_row_bytes(
    args: llama.ModelArgs,
    layers: Sequence[int],
    dtype: mx.Dtype,
    packed: tuple[int, int] | None = None,
) -> int:
    """Bytes one position takes in the full caches of ``layers``: a key and a value row of
    every key-value head (what a copied-out snapshot holds a position); ``packed``: the rows
    are --kv-bits rows of ``(bits, group)`` (``cache.kv_quantized``)."""
    if packed is None:
        row = args.head_dim * dtype.size
    else:
        row = kv_quantized.words(args.head_dim, *packed) * 4
    return len(layers) * 2 * args.num_key_value_heads * row


def recurrent_layers(args: llama.ModelArgs, layers: range) -> list[int]:
    """Those of ``layers`` that are a hybrid's Gated DeltaNet layers (recurrent caches)."""
    hybrid = args.extra.get("hybrid")
    if hybrid is None:
        return []
    return [i for i in layers if hybrid.layer_types[i] == "linear_attention"]


def windowed_layers(args: llama.ModelArgs, layers: range) -> list[int]:
    """Those of ``layers`` with a sliding window (their caches resume only where a window
    was kept, which the prefix cache would have to ask the other ranks about)."""
    windows = llama.layer_windows(args)
    return [i for i in layers if windows[i] is not None]


def stage_load(options: EngineOptions) -> stage.StageLoad:
    """How every rank loads and lays out its stage: the engine options of the one command
    line every rank runs."""
    return stage.StageLoad(
        dtype=options.dtype,
        keep_quantized=options.keep_quantized,
        layout=options.weight_layout,
        compile=options.compile,
        native_blocks=options.native_blocks,
        exact_products=options.exact_products,
        quantize=options.quantize,
        kv_bits=options.kv_bits,
        kv_group=options.kv_group,
    )
