"""Admission: at most N requests run at once; the next ones wait in a bounded FIFO line.

A request over the running limit waits its turn instead of failing; only a full line answers
RESOURCE_EXHAUSTED, saying how deep the line is. A request whose client goes away (cancellation,
a passed deadline) while waiting leaves the line at once and takes no one's turn.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from specdec.core.errors import Overloaded


class AdmissionQueue:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running must be >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}")
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = 0
        self._line: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._line if not f.done())

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the block's duration, waiting in line for it if need be."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise Overloaded(f"{self.running} requests running and {self.waiting} waiting, the most this server queues; "
                             "retry later or on another replica")
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        try:
            await turn  # _release hands its slot over: running already counts us
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the slot came just as we were cancelled: pass it on
                self._release()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._line.remove(turn)

    def _release(self) -> None:
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes straight to the next in line
                return
        self.running -= 1
