"""Run a synchronous engine from asyncio code: on one dedicated thread, or inline.

Model work holds the GIL only briefly (torch releases it in kernels), so a worker thread keeps the
event loop free for health checks, cancellations and other sessions' messages. One thread per
engine serialises model calls, which is what a single set of weights on 2 cores wants anyway.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

R = TypeVar("R")


class Offload:
    def __init__(self, name: str, threaded: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if threaded else None
        self.pending = 0  # calls submitted and not finished (the one running included): the queue depth

    async def __call__(self, fn: Callable[..., R], *args) -> R:
        if self._pool is None:
            return fn(*args)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
