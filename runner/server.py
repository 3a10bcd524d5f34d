"""The runner process: stdin reader thread, preparation thread, completion queue, inference
thread, stdout writer.

Threads and their jobs:
- the main thread is the inference thread: it builds the engine (every MLX call, loading
  included, happens on it), sends `ready`, then admits queued completions in arrival order
  to the scheduler (``runner.batch``) and steps it: one loop, whatever ``--parallel`` is;
- the reader thread reads stdin in bounded chunks, decodes each line and answers control lines
  at once (cancel, status, shutdown), so they never wait behind a long prompt; a completion is
  checked (id, queue room, a prompt whose byte length alone proves it cannot fit) and handed on;
- the preparation thread tokenizes completions (then queues them) and answers tokenize and
  detokenize, in arrival order;
- a signal thread takes SIGTERM/SIGINT (blocked on every thread, so pending until taken) and
  starts the shutdown within a poll interval, even while the inference thread is inside a
  long MLX call (Python runs signal handlers on the main thread only between bytecodes).
Every frame goes through one FrameWriter: one lock, one write and one flush per frame.

A completion rejected before it starts (bad field, duplicate id, full queue, prompt too long)
gets exactly one `error` frame and no `done`. A completion that was accepted (handed to the
preparation thread) gets exactly one `done`, also when it is cancelled before it runs or when
generation fails.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec

import protocol
from protocol import (
    BAD_REQUEST,
    DUPLICATE_ID,
    LINE_TOO_LONG,
    LOAD_ERROR,
    OVERLOADED,
    PROTOCOL_VERSION,
    UNKNOWN_ID,
    Cancel,
    Completion,
    Detokenize,
    Done,
    Error,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    Status,
    StatusFrame,
    TextFrame,
    Tokenize,
    TokensFrame,
)
from protocol.errors import CodedError, error_frame
from runner.faults import Faults

if TYPE_CHECKING:
    from runner.batch import Scheduler, ServedEngine

log = logging.getLogger("mtp_runner.server")

READ_CHUNK = 1 << 16
TOO_LONG = object()  # yielded by split_lines in place of a line over the limit
SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
SIGNAL_POLL_S = 0.01  # how often the signal thread takes pending shutdown signals
STATUS_FIELDS = (
    "cache_entries",
    "cache_bytes",
    "memory_bytes",
    "speculation_depth",
    "speculation",
    "weights_bytes",
    "image_bytes",
    "kv_bytes",
    "disk_segments",
    "disk_bytes",
    "disk_skipped",
)

ProgressFn = Callable[[str, int, int], None]
EngineFactory = Callable[[ProgressFn], Any]


def split_lines(
    read: Callable[[int], bytes], max_line: int, chunk: int = READ_CHUNK
) -> Iterator[bytes | object]:
    """Yield request lines (without b"\\n") from bounded reads; TOO_LONG for an oversized line.

    An oversized line is reported as soon as it passes the limit and the rest of it is read
    and dropped chunk by chunk, so no more than `max_line + chunk` bytes are ever held.
    A last line without a newline still counts as a line.
    """
    pending = bytearray()
    discarding = False
    while data := read(chunk):
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                if not discarding:
                    pending += memoryview(data)[start:]
                    if len(pending) > max_line:
                        yield TOO_LONG
                        pending = bytearray()
                        discarding = True
                break
            if discarding:
                discarding = False
            elif pending:
                pending += memoryview(data)[start:end]
                yield TOO_LONG if len(pending) > max_line else bytes(pending)
                pending = bytearray()
            else:
                yield TOO_LONG if end - start > max_line else data[start:end]
            start = end + 1
    if pending and not discarding:
        yield bytes(pending)


class FrameWriter:
    """Writes whole frames to the host: one lock, one write + flush per frame.

    When the host stops reading (broken pipe) the writer goes quiet and calls `on_closed`
    once, so the server can cancel work nobody will read.
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self.closed = False
        self.on_closed: Callable[[], None] | None = None

    def write(self, frame: protocol.Frame) -> bool:
        with self._lock:  # encoding under the lock too: one shared msgspec encoder
            if self.closed:
                return False
            line = protocol.encode_frame(frame)  # a malformed frame raises to its sender
            try:
                self._out.write(line)
                self._out.flush()
                return True
            except (BrokenPipeError, ValueError, OSError) as exc:
                log.warning("stdout closed (%s); stopping", exc)
                self.closed = True
        if self.on_closed is not None:
            self.on_closed()
        return False


@dataclass(eq=False)
class Job:
    """A completion from the moment it is queued until its done frame is written."""

    request: Completion
    prepared: Any = None  # None while the preparation thread tokenizes it
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    token_frames: int = 0


class Server:
    def __init__(
        self,
        writer: FrameWriter,
        queue_limit: int = 64,
        max_line_bytes: int = protocol.MAX_LINE_BYTES,
        faults: Faults | None = None,
    ) -> None:
        self.writer = writer
        self.queue_limit = queue_limit
        self.max_line_bytes = max_line_bytes
        self.faults = faults or Faults()
        self.engine: ServedEngine | None = None
        # Re-entrant: cancel_all writes while holding it, and a broken pipe found by that write
        # calls cancel_all again on the same thread.
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: collections.deque[Job] = collections.deque()
        # Completions being tokenized, then tokenize/detokenize requests, in arrival order.
        self._preparing: collections.deque[Job | Tokenize | Detokenize] = collections.deque()
        self._jobs: dict[str, Job] = {}  # preparing, queued and running completions by id
        self._active: list[Job] = []  # running completions, oldest first
        self._closing = False  # no more completions: finish the queue and exit
        self._signalled: int | None = None  # the first shutdown signal, once one arrived
        self._signals_blocked = False  # serve(handle_signals=True) took SIGTERM/SIGINT
        self._signal_lock = threading.Lock()  # taken before self._lock, never after
        self.load_failed = False
        writer.on_closed = self.cancel_all

    # ------------------------------------------------------------------ lifecycle
    def serve(
        self,
        load: EngineFactory,
        read: Callable[[int], bytes],
        handle_signals: bool = False,
    ) -> int:
        """Load the engine, send `ready`, serve until end of input; returns the exit status.

        Runs the inference loop on the calling thread, which should be the main thread: MLX
        state built on another thread is torn down by thread-local destructors that abort
        the process if they race with interpreter shutdown. ``handle_signals`` (the process's
        own entry point only) takes SIGTERM/SIGINT for the rest of the process's life: the
        handlers are never restored, so a signal during the exit is ignored, not fatal.
        """
        if handle_signals:
            self._install_signals()
        self._inference_main(load, read)
        if handle_signals:
            # Nothing is left to cancel. Ignored (not handled) signals stay ignored through
            # interpreter finalization, which resets handled ones to the fatal default.
            for signum in SHUTDOWN_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        return 1 if self.load_failed else 0

    def _install_signals(self) -> None:
        # SIGTERM/SIGINT are blocked on this thread before any other thread exists (MLX and
        # BLAS start theirs while loading), so they stay pending on the process until taken
        # with sigtimedwait: never run as handlers, never fatal, whatever any thread is
        # doing. The Python-level handler is a backstop for a thread that unblocks them.
        signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)
        for signum in SHUTDOWN_SIGNALS:
            signal.signal(signum, _ignore_signal)
        self._signals_blocked = True
        threading.Thread(target=self._watch_signals, name="signals", daemon=True).start()

    def _watch_signals(self) -> None:
        while True:
            self.poll_signals()
            time.sleep(SIGNAL_POLL_S)

    def poll_signals(self) -> None:
        """Take and act on the shutdown signals sent so far. The reader calls it before
        accepting a completion too, so a line the host wrote after signalling is refused."""
        if not self._signals_blocked:
            return
        # Taking a signal and acting on it are one step: a reader never sees "no signal"
        # while the signal thread holds one it has not acted on yet.
        with self._signal_lock:
            while (info := signal.sigtimedwait(SHUTDOWN_SIGNALS, 0)) is not None:
                self.on_signal(info.si_signo)

    def on_signal(self, signum: int) -> None:
        """The first SIGTERM/SIGINT shuts down (cancel everything, refuse new completions);
        any later one is logged and ignored."""
        name = _signal_name(signum)
        if self._signalled is not None:
            log.info("received %s during shutdown: ignored", name)
            return
        self._signalled = signum
        log.info("received %s: cancelling everything", name)
        self.cancel_all()

    def cancel_all(self) -> None:
        """Stop taking completions, cancel the queued ones (done frames) and the running one."""
        with self._lock:
            self._closing = True
            dropped = [j for j in self._preparing if isinstance(j, Job)] + list(self._queue)
            self._queue.clear()
            for job in dropped:
                if job.finished:
                    continue
                self._jobs.pop(job.request.id, None)
                job.finished = True
                # Written under the lock so the inference loop cannot exit before they are out.
                self.writer.write(cancelled_done(job.request.id))
            for job in self._active:
                job.cancel.set()
            self._wakeup.notify_all()

    def abort(self, exc: CodedError) -> None:
        """The process cannot go on (``runner.distributed``: a rank was lost), whatever thread
        it is stuck on: one error frame without an id, then every accepted completion ends
        with its error and done frames; nothing more is taken. The caller exits."""
        with self._lock:
            self._closing = True
            self.writer.write(exc.frame(None))
            for job in list(self._jobs.values()):
                if not job.finished:
                    job.finished = True
                    self.writer.write(exc.frame(job.request.id))
                    self.writer.write(Done(job.request.id, "error"))
            self._jobs.clear()
            self._queue.clear()
            self.writer.closed = True  # nothing may follow: the process is ending

    def close_input(self) -> None:
        """End of stdin or `shutdown`: finish what is queued, then let the process exit."""
        with self._lock:
            self._closing = True
            self._wakeup.notify_all()

    # ------------------------------------------------------------------ inference thread
    def _inference_main(self, load: EngineFactory, read: Callable[[int], bytes]) -> None:
        try:
            self.engine = load(self._progress)
        except Exception as exc:  # any load failure is a frame and exit 1, never a traceback
            self.load_failed = True
            log.error("model failed to load: %s", exc)
            log.debug("load failure", exc_info=True)
            code = exc.code if isinstance(exc, CodedError) else LOAD_ERROR
            self.writer.write(Error(None, code, str(exc) or type(exc).__name__))
            return
        with self._lock:
            stopping = self._closing
        if stopping:  # a signal arrived while loading
            return
        info = self.engine.info
        self.writer.write(
            Ready(
                PROTOCOL_VERSION,
                info.model,
                info.context_length,
                info.vocab_size,
                info.mtp,
                info.mtp_detail,
                info.blas,
                info.weights_bytes,
                list(info.draft_sources),
                info.images,
            )
        )
        threading.Thread(target=self._prepare_loop, daemon=True, name="prepare").start()
        reader = threading.Thread(target=self.read_loop, args=(read,), daemon=True, name="reader")
        reader.start()
        from runner.batch import Scheduler  # MLX is imported on this thread, after loading

        self._inference_loop(Scheduler(self.engine))

    def _progress(self, stage: str, done: int, total: int) -> None:
        self.writer.write(Progress(stage, int(done), int(total)))

    def _retire(self, job: Job) -> None:
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            if self._jobs.get(job.request.id) is job:
                del self._jobs[job.request.id]

    def _inference_loop(self, scheduler: Scheduler) -> None:
        """The one inference loop: queued jobs are admitted in arrival order while a cache
        slot is free (``--parallel``; one slot: one completion at a time), and every pass
        advances all the active ones by one step (``runner.batch``)."""
        jobs: dict[int, Job] = {}
        while True:
            with self._lock:
                while not scheduler.active and not self._queue:
                    if self._closing and not any(isinstance(j, Job) for j in self._preparing):
                        return
                    self._wakeup.wait()
                admitted, room = [], scheduler.room
                while len(admitted) < room and self._queue:
                    job = self._queue.popleft()
                    self._active.append(job)
                    admitted.append(job)
            for job in admitted:
                try:
                    emit = lambda frame, job=job: self._emit(job, frame)  # noqa: E731
                    stream = scheduler.admit(job.prepared, emit, job.cancel.is_set)
                    jobs[id(stream)] = job
                except Exception as exc:
                    self._failed(job, exc)
            try:
                ended = scheduler.step()
            except Exception as exc:  # a bug outside the streams' own guards: end them all
                log.error("scheduler step failed: %s", exc, exc_info=True)
                ended = scheduler.fail_all(exc)
            for stream in ended:
                job = jobs.pop(id(stream))
                if not job.finished:
                    self._failed(job, RuntimeError("the engine returned without a done frame"))
                self._retire(job)

    def _failed(self, job: Job, exc: Exception) -> None:
        """A completion that failed outside the engine's own handling: error, then done."""
        log.error("completion %s failed: %s", job.request.id, exc, exc_info=True)
        if not job.finished:
            self._emit(job, error_frame(job.request.id, exc))
            self._emit(job, Done(job.request.id, "error"))
        self._retire(job)

    def _emit(self, job: Job, frame: protocol.Frame) -> None:
        if job.finished:
            log.warning("dropping a %s frame sent after done", type(frame).__name__)
            return
        if isinstance(frame, Done):
            # Forget the id (and stop reporting it as active) before the host can see the
            # done, so it may reuse the id at once and a status never names a finished job.
            with self._lock:
                job.finished = True
                if self._jobs.get(job.request.id) is job:
                    del self._jobs[job.request.id]
                if job in self._active:
                    self._active.remove(job)
                # A cancel the reader took for this job (under this lock) after the engine's
                # last check: the documented answer to a running job's cancel is a cancelled
                # done, never silence; one taken after this point gets unknown_id.
                if job.cancel.is_set() and frame.done_reason not in ("cancelled", "error"):
                    frame = msgspec.structs.replace(frame, done_reason="cancelled")
        elif isinstance(frame, protocol.Token):
            job.token_frames += 1
            self.faults.on_token_frame(job.request.id, job.token_frames)
        self.writer.write(frame)

    # ------------------------------------------------------------------ reader thread
    def read_loop(self, read: Callable[[int], bytes]) -> None:
        try:
            for line in split_lines(read, self.max_line_bytes):
                if line is TOO_LONG:
                    self.writer.write(
                        Error(
                            None,
                            LINE_TOO_LONG,
                            f"request line longer than {self.max_line_bytes} bytes; discarded",
                        )
                    )
                elif not self._handle_line_safely(line):
                    break
        except OSError as exc:
            log.warning("stdin failed: %s", exc)
        finally:
            self.close_input()

    def _handle_line_safely(self, line: bytes) -> bool:
        try:
            return self.handle_line(line)
        except Exception as exc:  # a bug answering one line must not stop the reader
            log.error("failed to answer a request line: %s", exc, exc_info=True)
            self.writer.write(error_frame(None, exc))
            return True

    def handle_line(self, line: bytes) -> bool:
        """Answer one request line; False after `shutdown` (stop reading)."""
        try:
            request = protocol.decode_request(line)
        except ProtocolError as exc:
            self.writer.write(exc.frame())
            return True
        if self.engine is None:  # the inference thread has finished: nothing more is served
            if not isinstance(request, Shutdown):
                self.writer.write(Error(request.id, OVERLOADED, "the runner is shutting down"))
            return False
        if isinstance(request, Completion):
            self._submit(request)
        elif isinstance(request, Cancel):
            self._cancel(request.id)
        elif isinstance(request, Shutdown):
            return False
        elif isinstance(request, Status):
            self._answer(request)
        else:  # tokenize, detokenize: behind the completions read before them
            with self._lock:
                self._preparing.append(request)
                self._wakeup.notify_all()
        return True

    def _submit(self, request: Completion) -> None:
        """Check what can be checked without tokenizing, then hand the completion on."""
        request_id = request.id
        self.poll_signals()
        with self._lock:
            refusal = None
            waiting = len(self._queue) + sum(isinstance(j, Job) for j in self._preparing)
            if request_id in self._jobs:
                refusal = (DUPLICATE_ID, f"a completion with id {request_id!r} is in progress")
            elif self._closing or self._signalled is not None:
                refusal = (OVERLOADED, "the runner is shutting down")
            elif waiting >= self.queue_limit:
                refusal = (OVERLOADED, f"queue full ({self.queue_limit} completions waiting)")
        if refusal:
            self.writer.write(Error(request_id, *refusal))
            return
        try:
            self.engine.precheck(request)
        except Exception as exc:
            self.writer.write(error_frame(request_id, exc))
            return
        with self._lock:
            # Only this thread adds jobs, so the checks above still hold, except closing.
            if self._closing:
                refusal = (OVERLOADED, "the runner is shutting down")
            else:
                job = Job(request)
                self._jobs[request_id] = job
                self._preparing.append(job)
                self._wakeup.notify_all()
        if refusal:
            self.writer.write(Error(request_id, *refusal))

    # ------------------------------------------------------------------ preparation thread
    def _prepare_loop(self) -> None:
        while True:
            with self._lock:
                while not self._preparing:
                    self._wakeup.wait()
                item = self._preparing[0]
            try:
                if isinstance(item, Job):
                    self._prepare(item)
                else:
                    self._answer(item)
            except Exception as exc:  # a bug here must not stop the thread
                log.error("preparation failed: %s", exc, exc_info=True)
                if isinstance(item, Job):
                    self._fail_accepted(item, exc)
            finally:
                with self._lock:
                    self._preparing.popleft()
                    self._wakeup.notify_all()

    def _fail_accepted(self, job: Job, exc: Exception) -> None:
        """An accepted completion that cannot be queued still gets its error and one done."""
        with self._lock:
            if job.finished:
                return
            job.finished = True
            if self._jobs.get(job.request.id) is job:
                del self._jobs[job.request.id]
            self.writer.write(error_frame(job.request.id, exc))
            self.writer.write(Done(job.request.id, "error"))

    def _prepare(self, job: Job) -> None:
        """Tokenize one accepted completion and queue it; a refusal is its one error frame.
        Held in ``_preparing`` meanwhile, so a cancel or shutdown finds it."""
        request_id = job.request.id
        try:
            prepared, failure = self.engine.prepare(job.request), None
        except Exception as exc:
            prepared, failure = None, exc
        with self._lock:
            if job.finished:  # cancelled while it was being tokenized: its done is out
                return
            if failure is None:
                job.prepared = prepared
                self._queue.append(job)
                return
            if self._jobs.get(request_id) is job:
                del self._jobs[request_id]
            job.finished = True
            self.writer.write(error_frame(request_id, failure))

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            queued = job is not None and job not in self._active
            if job is None:
                pass
            elif queued:
                if job in self._queue:
                    self._queue.remove(job)
                # A job still being tokenized stays in _preparing; finished makes it drop.
                del self._jobs[request_id]
                job.finished = True
            else:
                job.cancel.set()  # the engine checks before each prefill chunk and decode step
        if job is None:
            self.writer.write(
                Error(request_id, UNKNOWN_ID, f"no queued or running completion {request_id!r}")
            )
        elif queued:
            self.writer.write(cancelled_done(request_id))

    def _answer(self, request: Tokenize | Detokenize | Status) -> None:
        """status (reader thread), tokenize/detokenize (preparation thread): answered
        concurrently with a running completion."""
        try:
            if isinstance(request, Tokenize):
                frame = TokensFrame(request.id, list(self.engine.tokenize_request(request)))
            elif isinstance(request, Detokenize):
                frame = self._detokenize(request)
            else:
                frame = self._status(request)
        except CodedError as exc:  # a refusal (bad_request, ...): its frame, no traceback
            frame = error_frame(request.id, exc)
        except Exception as exc:
            log.error("%s %s failed: %s", type(request).__name__, request.id, exc, exc_info=True)
            frame = error_frame(request.id, exc)
        self.writer.write(frame)

    def _detokenize(self, request: Detokenize) -> protocol.Frame:
        vocab = self.engine.info.vocab_size
        for index, token in enumerate(request.tokens):
            if token >= vocab:
                return Error(
                    request.id,
                    BAD_REQUEST,
                    f"tokens[{index}]: id {token} is outside the vocabulary (0..{vocab - 1})",
                )
        return TextFrame(request.id, self.engine.detokenize(list(request.tokens)))

    def _status(self, request: Status) -> StatusFrame:
        state = self.engine.status()
        with self._lock:
            queue_length = len(self._queue) + sum(
                isinstance(j, Job) and not j.finished for j in self._preparing
            )
            active = [job.request.id for job in self._active]
        values = {name: state[name] for name in STATUS_FIELDS if name in state}
        first = active[0] if active else None
        return StatusFrame(request.id, queue_length, first, **values, active_ids=active)


def _ignore_signal(_signum: int, _frame: object) -> None:
    """The Python-level handler: the signal thread has already acted on the signal."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def cancelled_done(request_id: str) -> Done:
    """The done frame of a completion cancelled while it was still queued: nothing ran."""
    return Done(request_id, "cancelled")
