"""The verifier's scheduler: one loop that owns the batch.

Each iteration takes the sessions whose step is ready (their block is in, or their wait for it
ended), runs one step over all of them on the model thread (one forward over the flat ragged batch,
the rules once over it: `VerifierEngine.verify_batch`), then, in one place (`_decide`), observes
every session's step, cuts its tokens at its limits, and chooses every session's next speculation
length together: the goodput cap is a property of the batch, priced once per batch, and each
request's own cap and controller bound its k. The outcomes then fan out to the sessions' loops
(services/target/loop.py), which keep only their streams' I/O: the drafter link and the commits.

A session's record is the engine's `SessionState` (its committed tokens, the only copy in this
process, and its KV cache) and the scheduler's `SessionPlan` (its controller, limits, next k and
where its step is). The scheduler is the only caller of the model on the verifier, prefills
included: opens that arrive while one prefill runs are prefilled together in the next.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from specdec.core.errors import SessionAlreadyOpen, SpecdecError
from specdec.core.goodput import BatchCostModel, LoadRegimes, load_cap
from specdec.core.offload import Offload
from specdec.core.speculation import TREE_DRAFTERS, SpeculationController, SpeculationMode, StepTiming, TreeBudgetController
from specdec.core.steps import DraftProposal, SessionRun, SessionSpec, StepCommit, VerifyOutcome, WorkerInfo
from specdec.core.threads import ThreadChooser
from specdec.target.engine import KVBudgetFull, SessionState, VerifierEngine

if TYPE_CHECKING:
    from specdec.core.offload import Submits
    from specdec.metrics import VerifierMetrics

R = TypeVar("R")
log = logging.getLogger(__name__)


class Phase(enum.Enum):
    TURN = "turn"  # its loop has the last outcome and is on its way to the next step (no I/O waited on)
    WAITING = "waiting"  # its loop waits for its drafter's block
    READY = "ready"  # its step is queued
    STEPPING = "stepping"  # its step is in the batch on the model thread


@dataclass
class SessionPlan:
    """The scheduler's part of one session's record."""

    run: SessionRun
    controller: SpeculationController
    state: SessionState | None = None  # the engine's part, once the session is open
    generated: int = 0  # tokens streamed to the client so far
    k: int = 0  # the next step's speculation length
    overlap: bool = False  # whether the drafter drafts the step after next while this one is verified
    phase: Phase = Phase.TURN


@dataclass(frozen=True)
class StepTicket:
    """One step as a session's loop hands it in: the proposal and what its block cost the loop."""

    proposal: DraftProposal
    started: float  # perf_counter when the step began (before its block wait)
    block_at: float  # perf_counter when the block was in (or the wait ended)
    draft_s: float = 0.0  # the drafter's own time for the block (0: none)
    predrafted: bool = False
    linked: bool = False  # a drafter was linked: the block wait means something


@dataclass
class _Queued:
    session_id: str
    proposal: DraftProposal
    done: asyncio.Future
    plan: SessionPlan | None = None
    ticket: StepTicket | None = None


@dataclass(frozen=True)
class _BatchPrice:
    """What a draft token costs the batch now (core/goodput.py), read once per batch."""

    per_row_s: float
    draft_per_token_s: float
    fitted_draft_token_s: float | None  # what drafts were seen to cost the batch's cycles, all effects in
    goodput_tokens_per_s: float


class VerifierScheduler:
    """Owns the verifier's batch; awaitable from the event loop, the model work on its own thread
    (or the drafter's, in one process: ``executor``), or inline (``threaded=False``)."""

    def __init__(self, engine: VerifierEngine, threaded: bool = True, metrics: "VerifierMetrics | None" = None,
                 kv_store=None, executor: "Submits | None" = None, threads: ThreadChooser | None = None) -> None:
        """``kv_store``: a core.redis_kv.RedisKVStore for the sessions' KV blocks (None: not kept).
        ``threads``: choose each forward's torch thread count by measurement (core/threads.py)."""
        self.engine = engine
        self.kv_store = kv_store
        self._run = Offload("verify", threaded, executor)
        # Model work on a thread shared with the drafter (one process): nothing drafts while a
        # forward runs, so drafting ahead cannot overlap verification here.
        self.shares_model_thread = executor is not None
        self.threads = threads
        self.metrics = metrics
        self.plans: dict[str, SessionPlan] = {}  # the sessions whose loops run here
        self._queue: collections.deque[_Queued] = collections.deque()
        self._on_the_way = 0  # planned, open sessions whose loops are on their way to their next step
        self._settled: asyncio.Future | None = None  # what a held batch waits on
        self._batcher: asyncio.Task | None = None
        self._opens: collections.deque[tuple[SessionSpec, int | None, Sequence[torch.Tensor], asyncio.Future]] = collections.deque()
        self._prefiller: asyncio.Task | None = None
        self._freed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the KV writer runs
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # sessions per forward, for benchmarks
        self.batch_costs = BatchCostModel()  # what a verified row costs under the load now (core/goodput.py)
        self.load_regimes = LoadRegimes()  # under load: adaptive k capped by that model, or a fixed k, as measured
        self._last_batch_end: float | None = None
        if metrics is not None:
            metrics.watch(sessions=lambda: len(engine.sessions), kv_bytes=engine.kv_bytes_held,
                          queued_steps=lambda: len(self._queue) + self._run.pending)

    @property
    def context_length(self) -> int:
        return self.engine.loaded.context_length

    # -- sessions -------------------------------------------------------------------------------

    def admit(self, run: SessionRun) -> SessionPlan:
        """A session's plan, before it opens: its controller, and the regimes' count of the requests they steer."""
        policy = run.policy
        if policy.mode is SpeculationMode.ADAPTIVE:
            if self.shares_model_thread:
                # One model thread for both models: an adaptive request has no overlap to choose
                # (drafting ahead would only delay the verifications it cannot run beside).
                policy = dataclasses.replace(policy, overlap=False)
            self.load_regimes.adaptive_sessions += 1
        controller = TreeBudgetController if run.spec.drafter in TREE_DRAFTERS else SpeculationController
        plan = SessionPlan(run, controller(policy))
        self.plans[run.spec.session_id] = plan
        return plan

    def retire(self, plan: SessionPlan) -> None:
        """The session's loop ends: the scheduler stops waiting for it."""
        self._on_the_way -= self._is_on_the_way(plan)
        if self.plans.get(plan.run.spec.session_id) is plan:
            del self.plans[plan.run.spec.session_id]
        if plan.run.policy.mode is SpeculationMode.ADAPTIVE:
            self.load_regimes.adaptive_sessions -= 1
        self._wake_if_settled()

    async def start(self, plan: SessionPlan) -> None:
        """Open (prefill) the planned session and choose its first k."""
        await self.open(plan.run.spec, plan.run.max_new_tokens)
        before = self._is_on_the_way(plan)
        plan.state = self.engine.sessions.peek(plan.run.spec.session_id)
        self._on_the_way += self._is_on_the_way(plan) - before
        self._decide([plan])

    def waiting(self, plan: SessionPlan) -> None:
        """The session's loop now waits for its drafter's block."""
        self._move(plan, Phase.WAITING)

    def _is_on_the_way(self, plan: SessionPlan) -> int:
        """1 if a batch is held for this session: open, planned here, its loop between steps."""
        return int(plan.state is not None and plan.phase in (Phase.TURN, Phase.WAITING)
                   and self.plans.get(plan.run.spec.session_id) is plan)

    def _move(self, plan: SessionPlan, phase: Phase) -> None:
        before = self._is_on_the_way(plan)
        plan.phase = phase
        self._on_the_way += self._is_on_the_way(plan) - before
        self._wake_if_settled()

    def _wake_if_settled(self) -> None:
        """End a held batch's wait once nobody is on the way or the batch is full (no polling: a
        count kept as phases change, so 64 sessions coming in cost no 64 wake-ups of the batcher)."""
        settled = self._settled
        if settled is not None and not settled.done() and (
                self._on_the_way <= 0 or len(self._queue) >= self.engine.config.max_batch_sessions):
            settled.set_result(None)

    async def open(self, spec: SessionSpec, max_new_tokens: int | None = None) -> int:
        """Open (prefill) a session. Over the KV budget, wait (up to ``kv_wait_s``) for sessions to
        close rather than fail: the budget is what this worker holds, not a reason to turn work away."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine.config.kv_wait_s
        stored = await self.kv_store.load(spec.session_id, spec.prompt_ids) if self.kv_store is not None else []
        closing_wait = loop.time() + 2.0
        while True:
            try:
                opened = await self._prefill(spec, max_new_tokens, stored)
                # The gap before the next batch holds this prefill (and a client's turnaround), not
                # decoding: it is no cycle for the cost model (counted, it made draft tokens look far
                # dearer than they are: docs/performance.md, 8).
                self._last_batch_end = None
                return opened
            except SessionAlreadyOpen:
                # A session resumed here while its earlier stream is still being torn down (its
                # orchestrator died a moment ago): that one closes within moments; then this opens.
                if loop.time() >= closing_wait:
                    raise
                await self._wait_freed(closing_wait - loop.time())
            except KVBudgetFull as exc:
                left = deadline - loop.time()
                if not exc.ever_fits or left <= 0:
                    raise
                await self._wait_freed(left)  # then one last try, whose error says why

    async def _wait_freed(self, timeout_s: float) -> None:
        self._freed.clear()
        try:
            await asyncio.wait_for(self._freed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def _prefill(self, spec: SessionSpec, max_new_tokens: int | None, stored: Sequence[torch.Tensor]) -> int:
        """Queue the open for the next prefill batch: the opens that arrive while one prefill runs
        go together in the next (64 clients at once: 2 forwards, not 64)."""
        done = asyncio.get_running_loop().create_future()
        self._opens.append((spec, max_new_tokens, stored, done))
        if self._prefiller is None or self._prefiller.done():
            self._prefiller = asyncio.ensure_future(self._prefills())
        return await done

    async def _prefills(self) -> None:
        budget = self.engine.config.max_prefill_tokens
        while self._opens:
            batch, tokens = [], 0
            while self._opens and (not batch or tokens + len(self._opens[0][0].prompt_ids) <= budget):
                item = self._opens.popleft()
                if not item[3].done():  # an open whose request was cancelled while it waited
                    batch.append(item)
                    tokens += len(item[0].prompt_ids)
            if not batch:
                continue
            try:
                results = await self._run(self._timed, tokens, self.engine.open_batch, [item[:3] for item in batch])
            except BaseException as exc:  # a bug in the forward, or shutdown: every open of the batch hears it
                results = [exc] * len(batch)
            # (An open cancelled during its prefill is closed by its loop's release, queued behind it.)
            for item, result in zip(batch, results):
                done = item[3]
                if not done.done():
                    done.set_exception(result) if isinstance(result, BaseException) else done.set_result(result)
            if any(isinstance(r, asyncio.CancelledError) for r in results):
                raise asyncio.CancelledError

    async def close(self, session_id: str) -> bool:
        closed = await self._run(self.engine.close, session_id)
        self._freed.set()  # a session waiting for KV room may fit now
        return closed

    async def status(self) -> WorkerInfo:
        return await self._run(self.engine.status)

    # -- steps ----------------------------------------------------------------------------------

    async def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        """One step of a session that has no plan here (benchmarks and tests drive the engine so)."""
        return await self._submit(_Queued(session_id, proposal, asyncio.get_running_loop().create_future()))

    async def step(self, plan: SessionPlan, ticket: StepTicket) -> StepCommit:
        """One step of a planned session: its commit; the plan then holds its next k and overlap."""
        queued = _Queued(plan.run.spec.session_id, ticket.proposal, asyncio.get_running_loop().create_future(), plan, ticket)
        self._move(plan, Phase.READY)
        try:
            return await self._submit(queued)
        finally:
            if plan.phase is not Phase.TURN:  # refused or cancelled before it was stepped
                self._move(plan, Phase.TURN)

    async def _submit(self, queued: _Queued):
        self._loop = asyncio.get_running_loop()
        self._queue.append(queued)
        self._wake_if_settled()
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.ensure_future(self._batches())
        return await queued.done

    async def _settle(self, limit: int) -> None:
        """Hold the batch (``batch_wait_s`` at most) while planned sessions are still on their way
        to their next step: those whose loops have their outcome and those waiting for a block."""
        if len(self._queue) >= limit or self._on_the_way <= 0:
            return
        loop = asyncio.get_running_loop()
        self._settled = settled = loop.create_future()
        timer = loop.call_later(self.engine.config.batch_wait_s, lambda: settled.done() or settled.set_result(None))
        try:
            await settled
        finally:
            timer.cancel()
            self._settled = None

    async def _batches(self) -> None:
        limit = self.engine.config.max_batch_sessions
        while self._queue:
            await self._settle(limit)
            batch: list[_Queued] = []
            while self._queue and len(batch) < limit:
                item = self._queue.popleft()
                if not item.done.done():  # a step whose session was cancelled while it waited
                    batch.append(item)
                    if item.plan is not None:
                        self._move(item.plan, Phase.STEPPING)
            if not batch:
                continue
            self.batch_sizes[len(batch)] += 1
            rows = sum(len(q.proposal.token_ids) + 1 for q in batch)
            started = time.perf_counter()
            try:
                results = await self._run(self._timed, rows, self._verify_batch, [(q.session_id, q.proposal) for q in batch])
            except BaseException as exc:  # a bug in the forward, or shutdown: every step of the batch hears it
                for q in batch:
                    if not q.done.done():
                        q.done.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            ended = time.perf_counter()
            self._finish(batch, results, started, ended)

    def _finish(self, batch: list[_Queued], results: list[VerifyOutcome | SpecdecError], started: float, ended: float) -> None:
        """Commits for the batch's steps, every next k chosen in one place, then the outcomes out."""
        planned = [(i, q, r) for i, (q, r) in enumerate(zip(batch, results)) if q.plan is not None and isinstance(r, VerifyOutcome)]
        commits = {i: self._commit(q.plan, q.ticket, outcome) for i, q, outcome in planned}
        try:
            for i, q, outcome in planned:
                self._observe(q.plan, q.ticket, outcome, ended)
            self._decide([q.plan for i, q, _ in planned if not commits[i].finished])
        except Exception:  # speed's bookkeeping, never output: a fault here falls back to plain decoding
            log.exception("verify batch planning failed")
            for _, q, _ in planned:
                q.plan.k = 0
        for i, (q, result) in enumerate(zip(batch, results)):
            if q.plan is not None:
                self._move(q.plan, Phase.TURN)
            if q.done.done():
                continue
            if isinstance(result, BaseException):
                q.done.set_exception(result)
            elif q.plan is None:
                q.done.set_result(result)
            else:
                q.done.set_result(commits[i])
        since = None if self._last_batch_end is None else ended - self._last_batch_end
        self._last_batch_end = ended
        committed = sum(len(r.token_ids) for r in results if isinstance(r, VerifyOutcome))
        try:
            self.batch_costs.observe(sum(len(q.proposal.token_ids) + 1 for q in batch), ended - started, committed, since,
                                     drafts=sum(len(q.proposal.token_ids) for q in batch))
            self.load_regimes.observe(len(self.engine.sessions), committed, ended)
        except Exception:  # speed's bookkeeping, not output: log it and keep batching
            log.exception("verify batch bookkeeping failed")

    def _commit(self, plan: SessionPlan, ticket: StepTicket, outcome: VerifyOutcome) -> StepCommit:
        """What the step streams for its session: its tokens cut at the request's limits."""
        tokens, finished = self._cut(plan, outcome.token_ids)
        plan.generated += len(tokens)
        finished = finished or outcome.committed_len >= self.context_length
        return StepCommit(tokens, len(ticket.proposal.token_ids), outcome.num_accepted, outcome.committed_len,
                          outcome.verify_time_ns, int((ticket.block_at - ticket.started) * 1e9), ticket.predrafted, finished)

    def _observe(self, plan: SessionPlan, ticket: StepTicket, outcome: VerifyOutcome, now: float) -> None:
        """What the step cost, for the session's controller, the batch's cost model and the metrics."""
        drafted = len(ticket.proposal.token_ids)
        timing = StepTiming(verify_s=outcome.verify_time_ns * 1e-9, wait_s=ticket.block_at - ticket.started,
                            step_s=now - ticket.started, draft_s=ticket.draft_s, predrafted=ticket.predrafted)
        plan.controller.observe(drafted, outcome.num_accepted, timing)
        if drafted and ticket.draft_s > 0:
            self.batch_costs.observe_draft(ticket.draft_s / drafted)
        if self.metrics is not None:  # the draft wait only means something while a drafter is linked
            self.metrics.observe_round(drafted, outcome.num_accepted, timing.wait_s if ticket.linked else None,
                                       plan.run.spec.drafter)

    @staticmethod
    def _cut(plan: SessionPlan, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
        """A step's tokens up to max_new_tokens or the first stop token, and whether the session ends."""
        remaining = plan.run.max_new_tokens - plan.generated
        stops = plan.run.stop_token_ids
        for i, tok in enumerate(token_ids[:remaining]):
            if tok in stops:
                return token_ids[: i + 1], True
        return token_ids[:remaining], len(token_ids) >= remaining

    def _decide(self, plans: Sequence[SessionPlan]) -> None:
        """Every next k of a batch, in one place: the batch's price of a draft token once, then each
        request's own controller and limits."""
        open_sessions = len(self.engine.sessions)
        costs = self.batch_costs
        regime = self.load_regimes.current
        price = _BatchPrice(costs.per_row_s, costs.draft_per_token_s, costs.draft_token_cost_s, costs.goodput_tokens_per_s)
        shared_busy = self.shares_model_thread and open_sessions > 1
        for plan in plans:
            plan.k = self._room(plan, self._next_k(plan, open_sessions, regime, price))
            # Drafting ahead in one process takes the model thread from the other sessions' work
            # (docs/decisions/drafting-ahead-in-company.md); one session alone still drafts ahead.
            plan.overlap = plan.controller.next_overlap() and not shared_busy

    @staticmethod
    def _next_k(plan: SessionPlan, open_sessions: int, regime: str | int, price: "_BatchPrice") -> int:
        """The request's k; an adaptive request's no more drafts than pay for what they cost the batch (core/goodput.py)."""
        controller, policy = plan.controller, plan.run.policy
        if policy.mode is not SpeculationMode.ADAPTIVE or open_sessions <= 1:
            # Alone, what a draft token costs the batch is what it costs this request, which its
            # own step-time model already weighs (the batch-wide fit, which also charges a block's
            # fixed cost to each of its tokens, cut one session's k to 0 or 1 where k = 2-3 paid).
            return controller.next_k()
        if regime != LoadRegimes.CAPPED:  # a fixed k, measured to serve this load better
            return min(int(regime), policy.max_speculative_tokens)
        mine = controller.costs
        # Drafting costs the batch what it adds to this session's steps: the blocks it waited for.
        per_token = price.per_row_s + mine.miss.get(1.0) * mine.draft_per_token.get(price.draft_per_token_s)
        if price.fitted_draft_token_s is not None:
            per_token = max(per_token, price.fitted_draft_token_s)
        cap = load_cap(controller.alpha, per_token, price.goodput_tokens_per_s, policy.max_speculative_tokens)
        # (The cap first: under load it is often 0, and the request's own best k is then not needed.)
        return min(cap, controller.next_k()) if cap > 0 else 0

    def _room(self, plan: SessionPlan, k: int) -> int:
        """No more drafts than the request and the context have room for (the step adds one token)."""
        remaining = plan.run.max_new_tokens - plan.generated
        committed = len(plan.state.committed) if plan.state is not None else len(plan.run.spec.prompt_ids)
        return max(0, min(k, remaining - 1, self.context_length - committed - 1))

    # -- the model thread -----------------------------------------------------------------------

    async def on_model_thread(self, fn: Callable[..., R], *args) -> R:
        """``fn(*args)`` where this scheduler's model work runs (benchmarks: a baseline on the same thread)."""
        return await self._run(fn, *args)

    def _timed(self, rows: int, fn: Callable[..., R], *args) -> R:
        """On the model thread: ``fn(*args)`` with the thread count chosen for ``rows`` rows, timed for the chooser."""
        if self.threads is None:
            return fn(*args)
        count = self.threads.choose(rows)
        torch.set_num_threads(count)
        started = time.perf_counter()
        result = fn(*args)
        self.threads.observe(rows, count, time.perf_counter() - started)
        return result

    def _verify_batch(self, steps: list[tuple[str, DraftProposal]]) -> list[VerifyOutcome | SpecdecError]:
        if self.metrics is None:
            results = self.engine.verify_batch(steps)
        else:
            with self.metrics.busy():
                results = self.engine.verify_batch(steps)
        if self.kv_store is not None:  # encoded here, on the model's thread; written by the store's own task
            due = self.engine.due_blocks([session_id for session_id, _ in steps])
            if due:
                loop = self._loop
                for session_id, blocks in due:
                    loop.call_soon_threadsafe(self.kv_store.offer, session_id, blocks)
        return results
