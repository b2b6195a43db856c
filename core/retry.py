"""Trying a call again while what it talks to is briefly away (a Redis restart or failover)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.05, 0.5  # pauses double from the first up to the longest


async def retry_for(call: Callable[[], Awaitable[T]], budget_s: float,
                    retry_on: type[BaseException] | tuple[type[BaseException], ...]) -> T:
    """``call()``, tried again while it raises ``retry_on``, for up to ``budget_s`` seconds; the
    last error is raised once the next pause would end past the budget."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + budget_s, FIRST_PAUSE_S
    while True:
        try:
            return await call()
        except retry_on:
            if loop.time() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(LONGEST_PAUSE_S, pause * 2)
