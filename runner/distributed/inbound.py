"""Wait for the previous rank's bytes without spinning a core.

MLX's ring backend reads each socket on a thread of its own that retries a non-blocking
``recv`` for as long as a receive is posted: a rank waiting for rank 0's next command (an
idle runner) or rank 0 waiting for the last rank's rows keeps a core busy, and ranks sharing
a machine's cores take them from the rank that works. So before posting a receive, a rank
blocks in ``poll`` on that socket until bytes are there; the receive then completes at once.

The socket is found the way the ring connects: a rank accepts its previous rank's connection
on its own port of the host file, so of this process's sockets it is the established one whose
local port is that port. Where it cannot be found (another backend, several connections per
rank, no ``/proc``) the receive is posted at once, as before.
"""

from __future__ import annotations

import json
import logging
import os
import select
from collections.abc import Iterable, Mapping

log = logging.getLogger("mtp_runner.distributed")

ESTABLISHED = "01"  # /proc/net/tcp's state column
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def own_port(hostfile: str, rank: int) -> int | None:
    """``rank``'s port in the ring backend's host file (None: not one address a rank)."""
    with open(hostfile) as f:
        nodes = json.load(f)
    if rank >= len(nodes) or len(nodes[rank]) != 1:
        return None
    return int(nodes[rank][0].rpartition(":")[2])


def socket_inodes(fd_dir: str = "/proc/self/fd") -> dict[int, int]:
    """This process's sockets: inode -> descriptor."""
    found = {}
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def find_socket(tables: Iterable[str], inodes: Mapping[int, int], port: int) -> int | None:
    """The descriptor of the established socket of ours (``inodes``) whose local port is
    ``port``, from the text of ``/proc/net/tcp``-style ``tables``; None unless exactly one."""
    hits = []
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != ESTABLISHED:
                continue
            local_port = int(fields[1].rpartition(":")[2], 16)
            inode = int(fields[9])
            if local_port == port and inode in inodes:
                hits.append(inodes[inode])
    return hits[0] if len(hits) == 1 else None


_ports: dict[int, int | None] = {}  # rank -> its port, read from the host file at join


def remember_port(rank: int) -> None:
    """Read this rank's port from the host file before joining (``--ranks`` removes the file
    once every rank has joined)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    try:
        _ports[rank] = own_port(hostfile, rank) if hostfile else None
    except (OSError, ValueError) as exc:
        log.info("rank %d: no port of its own in %s (%s)", rank, hostfile, exc)
        _ports[rank] = None


def inbound_socket(rank: int) -> int | None:
    """The descriptor this rank's previous rank sends on, or None (module docstring)."""
    port = _ports.get(rank)
    if port is None:
        return None
    try:
        tables = []
        for path in TABLES:
            if os.path.exists(path):
                with open(path) as f:
                    tables.append(f.read())
        fd = find_socket(tables, socket_inodes(), port)
    except (OSError, ValueError) as exc:
        log.info("rank %d: waiting for the previous rank by polling MLX (%s)", rank, exc)
        return None
    if fd is None:
        log.info("rank %d: the previous rank's socket was not found; MLX polls it", rank)
    return fd


def wait_readable(fd: int) -> None:
    """Block until ``fd`` has bytes to read (or is closed: the receive then reports it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    while not poller.poll():
        pass
