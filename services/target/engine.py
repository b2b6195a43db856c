"""The verifier's core: the target model, one KV cache per session, the rejection rule. No gRPC here."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from specdec.core import rng
from specdec.core.errors import InvalidRequest, Overloaded, SessionAlreadyOpen, SpecdecError
from specdec.core.goodput import BatchCostModel, LoadRegimes
from specdec.core.kv import KVSequence, common_prefix_len, logits_for_batch, shared_prefixes
from specdec.core.kv_blocks import BlockLayout, encode_block, model_fingerprint
from specdec.core.llama_decode import NUMERICS, PACK_ROWS, LlamaDecoder, supports
from specdec.core.models import LoadedModel, load_causal_lm, resolve_dtype
from specdec.core.coupled import coupled_verify_one, processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.runner import runner_for
from specdec.core.rejection import greedy_verify, rejection_sample
from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.core.session_table import SessionTable
from specdec.core.steps import MAX_PREFILL_TOKENS, DraftProposal, SessionSpec, VerifyOutcome, WorkerInfo, check_room, dense_draft_probs, validate_prompt
from specdec.core.threads import ThreadChooser

if TYPE_CHECKING:
    from specdec.core.offload import Submits
    from specdec.metrics import VerifierMetrics

R = TypeVar("R")
log = logging.getLogger(__name__)
# Opens of one prefill batch whose prompts share at least this many leading tokens compute them once.
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class TargetConfig:
    model_path: str
    max_sessions: int = 256
    idle_timeout_s: float = 300.0
    threads: int | None = None
    # The lean Llama forward with oneDNN-packed weights (specdec.core.llama_decode): verifying k
    # drafts then costs little more than one step. False, or a model it does not support, runs the
    # reference HF forward. Either way the verifier's forward defines the target distribution.
    fast_forward: bool = True
    pack_rows: int = PACK_ROWS
    # The target's precision (weights, activations, KV cache): float32 | bfloat16 (CPUs with native bf16 only).
    dtype: str = "float32"
    # fast | exact. exact: a row's logits are bitwise the same whatever else shares the forward (its
    # block's other rows, other sessions, thread count; core/exact_ops.py), so speculation never
    # changes greedy output. Needs the lean forward.
    numerics: str = "fast"
    # KV memory budget in tokens over all sessions (None: max_sessions full contexts). A session
    # reserves prompt + max_new_tokens (at most the context) when it opens, so one admitted never
    # runs out mid-stream; one that does not fit is refused with RESOURCE_EXHAUSTED.
    max_kv_tokens: int | None = None
    # Continuous batching: the verify steps that arrive while a batch runs form the next batch (no
    # waiting when idle, so one session alone pays nothing), up to this many sessions per forward.
    max_batch_sessions: int = 64
    kv_wait_s: float = 30.0  # over the KV budget, a new session waits this long for room before RESOURCE_EXHAUSTED
    # Session KV in Redis (core/redis_kv.py): full blocks of kv_block_tokens written off the verify
    # path, read back when a session opens here that began elsewhere. None: not kept.
    kv_redis_url: str | None = None
    kv_block_tokens: int = 16  # smaller blocks leave less to recompute on resume (docs/decisions/kv-block-size.md)
    kv_prefix: str = "specdec"  # the key prefix, as the session store's
    # Redis memory per session is capped: positions past this are not kept (a resume recomputes them).
    kv_redis_max_tokens: int = 4096
    # Sessions whose steps came back together re-submit a moment apart (each passes through the event
    # loop): wait this long at most for every open session to be ready, so a batch is not split in
    # two halves that alternate. One session alone never waits (it is all the open sessions).
    batch_wait_s: float = 0.003
    # Opens that arrive while a prefill runs are prefilled together, up to this many prompt tokens per forward.
    max_prefill_tokens: int = MAX_PREFILL_TOKENS


class KVBudgetFull(Overloaded):
    """Over the verifier's KV budget now; ``ever_fits`` says whether it would fit once others close."""

    def __init__(self, message: str, ever_fits: bool) -> None:
        super().__init__(message)
        self.ever_fits = ever_fits


@dataclass
class _Session:
    kv: KVSequence
    committed: list[int]
    sampling: SamplingParams
    reserved_tokens: int  # of the worker's KV budget, held until the session closes
    blocks_written: int = 0  # full KV blocks handed to the store so far


class VerifierEngine:
    """Synchronous; the server runs it on one worker thread, the embedded path calls it directly."""

    def __init__(self, loaded: LoadedModel, config: TargetConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.sessions: SessionTable[_Session] = SessionTable(config.max_sessions, config.idle_timeout_s)
        fast = config.fast_forward and supports(loaded.model)
        if config.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {config.numerics!r}")
        if config.numerics != "fast" and not fast:
            raise ValueError(f"numerics={config.numerics!r} needs the lean forward (fast_forward on, a plain Llama)")
        self.decoder = LlamaDecoder(loaded.model, pack_rows=config.pack_rows, dtype=resolve_dtype(config.dtype),
                                    numerics=config.numerics) if fast else None
        self.runner = runner_for(loaded.model, self.decoder)  # every session's forward goes through it, batched
        self.last_prefill_tokens = 0  # positions the last prefill batch computed (the rest came from stored KV blocks)
        self.layout = None  # the KV block layout, on the lean forward (blocks are its buffer's bytes)
        if self.decoder is not None:
            d = self.decoder
            self.layout = BlockLayout(len(d.layers), d.n_kv, d.head_dim, d.dtype, config.kv_block_tokens,
                                      model_fingerprint(loaded.model, d.dtype, d.numerics))

    @classmethod
    def from_config(cls, config: TargetConfig) -> "VerifierEngine":
        return cls(load_causal_lm(config.model_path, dtype=config.dtype, threads=config.threads), config)

    def open(self, spec: SessionSpec, max_new_tokens: int | None = None, stored: Sequence[torch.Tensor] = ()) -> int:
        """Prefill a session; ``max_new_tokens`` sizes its KV reservation (None: the whole context);
        ``stored``: KV blocks of the prompt's first positions, already checked (core/redis_kv.py)."""
        result = self.open_batch([(spec, max_new_tokens, stored)])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

    def open_batch(self, opens: Sequence[tuple[SessionSpec, int | None, Sequence[torch.Tensor]]]) -> list[int | SpecdecError]:
        """Prefill many sessions in one target forward: (spec, max_new_tokens, stored) each, as `open`.

        A prefill is bound by arithmetic rather than by reading weights, yet one forward over many
        prompts measured much faster than one forward each (benchmarks/bench_prefill.py;
        docs/performance.md, 2.1). A refused open gets its error in its place and the others
        go on. Returns each one's time in ns (the whole batch's: each waited for all of it).
        """
        t0 = time.perf_counter_ns()
        results: list[int | SpecdecError | None] = [None] * len(opens)
        ready = []  # (index, session id, session, prompt ids)
        reserving = 0  # what the batch's earlier opens reserve: they count against the budget too
        context = self.loaded.context_length
        for i, (spec, max_new_tokens, stored) in enumerate(opens):
            try:  # every check before the prefill, not after it
                self.sessions.check_can_add(spec.session_id, adding=len(ready))
                validate_prompt(spec.prompt_ids, self.loaded.vocab_size, context)
                if any(spec.session_id == sid for _, sid, _, _ in ready):
                    raise SessionAlreadyOpen("a session is opened at most once per prefill batch")
                reserve = context if max_new_tokens is None else min(context, len(spec.prompt_ids) + max_new_tokens)
                self._check_kv_budget(reserve, reserving)
            except SpecdecError as exc:
                results[i] = exc
                continue
            reserving += reserve
            session = _Session(KVSequence(self.loaded.model, self.decoder, self.runner), list(spec.prompt_ids), spec.sampling, reserve)
            if stored:
                n = len(stored) * self.layout.block_tokens
                session.kv.load_prefix(spec.prompt_ids[:n], torch.cat(list(stored), dim=3))
                session.blocks_written = len(stored)
            ready.append((i, spec.session_id, session, spec.prompt_ids))
        # Prefill all but the last prompt token's successor: the first Verify feeds only drafts.
        # Prompts that begin alike (one prompt sent many times, a shared system prompt) compute what
        # they share once: the first in one forward, the others copy its keys and values and feed
        # only the rest in a second.
        copies = shared_prefixes([prompt for _, _, _, prompt in ready], MIN_SHARED_PREFIX,
                                 [self.decoder is not None and session.kv.cached_len == 0 for _, _, session, _ in ready])
        leaders = [(session, prompt) for (_, _, session, prompt), copy in zip(ready, copies) if copy is None]
        followers = [(session, prompt, ready[copy[0]][2], copy[1]) for (_, _, session, prompt), copy in zip(ready, copies) if copy]
        self.last_prefill_tokens = (sum(len(prompt) - session.kv.cached_len for session, prompt in leaders)
                                    + sum(len(prompt) - shared for session, prompt, _, shared in followers))
        logits_for_batch([(session.kv, prompt, 1) for session, prompt in leaders])
        for session, prompt, leader, shared in followers:
            session.kv.load_prefix(prompt[:shared], leader.kv.decode_cache.buf[:, :, :, :shared])
        logits_for_batch([(session.kv, prompt, 1) for session, prompt, _, _ in followers])
        elapsed = time.perf_counter_ns() - t0  # each open waited for the whole prefill
        for i, session_id, session, _ in ready:
            self.sessions.add(session_id, session)
            results[i] = elapsed
        return results

    def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        """Check ``proposal`` against the session's committed tokens; commit what the rule keeps."""
        result = self.verify_batch([(session_id, proposal)])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

    def verify_batch(self, steps: Sequence[tuple[str, DraftProposal]]) -> list[VerifyOutcome | SpecdecError]:
        """One verification step for each (session, proposal), all in one target forward.

        Proposals are ragged (each session its own k, 0 included). A step that is refused gets its
        error in its place and changes nothing; the others go on. Every session's tokens follow
        from its own logits and its own seed, so what shares a batch never changes an outcome.
        """
        t0 = time.perf_counter_ns()
        results: list[VerifyOutcome | SpecdecError | None] = [None] * len(steps)
        checked = []  # (index, session, proposal, committed length, draft probs)
        seen: set[str] = set()
        for i, (session_id, proposal) in enumerate(steps):
            try:  # validate everything before touching the session: a refused step leaves it as it was
                if session_id in seen:
                    raise InvalidRequest("a session verifies at most one step per batch")
                s = self.sessions.get(session_id)
                n = len(s.committed)
                check_room(n, len(proposal.token_ids), self.loaded.context_length)
                draft_probs = dense_draft_probs(proposal, self.loaded.vocab_size)  # [k, vocab] or None
            except SpecdecError as exc:
                results[i] = exc
                continue
            seen.add(session_id)
            checked.append((i, s, proposal, n, draft_probs))
        all_logits = logits_for_batch([(s.kv, s.committed + list(p.token_ids), len(p.token_ids) + 1)
                                       for _, s, p, _, _ in checked])  # each [k+1, vocab]
        for (i, s, proposal, n, draft_probs), logits in zip(checked, all_logits):
            tokens, accepted = self._decide(s, n, proposal, draft_probs, logits)
            s.committed.extend(tokens)
            results[i] = (tokens, accepted, len(s.committed))
        elapsed = time.perf_counter_ns() - t0  # each step waited for the whole batch
        return [VerifyOutcome(*r, elapsed) if isinstance(r, tuple) else r for r in results]

    def due_blocks(self, session_ids: Sequence[str]) -> list[tuple[str, list[tuple[int, bytes]]]]:
        """The KV blocks of these sessions (those a batch just stepped) that have become full and
        valid since last asked, encoded."""
        if self.layout is None:
            return []
        b = self.layout.block_tokens
        out = []
        for session_id in dict.fromkeys(session_ids):
            s = self.sessions.peek(session_id)
            if s is None:
                continue
            # Valid keys and values: the cached positions that are still the committed tokens. The
            # blocks written are valid already, so compare only past them (a block and a step, not
            # the whole sequence, per step).
            done = s.blocks_written * b
            valid = done + common_prefix_len(s.kv.cached_ids[done:], s.committed[done:])
            full = valid // b
            if full > s.blocks_written:
                buf = s.kv.decode_cache.buf
                blocks = [(i, encode_block(self.layout, i * b, s.committed, buf[:, :, :, i * b:(i + 1) * b]))
                          for i in range(s.blocks_written, full)]
                s.blocks_written = full
                out.append((session_id, blocks))
        return out

    def _decide(self, s: _Session, n: int, proposal: DraftProposal, draft_probs: torch.Tensor | None,
                logits: torch.Tensor) -> tuple[tuple[int, ...], int]:
        """The session's rule over its own logits [k+1, vocab]: greedy, coupled or rejection."""
        k = len(proposal.token_ids)
        if s.sampling.greedy:
            return greedy_verify(proposal.token_ids, logits)
        if s.sampling.coupled:
            noise = gumbel_noise(s.sampling.seed, range(n, n + k + 1), logits.shape[-1])  # [k+1, vocab]
            return coupled_verify_one(proposal.token_ids, processed_logprobs(logits, s.sampling), noise)
        return self._sample(s, n, proposal, draft_probs, logits)

    @staticmethod
    def _sample(s: _Session, n: int, proposal: DraftProposal, draft_probs: torch.Tensor | None,
                logits: torch.Tensor) -> tuple[tuple[int, ...], int]:
        k = len(proposal.token_ids)
        target_probs = probs_from_logits(logits, s.sampling)  # [k+1, vocab]
        seed = s.sampling.seed
        output, num_accepted = rejection_sample(
            draft_token_ids=torch.tensor([proposal.token_ids], dtype=torch.long).reshape(1, k),  # [1, k]
            draft_probs=None if draft_probs is None else draft_probs[None],  # [1, k, vocab]
            target_probs=target_probs[None],  # [1, k+1, vocab]
            accept_uniforms=rng.uniforms(seed, rng.Stream.ACCEPT, range(n, n + k))[None],  # [1, k]
            sample_uniforms=rng.uniforms(seed, rng.Stream.TARGET_SAMPLE, range(n, n + k + 1))[None],  # [1, k+1]
        )
        accepted = int(num_accepted[0])
        return tuple(int(t) for t in output[0, : accepted + 1]), accepted

    def close(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    @property
    def kv_budget_tokens(self) -> int:
        return self.config.max_kv_tokens or self.config.max_sessions * self.loaded.context_length

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value vectors of every layer for one token, as this engine stores them."""
        cfg = self.loaded.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        element = next(self.loaded.model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * heads * head_dim * element

    def kv_bytes_held(self) -> int:
        """Bytes of KV cache the sessions hold now (read by the metrics thread: retried if the table moves)."""
        for _ in range(3):
            try:
                return self.kv_bytes_per_token * sum(len(s.committed) for s in self.sessions.values())
            except RuntimeError:  # the table changed size while we read it
                continue
        return 0

    def kv_reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.sessions.values())

    def _check_kv_budget(self, reserve: int, reserving: int = 0) -> None:
        """``reserving``: tokens that opens of the same prefill batch, not yet in the table, reserve."""
        self.sessions.reap_idle()  # an expired session's reservation is free again
        held, budget = self.kv_reserved_tokens() + reserving, self.kv_budget_tokens
        if reserve > budget:
            raise KVBudgetFull(f"this session needs {reserve} KV tokens (prompt + max_new_tokens), more than this verifier's "
                               f"whole budget of {budget}: ask for fewer tokens", ever_fits=False)
        if held + reserve > budget:
            raise KVBudgetFull(f"this verifier's KV budget is {budget} tokens and {held} are reserved by {len(self.sessions)} "
                               f"sessions; this one needs {reserve} (prompt + max_new_tokens): retry later, on another "
                               "replica, or ask for fewer tokens", ever_fits=True)

    def status(self) -> WorkerInfo:
        self.sessions.reap_idle()
        return WorkerInfo(len(self.sessions), self.loaded.path, self.loaded.vocab_size, self.loaded.context_length)


class AsyncVerifierEngine:
    """A VerifierEngine on its own thread (or inline), awaitable from the event loop.

    Verify steps are batched: every step that arrives while a batch runs on the thread joins the
    next one (FIFO, up to ``max_batch_sessions``), so under load one target forward serves many
    sessions and nobody waits longer than the batch ahead of it.
    """

    def __init__(self, engine: VerifierEngine, threaded: bool = True, metrics: "VerifierMetrics | None" = None,
                 kv_store=None, executor: "Submits | None" = None, threads: ThreadChooser | None = None) -> None:
        """``kv_store``: a core.redis_kv.RedisKVStore for the sessions' KV blocks (None: not kept).
        ``executor``: where the model work runs (None: a thread of its own). ``threads``: choose each
        forward's torch thread count by measurement (core/threads.py; None: leave it as loaded)."""
        from specdec.core.offload import Offload

        self.engine = engine
        self.kv_store = kv_store
        self._run = Offload("verify", threaded, executor)
        # Model work on a thread shared with the drafter (one process): nothing drafts while a
        # forward runs, so drafting ahead cannot overlap verification here.
        self.shares_model_thread = executor is not None
        self.threads = threads
        self._waiting: collections.deque[tuple[str, DraftProposal, asyncio.Future]] = collections.deque()
        self._batcher: asyncio.Task | None = None
        self._opens: collections.deque[tuple[SessionSpec, int | None, Sequence[torch.Tensor], asyncio.Future]] = collections.deque()
        self._prefiller: asyncio.Task | None = None
        self._arrived = asyncio.Event()
        self._freed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by verify(): where the KV writer runs
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # sessions per forward, for benchmarks
        self.batch_costs = BatchCostModel()  # what a verified row costs under the load now (core/goodput.py)
        self.load_regimes = LoadRegimes()  # under load: adaptive k capped by that model, or a fixed k, as measured
        self._last_batch_end: float | None = None
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(sessions=lambda: len(engine.sessions), kv_bytes=engine.kv_bytes_held,
                          queued_steps=lambda: len(self._waiting) + self._run.pending)

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
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), closing_wait - loop.time())
                except asyncio.TimeoutError:
                    pass
            except KVBudgetFull as exc:
                left = deadline - loop.time()
                if not exc.ever_fits or left <= 0:
                    raise
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), left)
                except asyncio.TimeoutError:
                    pass  # one last try, then the error says why

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

    async def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        self._loop = asyncio.get_running_loop()
        done = self._loop.create_future()
        self._waiting.append((session_id, proposal, done))
        self._arrived.set()
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.ensure_future(self._batches())
        return await done

    async def _gather(self, limit: int) -> None:
        """Wait (bounded by batch_wait_s) until every open session has a step waiting, or the batch is full."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine.config.batch_wait_s
        while len(self._waiting) < min(limit, len(self.engine.sessions)):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _batches(self) -> None:
        limit = self.engine.config.max_batch_sessions
        while self._waiting:
            await self._gather(limit)
            batch = []
            while self._waiting and len(batch) < limit:
                item = self._waiting.popleft()
                if not item[2].done():  # a step whose session was cancelled while it waited
                    batch.append(item)
            if not batch:
                continue
            self.batch_sizes[len(batch)] += 1
            started = time.perf_counter()
            try:
                results = await self._run(self._timed, sum(len(p.token_ids) + 1 for _, p, _ in batch), self._verify_batch,
                                          [(sid, proposal) for sid, proposal, _ in batch])
            except BaseException as exc:  # a bug in the forward, or shutdown: every step of the batch hears it
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            ended = time.perf_counter()
            # The steps' outcomes first: a fault in the bookkeeping below must cost no session its step.
            for (_, _, done), result in zip(batch, results):
                if not done.done():
                    done.set_exception(result) if isinstance(result, BaseException) else done.set_result(result)
            since = None if self._last_batch_end is None else ended - self._last_batch_end
            self._last_batch_end = ended
            committed = sum(len(r.token_ids) for r in results if isinstance(r, VerifyOutcome))
            try:
                self.batch_costs.observe(sum(len(p.token_ids) + 1 for _, p, _ in batch), ended - started, committed, since,
                                         drafts=sum(len(p.token_ids) for _, p, _ in batch))
                self.load_regimes.observe(len(self.engine.sessions), committed, ended)
            except Exception:  # speed's bookkeeping, not output: log it and keep batching
                log.exception("verify batch bookkeeping failed")

    @property
    def open_sessions(self) -> int:
        return len(self.engine.sessions)

    async def on_model_thread(self, fn: Callable[..., R], *args) -> R:
        """``fn(*args)`` where this engine's model work runs (benchmarks: a baseline on the same thread)."""
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

    async def close(self, session_id: str) -> bool:
        closed = await self._run(self.engine.close, session_id)
        self._freed.set()  # a session waiting for KV room may fit now
        return closed

    async def status(self) -> WorkerInfo:
        return await self._run(self.engine.status)
