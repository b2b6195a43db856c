"""The draft worker's core: sessions, and the one thread that runs all of their model work. No gRPC here.

A session is driven by outcomes (``outcome``) and answers with blocks through the ``emit`` callback
it was opened with (called on the draft thread). The thread serves, in this order: session opens
(prefill), calls submitted to it (``submit``: in one process, the verifier's model work shares this
thread), blocks some verifier is waiting for (just in time), then pre-drafts, one session after
another, so no session starves and a waiting verifier never queues behind speculative work. One
thread serialises model calls, which is what one set of small weights on a couple of cores wants.
"""
from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from specdec.core.errors import SessionNotFound
from specdec.core.session_table import FreedMemory, SessionTable
from specdec.core.sessions import check_session_id
from specdec.core.steps import MAX_PREFILL_TOKENS, DraftBlock, SessionSpec, StepOutcome, WorkerInfo, validate_prompt
from specdec.draft.drafters import DraftConfig, Drafter, build_drafters, pick
from specdec.draft.speculator import JUST_IN_TIME, NUM_ALTERNATIVES, SessionSpeculator, Work

if TYPE_CHECKING:
    from specdec.metrics import DrafterMetrics

log = logging.getLogger(__name__)
Emit = Callable[[DraftBlock], None]


class DraftEngine:
    def __init__(self, drafters: dict[str, Drafter], config: DraftConfig, context_length: int | None = None,
                 metrics: "DrafterMetrics | None" = None) -> None:
        if not drafters:
            raise ValueError("a draft worker needs at least one drafter")
        self.drafters = drafters
        self.config = config
        self.context_length = min(context_length or config.max_session_tokens, config.max_session_tokens)
        self.sessions: SessionTable[SessionSpeculator] = SessionTable(config.max_sessions, config.idle_timeout_s, freed=FreedMemory())
        self._lock = threading.Condition()
        self._opens: collections.deque[tuple[SessionSpec, Emit, Future]] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()
        self._opening: set[str] = set()  # queued or prefilling; closing one of these abandons it
        self._turn = 0  # round-robin position over sessions for pre-drafts
        # Set when a verifier starts waiting for a just-in-time block: a pre-draft in progress stops
        # at its next token (a shorter block is still a block) so the waiting one goes first.
        self._jit_pending = False
        self._stopped = False
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(sessions=lambda: len(self.sessions))
        self._thread = threading.Thread(target=self._serve, name="draft", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)  # a model thread still alive at interpreter exit can abort it

    @classmethod
    def from_config(cls, config: DraftConfig, metrics: "DrafterMetrics | None" = None) -> "DraftEngine":
        drafters = build_drafters(config)
        models = [d.loaded for d in drafters.values() if hasattr(d, "loaded")]
        context = min((m.context_length for m in models), default=None)
        return cls(drafters, config, context, metrics)

    # ------------------------------------------------------------------ called from any thread
    def open(self, spec: SessionSpec, emit: Emit) -> Future:
        """Queue the session's prefill on the draft thread; the future gives the prefill time in ns.

        Checks that need no model run here, so bad input fails before anything is queued.
        """
        check_session_id(spec.session_id)
        drafter = pick(self.drafters, spec.drafter)
        validate_prompt(spec.prompt_ids, drafter.vocab_size or (1 << 31) - 1, self.context_length)
        done: Future = Future()
        with self._lock:
            self._opening.add(spec.session_id)
            self._opens.append((spec, emit, done))
            self._lock.notify()
        return done

    def submit(self, fn: Callable[..., object], *args) -> Future:
        """Run ``fn(*args)`` on the draft thread ahead of any drafting (an Executor's ``submit``).

        In one process the verifier runs its model work here (specdec.roles.embedded): draft and
        verify forwards then take turns on one thread, each with every core, instead of two
        threads sharing the cores, which measured slower on 2 cores (benchmarks/bench_threads.py).
        A pre-draft in progress stops at its next token for it."""
        done: Future = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the draft engine is shut down")
            self._calls.append((functools.partial(fn, *args), done))
            self._lock.notify()
        return done

    def outcome(self, session_id: str, outcome: StepOutcome) -> None:
        """Apply a verification step's outcome; raises (changing nothing) if it does not fit."""
        with self._lock:
            speculator = self.sessions.get(session_id)
            speculator.on_outcome(outcome)
            if speculator.wants_just_in_time():
                self._jit_pending = True
            if speculator.k > 0:  # else nothing new to draft: waking the draft thread (in one process,
                self._lock.notify()  # the model thread) would only have it scan every session for work

    def close(self, session_id: str) -> bool:
        """Free the session; one still opening is dropped once its prefill ends. Idempotent."""
        with self._lock:
            abandoned = session_id in self._opening
            self._opening.discard(session_id)
            return self.sessions.pop(session_id) is not None or abandoned

    def status(self) -> WorkerInfo:
        with self._lock:
            self.sessions.reap_idle()
            active = len(self.sessions)
        paths = [d.loaded.path for d in self.drafters.values() if hasattr(d, "loaded")]
        vocab = max((d.vocab_size for d in self.drafters.values()), default=0)
        return WorkerInfo(active, ",".join(paths) or "model-free", vocab, self.context_length, tuple(sorted(self.drafters)))

    def shutdown(self) -> None:
        """Stop the draft thread (after the job it is running). Idempotent."""
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the draft thread
    def _serve(self) -> None:
        # Drafting is speculative work: where it shares cores with a verifier or with this worker's
        # own event loop (one machine, `specdec up`, `specdec generate`), those go first. Linux
        # gives each thread its own nice value; elsewhere this is a no-op.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.thread_nice)
        except (AttributeError, OSError, PermissionError):
            pass
        while True:
            with self._lock:
                job = self._next_job()
                while job is None and not self._stopped:
                    self._lock.wait(timeout=1.0)
                    job = self._next_job()
                if self._stopped:
                    calls, self._calls = list(self._calls), collections.deque()
                    for _, done in calls:
                        done.cancel()
                    return
            try:
                if self.metrics is None:
                    job()
                else:
                    with self.metrics.busy():
                        job()
            except Exception:  # a bug in one session's drafting must not stop every session's
                log.exception("draft job failed")

    def _next_job(self) -> Callable[[], None] | None:
        """Under the lock: the most urgent piece of work, as a callable to run outside it."""
        if self._opens:  # first: a session starts only once both its prefills are done
            opens = [self._opens.popleft()]
            drafter = pick(self.drafters, opens[0][0].drafter)
            if hasattr(drafter, "open_many"):  # every queued open of this drafter in one prefill forward
                tokens = len(opens[0][0].prompt_ids)
                for item in list(self._opens):
                    if pick(self.drafters, item[0].drafter) is drafter and tokens + len(item[0].prompt_ids) <= MAX_PREFILL_TOKENS:
                        self._opens.remove(item)
                        opens.append(item)
                        tokens += len(item[0].prompt_ids)
            return lambda: self._open_now(drafter, opens)
        if self._calls:
            fn, done = self._calls.popleft()
            return lambda: _run_call(fn, done)
        ids = self.sessions.ids()
        if not ids:
            return None
        # Just-in-time blocks first (a verifier is waiting), then pre-drafts round-robin.
        waiting = [sid for sid in ids if (sp := self.sessions.peek(sid)) is not None and sp.wants_just_in_time()]
        self._jit_pending = False  # whoever waits now is served first, below
        together = self._just_in_time_together(waiting)
        if together is not None:
            return together
        urgent = waiting[0] if waiting else None
        order = [urgent] if urgent else ids[self._turn % len(ids):] + ids[: self._turn % len(ids)]
        self._turn += 1
        for sid in order:
            speculator = self.sessions.peek(sid)
            work = speculator.next_work(batched=hasattr(speculator.session, "propose_branches")) if speculator is not None else None
            if work is not None:
                return lambda: self._draft_now(sid, speculator, work)
        return None

    def _just_in_time_together(self, waiting: list[str]) -> Callable[[], None] | None:
        """Under the lock: the waiting sessions that can draft in one batched forward, as one job (None: fewer than two)."""
        groups: dict[int, list[str]] = collections.defaultdict(list)
        for sid in waiting:
            key = getattr(self.sessions.peek(sid).session, "batch_key", None)
            if key is not None:
                groups[id(key)].append(sid)
        group = max(groups.values(), key=len, default=[])
        if len(group) < 2:
            return None
        jobs = []
        for sid in group:
            speculator = self.sessions.peek(sid)
            work = speculator.next_work(batched=False)  # a just-in-time block: one sequence
            if work is not None:
                jobs.append((sid, speculator, work))
        return (lambda: self._draft_together(jobs)) if jobs else None

    def _draft_together(self, jobs: list[tuple[str, SessionSpeculator, Work]]) -> None:
        from specdec.draft.model_drafter import propose_together

        items = [(speculator.session, work.sequences[0], work.num_tokens) for _, speculator, work in jobs]
        interrupts = [functools.partial(speculator.is_stale, work) for _, speculator, work in jobs]
        proposals = propose_together(items, NUM_ALTERNATIVES, interrupts)
        if self.metrics is not None:
            self.metrics.observe_drafted(sum(len(p.token_ids) for p in proposals))
        with self._lock:
            for (sid, speculator, work), proposal in zip(jobs, proposals):
                if self.sessions.peek(sid) is speculator:  # not closed while it drafted
                    speculator.finish(work, [proposal])

    def _open_now(self, drafter: Drafter, opens: list[tuple[SessionSpec, Emit, Future]]) -> None:
        opens = [item for item in opens if item[2].set_running_or_notify_cancel()]
        if not opens:
            return
        try:
            t0 = time.perf_counter_ns()
            if hasattr(drafter, "open_many"):  # the prefills, in one forward
                sessions = drafter.open_many([(spec.prompt_ids, spec.sampling) for spec, _, _ in opens])
            elif hasattr(drafter, "open_for"):  # a drafter inside the verifier, drafting over the session's own state there
                sessions = [drafter.open_for(spec) for spec, _, _ in opens]
            else:  # (only model drafters are grouped: this is one open)
                sessions = [drafter.open(spec.prompt_ids, spec.sampling) for spec, _, _ in opens]
            elapsed = time.perf_counter_ns() - t0
        except BaseException as exc:
            with self._lock:
                for spec, _, _ in opens:
                    self._opening.discard(spec.session_id)
            for _, _, done in opens:
                done.set_exception(exc)
            return
        vocab = drafter.vocab_size or (1 << 31) - 1  # model-free drafters: any non-negative int32
        for (spec, emit, done), session in zip(opens, sessions):
            speculator = SessionSpeculator(session, spec.prompt_ids, vocab, self.context_length, emit)
            with self._lock:
                if spec.session_id not in self._opening:  # closed while it was opening
                    done.set_exception(SessionNotFound("the session was closed while it was opening"))
                    continue
                self._opening.discard(spec.session_id)
                try:
                    self.sessions.add(spec.session_id, speculator)
                except BaseException as exc:  # e.g. the worker's session cap
                    done.set_exception(exc)
                    continue
            done.set_result(elapsed)

    def _draft_now(self, session_id: str, speculator: SessionSpeculator, work: Work) -> None:
        session = speculator.session
        ahead = work.predrafts[0] is not JUST_IN_TIME

        def interrupt() -> bool:  # a pre-draft yields to a verifier that is waiting now
            return speculator.is_stale(work) or (ahead and (self._jit_pending or bool(self._calls)))

        proposals = None
        if len(work.sequences) > 1:
            proposals = session.propose_branches(work.sequences, work.num_tokens, NUM_ALTERNATIVES, interrupt)
        if proposals is None:
            proposals = [session.propose(seq, work.num_tokens, NUM_ALTERNATIVES, interrupt) for seq in work.sequences]
        if self.metrics is not None:  # every branch cost draft forwards, used or not
            self.metrics.observe_drafted(sum(len(p.token_ids) for p in proposals if p is not None))
        with self._lock:
            if self.sessions.peek(session_id) is speculator:  # not closed while it drafted
                speculator.finish(work, proposals)


def _run_call(fn: Callable[[], object], done: Future) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(fn())
    except BaseException as exc:  # the caller hears it, as from an executor
        done.set_exception(exc)
