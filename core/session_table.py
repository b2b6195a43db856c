"""A worker's open sessions, with idle expiry so a vanished orchestrator cannot leak them, and the
allocator's free pages handed back once sessions close (`FreedMemory`)."""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.core.errors import Overloaded, SessionAlreadyOpen, SessionNotFound
from specdec.core.sessions import check_session_id, short_id

T = TypeVar("T")
log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class FreedMemory:
    """Returns the C allocator's free pages to the operating system after sessions close.

    glibc's malloc keeps what a closed session freed (activations and logits of its forwards, gRPC
    and protobuf buffers) in its arenas, one per thread that allocates, and gives back only what
    sits at the top of the main heap, so a worker's resident memory drifts with its arenas' free,
    fragmented pages. ``malloc_trim(0)`` hands back every free page of every arena, and takes
    milliseconds (what it gave back and cost under benchmarks/soak.py: docs/performance.md,
    section 8). So it runs on a thread of its own, ``delay_s`` after a close (what the close frees,
    its stream's buffers included, goes first), when the worker has no session left or
    ``interval_s`` has passed since the last trim, never on a request's path.
    """

    def __init__(self, delay_s: float = 1.0, interval_s: float = 60.0, trim: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._delay, self._interval, self._clock = delay_s, interval_s, clock
        self._last = clock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.trims = 0  # how many ran (tests)

    def after_close(self, sessions_left: int) -> None:
        """A session closed and ``sessions_left`` remain: trim soon if the worker is idle or a trim is due."""
        if self._trim is None or (sessions_left and self._clock() - self._last < self._interval):
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="malloc-trim", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self._delay)
            self._wake.clear()  # closes during the delay are covered by this trim
            try:
                self._trim()
            except Exception:  # memory left in the arenas is no reason to stop the worker
                log.exception("malloc_trim failed")
            self._last = self._clock()
            self.trims += 1


class SessionTable(Generic[T]):
    """Session id -> per-session state. Not thread-safe: callers hold their engine's lock or stay on one thread."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 freed: FreedMemory | None = None) -> None:
        """``freed``: told of every session that leaves the table (closed or expired)."""
        self._max = max_sessions
        self._idle = idle_timeout_s
        self._clock = clock
        self._items: dict[str, tuple[T, float]] = {}
        self._freed = freed

    def __len__(self) -> int:
        return len(self._items)

    def add(self, session_id: str, state: T) -> None:
        self.check_can_add(session_id)
        self._items[session_id] = (state, self._clock())

    def check_can_add(self, session_id: str, adding: int = 0) -> None:
        """Raise what `add` would, with ``adding`` more sessions about to be added first (a batch's earlier opens)."""
        check_session_id(session_id)
        self.reap_idle()
        if session_id in self._items:
            raise SessionAlreadyOpen(f"session {short_id(session_id)} is already open on this worker")
        if len(self._items) + adding >= self._max:
            raise Overloaded(f"this worker holds its maximum of {self._max} sessions; retry later or on another replica")

    def get(self, session_id: str) -> T:
        """The session's state, marked as used now. An expired session is gone even if not yet reaped."""
        now = self._clock()
        item = self._items.get(session_id)
        if item is not None and now - item[1] > self._idle:
            del self._items[session_id]
            self._left()
            item = None
        if item is None:
            raise SessionNotFound(f"session {short_id(session_id)} is not open on this worker (never opened, closed, or expired after {self._idle:g}s idle)")
        self._items[session_id] = (item[0], now)
        return item[0]

    def peek(self, session_id: str) -> T | None:
        """The session's state without marking it used, or None."""
        item = self._items.get(session_id)
        return None if item is None else item[0]

    def values(self) -> list[T]:
        return [state for state, _ in self._items.values()]

    def ids(self) -> list[str]:
        return list(self._items)

    def pop(self, session_id: str) -> T | None:
        item = self._items.pop(session_id, None)
        if item is None:
            return None
        self._left()
        return item[0]

    def reap_idle(self) -> list[str]:
        """Drop sessions idle longer than the timeout; returns their ids."""
        now = self._clock()
        stale = [sid for sid, (_, used) in self._items.items() if now - used > self._idle]
        for sid in stale:
            del self._items[sid]
        if stale:
            self._left()
        return stale

    def _left(self) -> None:
        if self._freed is not None:
            self._freed.after_close(len(self._items))
