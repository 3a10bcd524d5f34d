"""``--ranks N`` / ``--distributed``: one model split over several processes.

Every rank runs this with the same command line. Rank 0 is the runner the host sees: it
serves stdin and stdout exactly as one process does (``runner.server`` over a
``runner.distributed.engine.PipelineEngine``), with a watchdog bounding every wait for the
others. The other ranks load their layers and follow rank 0's commands
(``runner.distributed.follower``); they never write to stdout. Options the pipeline does
not serve yet are refused before anything starts when given explicitly; what the split
itself rules out (the prefix cache over a later rank's sliding-window layers, shared
forwards over its windows) is turned off and said in the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, BinaryIO, NoReturn

import mlx.core as mx

from protocol.codes import INTERNAL, LOAD_ERROR
from protocol.errors import CodedError
from runner.distributed import ranks
from runner.distributed.watchdog import Fatal, Watchdog
from runner.faults import Faults
from runner.server import FrameWriter, Server

# The engine, the loader and the stages are imported where they are used: importing them
# starts threads, and on rank 0 a thread started before the server blocks SIGTERM/SIGINT
# (``Server.serve``) would take those signals away from the server's signal thread.
if TYPE_CHECKING:
    from runner.distributed.engine import PipelineEngine
    from runner.engine import EngineOptions

Options = Callable[[argparse.Namespace], "EngineOptions"]

log = logging.getLogger("mtp_runner.distributed")

# Options asking for what the pipeline does not serve yet: refused when given explicitly.
NOT_YET = {
    "cache_dir": "the prefix cache's disk tier",
    "cache_disk_bytes": "the prefix cache's disk tier",
    "noop_model": "the no-op model (nothing to split)",
}
STOP_WAIT_S = 10.0  # how long rank 0 waits for a rank to exit after shutdown before killing it


def given_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> dict:
    """The options ``argv`` gives explicitly: argparse sets a default only where the
    namespace has no value yet, so every option left at the mark was not given (a list, so
    that an ``append`` option copies it into a value of its own)."""
    mark = _Unset()
    seen = argparse.Namespace(**{name: mark for name in vars(args)})
    parsed = vars(parser.parse_args(argv, namespace=seen))
    return {name: value for name, value in parsed.items() if value is not mark}


class _Unset(list):
    """The mark of an option not given (``given_options``)."""


def refusal(args: argparse.Namespace, given: dict) -> str | None:
    """Why this command line (``args``, of which ``given`` were explicit) cannot run split
    across ranks (None: it can)."""
    flag = "--ranks" if args.ranks else "--distributed"
    for name, what in NOT_YET.items():
        if name in given:
            option = "--" + name.replace("_", "-")
            return f"{option}: {what} is not served across ranks yet ({flag})"
    if args.model is None:
        return f"{flag} needs --model (a Hugging Face directory: the llama family or qwen3_moe)"
    if args.ranks and "MLX_RANK" in os.environ:
        return "--ranks starts its own ranks; under mlx.launch pass --distributed instead"
    if args.distributed and "MLX_RANK" not in os.environ:
        return "--distributed runs under mlx.launch (MLX_RANK is not set); use --ranks N here"
    return None


def main(
    args: argparse.Namespace,
    argv: Sequence[str],
    parser: argparse.ArgumentParser,
    options: Options,
    frames: BinaryIO,
) -> int:
    """Run this process's rank (``args`` parsed from ``argv`` by ``parser``; ``options``
    makes the engine options they give; ``frames`` the claimed stdout); returns the exit
    status."""
    why = refusal(args, given_options(parser, args, argv))
    if why is not None:
        print(f"mtp-runner: error: {why}", file=sys.stderr)
        return 2
    children, directory = [], None
    if args.ranks:
        children, directory = ranks.spawn(args.ranks, argv)
        for rank, proc in children:
            log.info("started rank %d (pid %d)", rank, proc.pid)
    ranks.share_cores()
    if ranks.rank_from_environment() != 0:
        frames.close()  # only rank 0 writes frames
        return follower_main(args, options(args))
    return leader_main(args, options, frames, children, directory)


def follower_main(args: argparse.Namespace, engine: EngineOptions) -> int:
    """A later rank: join, load its layers, follow rank 0 until shutdown (or a lost peer)."""
    from runner.distributed import follower, stage
    from runner.distributed.channel import Channel
    from runner.distributed.engine import stage_load

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    options = stage_load(engine)
    group = ranks.join()
    checkpoint, run, failure = None, range(0), None
    try:
        checkpoint = stage.read_checkpoint(args.model, lambda *a: None)
        plan = stage.plan(checkpoint, group.size(), *stage.held_as(options))
        run = plan.ranges[group.rank()]
    except Exception as exc:
        failure = exc
    model = follower.load(group, checkpoint, run, options, failure)
    if model is None:
        return 1
    try:
        follower.follow(Channel(group, checkpoint.args.hidden_size), model, options)
    except RuntimeError as exc:  # a lost peer, or caches out of step with rank 0
        log.error("rank %d stopping: %s", group.rank(), exc)
        return 1
    log.info("rank %d: shut down", group.rank())
    return 0


def leader_main(
    args: argparse.Namespace,
    options: Options,
    frames: BinaryIO,
    children: list[tuple[int, subprocess.Popen]],
    directory: str | None,
) -> int:
    """Rank 0: the runner the host talks to."""
    writer = FrameWriter(frames)
    server = Server(
        writer,
        queue_limit=args.queue_limit,
        max_line_bytes=args.max_line_bytes,
        faults=Faults.parse(args.inject_fault),
    )
    fatal = Fatal()
    watchdog = Watchdog(children, fatal, args.rank_timeout)
    fatal.handler = lambda message: abort(server, children, message)
    joined: list[mx.distributed.Group] = []

    def load(progress) -> PipelineEngine:
        from runner.distributed.engine import PipelineEngine

        watchdog.start()  # here, after the server blocked SIGTERM/SIGINT (imports above)
        with watchdog.exchange("start-up", timed=False):
            joined.append(ranks.join())
        if directory is not None:  # every rank has read it
            shutil.rmtree(directory, ignore_errors=True)
        return PipelineEngine(options(args), joined[0], watchdog, progress)

    stdin_fd = sys.stdin.fileno()
    status = server.serve(load, lambda n: os.read(stdin_fd, n), handle_signals=True)
    watchdog.stop()
    if joined:
        stop_ranks(joined[0])
    reap(children)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    log.info("exiting with status %d", status)
    return status


def stop_ranks(group: mx.distributed.Group) -> None:
    """Tell the other ranks to exit (those that already left after a failed start-up are
    past hearing it)."""
    from runner.distributed.channel import Channel, Command, Op

    try:
        Channel(group, 0).send_command(Command(Op.SHUTDOWN))
    except RuntimeError as exc:
        log.info("the other ranks had stopped already (%s)", exc)


def reap(children: list[tuple[int, subprocess.Popen]]) -> None:
    """Wait for the ranks this process started; kill one that does not exit."""
    for rank, proc in children:
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("rank %d did not exit; killing it", rank)
            proc.kill()
            proc.wait()


def abort(server: Server, children: list[tuple[int, subprocess.Popen]], message: str) -> NoReturn:
    """A rank was lost (``Fatal``'s handler, any thread): error frames for everything
    accepted (a load error before ``ready``), the other ranks stopped, exit 1."""
    code = INTERNAL if server.engine is not None else LOAD_ERROR
    server.abort(CodedError(message, code=code))
    for _, proc in children:
        if proc.poll() is None:
            proc.kill()
    logging.shutdown()
    os._exit(1)
