"""The verifier's core: the target model, one KV cache per session, the rejection rule. No gRPC here."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.core import rng
from specdec.core.kv import KVSequence
from specdec.core.llama_decode import PACK_ROWS, LlamaDecoder, supports
from specdec.core.models import LoadedModel, load_causal_lm
from specdec.core.coupled import coupled_verify_one, processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.rejection import greedy_verify, rejection_sample
from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.core.session_table import SessionTable
from specdec.core.sessions import check_session_id
from specdec.core.steps import DraftProposal, SessionSpec, VerifyOutcome, WorkerInfo, check_room, dense_draft_probs, validate_prompt


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


@dataclass
class _Session:
    kv: KVSequence
    committed: list[int]
    sampling: SamplingParams


class VerifierEngine:
    """Synchronous; the server runs it on one worker thread, the embedded path calls it directly."""

    def __init__(self, loaded: LoadedModel, config: TargetConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.sessions: SessionTable[_Session] = SessionTable(config.max_sessions, config.idle_timeout_s)
        fast = config.fast_forward and supports(loaded.model)
        self.decoder = LlamaDecoder(loaded.model, pack_rows=config.pack_rows) if fast else None

    @classmethod
    def from_config(cls, config: TargetConfig) -> "VerifierEngine":
        return cls(load_causal_lm(config.model_path, threads=config.threads), config)

    def open(self, spec: SessionSpec) -> int:
        t0 = time.perf_counter_ns()
        check_session_id(spec.session_id)  # before the prefill, not after it
        validate_prompt(spec.prompt_ids, self.loaded.vocab_size, self.loaded.context_length)
        session = _Session(KVSequence(self.loaded.model, self.decoder), list(spec.prompt_ids), spec.sampling)
        # Prefill all but the last prompt token's successor: the first Verify feeds only drafts.
        session.kv.logits_for(spec.prompt_ids, 1)
        self.sessions.add(spec.session_id, session)
        return time.perf_counter_ns() - t0

    def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        """Check ``proposal`` against the session's committed tokens; commit what the rejection rule keeps."""
        t0 = time.perf_counter_ns()
        s = self.sessions.get(session_id)
        # Validate everything before touching the session: a refused step leaves it as it was.
        n = len(s.committed)
        k = len(proposal.token_ids)
        check_room(n, k, self.loaded.context_length)
        draft_probs = dense_draft_probs(proposal, self.loaded.vocab_size)  # [k, vocab] or None
        logits = s.kv.logits_for(s.committed + list(proposal.token_ids), k + 1)  # [k+1, vocab]
        if s.sampling.greedy:
            tokens, accepted = greedy_verify(proposal.token_ids, logits)
        elif s.sampling.coupled:
            noise = gumbel_noise(s.sampling.seed, range(n, n + k + 1), logits.shape[-1])  # [k+1, vocab]
            tokens, accepted = coupled_verify_one(proposal.token_ids, processed_logprobs(logits, s.sampling), noise)
        else:
            tokens, accepted = self._sample(s, n, proposal, draft_probs, logits)
        s.committed.extend(tokens)
        return VerifyOutcome(tokens, accepted, len(s.committed), time.perf_counter_ns() - t0)

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

    def status(self) -> WorkerInfo:
        self.sessions.reap_idle()
        return WorkerInfo(len(self.sessions), self.loaded.path, self.loaded.vocab_size, self.loaded.context_length)


class AsyncVerifierEngine:
    """A VerifierEngine on its own thread (or inline), awaitable from the event loop."""

    def __init__(self, engine: VerifierEngine, threaded: bool = True) -> None:
        from specdec.core.offload import Offload

        self.engine = engine
        self._run = Offload("verify", threaded)

    async def open(self, spec: SessionSpec) -> int:
        return await self._run(self.engine.open, spec)

    async def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        return await self._run(self.engine.verify, session_id, proposal)

    async def close(self, session_id: str) -> bool:
        return await self._run(self.engine.close, session_id)

    async def status(self) -> WorkerInfo:
        return await self._run(self.engine.status)
