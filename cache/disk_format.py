"""What the prefix cache's disk tier (``cache.disk``) puts in files, and how it writes them.

- **Segments** are safetensors files: tensors (raw little-endian arrays, bfloat16 as its bits)
  and one metadata entry, ``segment``, a JSON object naming the segment. ``encode`` lays one
  out, ``parse`` reads the header of one held in memory.
- **The index** (``index.json``) lists the segments with their sizes and SHA-256 digests and
  carries a digest of itself, so a damaged index is seen as damaged, not misread.
- **Atomic writes** (``write_atomic``): a temporary file in the same directory, written,
  flushed and fsynced, then renamed over the final name and the directory fsynced. A process
  killed at any point leaves either the old file or the new one, plus at worst a temporary
  file that the next start removes; nothing half-written ever carries a final name.
- **Fingerprints**: cheap digests of what decides the cached bits (``files_print`` for
  checkpoint files, ``arrays_print`` for loaded weights, ``sources_print`` for code).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np

FORMAT = 1  # bump when the files' meaning changes: older directories then miss, never misread
INDEX = "index.json"
LOCK = "lock"
TMP_PREFIX = ".tmp-"

# A write hook hears each stage of a write ("segment": half the data is out, "renamed": the
# segment has its final name and the index does not list it yet, "index": half the index is
# out); a test seam (``fault_hook``), None in service.
Hook = Callable[[str], None] | None

_TO_ST = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
}
_FROM_ST = {name: dtype for dtype, name in _TO_ST.items()} | {"BF16": np.dtype(np.uint16)}


class FormatError(ValueError):
    """A file that is not what the disk tier wrote (damaged, truncated or foreign)."""


# ---------------------------------------------------------------------------- arrays
def to_numpy(array: mx.array) -> tuple[np.ndarray, str]:
    """A host copy of ``array`` and its safetensors dtype (bfloat16 travels as its bits)."""
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)), "BF16"
    host = np.array(array)
    return host, _TO_ST[host.dtype]


def to_mlx(host: np.ndarray, st_dtype: str) -> mx.array:
    array = mx.array(host)
    return array.view(mx.bfloat16) if st_dtype == "BF16" else array


# ---------------------------------------------------------------------------- segments
def encode(tensors: dict[str, tuple[np.ndarray, str]], meta: dict) -> tuple[bytes, list]:
    """The safetensors header for ``tensors`` (name -> (host array, dtype)) with ``meta`` as
    its ``segment`` metadata, and the arrays' bytes in file order."""
    header: dict = {"__metadata__": {"segment": json.dumps(meta, sort_keys=True)}}
    chunks, at = [], 0
    for name in sorted(tensors):
        host, st_dtype = tensors[name]
        data = memoryview(np.ascontiguousarray(host)).cast("B")
        header[name] = {
            "dtype": st_dtype,
            "shape": list(host.shape),
            "data_offsets": [at, at + data.nbytes],
        }
        chunks.append(data)
        at += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return len(text).to_bytes(8, "little") + text, chunks


def encoded_size(head: bytes, chunks: Sequence[memoryview]) -> int:
    return len(head) + sum(c.nbytes for c in chunks)


def parse(buf: bytes | memoryview) -> tuple[dict, dict[str, tuple[str, list, int, int]]]:
    """The ``segment`` metadata and the tensors (name -> dtype, shape, begin, end: absolute
    offsets in ``buf``) of a whole segment file's bytes; ``FormatError`` when it is not one."""
    size = int.from_bytes(bytes(buf[:8]), "little")
    if len(buf) < 8 or not 0 < size <= len(buf) - 8:
        raise FormatError("the header runs past the end of the file")
    meta, tensors = _parse_head(bytes(buf[: 8 + size]))
    for name, (st_dtype, _, begin, end) in tensors.items():
        if st_dtype not in _FROM_ST or not 8 + size <= begin <= end <= len(buf):
            raise FormatError(f"tensor {name} is out of bounds or of an unknown dtype")
    return meta, tensors


def tensor(buf, spec: tuple[str, list, int, int]) -> np.ndarray:
    """One tensor of ``parse``'s answer as a host array over ``buf`` (no copy)."""
    st_dtype, shape, begin, end = spec
    dtype = _FROM_ST[st_dtype]
    count = (end - begin) // dtype.itemsize
    if count != int(np.prod(shape, dtype=np.int64)):
        raise FormatError("tensor size does not match its shape")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)


def read_head(path: str) -> tuple[dict, dict, bytes]:
    """The metadata, the tensor table and the ``keys`` tensor's bytes of a segment file,
    reading only its header and keys (at start: checked in full when first restored)."""
    with open(path, "rb") as f:
        first = f.read(8)
        size = int.from_bytes(first, "little") if len(first) == 8 else -1
        if not 0 < size < 1 << 26:
            raise FormatError("no safetensors header")
        header = first + f.read(size)
        meta, tensors = _parse_head(header)
        spec = tensors.get("keys")
        if spec is None:
            raise FormatError("no keys tensor")
        f.seek(spec[2])
        keys = f.read(spec[3] - spec[2])
    return meta, tensors, keys


def _parse_head(header: bytes) -> tuple[dict, dict]:
    """``parse`` on a header alone (offsets are checked against the file size elsewhere)."""
    size = int.from_bytes(header[:8], "little")
    try:
        raw = json.loads(header[8 : 8 + size])
        meta = json.loads(raw.pop("__metadata__")["segment"])
        tensors = {
            name: (
                spec["dtype"],
                [int(d) for d in spec["shape"]],
                *(8 + size + int(o) for o in spec["data_offsets"]),
            )
            for name, spec in raw.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"not a segment file ({exc})") from None
    return meta, tensors


# ---------------------------------------------------------------------------- writing
def other_caches(root: str, fingerprint: str) -> int:
    """How many caches of other fingerprints (models, settings, formats) ``root`` holds."""
    names = [n for n in os.listdir(root) if n != fingerprint]
    return sum(os.path.isfile(os.path.join(root, n, INDEX)) for n in names)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    directory: str, name: str, chunks: Iterable, stage: str, hook: Hook = None
) -> tuple[str, int]:
    """Write ``chunks`` to ``directory/name`` atomically (module docstring); return the
    SHA-256 hex digest and size of what was written. On any error the temporary file is
    removed and the error raised; the final name is untouched."""
    chunks = list(chunks)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{name}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "xb") as f:
            for i, chunk in enumerate(chunks):
                if hook is not None and i == (len(chunks) + 1) // 2:
                    f.flush()
                    hook(stage)  # half the bytes are out
                digest.update(chunk)
                f.write(chunk)
                size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
    return digest.hexdigest(), size


def file_digest(buf) -> str:
    return hashlib.sha256(buf).hexdigest()


# ---------------------------------------------------------------------------- the index
def encode_index(body: dict) -> bytes:
    """``body`` as the index file: itself plus a digest of its canonical JSON."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "sha256": file_digest(text.encode())}).encode() + b"\n"


def decode_index(data: bytes) -> dict:
    """The body of an index file; ``FormatError`` when it is damaged."""
    try:
        outer = json.loads(data)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"unreadable index ({exc})") from None
    if file_digest(text.encode()) != outer.get("sha256"):
        raise FormatError("the index fails its checksum")
    return body


# ---------------------------------------------------------------------------- the lock
class DirectoryBusy(RuntimeError):
    """Another live process holds the cache directory."""


def lock_directory(directory: str, wait_s: float) -> int:
    """An exclusive ``flock`` on ``directory/lock`` (released by the kernel when the process
    dies, SIGKILL included), waiting up to ``wait_s`` for a runner that is exiting; returns
    the descriptor to keep open. ``DirectoryBusy`` names the holder's pid."""
    path = os.path.join(directory, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise DirectoryBusy(
                    f"prefix cache directory {directory} is in use by another runner of this "
                    f"model (pid {holder}); give each runner its own --cache-dir"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# ---------------------------------------------------------------------------- fingerprints
SAMPLES = 16  # blocks read from each weight file
BLOCK = 64 * 1024


def files_print(paths: Iterable[str]) -> list:
    """Each file's name, size, header and a few evenly spread blocks of its contents: a
    changed, converted or fine-tuned checkpoint differs in at least one of them, for a read
    of about a megabyte per file whatever its size."""
    out = []
    for path in sorted(paths):
        size = os.path.getsize(path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            head = f.read(8)
            digest.update(head)
            if path.endswith(".safetensors") and len(head) == 8:
                digest.update(f.read(min(int.from_bytes(head, "little"), size)))
            step = max(size // SAMPLES, 1)
            for at in range(0, size, step):
                f.seek(at)
                digest.update(f.read(BLOCK))
            f.seek(max(size - BLOCK, 0))
            digest.update(f.read(BLOCK))
        out.append([os.path.basename(path), size, digest.hexdigest()])
    return out


def arrays_print(named: Iterable[tuple[str, mx.array]], count: int = 256) -> str:
    """A digest of each array's name, shape, dtype and its first, middle and last ``count``
    values, as held after loading and laying out (quantization, packing)."""
    digest = hashlib.sha256()
    for name, array in named:
        if not isinstance(array, mx.array):
            continue
        digest.update(f"{name}:{array.shape}:{array.dtype}".encode())
        flat = array.reshape(-1)
        n, mid = flat.size, flat.size // 2
        for lo in sorted({0, max(mid - count // 2, 0), max(n - count, 0)}):
            digest.update(np.array(flat[lo : lo + count].view(mx.uint8)).tobytes())
    return digest.hexdigest()


def sources_print(roots: Iterable[str], suffixes: tuple[str, ...] = (".py", ".so")) -> str:
    """A digest of the code under ``roots`` (Python sources whole, built extensions by
    ``files_print``): a change to the code that computes the cached arrays invalidates them."""
    digest = hashlib.sha256()
    for root in roots:
        found = []
        for base, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__", "build")))
            found += [os.path.join(base, f) for f in files if f.endswith(suffixes)]
        for path in sorted(found):
            digest.update(os.path.relpath(path, root).encode())
            if path.endswith(".py"):
                with open(path, "rb") as f:
                    digest.update(f.read())
            else:
                digest.update(json.dumps(files_print([path])).encode())
    return digest.hexdigest()


def fingerprint(parts: dict) -> str:
    """The directory name for a cache whose bits are decided by ``parts`` (JSON-able)."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------- test seam
def fault_hook(spec: str | None) -> Hook:
    """A write hook from ``ACTION:STAGE`` (``kill`` the process with SIGKILL, or behave as a
    ``full`` disk, at the stage ``Hook`` names), for the fault tests through a
    real runner; None for None."""
    if not spec:
        return None
    action, _, stage = spec.partition(":")
    if action not in ("kill", "full") or stage not in ("segment", "renamed", "index"):
        raise ValueError(f"{spec!r}: expected kill|full:segment|renamed|index")

    def hook(at: str) -> None:
        if at != stage:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return hook
