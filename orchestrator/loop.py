"""The client side of a request: tokenize -> run the session on a verifier -> store, detokenize, stream.

The draft/verify loop itself runs at the verifier (specdec.target.loop), next to the target model,
with draft blocks streaming in from the drafter; this side receives each step's committed tokens,
writes them to the session store before the client sees them, cuts at stop strings and
detokenizes, all off the draft-verify path. The verifier is reached through the VerifyWorker
protocol (specdec.core.steps): in this process for ``specdec generate``, over gRPC for ``specdec serve``.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.core.errors import (DeadlineExceeded, InvalidRequest, SessionMoved, SessionNotFound, SessionTakenOver, SpecdecError,
                                 StoreUnavailable, WorkerUnavailable)
from specdec.core.sessions import (SessionRecord, SessionStatus, SessionStore, SpecCounters, new_holder, new_session_id,
                                   short_id)
from specdec.core.retry import retry_for
from specdec.core.speculation import SpeculationPolicy
from specdec.core.steps import SessionRun, SessionSpec, VerifyWorker, validate_prompt
from specdec.orchestrator.admission import AdmissionQueue
from specdec.orchestrator.detokenize import Detokenizer
from specdec.orchestrator.request import (DEFAULT_STORE_RETRY_S, GenerationRequest, OrchestratorConfig, params_json,
                                          request_from_record)

if TYPE_CHECKING:
    from specdec.metrics import OrchestratorMetrics
    from specdec.orchestrator.pool import DrafterPool

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0
RESUME_ATTEMPTS = 5


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    CONTEXT_FULL = "context_full"


@dataclass(frozen=True)
class Chunk:
    """Tokens committed by one step, and the text they complete. The last chunk has finish_reason set."""

    session_id: str
    seed: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counters: SpecCounters = SpecCounters()
    last_num_speculative_tokens: int = 0
    # The step this chunk comes from (0 and 0 for a chunk that replays tokens committed earlier).
    num_draft_tokens: int = 0
    num_accepted: int = 0


@dataclass(frozen=True)
class TargetInfo:
    """What the loop needs to know of the target model."""

    tokenizer: object
    vocab_size: int
    context_length: int
    eos_token_id: int | None
    drafters: tuple[str, ...] = ()  # names the draft worker serves; empty: let the worker decide


class Orchestrator:
    def __init__(self, target: TargetInfo, verifier: VerifyWorker, store: SessionStore, config: OrchestratorConfig,
                 drafter_address: str = "", metrics: "OrchestratorMetrics | None" = None,
                 drafters: "DrafterPool | None" = None) -> None:
        """``drafters``: a pool to place each session's drafting on (None: ``drafter_address``)."""
        self.target = target
        self.metrics = metrics
        self.verifier = verifier
        self.drafter_address = drafter_address  # "" in one process: the verifier has its drafter at hand
        self.drafters = drafters
        self.store = store
        self.config = config
        self.admission = AdmissionQueue(config.max_concurrent_requests, config.max_waiting_requests)
        self._reaper: asyncio.Task | None = None
        if metrics is not None:  # read at scrape time: the line and the running set are the admission's
            metrics.requests_running.set_function(lambda: self.admission.running)
            metrics.requests_waiting.set_function(lambda: self.admission.waiting)

    async def _session_run(self, spec: SessionSpec, max_new_tokens: int, policy: SpeculationPolicy) -> SessionRun:
        """The session as a verifier runs it, on the drafter it is placed on (and the others it may move to)."""
        address, name, fallbacks = self.drafter_address, "", ()
        if self.drafters is not None:
            try:
                address, name = await self.drafters.place()
                fallbacks = self.drafters.fallbacks(address)
            except WorkerUnavailable as exc:  # no drafter answers: the session decodes alone (speed, not output)
                log.warning("no drafter to place a session on (%s): decoding without speculation", exc)
                address = ""
        stops = () if self.target.eos_token_id is None else (self.target.eos_token_id,)
        return SessionRun(spec, address, max_new_tokens, policy, stops, name, fallbacks)

    @property
    def running(self) -> int:
        return self.admission.running

    def start_reaper(self) -> None:
        """Every lease, mark failed the running sessions nobody commits to any more (their
        orchestrator died and no client resumed them): no record stays running for good."""
        async def reap() -> None:
            while True:
                await asyncio.sleep(self.config.resume_lease_s)
                try:
                    lost = await self.store.abandon_stale(self.config.resume_lease_s)
                except SpecdecError as exc:  # the store is down: try again next time
                    log.warning("reaping abandoned sessions: %s", exc)
                    continue
                if lost:
                    log.info("%d sessions lost their orchestrator: marked failed", len(lost))

        if self._reaper is None:
            self._reaper = asyncio.ensure_future(reap())

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    async def session(self, session_id: str, owner: str) -> SessionRecord:
        """A session's record, for its owner only: anyone else is told it does not exist. A store
        failing over is waited for, as by a stream (a resume reads this first)."""
        record = await self._retrying(lambda: self.store.get(session_id))
        if not hmac.compare_digest(str(record.params.get("owner", "")), owner):
            raise SessionNotFound(f"no session {short_id(session_id)} for this key")
        return record

    def tokenize(self, request: GenerationRequest) -> tuple[int, ...]:
        if request.prompt_ids is not None:
            ids = request.prompt_ids
        else:
            ids = tuple(self.target.tokenizer(request.prompt_text)["input_ids"])
        validate_prompt(ids, self.target.vocab_size, self.target.context_length)
        return ids

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Run one request, yielding a chunk per step. Frees worker sessions however it ends."""
        request.validate(self.config)
        timer = self.metrics.start_request() if self.metrics is not None else None  # TTFT includes the wait in line
        try:
            async with self.admission.slot():  # over the running limit: wait in line (full line: Overloaded)
                # aclosing: when the client goes away, the inner generator's cleanup runs now, not at GC.
                async with contextlib.aclosing(self._admitted(request)) as chunks:
                    async for chunk in chunks:
                        if timer is not None:
                            timer.tokens(len(chunk.token_ids))
                        yield chunk
        finally:
            if timer is not None:
                timer.finish()

    async def _admitted(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        # Off the event loop: a long prompt's tokenizing must not stall every other stream.
        prompt_ids = await asyncio.to_thread(self.tokenize, request)
        drafter_name = request.drafter or self.config.default_drafter
        if self.target.drafters and drafter_name not in self.target.drafters:
            raise InvalidRequest(f"unknown drafter {drafter_name!r}; this deployment serves {sorted(self.target.drafters)}")
        sampling = request.sampling
        session_id = new_session_id()
        record = SessionRecord.new(prompt_ids, params_json(request, drafter_name), sampling.seed, session_id)
        spec = SessionSpec(session_id, prompt_ids, sampling, drafter_name, request.lookahead)
        run = await self._session_run(spec, request.max_new_tokens, request.policy)
        holder = new_holder()  # this stream's fencing token: a resume elsewhere fences it off
        await self._retrying(lambda: self.store.create(record, holder))  # a failover pauses a new stream too
        async with contextlib.aclosing(self._tracked(session_id, holder, self._loop(request, run, holder))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _tracked(self, session_id: str, holder: str, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """The session's chunks, its record marked finished, cancelled or failed however it ends
        (unless a newer stream took it over: that one's record is not this stream's to mark)."""
        status, reason = SessionStatus.FAILED, ""
        try:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    status, reason = SessionStatus.FINISHED, chunk.finish_reason.value
                    await self._retrying(lambda: self.store.finish(session_id, status, reason, holder))  # idempotent
                yield chunk
        # The client went away, or gave up: its deadline, carried to the worker, passed there first.
        except (asyncio.CancelledError, GeneratorExit, DeadlineExceeded):
            status = SessionStatus.CANCELLED
            raise
        except SessionTakenOver:
            status = SessionStatus.FINISHED  # not ours to mark any more
            log.info("session %s: resumed by another stream; this one ends", short_id(session_id))
            raise
        finally:
            if status is not SessionStatus.FINISHED:
                await self._mark(session_id, status, reason, holder)

    async def resume(self, session_id: str, owner: str, received: int) -> AsyncIterator[Chunk]:
        """`_resume_once`, read again while a stream being fenced off still commits (a few times)."""
        for attempt in range(RESUME_ATTEMPTS):
            started = False
            try:
                async with contextlib.aclosing(self._resume_once(session_id, owner, received)) as chunks:
                    async for chunk in chunks:
                        started = True
                        yield chunk
                return
            except SessionMoved:
                if started or attempt == RESUME_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.01 * (attempt + 1))

    async def _resume_once(self, session_id: str, owner: str, received: int) -> AsyncIterator[Chunk]:
        """Continue a session whose stream broke, here: the committed tokens after the first
        ``received``, then the rest of the generation from the prompt and every committed token
        (a new verifier session at the same positions: greedy and coupled output go on exactly).
        Only its owner may. A stream still running it elsewhere (its orchestrator paused, or the
        client lost sight of a live one) is fenced off and ends with ABORTED: the newest stream wins."""
        record = await self.session(session_id, owner)
        output = tuple(record.output_ids)
        if not 0 <= received <= len(output):
            raise InvalidRequest(f"received_tokens is {received} but the session committed {len(output)}: send how many "
                                 "generated tokens your stream delivered")
        request = request_from_record(record)
        detok = Detokenizer(self.target.tokenizer, request.stop)
        detok.add(output[:received])  # the client has that text already
        common = dict(session_id=session_id, seed=record.seed, prompt_tokens=len(record.prompt_ids))

        def undelivered(text: str, finish: FinishReason | None) -> Chunk:
            """The committed tokens the client never received, as one chunk."""
            return Chunk(token_ids=output[received:], text=text, finish_reason=finish, completion_tokens=len(output),
                         counters=record.counters, last_num_speculative_tokens=record.step_ks[-1] if record.step_ks else 0,
                         **common)

        ended = FinishReason(record.finish_reason) if record.status is SessionStatus.FINISHED else None
        if ended is None and output and output[-1] == self.target.eos_token_id:
            ended = FinishReason.STOP  # it had ended; its orchestrator died before saying so
        elif ended is None and len(output) >= request.max_new_tokens:
            ended = FinishReason.LENGTH
        elif ended is None and len(record.prompt_ids) + len(output) >= self.target.context_length:
            ended = FinishReason.CONTEXT_FULL
        if ended is not None:  # nothing to generate: what is left, and how it ended
            if record.status is not SessionStatus.FINISHED:
                await self._retrying(lambda: self.store.finish(session_id, SessionStatus.FINISHED, ended.value))
            yield undelivered(detok.add(output[received:]) + detok.finish(), ended)
            return
        async with self.admission.slot():
            holder = new_holder()
            await self._retrying(lambda: self.store.claim(session_id, len(output), holder))  # idempotent for one holder
            spec = SessionSpec(session_id, tuple(record.prompt_ids) + output, request.sampling,
                               request.drafter or self.config.default_drafter, request.lookahead)
            run = await self._session_run(spec, request.max_new_tokens - len(output),
                                          request.policy.resumed_at(record.step_ks[-1] if record.step_ks else None))
            rest = self._loop(request, run, holder, detok=detok, generated=len(output), counters=record.counters,
                              prompt_tokens=len(record.prompt_ids))
            async with contextlib.aclosing(self._tracked(session_id, holder, rest)) as chunks:
                if received < len(output):  # committed before the break, never delivered
                    yield undelivered(detok.add(output[received:]), None)
                async for chunk in chunks:
                    yield chunk

    async def _mark(self, session_id: str, status: SessionStatus, reason: str, holder: str) -> None:
        """Record how a session that did not finish ended; shielded, so a cancelled request still does it."""
        async def mark() -> None:
            try:
                await self.store.finish(session_id, status, reason, holder)
            except Exception as exc:  # the record may not exist if create failed
                log.debug("marking session %s %s: %s", short_id(session_id), status.value, exc)

        task = asyncio.ensure_future(asyncio.wait_for(mark(), CLOSE_TIMEOUT_S))
        try:
            await asyncio.shield(task)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass

    async def _loop(self, request: GenerationRequest, run: SessionRun, holder: str, *, detok: Detokenizer | None = None,
                    generated: int = 0, counters: SpecCounters | None = None,
                    prompt_tokens: int | None = None) -> AsyncIterator[Chunk]:
        """The session's steps as chunks; a resumed session passes what it had already generated."""
        target = self.target
        spec = run.spec
        detok = detok or Detokenizer(target.tokenizer, request.stop)
        counters = counters or SpecCounters()
        common = dict(session_id=spec.session_id, seed=spec.sampling.seed,
                      prompt_tokens=len(spec.prompt_ids) if prompt_tokens is None else prompt_tokens)
        steps = self.verifier.run(run)
        try:
            async for step in steps:
                drafted = step.num_draft_tokens
                counters = counters.plus(SpecCounters(int(drafted > 0), drafted, step.num_accepted, 1, int(step.predrafted),
                                                      step.verify_time_ns, step.draft_wait_ns))
                tokens, text = self._emit(step.token_ids, detok)
                generated += len(tokens)
                finish = self._finish(tokens, generated, request, detok, step.finished)
                # Nothing lost: the committed tokens are in the store before the client sees them.
                await self._commit(spec.session_id, tokens, counters, drafted, holder, generated - len(tokens))
                if finish is not None:
                    text += detok.finish()
                yield Chunk(token_ids=tokens, text=text, finish_reason=finish, completion_tokens=generated,
                            counters=counters, last_num_speculative_tokens=drafted, num_draft_tokens=drafted,
                            num_accepted=step.num_accepted, **common)
                if finish is not None:
                    return
        finally:
            await steps.aclose()  # ends the session on the verifier (and its drafter) if it is still running

    async def _commit(self, session_id: str, tokens: tuple[int, ...], counters: SpecCounters, drafted: int, holder: str,
                      after: int) -> None:
        """Commit one step; safe to retry, since a commit naming the length it extends lands once."""
        await self._retrying(lambda: self.store.commit(session_id, tokens, counters, (drafted,), holder, after))

    async def _retrying(self, call):
        """A store call, riding out a store that is briefly away (a Redis restart, a failover):
        ``call()`` is tried again for up to ``store_retry_s``, so the stream only pauses; past that,
        StoreUnavailable ends it, saying how long it was tried (the client may resume later)."""
        budget_s = self.config.store_retry_s if self.config.store_retry_s is not None else DEFAULT_STORE_RETRY_S
        try:
            return await retry_for(call, budget_s, StoreUnavailable)
        except StoreUnavailable as exc:
            raise StoreUnavailable(f"{exc} (tried for {budget_s:g} s, the orchestrator's store retry budget)") from None

    @staticmethod
    def _emit(token_ids: tuple[int, ...], detok: Detokenizer) -> tuple[tuple[int, ...], str]:
        """A step's tokens and text, up to a stop string. The verifier's scheduler has already cut
        them at max_new_tokens and the stop tokens (the one place those limits are applied)."""
        tokens: list[int] = []
        text = ""
        for tok in token_ids:
            tokens.append(tok)
            text += detok.add([tok])
            if detok.stopped:
                break
        return tuple(tokens), text

    def _finish(self, tokens: tuple[int, ...], generated: int, request: GenerationRequest, detok: Detokenizer,
                verifier_finished: bool) -> FinishReason | None:
        """How the stream ends after this step, or None while it goes on."""
        if detok.stopped:
            return FinishReason.STOP
        if not verifier_finished:
            return None
        if tokens and tokens[-1] == self.target.eos_token_id:
            return FinishReason.STOP
        return FinishReason.LENGTH if generated >= request.max_new_tokens else FinishReason.CONTEXT_FULL


async def collect(chunks: AsyncIterator[Chunk]) -> tuple[Chunk, tuple[int, ...], str]:
    """Run a request to the end: (last chunk, all token ids, all text)."""
    ids: list[int] = []
    text: list[str] = []
    last = None
    async for chunk in chunks:
        ids.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.finish_reason is not None
    return last, tuple(ids), "".join(text)
