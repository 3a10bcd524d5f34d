"""Rank 0's engine: ``runner.engine.Engine`` over the pipelined model.

Everything above the model is the one-process engine's (preparation, the scheduler, streams,
sampling, emission), so the protocol and the output are the same. What this slice does not
serve across ranks is turned off before ``ready`` and said where the host sees it: no
speculation (``ready``'s ``mtp_detail``) and one completion at a time (the log);
``runner.distributed.main`` refuses the options that ask for them explicitly. The prefix
cache is served (``runner.distributed.remote``) where every later rank's layers attend in
full; with a sliding window there it is off, and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx

from protocol.errors import CodedError, LoadError
from runner.distributed import stage
from runner.distributed.channel import DTYPES, Channel, RankReport, handshake
from runner.distributed.pipeline import pipeline_class
from runner.distributed.remote import Link
from runner.distributed.split import LayerPlan
from runner.distributed.watchdog import Watchdog
from runner.engine import Engine, EngineOptions, Progress
from runner.loader import LoadedModel
from runner.models import llama
from runner.models.llama import Model

log = logging.getLogger("mtp_runner.distributed")

NO_SPECULATION = "no speculation: a model split across ranks decodes plainly for now"


def served_options(options: EngineOptions) -> EngineOptions:
    """``options`` with what the pipeline does not serve yet turned off."""
    return dataclasses.replace(options, use_draft=False, parallel=1)


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
        log.info("across %d ranks: no speculation, one completion at a time", group.size())
        super().__init__(served_options(options), progress)

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
        channel = Channel(self.group, checkpoint.args.hidden_size)
        later = range(run.stop, plan.ranges[-1].stop)
        row_bytes = kv_row_bytes(checkpoint.args, later, DTYPES[dtype])
        loaded.model.link = Link(channel, self.watchdog, row_bytes)
        windowed = windowed_layers(checkpoint.args, later)
        if windowed and self.options.prefix_cache:
            log.info(
                "no prefix cache: layers %s of the other ranks slide a window (not served "
                "across ranks yet)",
                ", ".join(map(str, windowed)),
            )
            self.options = dataclasses.replace(self.options, prefix_cache=False)
        return loaded

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
        return None, NO_SPECULATION

    def _warm_up(self, report: Progress) -> None:
        """Trace rank 0's own compiled blocks for one- and two-row feeds (the other ranks
        trace theirs at load): its layers alone, on caches of their own."""
        report("compile", 0, 1)
        for rows in (1, 2):
            caches = Model.make_caches(self.model)
            mx.eval(Model.hidden(self.model, mx.zeros((1, rows), dtype=mx.int32), caches))
        report("compile", 1, 1)


def kv_row_bytes(args: llama.ModelArgs, layers: range, dtype: mx.Dtype) -> int:
    """Bytes one position takes in the full caches of ``layers``: a key and a value row of
    every key-value head (what a copied-out snapshot holds a position)."""
    return len(layers) * 2 * args.num_key_value_heads * args.head_dim * dtype.size


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
        exact_products=options.exact_products,
        quantize=options.quantize,
    )
