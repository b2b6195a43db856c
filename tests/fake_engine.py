"""A fake verifier engine for the scheduler's unit tests: the engine's interface, no model.

Its "target" continues every sequence with (last token + 1) mod ``VOCAB``, so a draft is accepted
exactly when it counts up; it records every batch it was given."""
from __future__ import annotations

from collections.abc import Sequence

from specdec.core.errors import SpecdecError
from specdec.core.session_table import SessionTable
from specdec.core.steps import DraftProposal, SessionSpec, VerifyOutcome, WorkerInfo
from specdec.target.engine import SessionState, TargetConfig

VOCAB = 50


class FakeLoaded:
    context_length = 512
    vocab_size = VOCAB
    path = "fake"


class FakeEngine:
    def __init__(self, config: TargetConfig = TargetConfig("fake")) -> None:
        self.config = config
        self.loaded = FakeLoaded()
        self.sessions: SessionTable[SessionState] = SessionTable(config.max_sessions, config.idle_timeout_s)
        self.batches: list[list[tuple[str, DraftProposal]]] = []

    def open_batch(self, opens: Sequence[tuple[SessionSpec, int | None, Sequence]]) -> list[int | SpecdecError]:
        out: list[int | SpecdecError] = []
        for spec, _, _ in opens:
            try:
                self.sessions.check_can_add(spec.session_id)
            except SpecdecError as exc:
                out.append(exc)
                continue
            self.sessions.add(spec.session_id, SessionState(list(spec.prompt_ids), None, spec.sampling, 0))
            out.append(1)
        return out

    def verify_batch(self, steps: Sequence[tuple[str, DraftProposal]]) -> list[VerifyOutcome | SpecdecError]:
        self.batches.append(list(steps))
        out: list[VerifyOutcome | SpecdecError] = []
        for session_id, proposal in steps:
            s = self.sessions.get(session_id)
            tokens, last = [], s.committed[-1]
            for draft in proposal.token_ids:
                if draft != (last + 1) % VOCAB:
                    break
                tokens.append(draft)
                last = draft
            accepted = len(tokens)
            tokens.append((last + 1) % VOCAB)
            s.committed.extend(tokens)
            out.append(VerifyOutcome(tuple(tokens), accepted, len(s.committed), 1000))
        return out

    def due_blocks(self, session_ids):
        return []

    def close(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    def kv_bytes_held(self) -> int:
        return 0

    def status(self) -> WorkerInfo:
        return WorkerInfo(len(self.sessions), "fake", VOCAB, self.loaded.context_length)
