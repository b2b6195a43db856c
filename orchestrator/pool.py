"""A pool of verifier replicas: each session runs on the least-loaded one, and moves on failure.

A session is placed on the replica with the fewest open sessions (their WorkerStatus, refreshed
at most every ``status_ttl_s``) and kept there. When that replica becomes unreachable or stops
answering mid-stream, the session resumes on another replica from what it has committed: the
prompt plus every committed token becomes the new replica's prompt, with the tokens still to
generate as its budget. Every position keeps its place in the sequence, so greedy output, and
sampled output under the coupled rule (noise keyed by seed and position), continue exactly as
an uninterrupted run; the client sees only a pause. (Under the rejection rule the resumed session
draws the same per-position numbers but may speculate on another schedule: its tokens keep the
target's distribution, not necessarily the very same tokens.)
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from specdec.core.errors import WorkerUnavailable
from specdec.core.sessions import short_id
from specdec.core.steps import SessionRun, StepCommit, VerifyWorker, WorkerInfo

log = logging.getLogger(__name__)


class VerifierPool:
    """The VerifyWorker protocol over many replicas."""

    def __init__(self, replicas: Sequence[VerifyWorker], status_ttl_s: float = 1.0) -> None:
        if not replicas:
            raise ValueError("a verifier pool needs at least one replica")
        self.replicas = list(replicas)
        self._ttl = status_ttl_s
        self._load: dict[int, float] = {}  # replica index -> open sessions (inf: unreachable)
        self._checked_at = float("-inf")
        self._placed: dict[int, int] = {}  # sessions this orchestrator placed and still runs, per replica
        self.failovers = 0

    async def status(self) -> WorkerInfo:
        """The first replica that answers (they serve one model)."""
        last: Exception | None = None
        for replica in self.replicas:
            try:
                return await replica.status()
            except WorkerUnavailable as exc:
                last = exc
        raise WorkerUnavailable(f"no verifier of the pool answers: {last}")

    async def _refresh(self) -> None:
        if time.monotonic() - self._checked_at < self._ttl:
            return
        self._checked_at = time.monotonic()

        async def load(i: int) -> float:
            try:
                return float((await asyncio.wait_for(self.replicas[i].status(), 2.0)).active_sessions)
            except (WorkerUnavailable, asyncio.TimeoutError):
                return float("inf")

        loads = await asyncio.gather(*(load(i) for i in range(len(self.replicas))))
        self._load = dict(enumerate(loads))

    async def _pick(self, avoid: set[int]) -> int:
        if len(self.replicas) == 1:
            return 0
        await self._refresh()
        candidates = [i for i in range(len(self.replicas)) if i not in avoid] or list(range(len(self.replicas)))
        # Open sessions as last reported, plus those placed since: fresh placements spread out too.
        return min(candidates, key=lambda i: (self._load.get(i, 0.0) + self._placed.get(i, 0), i))

    async def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        committed: list[int] = []  # what the session has committed so far, over every replica
        failed: set[int] = set()
        current = run
        while True:
            index = await self._pick(failed)
            self._placed[index] = self._placed.get(index, 0) + 1
            steps = self.replicas[index].run(current)
            try:
                async for step in steps:
                    committed.extend(step.token_ids)
                    yield step
                return
            except WorkerUnavailable as exc:
                failed.add(index)
                self._load[index] = float("inf")
                if len(failed) >= len(self.replicas):
                    raise
                remaining = run.max_new_tokens - len(committed)
                if remaining <= 0:
                    return
                self.failovers += 1
                log.warning("session %s: verifier %d failed (%s); resuming on another replica after %d tokens",
                            short_id(run.spec.session_id), index, exc, len(committed))
                spec = replace(run.spec, prompt_ids=tuple(run.spec.prompt_ids) + tuple(committed))
                current = replace(run, spec=spec, max_new_tokens=remaining)
            finally:
                self._placed[index] -= 1
                await steps.aclose()

    async def aclose(self) -> None:
        for replica in self.replicas:
            close = getattr(replica, "aclose", None)
            if close is not None:
                await close()
