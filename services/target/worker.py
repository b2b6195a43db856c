"""A VerifyWorker in this process: sessions run by VerifierLoop on this worker's scheduler.

The gRPC servicer serves it to remote orchestrators; ``specdec generate`` calls it directly. Each
session's loop runs as its own task and hands StepCommits over through a queue, so the loop never
waits for its consumer (a client stream, the session store) before the next step.

A session opened again while an earlier stream of it still runs here (its orchestrator died or
paused, and the session was resumed) supersedes it: the earlier stream ends with SessionTakenOver
and frees the session first. Only orchestrators open sessions, and ids are unguessable, so the
newest stream of a session is its rightful one.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from specdec.core.sessions import taken_over
from specdec.core.steps import SessionRun, StepCommit, WorkerInfo
from specdec.target.loop import LinkFactory, LoopConfig, VerifierLoop
from specdec.target.scheduler import VerifierScheduler

_END = object()


class LocalVerifier:
    def __init__(self, scheduler: VerifierScheduler, link_factory: LinkFactory, config: LoopConfig = LoopConfig(),
                 drafters: tuple[str, ...] = ()) -> None:
        """``drafters``: the drafters this verifier runs itself (in-verifier drafting), advertised in its status."""
        self.scheduler = scheduler
        self.link_factory = link_factory
        self.config = config
        self.drafters = drafters
        self._streams: dict[str, tuple[asyncio.Task, asyncio.Queue]] = {}  # session id -> its running loop

    async def _supersede(self, session_id: str) -> None:
        """End the earlier stream of this session, if one runs here, and wait until it freed the session."""
        earlier = self._streams.pop(session_id, None)
        if earlier is None:
            return
        task, queue = earlier
        queue.put_nowait(taken_over(session_id))
        task.cancel()
        await asyncio.wait([task], timeout=self.config.close_timeout_s)

    async def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        session_id = run.spec.session_id
        await self._supersede(session_id)
        loop = VerifierLoop(self.scheduler, run, self.link_factory, self.config)
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
        self._streams[session_id] = (task, queue)
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
            if self._streams.get(session_id, (None,))[0] is task:
                del self._streams[session_id]

    async def status(self) -> WorkerInfo:
        info = await self.scheduler.status()
        return dataclasses.replace(info, drafters=self.drafters) if self.drafters else info
