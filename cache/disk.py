"""The prefix cache's disk tier: segments of cached prefixes kept in files across restarts.

**Segments.** A segment holds what the caches of a slot hold for positions ``[start, end)``
of one token sequence: its trie keys (int64 token ids, or pair keys as uint64), every full
cache's keys and values of those positions (target layers and the draft head's cache), and,
at some positions of ``[start, end]`` (its *stops*, the trie's node ends where every windowed
cache kept a window), each windowed cache's window and each recurrent layer's state. A
segment continues another (its *parent*) from ``start``, anywhere inside the parent's range,
so segments form a tree mirroring the trie's branches; a prefix is restored from the chain of
segments that spells it. The files are safetensors, the list of segments an index
(``cache.disk_format``), both written atomically, in one directory per fingerprint of what
decides the cached bits (the model, its weights, the head, the dtype, the device tuning, the
code and this format), locked by the one runner using it.

**When.** ``record`` runs at each request's close, after the trie indexed it: the positions
the caches hold past what the disk already has become one new segment. The arrays are copied
to host memory on the inference thread (one copy of the new positions: the next request may
overwrite the buffers), and a writer thread does the rest: checksum, write, fsync, rename,
index. The inference loop never waits on the disk, and the thread is not a daemon, so the
interpreter finishes the queue before a runner that was asked to exit does.

**Restore.** ``graft`` runs at ``begin`` when the disk spells more of the prompt than the
trie: the chain's files are read, checked against the index's SHA-256 digests and their own
metadata, and grafted below the trie's match as materialised nodes, so the request restores
them as it restores anything paged out. A file that is missing, truncated, damaged or foreign
is dropped with a warning, with the segments continuing it, and the restore falls back to
what remains: a wrong file never yields output.

**Budget.** The files' bytes stay within ``budget``: before a write, the least recently used
segments that no other segment continues are deleted. A write that finds the disk full is
dropped and the budget shrinks to what is on disk, so later writes make room first.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

import cache.disk_format as fmt
from cache.kv import KVSnapshot
from cache.recurrent import RecurrentCache, RecurrentSnapshot
from cache.window import WindowSnapshot

log = logging.getLogger("mtp_runner.disk_cache")

LOCK_WAIT_S = 5.0  # a runner that is exiting finishes its writes first


def cache_kind(cache) -> str:
    """How a segment keeps a cache: ``kv`` (a range), ``window`` or ``state`` (at stops)."""
    if isinstance(cache, RecurrentCache):
        return "state"
    return "window" if cache.windowed else "kv"


class Segment:
    """One file's positions ``[start, end)``, continuing ``parent`` (the root sentinel for a
    segment starting at 0). ``children`` maps (start, first key) to the segments continuing
    it; ``written`` once the file and its digest are on disk, ``gone`` once dropped."""

    def __init__(self, sid: int, parent, start: int, keys: list, stops=(), nbytes: int = 0):
        self.id, self.parent, self.start = sid, parent, start
        self.end = start + len(keys)
        self.keys = keys
        self.stops = tuple(stops)
        self.nbytes = nbytes
        self.digest = ""
        self.used = 0
        self.children: dict[tuple[int, int], Segment] = {}
        self.written = False
        self.gone = False

    @property
    def name(self) -> str:
        return f"seg-{self.id:08d}.safetensors"


class DiskCache:
    """The disk tier of one ``PrefixCache`` (module docstring).

    ``root`` is ``--cache-dir``; the files go to ``root/fingerprint``. ``kinds`` lists each
    cache of a slot (``cache_kind``), in the prefix cache's order; ``pair_keys`` is the key
    scheme they were recorded under. ``hook`` is a test seam (``disk_format.Hook``).
    Raises ``disk_format.DirectoryBusy`` when another live runner holds the directory.
    """

    def __init__(
        self,
        root: str,
        fingerprint: str,
        kinds: Sequence[str],
        budget: int,
        *,
        pair_keys: bool,
        hook: fmt.Hook = None,
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> None:
        self.root = os.path.abspath(root)
        self.fingerprint = fingerprint
        self.path = os.path.join(self.root, fingerprint)
        self.kinds = list(kinds)
        self.windowed = any(k != "kv" for k in self.kinds)
        self.budget = budget
        self.pair_keys = pair_keys
        self.hook = hook
        self.skipped = 0  # segments found unusable since start (logged one by one)
        self._top = Segment(-1, None, 0, [])
        self._segments: dict[int, Segment] = {}
        self._next, self._clock = 1, 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: deque = deque()
        self._writing = self._dirty = False
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd: int | None = fmt.lock_directory(self.path, lock_wait_s)
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ reporting
    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._segments.values())

    def status(self) -> dict:
        with self._lock:
            return {
                "disk_segments": len(self._segments),
                "disk_bytes": self.nbytes,
                "disk_skipped": self.skipped,
            }

    # ------------------------------------------------------------------ start
    def _load(self) -> None:
        others = fmt.other_caches(self.root, self.fingerprint)
        if others:
            what = "prefix cache(s) of other models or settings: left alone"
            log.info("%s also holds %d %s", self.root, others, what)
        names = os.listdir(self.path)
        for name in names:
            if name.startswith(fmt.TMP_PREFIX):
                log.warning("disk cache: removing %s, left by an interrupted write", name)
                self._unlink(name)
        entries = self._read_index()
        entries = [e for e in entries if isinstance(e, dict)]
        for entry in sorted(entries, key=lambda e: str(e.get("id")).zfill(20)):
            reason = self._adopt(entry)
            if reason is not None:
                self.skipped += 1
                log.warning("disk cache: segment %s skipped: %s", entry.get("id"), reason)
        kept = {s.name for s in self._segments.values()}
        stray = [n for n in names if n.startswith("seg-") and n not in kept]
        for name in stray:
            self._unlink(name)
        if stray:
            log.warning(
                "disk cache: removed %d segment file(s) that no valid index entry lists "
                "(a write cut short, or entries skipped above)",
                len(stray),
            )
        with self._lock:
            self._make_room(0, ())
            self._dirty = bool(self.skipped or stray)  # the index to rewrite without them
            self._submit(None)  # the writer thread is the only one writing files from now on
        log.info(
            "disk cache %s: %d segment(s), %d bytes, budget %d bytes",
            self.path,
            len(self._segments),
            self.nbytes,
            self.budget,
        )

    def _read_index(self) -> list:
        path = os.path.join(self.path, fmt.INDEX)
        try:
            with open(path, "rb") as f:
                body = fmt.decode_index(f.read())
        except FileNotFoundError:
            return []
        except (OSError, fmt.FormatError) as exc:
            files = sum(n.startswith("seg-") for n in os.listdir(self.path))
            self.skipped += files
            log.warning("disk cache: %s unusable (%s): its %d segment(s) skipped", path, exc, files)
            return []
        segments = body.get("segments") if isinstance(body, dict) else None
        if body.get("format") != fmt.FORMAT or body.get("fingerprint") != self.fingerprint:
            self.skipped += len(segments or ())
            log.warning(
                "disk cache: %s belongs to another model, settings or format (%s): its %d "
                "segment(s) skipped",
                path,
                body.get("fingerprint"),
                len(segments or ()),
            )
            return []
        self._next = int(body.get("next", 1))
        self._clock = int(body.get("clock", 0))
        return segments if isinstance(segments, list) else []

    def _adopt(self, entry) -> str | None:
        """Take an index entry into the tree (its keys read from its file, unverified until
        a restore reads the whole file); the reason it is unusable, or None."""
        try:
            sid, start, end = int(entry["id"]), int(entry["start"]), int(entry["end"])
            parent = self._top if entry["parent"] is None else self._segments.get(entry["parent"])
            if parent is None:
                return "the segment it continues is gone"
            stops = [int(p) for p in entry["stops"]]
            seg = Segment(sid, parent, start, [], stops, int(entry["bytes"]))
            seg.digest, seg.used = str(entry["sha256"]), int(entry["used"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed index entry ({exc})"
        path = os.path.join(self.path, seg.name)
        try:
            size = os.path.getsize(path)
            if size != seg.nbytes:
                return f"{seg.name} is {size} bytes, the index says {seg.nbytes} (truncated?)"
            meta, _, raw = fmt.read_head(path)
        except FileNotFoundError:
            return f"{seg.name} is missing"
        except (OSError, fmt.FormatError) as exc:
            return f"{seg.name} unreadable ({exc})"
        seg.keys = np.frombuffer(raw, dtype="<u8").tolist()
        seg.end = start + len(seg.keys)
        if meta != self._meta(seg) or seg.end != end or seg.end <= start:
            return f"{seg.name} does not match its index entry (damaged, or another model's)"
        if not (parent.start < start <= parent.end or parent is self._top and start == 0):
            return "it does not continue its parent's positions"
        if (start, seg.keys[0]) in parent.children:
            return "a duplicate of another segment"
        seg.written = True
        self._attach(seg)
        return None

    def _where(self, seg: Segment) -> dict:
        parent = None if seg.parent is self._top else seg.parent.id
        return {"id": seg.id, "parent": parent, "start": seg.start, "end": seg.end}

    def _meta(self, seg: Segment) -> dict:
        """What a segment's file says of itself, its keys' digest included: checked against
        the index and the keys at start, so a damaged key is caught before it can match."""
        meta = {"format": fmt.FORMAT, "fingerprint": self.fingerprint, **self._where(seg)}
        meta["keys"] = fmt.file_digest(np.asarray(seg.keys, dtype="<u8").tobytes())
        return meta

    def _attach(self, seg: Segment) -> None:
        seg.parent.children[(seg.start, seg.keys[0])] = seg
        self._segments[seg.id] = seg

    # ------------------------------------------------------------------ matching
    def _match(self, keys: Sequence[int], limit: int) -> tuple[list, int]:
        """The chain of segments spelling the longest prefix of ``keys[:limit]``: a list of
        (segment, from, to) ranges, and the prefix's length."""
        node, pos, chain = self._top, 0, []
        while pos < limit:
            child = node.children.get((pos, keys[pos]))
            if child is None:
                break
            want = min(child.end, limit) - pos
            if child.keys[:want] == keys[pos : pos + want]:
                common = want
            else:
                common = next(i for i in range(want) if child.keys[i] != keys[pos + i])
            chain.append((child, pos, pos + common))
            pos += common
            node = child  # a branch leaving it at ``pos`` is one of its children too
        return chain, pos

    def _touch(self, chain) -> None:
        if chain:
            self._clock += 1
            for seg, _, _ in chain:
                seg.used = self._clock
            self._dirty = True

    # ------------------------------------------------------------------ writing
    def record(self, caches: Sequence, live: Sequence, keys: Sequence[int], indexed: int) -> None:
        """At a request's close: queue a segment of what the caches hold past the disk's
        match of ``keys[:indexed]``. ``live`` is the slot's trie path (its node ends are the
        candidate stops, their windowed snapshots the windows and states)."""
        with self._lock:
            chain, start = self._match(keys, indexed)
            self._touch(chain)
            sid = self._next
            self._next += 1
            if start >= indexed:
                self._submit(None)  # the touched segments' use, for the next start's order
                return
        stops = [n for n in live if 0 < n.end and start <= n.end <= indexed and self._kept(n)]
        if self.windowed and not stops:
            with self._lock:
                self._submit(None)
            return  # nothing here could be restored on its own
        parent = chain[-1][0] if chain else self._top
        seg = Segment(sid, parent, start, list(keys[start:indexed]), [n.end for n in stops])
        tensors = {"keys": (np.asarray(keys[start:indexed], dtype=np.uint64), "U64")}
        for i, (cache, kind) in enumerate(zip(caches, self.kinds, strict=True)):
            if kind == "kv":
                tensors[f"c{i}.k"] = fmt.to_numpy(cache.keys[..., start:indexed, :])
                tensors[f"c{i}.v"] = fmt.to_numpy(cache.values[..., start:indexed, :])
                continue
            for node in stops:
                k, v = node.snapshots[i].arrays()
                if k is not None:
                    tensors[f"c{i}@{node.end}.k"] = fmt.to_numpy(k)
                    tensors[f"c{i}@{node.end}.v"] = fmt.to_numpy(v)
        head, chunks = fmt.encode(tensors, self._meta(seg))
        size = fmt.encoded_size(head, chunks)
        with self._lock:
            if parent.gone or not self._make_room(size, [s for s, _, _ in chain]):
                log.debug("disk cache: segment of %d bytes not written (budget)", size)
                self._submit(None)
                return
            seg.nbytes, seg.used = size, self._clock
            self._attach(seg)
            self._submit(("write", seg, [head, *chunks]))

    def _kept(self, node) -> bool:
        """Whether every windowed cache kept its window (state) at ``node``'s end."""
        kinds = zip(node.snapshots, self.kinds, strict=True)
        return all(snap.restorable for snap, kind in kinds if kind != "kv")

    def _make_room(self, size: int, keep: Sequence[Segment]) -> bool:
        """Delete least recently used segments that nothing continues (not those of
        ``keep``) until ``size`` more bytes fit the budget; False when they cannot."""
        if size > self.budget:
            return False
        kept = {id(s) for s in keep}
        total = self.nbytes
        while total + size > self.budget:
            leaves = [s for s in self._segments.values() if not s.children and id(s) not in kept]
            if not leaves:
                return False
            victim = min(leaves, key=lambda s: (s.used, s.id))
            total -= victim.nbytes
            self._remove(victim)
        return True

    def _remove(self, seg: Segment) -> int:
        """Take ``seg`` and every segment continuing it out of the tree, their files to be
        deleted; returns how many went."""
        gone = [seg]
        for s in gone:
            gone.extend(s.children.values())
        del seg.parent.children[(seg.start, seg.keys[0])]
        for s in gone:
            s.gone = True
            self._segments.pop(s.id, None)
        self._submit(("delete", [s for s in gone if s.written]))
        return len(gone)

    def drop(self, seg: Segment, reason: str) -> None:
        """A segment found unusable: dropped with the segments continuing it, and said."""
        with self._lock:
            if seg.gone:
                return
            count = self._remove(seg)
            self.skipped += count
        more = f" with {count - 1} segment(s) continuing it" if count > 1 else ""
        log.warning("disk cache: %s skipped: %s%s", seg.name, reason, more)

    # ------------------------------------------------------------------ the writer thread
    def _submit(self, job) -> None:
        """Queue ``job`` (None: save the index) for the writer thread, started on demand;
        call with the lock held."""
        if job is not None:
            self._jobs.append(job)
        elif not self._dirty:
            return
        if not self._writing:
            self._writing = True
            threading.Thread(target=self._write_loop, name="disk-cache", daemon=False).start()

    def _write_loop(self) -> None:
        saved = True  # an index that could not be saved waits for the next job to retry
        while True:
            with self._lock:
                if self._jobs:
                    job = self._jobs.popleft()
                elif self._dirty and saved:
                    job = ("index",)
                else:
                    self._writing = False
                    self._idle.notify_all()
                    return
            try:
                saved = self._run(job)
            except Exception:
                log.exception("disk cache: %s failed", job[0])

    def _run(self, job) -> bool:
        """Do one job; False when the index it saved could not be written."""
        kind = job[0]
        if kind == "index":
            return self._save_index()
        if kind == "delete":
            with self._lock:
                self._dirty = True
            saved = self._save_index()  # first: no index lists a deleted file, if saved
            for seg in job[1]:
                self._unlink(seg.name)
            return saved
        self._write(job[1], job[2])
        return True

    def _write(self, seg: Segment, chunks: list) -> None:
        with self._lock:
            if seg.gone:
                return
        try:
            digest, _ = fmt.write_atomic(self.path, seg.name, chunks, "segment", self.hook)
            if self.hook is not None:
                self.hook("renamed")
        except OSError as exc:
            self._failed(f"{seg.name} not written", exc)
            self._unlink(seg.name)  # renamed already, perhaps: no index will list it
            with self._lock:
                if not seg.gone:
                    self._remove(seg)
            return
        with self._lock:
            seg.digest, seg.written, self._dirty = digest, True, True
            if seg.gone:  # evicted while it was written
                self._jobs.append(("delete", [seg]))

    def _save_index(self) -> bool:
        with self._lock:
            if not self._dirty:
                return True
            self._dirty = False
            entries = [
                {**self._where(s), "stops": list(s.stops), "bytes": s.nbytes}
                | {"sha256": s.digest, "used": s.used}
                for s in sorted(self._segments.values(), key=lambda s: s.id)
                if s.written
            ]
            body = {
                "format": fmt.FORMAT,
                "fingerprint": self.fingerprint,
                "next": self._next,
                "clock": self._clock,
                "segments": entries,
            }
        try:
            data = fmt.encode_index(body)
            halves = [data[: len(data) // 2], data[len(data) // 2 :]]  # the hook's half-way
            fmt.write_atomic(self.path, fmt.INDEX, halves, "index", self.hook)
        except OSError as exc:
            self._failed("index not saved (the previous one stays)", exc)
            with self._lock:
                self._dirty = True
            return False
        return True

    def _failed(self, what: str, exc: OSError) -> None:
        if exc.errno == errno.ENOSPC:
            with self._lock:
                held = sum(s.nbytes for s in self._segments.values() if s.written)
                self.budget = min(self.budget, held)
            log.warning("disk cache: disk full, %s; budget now %d bytes", what, self.budget)
        else:
            log.warning("disk cache: %s: %s", what, exc)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk cache: cannot remove %s: %s", name, exc)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        with self._idle:
            while self._writing:
                self._idle.wait()

    def close(self) -> None:
        """Finish the writes and release the directory."""
        self.flush()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ restoring
    def graft(self, trie, keys: Sequence[int], limit: int) -> tuple[int, int]:
        """Graft onto ``trie`` what the disk spells of ``keys[:limit]`` past the trie's own
        match (module docstring); returns the range ``[from, to)`` grafted (empty: none)."""
        path, have = trie.match(keys[:limit])
        for _ in range(8):  # each retry follows a dropped segment
            with self._lock:
                chain, end = self._match(keys, limit)
                pending = any(not s.written for s, _, _ in chain)
            if end <= have:
                return have, have
            if pending:
                self.flush()
                continue
            data = {}
            for seg, _, to in chain:
                if to > have:
                    data[seg.id] = self._read(seg)
                    if data[seg.id] is None:
                        break
            else:
                with self._lock:
                    self._touch(chain)
                    self._submit(None)
                self._insert(trie, path, have, end, chain, data, keys)
                return have, end
        return have, have

    def _read(self, seg: Segment) -> dict | None:
        """A segment's arrays, after checking the whole file; None when it is unusable. The
        file is mapped, not read: hashing and the arrays' one copy read the pages in place."""
        try:
            with open(os.path.join(self.path, seg.name), "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if seg.nbytes else b""
        except (OSError, ValueError) as exc:
            self.drop(seg, f"unreadable ({exc})")
            return None
        try:
            reason = self._check(seg, buf)
            if reason is None:
                _, tensors = fmt.parse(buf)
                del tensors["keys"]
                return {n: fmt.to_mlx(fmt.tensor(buf, t), t[0]) for n, t in tensors.items()}
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()  # the arrays are copies: MLX owns their memory (BufferError if not)
        self.drop(seg, reason)
        return None

    def _check(self, seg: Segment, buf) -> str | None:
        """Why a segment file's bytes cannot be trusted, or None."""
        if len(buf) != seg.nbytes:
            return f"{len(buf)} bytes, the index says {seg.nbytes} (truncated?)"
        if fmt.file_digest(buf) != seg.digest:
            return "fails its checksum (damaged)"
        try:
            meta, tensors = fmt.parse(buf)
            keys = fmt.tensor(buf, tensors["keys"]).tolist()
        except (fmt.FormatError, KeyError) as exc:
            return str(exc)
        if meta != self._meta(seg) or keys != seg.keys:
            return "its contents do not match the index (another model's file?)"
        return None

    def _insert(self, trie, path, have: int, end: int, chain, data, keys) -> None:
        """Nodes for ``[have, end)`` below the trie's match: cut at the chain's segment
        boundaries and at its stops (where windowed caches get their windows)."""
        node = path[-1]
        if node.end > have:
            node = trie.split(node, have)
        stops: dict[int, Segment] = {}
        cuts = {end}
        for seg, _, to in chain:
            if have < to < end:
                cuts.add(to)
            for p in seg.stops:
                if seg.start <= p <= to and have < p <= end:
                    stops.setdefault(p, seg)
        cuts |= set(stops) if self.windowed else set()
        a = have
        for b in sorted(cuts):
            seg = next(s for s, lo, to in chain if lo <= a and b <= to)
            arrays = data[seg.id]
            snaps = []
            for i, kind in enumerate(self.kinds):
                if kind == "kv":
                    lo, hi = a - seg.start, b - seg.start
                    k, v = arrays[f"c{i}.k"], arrays[f"c{i}.v"]
                    snaps.append(KVSnapshot.of_arrays(a, b, k[..., lo:hi, :], v[..., lo:hi, :]))
                else:
                    snaps.append(self._window(i, kind, a, b, stops, data))
            node = trie.add_child(node, list(keys[a:b]), snaps)
            node.user = b in stops
            a = b

    @staticmethod
    def _window(i: int, kind: str, a: int, b: int, stops: dict, data: dict):
        """Cache ``i``'s snapshot of node ``[a, b)``: the window or state kept at ``b``, or an
        unrestorable placeholder where the disk has none."""
        seg = stops.get(b)
        arrays = data[seg.id] if seg is not None else {}
        k, v = arrays.get(f"c{i}@{b}.k"), arrays.get(f"c{i}@{b}.v")
        if seg is None or (k is None and kind == "state"):
            return WindowSnapshot.empty(a, b)
        if kind == "state":
            return RecurrentSnapshot(a, b, (k, v))
        return WindowSnapshot.of_arrays(a, b, b if k is None else b - k.shape[2], k, v)
