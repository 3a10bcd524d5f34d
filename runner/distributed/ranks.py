"""Which rank this process is, and ``--ranks N``: the other ranks started on this machine.

``mlx.launch`` starts every rank itself and tells each its place through the environment
(``MLX_RANK``, and for the ring backend ``MLX_HOSTFILE``: a JSON file listing each rank's
``ip:port``). ``--ranks N`` sets up the same environment on loopback: rank 0 (the process
the host started) picks N free ports, writes the host file and starts ranks 1..N-1 as its
own children, with ``--distributed`` in place of ``--ranks N``; then every rank joins the
ring the same way, so the two paths differ only in who started the processes. Ranks on one
machine share its cores: ``--ranks`` gives each a fair share of BLAS threads, and
``MTP_RUNNER_CORES`` sets the share by hand (under ``mlx.launch`` too).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import mlx.core as mx

from runner import blas
from runner.distributed import inbound

log = logging.getLogger("mtp_runner.distributed")

LOOPBACK = "127.0.0.1"
# The cores one rank's BLAS may use (``--ranks`` sets a fair share; a user's value is kept).
CORES = "MTP_RUNNER_CORES"


def rank_from_environment() -> int:
    """This process's rank as ``mlx.launch`` (or rank 0's spawning) set it; 0 without one."""
    return int(os.environ.get("MLX_RANK", "0"))


def join() -> mx.distributed.Group:
    """Join the other ranks (blocks until every rank has joined): the ring backend where a
    host file is given, else whichever backend the environment configures."""
    backend = "ring" if os.environ.get("MLX_HOSTFILE") else "any"
    inbound.remember_port(rank_from_environment())
    return mx.distributed.init(strict=True, backend=backend)


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on now (each bound, then released:
    another process could take one before the ring does, which fails the start loudly)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_hostfile(ports: Sequence[int], directory: str) -> str:
    """The ring backend's host file for one rank per port on loopback."""
    path = os.path.join(directory, "hosts.json")
    with open(path, "w") as f:
        json.dump([[f"{LOOPBACK}:{port}"] for port in ports], f)
    return path


def follower_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--ranks N`` (either spelling), with ``--distributed``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ranks":
            skip = True
        elif not arg.startswith("--ranks="):
            out.append(arg)
    return [*out, "--distributed"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_environment(count: int) -> dict[str, str]:
    """What ``count`` ranks on this machine set in their environment to share its cores:
    each a fair share (``CORES``, read by ``share_cores``), and the thread pools a BLAS
    sizes at start-up (OpenMP's, OpenBLAS's) as large; whatever the user set is kept.
    Every rank's BLAS would otherwise size its pools for all the cores: N ranks, N times
    the threads the machine has cores for, contending for them."""
    if CORES in os.environ:
        return {}
    share = str(max(1, usable_cores() // count))
    names = (CORES, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {name: share for name in names if name not in os.environ}


def share_cores() -> None:
    """Narrow this process's BLAS threads to its share of the cores (``CORES``, where
    ``--ranks`` or the user set it)."""
    raw = os.environ.get(CORES)
    if raw is None:
        return
    try:
        cores = int(raw)
    except ValueError:
        cores = 0
    if cores < 1:
        log.warning("%s=%r is not a positive integer; ignored", CORES, raw)
        return
    blas.limit_cores(cores)


def spawn(count: int, argv: Sequence[str]) -> tuple[list[tuple[int, subprocess.Popen]], str]:
    """Start ranks 1..count-1 on loopback and set this process up as rank 0, every rank
    with its share of the cores (``thread_environment``); returns the children (rank,
    process) and the directory of the host file (remove it once every rank has joined). The
    children's stdout goes to this process's stderr: frames are rank 0's."""
    directory = tempfile.mkdtemp(prefix="mtp-runner-ranks-")
    hostfile = write_hostfile(free_ports(count), directory)
    command = [sys.executable, "-m", "runner", *follower_argv(argv)]
    os.environ.update(thread_environment(count))
    children = []
    for rank in range(1, count):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno()
        )
        children.append((rank, proc))
    os.environ["MLX_RANK"] = "0"
    os.environ["MLX_HOSTFILE"] = hostfile
    return children, directory
