"""A rank other than 0: load its layers, report, then follow rank 0's commands until shutdown.

It never reads stdin or writes a frame (``mlx.launch`` copies stdin to every rank and merges
their stdout, so only rank 0 may write there). Each command is passed down the chain first,
then applied to this rank's caches of the set it names, created on first use; the prefix
cache's snapshots of this rank's layers are kept here under the ids rank 0 gives them
(``runner.distributed.remote``); a command may name a part of the set (a hybrid's
recurrent layers, or the others: ``Part``), which rank 0 drives as two caches. A failure here
(a cache out of step, a lost peer) ends the process: its peers' pending operations then
fail, and rank 0 reports the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from cache.kv import concat_snapshots
from cache.kv_quantized import quantize_caches
from protocol.codes import LOAD_ERROR
from protocol.errors import CodedError
from runner import device
from runner.distributed import stage
from runner.distributed.channel import (
    DTYPES,
    Channel,
    Command,
    Op,
    Part,
    RankReport,
    handshake,
)
from runner.engine import served_kv_bits
from runner.images import PlacedRows
from runner.models import layers
from runner.models.llama import Model
from runner.models.native_block import NativeBlock

log = logging.getLogger("mtp_runner.distributed")


class OutOfStep(RuntimeError):
    """This rank's caches are not where rank 0's command says they are."""


def load(
    group: mx.distributed.Group,
    checkpoint: stage.Checkpoint | None,
    run: range,
    options: stage.StageLoad,
    failure: BaseException | None = None,
) -> Model | None:
    """Load and tune layers ``run`` and report to every rank (None when this rank or another
    failed: the caller exits). ``failure``: reading the checkpoint already failed."""
    model = None
    if failure is None:
        try:
            model = stage.load_stage(checkpoint, run, False, options, lambda *a: None).model
            stage.tune_stage(model, options)
            warm_up(model, options)
        except Exception as exc:
            failure = exc
    if failure is not None:
        log.error("rank %d could not load layers %s: %s", group.rank(), _span(run), failure)
        code = failure.code if isinstance(failure, CodedError) else LOAD_ERROR
        message = str(failure) or type(failure).__name__
        report = RankReport(False, run, code=code, message=message)
    else:
        held = DTYPES.index(stage.held_as(options)[0])
        report = RankReport(True, run, device.weight_bytes(model), held)
        log.info(
            "rank %d holds layers %s: %d weight bytes",
            group.rank(),
            _span(run),
            report.weight_bytes,
        )
    reports = handshake(group, report)
    return model if all(r.loaded for r in reports) else None


def warm_up(model: Model, options: stage.StageLoad) -> None:
    """Trace the compiled blocks for one-row feeds before the first request (rank 0 traces
    its own the same way)."""
    if not options.compile:
        return
    caches = model.make_caches()
    rows = mx.zeros((1, 1, model.args.hidden_size), dtype=_dtype(model))
    mx.eval(model.hidden(rows, caches, prenorm=True))


def _dtype(model: Model) -> mx.Dtype:
    norm = model.layers[0].input_layernorm.weight
    return norm.dtype


def _span(run: range) -> str:
    return f"{run.start}-{run.stop - 1}" if run else "(none: no split)"


def follow(channel: Channel, model: Model, options: stage.StageLoad | None = None) -> None:
    """Apply rank 0's commands until SHUTDOWN, each set of caches made as ``options`` say
    (--kv-bits). A command this rank cannot apply (a snapshot id it does not hold, a restore
    its caches are not ready for) means it is out of step."""
    options = stage.StageLoad() if options is None else options
    bits = served_kv_bits(model, options.kv_bits, options.kv_group)

    def make_caches() -> list:
        return quantize_caches(model.make_caches(), bits, options.kv_group)

    sets: dict[int, list] = {}
    kept = Snapshots()
    while True:
        command = channel.recv_command()
        channel.send_command(command)
        if command.op is Op.SHUTDOWN:
            return
        caches = sets.get(command.caches, [])
        if command.caches and command.caches not in sets:  # 0: a command naming no set
            caches = sets[command.caches] = make_caches()
        try:
            if command.op is Op.FORWARD_ROWS:
                forward_rows(channel, model, sets, command, make_caches)
            else:
                apply(channel, model, caches, kept, command)
        except (KeyError, ValueError) as exc:
            raise OutOfStep(f"{command}: {exc}") from exc


def part_of(caches: list, part: Part) -> list:
    """The caches of a set a command's ``part`` names."""
    if part is Part.ALL:
        return caches
    return [c for c in caches if c.keeps_states == (part is Part.STATES)]


def apply(channel: Channel, model: Model, caches: list, kept: Snapshots, command: Command) -> None:
    """One command on this rank's ``caches`` (the set it names) and ``kept`` snapshots."""
    op = command.op
    if op in (Op.FORWARD, Op.FORWARD_PLACED):
        forward(channel, model, caches, command)
        return
    caches = part_of(caches, command.part)
    if op is Op.REWIND:
        for cache in caches:
            cache.rewind(command.rows)
        if command.rows == 0:
            device.release_memory()  # a request starts over: return its buffers
    elif op is Op.KEEP:
        for cache in caches:
            cache.keep(range(command.offset, command.offset + command.rows))
    elif op is Op.RESET:
        for cache in caches:
            cache.reset()
    elif op is Op.SNAPSHOT:
        end = command.offset + command.rows
        kept.add(command.snap, [c.snapshot(command.offset, end) for c in caches])
    elif op is Op.RESTORE:
        for cache, snap in zip(caches, kept[command.snap], strict=True):
            if snap.owner is not None and snap.owner is not cache:
                snap.materialise()  # another set's live range: copied out first
            cache.restore(snap, command.offset)
    elif op is Op.DROP:
        for snap in kept.take(command.snap):
            snap.close()
    elif op is Op.SPLIT:
        halves = [snap.split(command.offset) for snap in kept.take(command.snap)]
        kept.add(command.head, [head for head, _ in halves])
        kept.add(command.tail, [tail for _, tail in halves])
    elif op is Op.MERGE:
        heads, tails = kept.take(command.head), kept.take(command.tail)
        merged = [concat_snapshots(h, t) for h, t in zip(heads, tails, strict=True)]
        kept.add(command.snap, merged)
    elif op is Op.PINS:
        positions = []
        if command.rows:  # no table follows an empty list
            (positions,) = channel.recv_table((1, command.rows))
            channel.send_table([positions])
        limit = None if command.offset < 0 else command.offset
        for cache in caches:
            cache.set_pins(positions, limit=limit)
    elif op is Op.ROW_LAYOUT:
        add_row_layout(model)


def add_row_layout(model: Model) -> None:
    """The verify-row copy of the packed weights (``runner.device.tune`` adds it on rank 0
    with a head, which only rank 0 knows it serves), compiled blocks traced afresh: they keep
    the weights they traced."""
    native = any(isinstance(b, NativeBlock) for b in device.blocks_of(model))
    compiled = device.uncompile_blocks(model)
    layers.add_row_layout(model)
    if compiled:
        device.compile_blocks(model, native)


class Snapshots(dict):
    """This rank's layers' snapshots under rank 0's ids (one per layer, in layer order)."""

    def add(self, number: int, snapshots: list) -> None:
        if number in self:
            raise KeyError(f"snapshot {number} is held already")
        self[number] = snapshots

    def __missing__(self, number: int) -> list:
        raise KeyError(f"no snapshot {number} is held")

    def take(self, number: int) -> list:
        """The snapshots under ``number``, no longer held under it."""
        snapshots = self[number]
        del self[number]
        return snapshots


def forward(channel: Channel, model: Model, caches: list, command: Command) -> None:
    """This rank's layers over the rows the previous rank sends, handed on; placed rows (a
    prompt with images) at the positions that come first."""
    if caches[0].offset != command.offset:
        raise OutOfStep(
            f"caches {command.caches} rest at {caches[0].offset}, rank 0 feeds at {command.offset}"
        )
    placed = None
    if command.op is Op.FORWARD_PLACED:
        table = channel.recv_table((3, command.rows))
        channel.send_table(table)
        placed = PlacedRows(command.offset, np.array(table, dtype=np.int64))
    for cache in caches:
        cache.layout = placed
    rows = channel.recv_rows(command.rows, DTYPES[command.dtype])
    out = model.hidden(rows, caches, prenorm=True)
    mx.eval(out, [c.state for c in caches])
    channel.send_rows(out)


def forward_rows(
    channel: Channel,
    model: Model,
    sets: dict[int, list],
    command: Command,
    make_caches: Callable[[], list],
) -> None:
    """A shared forward: one row for each set the table names (created on first use), each
    checked against its own offset, through this rank's layers and handed on."""
    numbers, offsets = channel.recv_table((2, command.rows))
    channel.send_table([numbers, offsets])
    caches = []
    for number, offset in zip(numbers, offsets, strict=True):
        if number not in sets:
            sets[number] = make_caches()
        if sets[number][0].offset != offset:
            raise OutOfStep(
                f"caches {number} rest at {sets[number][0].offset}, rank 0 feeds at {offset}"
            )
        caches.append(sets[number])
    rows = channel.recv_rows(command.rows, DTYPES[command.dtype])
    out, _ = model.layer_rows(rows, caches)
    mx.eval(out, [c.state for row in caches for c in row])
    channel.send_rows(out)
