"""The draft worker's core: open sessions, sync committed tokens, propose. No gRPC here."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.core.errors import InvalidRequest
from specdec.core.session_table import SessionTable
from specdec.core.sessions import check_session_id
from specdec.core.steps import DraftProposal, SequenceSync, SessionSpec, WorkerInfo, apply_sync, validate_prompt
from specdec.draft.drafters import DraftConfig, Drafter, DraftSession, build_drafters, pick

MAX_SPECULATIVE_TOKENS = 64


@dataclass
class _Session:
    drafter: DraftSession
    committed: list[int]
    vocab_size: int  # token ids synced in must be below this


class DraftEngine:
    """Synchronous; the server runs it on one worker thread, the embedded path calls it directly."""

    def __init__(self, drafters: dict[str, Drafter], config: DraftConfig, context_length: int = 1 << 20) -> None:
        if not drafters:
            raise ValueError("a draft worker needs at least one drafter")
        self.drafters = drafters
        self.config = config
        self.context_length = context_length
        self.sessions: SessionTable[_Session] = SessionTable(config.max_sessions, config.idle_timeout_s)

    @classmethod
    def from_config(cls, config: DraftConfig) -> "DraftEngine":
        drafters = build_drafters(config)
        models = [d.loaded for d in drafters.values() if hasattr(d, "loaded")]
        context = min((m.context_length for m in models), default=1 << 20)
        return cls(drafters, config, context)

    def open(self, spec: SessionSpec) -> int:
        t0 = time.perf_counter_ns()
        check_session_id(spec.session_id)  # before the prefill, not after it
        drafter = pick(self.drafters, spec.drafter)
        vocab = drafter.vocab_size or (1 << 31) - 1  # model-free drafters: any non-negative int32
        validate_prompt(spec.prompt_ids, vocab, self.context_length)
        self.sessions.add(spec.session_id, _Session(drafter.open(spec.prompt_ids, spec.sampling), list(spec.prompt_ids), vocab))
        return time.perf_counter_ns() - t0

    def draft(self, session_id: str, sync: SequenceSync, num_speculative_tokens: int) -> DraftProposal:
        if not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens}")
        session = self.sessions.get(session_id)
        apply_sync(session.committed, sync, session.vocab_size)
        # Never draft past the model's context: the verifier would refuse the step.
        room = max(0, self.context_length - len(session.committed) - 1)
        return session.drafter.propose(session.committed, min(num_speculative_tokens, room))

    def close(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    def status(self) -> WorkerInfo:
        self.sessions.reap_idle()
        paths = [d.loaded.path for d in self.drafters.values() if hasattr(d, "loaded")]
        vocab = max((d.vocab_size for d in self.drafters.values()), default=0)
        return WorkerInfo(len(self.sessions), ",".join(paths) or "model-free", vocab, self.context_length, tuple(sorted(self.drafters)))


class AsyncDraftEngine:
    """The DraftWorker protocol over a DraftEngine (in-process use, and the servicer's backend)."""

    def __init__(self, engine: DraftEngine, threaded: bool = True) -> None:
        from specdec.core.offload import Offload

        self.engine = engine
        self._run = Offload("draft", threaded)

    async def open(self, spec: SessionSpec) -> int:
        return await self._run(self.engine.open, spec)

    async def draft(self, session_id: str, sync: SequenceSync, num_speculative_tokens: int) -> DraftProposal:
        return await self._run(self.engine.draft, session_id, sync, num_speculative_tokens)

    async def close(self, session_id: str) -> bool:
        return await self._run(self.engine.close, session_id)

    async def status(self) -> WorkerInfo:
        return await self._run(self.engine.status)
