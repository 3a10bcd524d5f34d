"""The ranks' one channel: commands and hidden rows over MLX's distributed send and recv.

The ranks form the ring rank 0 -> 1 -> ... -> N-1 -> 0, which the ring backend connects
(each hop is between neighbours). Rank 0 drives: a command is a small int32 header that
travels down the chain (each rank passes it on before acting on it, so the next one is ready
for what follows), and a forward's hidden rows follow the same hops; the last rank hands its
output rows back to rank 0. Headers and rows are sent in the order the ranks act on them, so
no command needs an acknowledgement: every rank applies the same commands in the same order.

The start-up handshake is one ``all_sum`` over a row per rank: whether it loaded its layers,
how many weight bytes it holds, and its error when it did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import mlx.core as mx

from runner.distributed import inbound

HEADER = 9  # int32 words of a command header
# A report's words ahead of its message: status, layers, dtype, weight bytes, length.
WORDS = 7
MESSAGE = 480  # bytes of a rank's load error carried by the handshake
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class Op(IntEnum):
    """A command's first header word; the words it uses, in ``Command``'s field order."""

    FORWARD = 1  # caches, rows, offset, dtype: hidden rows [1, rows, D] follow
    REWIND = 2  # caches, rows (the offset to rewind to)
    RESET = 3  # caches
    SHUTDOWN = 4
    # The prefix cache: each rank keeps its own layers' snapshots under rank 0's ids.
    SNAPSHOT = 5  # caches, rows (positions), offset (the first), snap (the new id)
    RESTORE = 6  # caches, offset (restore up to), snap
    DROP = 7  # snap
    SPLIT = 8  # offset (where), snap (split and dropped), head, tail (the new ids)
    MERGE = 9  # snap (the new id), head, tail (merged and dropped)
    # Lay the layers out for verify rows as rank 0 did (``runner.device.tune`` with a head).
    ROW_LAYOUT = 10
    # A shared forward (``--parallel``): one decode row for each of several sets. An int32
    # [2, rows] table (each row's set, the offset it is fed at) follows, then the rows.
    FORWARD_ROWS = 11  # rows, dtype
    # A hybrid's recurrent layers keep their state at positions [offset, offset + rows) when
    # the next feed passes them (``cache.recurrent.RecurrentCache.keep``).
    KEEP = 12  # caches, rows, offset
    # The prefix cache's pins on a hybrid's recurrent layers (``RecurrentCache.set_pins``):
    # an int32 [1, rows] table of positions, most wanted first, follows; offset: the most
    # copies each layer keeps (-1: no limit).
    PINS = 13  # caches, rows, offset, part
    # A FORWARD over rows a request's images place (``runner.images``): an int32 [3, rows]
    # table of their RoPE positions follows, then the rows.
    FORWARD_PLACED = 14  # caches, rows, offset, dtype


class Part(IntEnum):
    """Which of a set's layers a command acts on (a hybrid's set is two caches to rank 0)."""

    ALL = 0
    FULL = 1  # every layer but the recurrent ones
    STATES = 2  # a hybrid's recurrent layers (their caches ``keeps_states``)


@dataclass(frozen=True)
class Command:
    op: Op
    caches: int = 0  # which set of caches (rank 0's ``make_caches`` calls, numbered)
    rows: int = 0  # FORWARD: rows fed; REWIND: the offset to rewind to; SNAPSHOT: positions
    offset: int = 0  # FORWARD: where the rows start (a check: every rank's caches agree)
    dtype: int = 0  # FORWARD: the rows' dtype, an index into DTYPES
    snap: int = 0  # a snapshot id (rank 0's numbering)
    head: int = 0  # SPLIT, MERGE: the snapshot id of the lower positions
    tail: int = 0  # SPLIT, MERGE: the snapshot id of the upper positions
    part: Part = Part.ALL  # which of the set's layers (REWIND, RESET, SNAPSHOT, RESTORE, PINS)

    def words(self) -> list[int]:
        words = [int(self.op), self.caches, self.rows, self.offset, self.dtype]
        return [*words, self.snap, self.head, self.tail, int(self.part)]

    @classmethod
    def parse(cls, words: list[int]) -> Command:
        return cls(Op(words[0]), *words[1 : HEADER - 1], Part(words[HEADER - 1]))


class Channel:
    """This rank's ends of the ring: ``prev`` sends to it, it sends to ``next``."""

    def __init__(self, group: mx.distributed.Group, hidden_size: int) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.hidden_size = hidden_size
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self._inbound: int | None | bool = False  # the previous rank's socket; False: not sought

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def send_command(self, command: Command) -> None:
        """Pass ``command`` down the chain (the last rank passes nothing on)."""
        if not self.last:
            header = mx.array(command.words(), dtype=mx.int32)
            mx.eval(mx.distributed.send(header, self.next, group=self.group))

    def _wait(self) -> None:
        """Block until the previous rank's bytes are there, without a core spinning
        (``runner.distributed.inbound``)."""
        if self._inbound is False:
            self._inbound = inbound.inbound_socket(self.rank)
        if self._inbound is not None:
            inbound.wait_readable(self._inbound)

    def recv_command(self) -> Command:
        """The next command from the previous rank (blocks until one comes)."""
        self._wait()
        header = mx.distributed.recv((HEADER,), mx.int32, self.prev, group=self.group)
        mx.eval(header)
        return Command.parse(header.tolist())

    def send_rows(self, rows: mx.array) -> None:
        """Hand hidden rows ``[1, L, D]`` on (the last rank: back to rank 0), evaluated."""
        mx.eval(mx.distributed.send(rows, self.next, group=self.group))

    def send_table(self, table: list[list[int]]) -> None:
        """Pass a small int32 table down the chain (the last rank passes nothing on)."""
        if not self.last:
            words = mx.array(table, dtype=mx.int32)
            mx.eval(mx.distributed.send(words, self.next, group=self.group))

    def recv_table(self, shape: tuple[int, int]) -> list[list[int]]:
        """An int32 table of ``shape`` from the previous rank."""
        self._wait()
        table = mx.distributed.recv(shape, mx.int32, self.prev, group=self.group)
        mx.eval(table)
        return table.tolist()

    def recv_rows(self, count: int, dtype: mx.Dtype) -> mx.array:
        """Hidden rows ``[1, count, D]`` from the previous rank, evaluated."""
        self._wait()
        rows = mx.distributed.recv((1, count, self.hidden_size), dtype, self.prev, group=self.group)
        mx.eval(rows)
        return rows


@dataclass(frozen=True)
class RankReport:
    """What a rank says after loading: its weight bytes, or why it could not load."""

    loaded: bool
    layers: range = range(0)  # the global layer indices the rank holds
    weight_bytes: int = 0
    dtype: int = 0  # the dtype its stage computes in, an index into DTYPES
    code: str = ""  # a load error's protocol code
    message: str = ""


def handshake(group: mx.distributed.Group, report: RankReport) -> list[RankReport]:
    """Every rank's report, in rank order (one ``all_sum``: each rank fills its own row)."""
    size, rank = group.size(), group.rank()
    table = [[0] * (WORDS + MESSAGE) for _ in range(size)]
    text = f"{report.code}\t{report.message}".encode()[:MESSAGE] if not report.loaded else b""
    table[rank][:WORDS] = [
        1 if report.loaded else 2,
        report.layers.start,
        report.layers.stop,
        report.dtype,
        report.weight_bytes & 0x7FFFFFFF,
        report.weight_bytes >> 31,
        len(text),
    ]
    table[rank][WORDS : WORDS + len(text)] = list(text)
    total = mx.distributed.all_sum(mx.array(table, dtype=mx.int32), group=group)
    mx.eval(total)
    return [_report(row) for row in total.tolist()]


def _report(row: list[int]) -> RankReport:
    status, start, stop, dtype, low, high, length = row[:WORDS]
    if status == 1:
        return RankReport(True, range(start, stop), low | (high << 31), dtype)
    text = bytes(row[WORDS : WORDS + length]).decode(errors="replace")
    code, _, message = text.partition("\t")
    return RankReport(False, range(start, stop), code=code, message=message or "did not report")
