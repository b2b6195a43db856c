"""What crosses the boundaries between the loop's parts, as plain dataclasses.

The orchestrator talks to a ``VerifyWorker``: it runs a whole session and streams ``StepCommit``s.
The verifier's loop talks to the session's drafter through a ``DraftLink``: ``StepOutcome``s one
way, ``DraftBlock``s the other. In one process (``specdec generate``) these are in-process objects;
across processes gRPC adapters convert the same dataclasses to protobuf at the edge
(specdec.rpc.wire), so both paths run the same core.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.core.features import FeatureChunk
from specdec.core.errors import InvalidRequest, SessionOutOfSync
from specdec.core.sampling import SamplingParams
from specdec.core.speculation import SpeculationPolicy
from specdec.core.tree import DraftTree

MAX_STEP_TOKENS = 65  # 64 draft tokens (the speculation length's cap) and the recovered or bonus token
# Prompt tokens per batched prefill forward, at the verifier and at the drafter (its attention's
# padded mask grows with sessions x longest prompt x context).
MAX_PREFILL_TOKENS = 4096
MAX_DISTRIBUTION_ENTRIES = 1024  # a draft token's sent distribution: its top-K (32 by default), never the vocabulary
MAX_FALLBACK_DRAFTERS = 8  # other drafters a session may move to (SessionRun.fallback_drafters)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class SparseDistribution:
    """The exact distribution a draft token was drawn from: non-zero entries only."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class LookaheadParams:
    """Lookahead decoding's shape for one request (drafter ``lookahead``): the Jacobi window W, the
    n-gram size N, the candidate n-grams G; 0: the deployment's default."""

    window: int = 0
    ngram: int = 0
    candidates: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.window <= MAX_LOOKAHEAD and (self.ngram == 0 or 2 <= self.ngram <= MAX_LOOKAHEAD)
                and 0 <= self.candidates <= MAX_LOOKAHEAD):
            raise InvalidRequest(f"lookahead: window and candidates in [0, {MAX_LOOKAHEAD}], ngram 0 or in [2, {MAX_LOOKAHEAD}] "
                                 f"(0: the server's default); got {self.window}, {self.ngram}, {self.candidates}")


MAX_LOOKAHEAD = 16


@dataclass(frozen=True)
class SessionSpec:
    """What a worker needs to open a session."""

    session_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    drafter: str = ""  # drafter workers only
    lookahead: LookaheadParams = LookaheadParams()  # drafter `lookahead` only


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens for the next positions, and the distributions they came from (None: point masses).

    ``alternatives`` never leaves the drafter: per draft position, its next likeliest tokens, which
    are its guesses of the recovered token should the verifier reject the draft there.
    ``parents`` makes the tokens a token tree (core/tree.py; empty: a chain); a tree's tokens are
    point masses (no distributions).
    """

    token_ids: tuple[int, ...]
    distributions: tuple[SparseDistribution, ...] | None = None
    draft_time_ns: int = 0
    alternatives: tuple[tuple[int, ...], ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.parents:
            DraftTree(self.token_ids, self.parents)  # ValueError naming what is wrong with the shape
            if self.distributions is not None:
                raise ValueError("a token tree's drafts are point masses: send no distributions with parents")

    @property
    def tree(self) -> DraftTree:
        return DraftTree.from_wire(self.token_ids, self.parents)

    def truncated(self, k: int) -> DraftProposal:
        """The first k draft tokens (of a tree: its first k nodes): a prefix of a block is itself a valid block."""
        if k >= len(self.token_ids):
            return self
        dists = None if self.distributions is None else self.distributions[:k]
        return DraftProposal(self.token_ids[:k], dists, self.draft_time_ns, self.alternatives[:k], self.parents[:k])


@dataclass(frozen=True)
class DraftBlock:
    """Draft tokens that continue one exact committed sequence.

    That sequence is the first ``anchor_len`` committed tokens (known to the drafter) followed by
    ``assumed_ids`` (what it guessed the block in flight would commit; empty for a block drafted
    just in time). A block is used only where that is exactly the committed sequence.
    """

    anchor_len: int
    assumed_ids: tuple[int, ...]
    proposal: DraftProposal

    @property
    def base_len(self) -> int:
        return self.anchor_len + len(self.assumed_ids)

    def continues(self, committed: Sequence[int]) -> bool:
        """Whether this block was drafted for exactly ``committed`` (O(len(assumed_ids)))."""
        return len(committed) == self.base_len and tuple(committed[self.anchor_len :]) == self.assumed_ids


@dataclass(frozen=True)
class StepOutcome:
    """What one verification step committed (the last ``len(token_ids)`` of ``committed_len``
    tokens), and how the drafter should go on."""

    committed_len: int
    token_ids: tuple[int, ...]
    num_speculative_tokens: int
    overlap: bool = True
    features: FeatureChunk | None = None  # for drafters that read the target's features (core/features.py)
    # For drafters that iterate on the target's guesses (core/features.py): the step's block
    # (draft ids, tree parents) and the target's likeliest token after each of its drafts.
    row_argmax: tuple[int, ...] = ()
    verified_ids: tuple[int, ...] = ()
    verified_parents: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyOutcome:
    """Tokens one verification step committed: ``num_accepted`` draft tokens, then one more."""

    token_ids: tuple[int, ...]
    num_accepted: int
    committed_len: int
    verify_time_ns: int = 0


@dataclass(frozen=True)
class SessionRun:
    """One session for a verifier to run to its end."""

    spec: SessionSpec
    drafter_address: str  # where the drafter serves; "" in one process
    max_new_tokens: int
    policy: SpeculationPolicy
    stop_token_ids: tuple[int, ...] = ()
    drafter_server_name: str = ""  # with TLS: the name on the drafter's certificate, when dialled by IP
    # Other drafters of the pool, (address, server name), tried in turn when the session's own fails.
    fallback_drafters: tuple[tuple[str, str], ...] = ()

    def drafters(self) -> tuple[tuple[str, str], ...]:
        """Every drafter the session may stream from, its own first."""
        own = ((self.drafter_address, self.drafter_server_name),) if self.drafter_address else ()
        return own + tuple(d for d in self.fallback_drafters if d[0] != self.drafter_address)


@dataclass(frozen=True)
class StepCommit:
    """One step as the verifier reports it to the orchestrator."""

    token_ids: tuple[int, ...]
    num_draft_tokens: int  # the step's speculation length (0: plain decoding)
    num_accepted: int
    committed_len: int
    verify_time_ns: int = 0
    draft_wait_ns: int = 0
    predrafted: bool = False  # the block was drafted while the previous step was verified
    finished: bool = False


@dataclass(frozen=True)
class WorkerInfo:
    active_sessions: int
    model: str
    vocab_size: int
    context_length: int
    drafters: tuple[str, ...] = field(default=())


class DraftLink(Protocol):
    """The verifier's side of one session's drafter (in-process, or a gRPC stream)."""

    async def open(self, spec: SessionSpec) -> None:
        """Open the session on the drafter (prefill); raises if the drafter cannot serve it."""
        ...

    def send(self, outcome: StepOutcome) -> None:
        """Tell the drafter what a step committed. Never blocks; a dead drafter shows in ``up``."""
        ...

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        """The first block that continues ``committed`` (stale ones are dropped), or None after
        ``timeout_s`` or once the drafter is gone."""
        ...

    @property
    def up(self) -> bool:
        """False once the drafter failed; the verifier then decodes without it."""
        ...

    async def close(self) -> None:
        """Free the session on the drafter. Idempotent."""
        ...


class VerifyWorker(Protocol):
    """The orchestrator's view of a verifier: it runs whole sessions."""

    def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        """Run a session, one StepCommit per step; closing the iterator cancels and frees it."""
        ...

    async def status(self) -> WorkerInfo: ...


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """InvalidRequest naming ``what`` if any id is outside [0, vocab_size): it would index past the embeddings."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def apply_outcome(committed: list[int], outcome: StepOutcome, vocab_size: int) -> None:
    """Bring a drafter's committed tokens in step with the verifier's, in place; nothing changes on error."""
    base = outcome.committed_len - len(outcome.token_ids)
    if not 0 <= base <= len(committed):
        raise SessionOutOfSync(f"outcome commits {len(outcome.token_ids)} tokens to reach {outcome.committed_len}, "
                               f"but this worker holds {len(committed)}")
    if len(outcome.token_ids) > MAX_STEP_TOKENS:
        raise InvalidRequest(f"an outcome commits at most {MAX_STEP_TOKENS} tokens, got {len(outcome.token_ids)}")
    if not 0 <= outcome.num_speculative_tokens < MAX_STEP_TOKENS:
        raise InvalidRequest(f"num_speculative_tokens must be in [0, {MAX_STEP_TOKENS - 1}], got {outcome.num_speculative_tokens}")
    check_token_ids(outcome.token_ids, vocab_size, "committed token ids (outcome.token_ids)")
    del committed[base:]
    committed.extend(outcome.token_ids)


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
