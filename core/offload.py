"""Run a synchronous engine from asyncio code: on one dedicated thread, on a thread shared with
another engine, or inline.

Model work holds the GIL only briefly (torch releases it in kernels), so a worker thread keeps the
event loop free for health checks, cancellations and other sessions' messages. One thread per
engine serialises model calls, which is what a single set of weights on 2 cores wants anyway; in
one process the verifier and the drafter share one (``executor``: the draft engine's thread).
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

R = TypeVar("R")


class Submits(Protocol):
    """What an Offload runs calls on: an Executor, or the draft engine's thread."""

    def submit(self, fn: Callable[..., R], /, *args) -> Future: ...


class Offload:
    def __init__(self, name: str, threaded: bool = True, executor: Submits | None = None) -> None:
        """``executor``: run calls there (anything with an Executor's ``submit``) instead of on a thread of our own."""
        self._pool = executor or (ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if threaded else None)
        self._owned = executor is None
        self.pending = 0  # calls submitted and not finished (the one running included): the queue depth

    async def __call__(self, fn: Callable[..., R], *args) -> R:
        if self._pool is None:
            return fn(*args)
        self.pending += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(functools.partial(fn, *args)))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        if self._pool is not None and self._owned:
            self._pool.shutdown(wait=False, cancel_futures=True)
