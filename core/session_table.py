"""A worker's open sessions, with idle expiry so a vanished orchestrator cannot leak them."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.core.errors import Overloaded, SessionAlreadyOpen, SessionNotFound
from specdec.core.sessions import check_session_id, short_id

T = TypeVar("T")


class SessionTable(Generic[T]):
    """Session id -> per-session state. Not thread-safe: callers hold their engine's lock or stay on one thread."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_sessions
        self._idle = idle_timeout_s
        self._clock = clock
        self._items: dict[str, tuple[T, float]] = {}

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
        return None if item is None else item[0]

    def reap_idle(self) -> list[str]:
        """Drop sessions idle longer than the timeout; returns their ids."""
        now = self._clock()
        stale = [sid for sid, (_, used) in self._items.items() if now - used > self._idle]
        for sid in stale:
            del self._items[sid]
        return stale
