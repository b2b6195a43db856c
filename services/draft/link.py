"""A DraftLink to a DraftEngine in this process (``specdec generate``): the same engine, thread and
scheduling as a draft worker, without the gRPC stream in between."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from specdec.core.errors import SpecdecError
from specdec.core.overlap import BlockInbox
from specdec.core.steps import DraftBlock, SessionSpec, StepOutcome
from specdec.draft.engine import DraftEngine

log = logging.getLogger(__name__)


class LocalDraftLink:
    in_process = True  # drafts on the engine's thread, which an in-verifier or one-process verifier shares

    def __init__(self, engine: DraftEngine) -> None:
        self._engine = engine
        self._inbox = BlockInbox()
        self._session_id: str | None = None
        self._opened = False

    async def open(self, spec: SessionSpec) -> None:
        loop = asyncio.get_running_loop()
        emit = lambda block: loop.call_soon_threadsafe(self._inbox.add, block)  # noqa: E731 (runs on the draft thread)
        opened = self._engine.open(spec, emit)
        self._session_id = spec.session_id  # from here on, close() frees it, even mid-prefill
        await asyncio.wrap_future(opened)
        self._opened = True

    def send(self, outcome: StepOutcome) -> None:
        if not self.up:
            return
        try:
            self._engine.outcome(self._session_id, outcome)
        except SpecdecError as exc:
            log.warning("drafter refused an outcome; decoding without it: %s", exc)
            self._inbox.fail(exc)

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        return await self._inbox.next_block(committed, timeout_s)

    @property
    def up(self) -> bool:
        return self._opened and self._session_id is not None and self._inbox.failed is None

    async def close(self) -> None:
        if self._session_id is not None:
            self._engine.close(self._session_id)
            self._session_id = None
