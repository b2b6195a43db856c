"""What crosses the boundary between the orchestrator's loop and the workers, as plain dataclasses.

The loop talks to ``DraftWorker`` and ``VerifyWorker``. In one process (``specdec generate``) the
draft and target engines are called directly; across processes a gRPC client converts these same
dataclasses to protobuf at the edge (specdec.orchestrator.remote), so both paths run the same core.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.core.errors import InvalidRequest, SessionOutOfSync
from specdec.core.sampling import SamplingParams


@dataclass(frozen=True)
class SparseDistribution:
    """The exact distribution a draft token was drawn from: non-zero entries only."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class SessionSpec:
    """What a worker needs to open a session."""

    session_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    drafter: str = ""  # drafter workers only


@dataclass(frozen=True)
class SequenceSync:
    """The worker keeps its first ``base_len`` committed tokens, then appends ``append_ids``."""

    base_len: int
    append_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens for the next positions, and the distributions they came from (None: point masses)."""

    token_ids: tuple[int, ...]
    distributions: tuple[SparseDistribution, ...] | None = None
    draft_time_ns: int = 0


@dataclass(frozen=True)
class VerifyOutcome:
    """Tokens one verification step committed: ``num_accepted`` draft tokens, then one more."""

    token_ids: tuple[int, ...]
    num_accepted: int
    committed_len: int
    verify_time_ns: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    active_sessions: int
    model: str
    vocab_size: int
    context_length: int
    drafters: tuple[str, ...] = field(default=())


class DraftWorker(Protocol):
    async def open(self, spec: SessionSpec) -> int: ...  # returns prefill time in ns
    async def draft(self, session_id: str, sync: SequenceSync, num_speculative_tokens: int) -> DraftProposal: ...
    async def close(self, session_id: str) -> bool: ...
    async def status(self) -> WorkerInfo: ...


class VerifyWorker(Protocol):
    async def open(self, spec: SessionSpec) -> int: ...
    async def verify(self, session_id: str, sync: SequenceSync, proposal: DraftProposal) -> VerifyOutcome: ...
    async def close(self, session_id: str) -> bool: ...
    async def status(self) -> WorkerInfo: ...


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """InvalidRequest naming ``what`` if any id is outside [0, vocab_size): it would index past the embeddings."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_sync(held: int, sync: SequenceSync, vocab_size: int) -> int:
    """Validate a sync against a worker holding ``held`` committed tokens, changing nothing.

    Returns the committed length the sync leads to.
    """
    if sync.base_len > held:
        raise SessionOutOfSync(f"sync base_len {sync.base_len} exceeds the {held} tokens this worker holds")
    check_token_ids(sync.append_ids, vocab_size, "synced token ids (sync.append_ids)")
    return sync.base_len + len(sync.append_ids)


def apply_sync(committed: list[int], sync: SequenceSync, vocab_size: int) -> None:
    """Bring a worker's committed tokens in step with the orchestrator's, in place; nothing changes on error."""
    check_sync(len(committed), sync, vocab_size)
    del committed[sync.base_len :]
    committed.extend(sync.append_ids)


def dense_draft_probs(proposal: DraftProposal, vocab_size: int) -> torch.Tensor | None:
    """Validate a proposal's sparse distributions and expand them: [k, vocab] float32, or None."""
    k = len(proposal.token_ids)
    check_token_ids(proposal.token_ids, vocab_size, "draft token ids")
    if proposal.distributions is None or k == 0:
        return None
    if len(proposal.distributions) != k:
        raise InvalidRequest(f"{len(proposal.distributions)} draft distributions for {k} draft tokens: send one per token, or none")
    dense = torch.zeros(k, vocab_size)
    for i, (tok, dist) in enumerate(zip(proposal.token_ids, proposal.distributions)):
        if len(dist.token_ids) != len(dist.probs) or not dist.token_ids:
            raise InvalidRequest(f"draft distribution {i}: token_ids and probs must be non-empty and of equal length")
        if any(not 0 <= t < vocab_size for t in dist.token_ids) or len(set(dist.token_ids)) != len(dist.token_ids):
            raise InvalidRequest(f"draft distribution {i}: token ids must be distinct and inside [0, {vocab_size})")
        if any(not (p > 0 and math.isfinite(p)) for p in dist.probs) or abs(sum(dist.probs) - 1.0) > 1e-3:
            raise InvalidRequest(f"draft distribution {i}: probabilities must be positive and sum to 1")
        if tok not in dist.token_ids:
            raise InvalidRequest(f"draft token {tok} at position {i} has zero probability in its own distribution")
        dense[i, list(dist.token_ids)] = torch.tensor(dist.probs)
    return dense / dense.sum(-1, keepdim=True)


def check_room(committed_len: int, num_draft: int, context_length: int) -> None:
    """A step reads positions up to committed_len + num_draft - 1 and writes one more token."""
    if committed_len + num_draft >= context_length + 1 or committed_len >= context_length:
        raise InvalidRequest(
            f"{committed_len} committed + {num_draft} draft tokens do not fit the model's context of {context_length} tokens"
        )


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, context_length: int) -> None:
    if not prompt_ids:
        raise InvalidRequest("prompt is empty: send at least one token")
    if len(prompt_ids) >= context_length:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; the model's context holds {context_length}, so it must be shorter")
    check_token_ids(prompt_ids, vocab_size, "prompt token ids")
