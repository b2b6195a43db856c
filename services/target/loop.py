"""A session's stream at the verifier: { take the block for the committed sequence -> hand the step
to the scheduler -> tell the drafter the outcome and the next k the scheduler chose } until the
session ends. The scheduler (services/target/scheduler.py) batches the steps and decides every k.

It runs where the target runs so that a step puts one hop on the critical path: the drafter
streams blocks in, this loop streams StepCommits out, and the orchestrator stores and forwards
them off the draft-verify path. The outcome of a step goes to the drafter before anything else, so
the drafter's next block (or its pre-drafted one) is being made while this side reports. Fail soft:
if the drafter is unreachable, refuses, or sends a bad block, the session goes on as plain decoding
and a new link is tried every ``reconnect_s``, to the next drafter of the session's pool
(``SessionRun.fallback_drafters``) when it has one; a slow drafter costs at most ``draft_wait_s`` per
step, then its steps stop waiting for a while (doubling each time it is late again).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdec.core.errors import InvalidRequest, SpecdecError
from specdec.core.features import needs_features, needs_row_tokens
from specdec.core.sampling import VerificationRule
from specdec.core.sessions import short_id
from specdec.core.steps import MAX_STEP_TOKENS, DraftLink, DraftProposal, SessionRun, SessionSpec, StepCommit, StepOutcome
from specdec.target.scheduler import SessionPlan, StepTicket, VerifierScheduler

log = logging.getLogger(__name__)
LinkFactory = Callable[[SessionRun], DraftLink | None]


@dataclass(frozen=True)
class LoopConfig:
    draft_wait_s: float = 0.2  # longest a step waits for its block before it decodes without one
    reconnect_s: float = 1.0  # after the drafter failed, how often to open a new link
    close_timeout_s: float = 5.0


class VerifierLoop:
    """One session's stream I/O: its drafter link in, its commits out. What it speculates and when
    it steps is the scheduler's (services/target/scheduler.py), which holds the session's record."""

    def __init__(self, scheduler: VerifierScheduler, run: SessionRun, link_factory: LinkFactory,
                 config: LoopConfig = LoopConfig()) -> None:
        self.scheduler = scheduler
        self.run = run
        self.link_factory = link_factory
        self.config = config
        self.plan: SessionPlan | None = None  # the scheduler's record of the session, from its start
        self.link: DraftLink | None = None
        self._reconnect: asyncio.Task | None = None
        self._last_attempt = 0.0
        self._drafter_turn = 0  # which of run.drafters() the current link is to
        self._patience_steps = 0  # steps left that do not wait for a late drafter
        self._lateness = 0  # consecutive times the drafter was late

    @property
    def committed(self) -> list[int]:
        """The session's committed tokens: the engine's list, read here, extended only by its steps."""
        state = self.plan.state if self.plan is not None else None
        return state.committed if state is not None else list(self.run.spec.prompt_ids)

    async def steps(self) -> AsyncIterator[StepCommit]:
        """Open the session on both sides, then one StepCommit per step. Frees everything however it ends."""
        spec = self.run.spec
        link = self.link_factory(self.run)
        self.plan = self.scheduler.admit(self.run)
        try:
            if self._first_token_first(link):
                await self.scheduler.start(self.plan)
                self.plan.k = 0  # the first step drafts nothing: its token comes before the drafter's prefill
                self._last_attempt = time.monotonic()  # (no reconnect: the link opens just below)
                commit = await self._step()
                yield commit
                if commit.finished:
                    return
                self.link = await self._open_link(link, dataclasses.replace(spec, prompt_ids=tuple(self.committed)))
            else:
                opened = await asyncio.gather(self.scheduler.start(self.plan), self._open_link(link, spec), return_exceptions=True)
                if isinstance(opened[0], BaseException):
                    raise opened[0]
                self.link = opened[1] if not isinstance(opened[1], BaseException) else None
            self._tell_drafter(())
            while True:
                commit = await self._step()
                yield commit
                if commit.finished:
                    return
        finally:
            self.scheduler.retire(self.plan)
            # Shielded, and waited for even when this task is cancelled: when the caller sees the
            # session end, both workers have freed it.
            release = asyncio.ensure_future(self._release(spec.session_id, link))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                await release
                raise

    def _first_token_first(self, link: DraftLink | None) -> bool:
        """Whether the session's first step runs before its drafter opens. Where the drafter drafts on
        the verifier's own model thread, its prefill and first block would otherwise come before the
        first token (TTFT). Only where a step's k changes no token (greedy, or the coupled rule) and
        the drafter reads nothing of the target's forward (features, row tokens)."""
        spec = self.run.spec
        return (getattr(link, "in_process", False)
                and (spec.sampling.temperature == 0 or spec.sampling.rule is VerificationRule.COUPLED)
                and not needs_features(spec.drafter) and not needs_row_tokens(spec.drafter))

    async def _open_link(self, link: DraftLink | None, spec: SessionSpec) -> DraftLink | None:
        self._last_attempt = time.monotonic()
        if link is None:
            return None
        try:
            await link.open(spec)
            return link
        except SpecdecError as exc:
            log.warning("session %s: drafter unavailable, decoding without it: %s", short_id(spec.session_id), exc)
            await link.close()
            return None

    async def _release(self, session_id: str, link: DraftLink | None) -> None:
        if self._reconnect is not None:
            self._reconnect.cancel()
        links = {id(x): x for x in (link, self.link) if x is not None}
        try:
            await asyncio.wait_for(asyncio.gather(self.scheduler.close(session_id), *(x.close() for x in links.values()),
                                                  return_exceptions=True), self.config.close_timeout_s)
        except asyncio.TimeoutError:
            log.warning("session %s: closing took over %.0fs", short_id(session_id), self.config.close_timeout_s)

    def _tell_drafter(self, token_ids: tuple[int, ...]) -> None:
        """The step's outcome, with the target's features for a drafter that reads them: the first
        chunk rides with the outcome, any more follow in outcomes that commit nothing."""
        state = self.plan.state
        chunks, rows = state.take_for_drafter() if state is not None else ([], None)
        if self.link is not None and self.link.up:
            n, k, overlap = len(self.committed), self.plan.k, self.plan.overlap
            self.link.send(StepOutcome(n, token_ids, k, overlap, chunks[0] if chunks else None, *(rows or ())))
            for chunk in chunks[1:]:
                self.link.send(StepOutcome(n, (), k, overlap, chunk))

    async def _take_block(self):
        link = self.link
        if self.plan.k == 0 or link is None or not link.up:
            self._maybe_reconnect()
            return None
        wait_s = 0.0 if self._patience_steps > 0 else self.config.draft_wait_s
        self.scheduler.waiting(self.plan)
        block = await link.next_block(self.committed, wait_s)
        if self._patience_steps > 0:
            self._patience_steps -= 1
        elif block is None and link.up:
            self._lateness += 1
            self._patience_steps = 2 ** min(self._lateness, 6)  # late again: stop waiting for longer
            log.info("session %s: drafter late; %d steps without waiting", short_id(self.run.spec.session_id), self._patience_steps)
        elif block is not None:
            self._lateness = 0
        return block

    async def _step(self) -> StepCommit:
        started = time.perf_counter()
        block = await self._take_block()
        block_at = time.perf_counter()
        proposal = block.proposal.truncated(self.plan.k) if block is not None else DraftProposal(())
        ticket = StepTicket(proposal, started, block_at, (proposal.draft_time_ns * 1e-9) if block is not None else 0.0,
                            block is not None and bool(block.assumed_ids), self.link is not None)
        try:
            commit = await self.scheduler.step(self.plan, ticket)
        except InvalidRequest as exc:
            if not proposal.token_ids:
                raise
            # The drafter sent something the verifier cannot use: its fault, not the client's.
            log.warning("session %s: bad draft block, decoding without the drafter: %s", short_id(self.run.spec.session_id), exc)
            await self._drop_link()
            commit = await self.scheduler.step(self.plan, dataclasses.replace(ticket, proposal=DraftProposal(()), draft_s=0.0,
                                                                              predrafted=False))
        if not commit.finished:  # (a step that does not finish streams every token it committed)
            self._tell_drafter(commit.token_ids)
        return commit

    async def _drop_link(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            await link.close()

    def _maybe_reconnect(self) -> None:
        """While the drafter is down, try a new link now and then, off the critical path."""
        if self.plan.k == 0 and self.link is not None:
            return  # speculation is off by choice, not by failure
        # A link just found down, with another drafter to go to: go now. Otherwise once per reconnect_s.
        just_failed = self.link is not None and not self.link.up and len(self.run.drafters()) > 1
        if self._reconnect is not None or (not just_failed and time.monotonic() - self._last_attempt < self.config.reconnect_s):
            return
        if self.link is not None and not self.link.up:
            asyncio.ensure_future(self.link.close())
            self.link = None
        link = self.link_factory(self._next_drafter())
        if link is None:
            self._last_attempt = time.monotonic()
            return
        # Reopened with every token committed so far as its prompt.
        spec = dataclasses.replace(self.run.spec, prompt_ids=tuple(self.committed))
        self._reconnect = asyncio.ensure_future(self._open_link(link, spec))
        self._reconnect.add_done_callback(lambda task: self._reconnected(task, len(spec.prompt_ids)))

    def _next_drafter(self) -> SessionRun:
        """The session as the next reconnect should open it: on the next drafter of its pool after
        the one that failed (the session's own one again once every other was tried)."""
        drafters = self.run.drafters()
        if len(drafters) <= 1:
            return self.run
        self._drafter_turn = (self._drafter_turn + 1) % len(drafters)
        address, server_name = drafters[self._drafter_turn]
        return dataclasses.replace(self.run, drafter_address=address, drafter_server_name=server_name)

    def _reconnected(self, task: asyncio.Task, known: int) -> None:
        self._reconnect = None
        link = None if task.cancelled() or task.exception() is not None else task.result()
        if link is None:
            return
        self.link = link
        log.info("session %s: drafter back", short_id(self.run.spec.session_id))
        # The drafter knows the tokens it was opened with; bring it up to now, then ask for a block.
        committed = self.committed
        sent_k = False
        while known < len(committed):
            chunk = tuple(committed[known : known + MAX_STEP_TOKENS])
            known += len(chunk)
            sent_k = known == len(committed)
            link.send(StepOutcome(known, chunk, self.plan.k if sent_k else 0, self.plan.overlap))
        if not sent_k:
            link.send(StepOutcome(known, (), self.plan.k, self.plan.overlap))
