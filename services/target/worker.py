"""A VerifyWorker in this process: sessions run by VerifierLoop on this worker's engine.

The gRPC servicer serves it to remote orchestrators; ``specdec generate`` calls it directly. Each
session's loop runs as its own task and hands StepCommits over through a queue, so the loop never
waits for its consumer (a client stream, the session store) before the next step.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from specdec.core.steps import SessionRun, StepCommit, WorkerInfo
from specdec.target.engine import AsyncVerifierEngine
from specdec.target.loop import LinkFactory, LoopConfig, VerifierLoop

_END = object()


class LocalVerifier:
    def __init__(self, engine: AsyncVerifierEngine, link_factory: LinkFactory, config: LoopConfig = LoopConfig()) -> None:
        self.engine = engine
        self.link_factory = link_factory
        self.config = config

    async def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        loop = VerifierLoop(self.engine, run, self.link_factory, self.engine.engine.loaded.context_length, self.config)
        queue: asyncio.Queue = asyncio.Queue()

        async def produce() -> None:
            try:
                async for commit in loop.steps():
                    queue.put_nowait(commit)
                queue.put_nowait(_END)
            except BaseException as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise

        task = asyncio.ensure_future(produce())
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # the loop frees its sessions as it stops

    async def status(self) -> WorkerInfo:
        return await self.engine.status()
