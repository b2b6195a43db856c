"""The per-request loop, at the verifier: { take the block for the committed sequence -> verify ->
tell the drafter -> choose the next k } until the session ends.

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
from specdec.core.sessions import short_id
from specdec.core.goodput import LoadRegimes, load_cap
from specdec.core.speculation import SpeculationController, SpeculationMode, StepTiming
from specdec.core.steps import MAX_STEP_TOKENS, DraftLink, DraftProposal, SessionRun, SessionSpec, StepCommit, StepOutcome
from specdec.target.engine import AsyncVerifierEngine

log = logging.getLogger(__name__)
LinkFactory = Callable[[SessionRun], DraftLink | None]


@dataclass(frozen=True)
class LoopConfig:
    draft_wait_s: float = 0.2  # longest a step waits for its block before it decodes without one
    reconnect_s: float = 1.0  # after the drafter failed, how often to open a new link
    close_timeout_s: float = 5.0


@dataclass
class LoopState:
    """Everything one session's loop knows, in one place."""

    committed: list[int]
    generated: int = 0
    k: int = 0
    patience_steps: int = 0  # steps left that do not wait for a late drafter
    lateness: int = 0  # consecutive times the drafter was late


class VerifierLoop:
    def __init__(self, engine: AsyncVerifierEngine, run: SessionRun, link_factory: LinkFactory, context_length: int,
                 config: LoopConfig = LoopConfig()) -> None:
        self.engine = engine
        self.run = run
        self.link_factory = link_factory
        self.context_length = context_length
        self.config = config
        policy = run.policy
        if policy.mode is SpeculationMode.ADAPTIVE and getattr(engine, "shares_model_thread", False):
            # One model thread for both models: an adaptive request has no overlap to choose
            # (drafting ahead would only delay the verifications it cannot run beside).
            policy = dataclasses.replace(policy, overlap=False)
        self.controller = SpeculationController(policy)
        self.state = LoopState(list(run.spec.prompt_ids))
        self.link: DraftLink | None = None
        self._reconnect: asyncio.Task | None = None
        self._last_attempt = 0.0
        self._drafter_turn = 0  # which of run.drafters() the current link is to

    async def steps(self) -> AsyncIterator[StepCommit]:
        """Open the session on both sides, then one StepCommit per step. Frees everything however it ends."""
        spec = self.run.spec
        link = self.link_factory(self.run)
        steered = getattr(self.engine, "load_regimes", None) if self.run.policy.mode is SpeculationMode.ADAPTIVE else None
        if steered is not None:
            steered.adaptive_sessions += 1
        try:
            opened = await asyncio.gather(self.engine.open(spec, self.run.max_new_tokens), self._open_link(link, spec), return_exceptions=True)
            if isinstance(opened[0], BaseException):
                raise opened[0]
            self.link = opened[1] if not isinstance(opened[1], BaseException) else None
            self.state.k = self._cap(self._next_k())
            self._tell_drafter(())
            while True:
                commit = await self._step()
                yield commit
                if commit.finished:
                    return
        finally:
            if steered is not None:
                steered.adaptive_sessions -= 1
            # Shielded, and waited for even when this task is cancelled: when the caller sees the
            # session end, both workers have freed it.
            release = asyncio.ensure_future(self._release(spec.session_id, link))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                await release
                raise

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
            await asyncio.wait_for(asyncio.gather(self.engine.close(session_id), *(x.close() for x in links.values()),
                                                  return_exceptions=True), self.config.close_timeout_s)
        except asyncio.TimeoutError:
            log.warning("session %s: closing took over %.0fs", short_id(session_id), self.config.close_timeout_s)

    def _next_k(self) -> int:
        """The request's k, for adaptive requests no more drafts than pay for what they cost the batch (core/goodput.py)."""
        costs = getattr(self.engine, "batch_costs", None)
        policy = self.run.policy
        if costs is None or policy.mode is not SpeculationMode.ADAPTIVE:
            return self.controller.next_k()
        if getattr(self.engine, "open_sessions", 2) <= 1:
            # Alone, what a draft token costs the batch is what it costs this request, which its
            # own step-time model already weighs (the batch-wide fit, which also charges a block's
            # fixed cost to each of its tokens, cut one session's k to 0 or 1 where k = 2-3 paid).
            return self.controller.next_k()
        regimes = getattr(self.engine, "load_regimes", None)
        if regimes is not None and regimes.current != LoadRegimes.CAPPED:  # a fixed k, measured to serve this load better
            return min(int(regimes.current), policy.max_speculative_tokens)
        mine = self.controller.costs
        # Drafting costs the batch what it adds to this session's steps: the blocks it waited for.
        per_token = costs.per_row_s + mine.miss.get(1.0) * mine.draft_per_token.get(costs.draft_per_token_s)
        fitted = costs.draft_token_cost_s  # what drafts were seen to cost the batch's cycles, all effects in
        if fitted is not None:
            per_token = max(per_token, fitted)
        cap = load_cap(self.controller.alpha, per_token, costs.goodput_tokens_per_s, policy.max_speculative_tokens)
        # (The cap first: under load it is often 0, and the request's own best k is then not needed.)
        return min(cap, self.controller.next_k()) if cap > 0 else 0

    def _cap(self, k: int) -> int:
        """No more drafts than the request and the context have room for (the step adds one token)."""
        s = self.state
        remaining = self.run.max_new_tokens - s.generated
        room = self.context_length - len(s.committed)
        return max(0, min(k, remaining - 1, room - 1))

    def _tell_drafter(self, token_ids: tuple[int, ...]) -> None:
        if self.link is not None and self.link.up:
            overlap = self.controller.next_overlap() and not self._shared_thread_busy()
            self.link.send(StepOutcome(len(self.state.committed), token_ids, self.state.k, overlap))

    def _shared_thread_busy(self) -> bool:
        """Whether drafting ahead would take the model thread from other sessions' work: in one
        process the drafter runs on the verifier's thread, which under load is never idle, so a
        block drafted ahead delays the other sessions' drafts and verifications (measured:
        docs/decisions/drafting-ahead-in-company.md). One session alone still
        drafts ahead, in the moments the thread waits for the event loop."""
        return getattr(self.engine, "shares_model_thread", False) and getattr(self.engine, "open_sessions", 1) > 1

    async def _take_block(self):
        s = self.state
        link = self.link
        if s.k == 0 or link is None or not link.up:
            self._maybe_reconnect()
            return None
        wait_s = 0.0 if s.patience_steps > 0 else self.config.draft_wait_s
        block = await link.next_block(s.committed, wait_s)
        if s.patience_steps > 0:
            s.patience_steps -= 1
        elif block is None and link.up:
            s.lateness += 1
            s.patience_steps = 2 ** min(s.lateness, 6)  # late again: stop waiting for longer
            log.info("session %s: drafter late; %d steps without waiting", short_id(self.run.spec.session_id), s.patience_steps)
        elif block is not None:
            s.lateness = 0
        return block

    async def _step(self) -> StepCommit:
        s = self.state
        t0 = time.perf_counter()
        block = await self._take_block()
        t_block = time.perf_counter()
        proposal = block.proposal.truncated(s.k) if block is not None else DraftProposal(())
        try:
            outcome = await self.engine.verify(self.run.spec.session_id, proposal)
        except InvalidRequest as exc:
            if not proposal.token_ids:
                raise
            # The drafter sent something the verifier cannot use: its fault, not the client's.
            log.warning("session %s: bad draft block, decoding without the drafter: %s", short_id(self.run.spec.session_id), exc)
            await self._drop_link()
            proposal = DraftProposal(())
            outcome = await self.engine.verify(self.run.spec.session_id, proposal)
        t1 = time.perf_counter()
        drafted = len(proposal.token_ids)
        tokens, finished = self._cut(outcome.token_ids)
        s.committed.extend(outcome.token_ids)
        s.generated += len(tokens)
        finished = finished or len(s.committed) >= self.context_length
        predrafted = block is not None and bool(block.assumed_ids)
        timing = StepTiming(verify_s=outcome.verify_time_ns * 1e-9, wait_s=t_block - t0, step_s=t1 - t0,
                            draft_s=(block.proposal.draft_time_ns * 1e-9) if block is not None else 0.0, predrafted=predrafted)
        self.controller.observe(drafted, outcome.num_accepted, timing)
        costs = getattr(self.engine, "batch_costs", None)
        if costs is not None and drafted and timing.draft_s > 0:
            costs.observe_draft(timing.draft_s / drafted)
        metrics = getattr(self.engine, "metrics", None)
        if metrics is not None:  # the draft wait only means something while a drafter is linked
            metrics.observe_round(drafted, outcome.num_accepted, t_block - t0 if self.link is not None else None)
        if not finished:
            s.k = self._cap(self._next_k())
            self._tell_drafter(outcome.token_ids)
        return StepCommit(tokens, drafted, outcome.num_accepted, len(s.committed), outcome.verify_time_ns,
                          int((t_block - t0) * 1e9), predrafted, finished)

    def _cut(self, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
        """A step's tokens up to max_new_tokens or the first stop token, and whether the session ends."""
        remaining = self.run.max_new_tokens - self.state.generated
        stops = self.run.stop_token_ids
        for i, tok in enumerate(token_ids[:remaining]):
            if tok in stops:
                return token_ids[: i + 1], True
        return token_ids[:remaining], len(token_ids) >= remaining

    async def _drop_link(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            await link.close()

    def _maybe_reconnect(self) -> None:
        """While the drafter is down, try a new link now and then, off the critical path."""
        if self.state.k == 0 and self.link is not None:
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
        spec = SessionSpec(self.run.spec.session_id, tuple(self.state.committed), self.run.spec.sampling, self.run.spec.drafter)
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
        committed = self.state.committed
        sent_k = False
        while known < len(committed):
            chunk = tuple(committed[known : known + MAX_STEP_TOKENS])
            known += len(chunk)
            sent_k = known == len(committed)
            link.send(StepOutcome(known, chunk, self.state.k if sent_k else 0, self.controller.overlap))
        if not sent_k:
            link.send(StepOutcome(known, (), self.state.k, self.controller.overlap))
