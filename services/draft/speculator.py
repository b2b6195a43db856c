"""One session's drafting as a small state machine: what to draft next, and which blocks stay useful.

The verifier tells the drafter what each step committed (``StepOutcome``); the drafter answers with
``DraftBlock``s. First the block the verifier waits for (drafted just in time for the committed
sequence), then, while the verifier checks it, blocks for its likeliest outcomes
(specdec.core.overlap). A block is emitted only if it continues, or may still continue, the
committed sequence. The drafter mirrors the verifier's buffer of unused blocks with the same rule,
so both agree which block is in flight without another message. Not thread-safe: the draft
worker's scheduler (specdec.draft.engine) calls it under its lock.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.core.errors import InvalidRequest
from specdec.core.steps import common_prefix_len
from specdec.core.overlap import BlockBuffer, Predraft, could_continue, plan_predrafts
from specdec.core.steps import DraftBlock, DraftProposal, StepOutcome, apply_outcome
from specdec.draft.drafters import DraftSession

JUST_IN_TIME = Predraft((), False, 1.0)
NUM_ALTERNATIVES = 2  # recovered-token guesses kept per draft position
MAX_PREDRAFTS = 9  # blocks drafted ahead per block in flight, at most


@dataclass(frozen=True)
class Work:
    """Blocks to draft in one go: after each of ``sequences`` (committed tokens, then that pre-draft's
    assumed ones), ``num_tokens`` tokens (one more than a block for a bonus guess)."""

    predrafts: tuple[Predraft, ...]
    anchor_len: int
    sequences: tuple[tuple[int, ...], ...]
    num_tokens: int
    version: int


class SessionSpeculator:
    def __init__(self, session: DraftSession, prompt_ids: Sequence[int], vocab_size: int, context_length: int,
                 emit: Callable[[DraftBlock], None]) -> None:
        self.session = session
        self.committed = list(prompt_ids)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.emit = emit
        self.k = 0  # nothing is drafted until the verifier asks
        self.overlap = True
        self.version = 0  # bumps with every outcome: work picked before it may be stale
        self.alpha = 0.6  # acceptance estimate; orders pre-drafts only
        self._in_flight: DraftBlock | None = None  # the block the verifier checks (or is about to)
        self._unused = BlockBuffer()  # mirror of the verifier's buffer of blocks sent and not yet used
        self._plan: list[Predraft] = []
        self._drafting_jit = False  # a just-in-time block for the current version is being drafted

    def on_outcome(self, outcome: StepOutcome) -> None:
        """Apply a step's outcome (validated first: nothing changes on error), then re-plan."""
        if outcome.committed_len > self.context_length:
            raise InvalidRequest(f"the outcome would make the session {outcome.committed_len} tokens long; this drafter "
                                 f"keeps at most {self.context_length} per session")
        base = outcome.committed_len - len(outcome.token_ids)
        features_only = (not outcome.token_ids and outcome.committed_len == len(self.committed) and outcome.features is not None
                         and (outcome.num_speculative_tokens, outcome.overlap) == (self.k, self.overlap))
        reads_features = outcome.features is not None and hasattr(self.session, "add_features")
        if reads_features:
            self.session.check_features(outcome.features)  # before anything changes
        apply_outcome(self.committed, outcome, self.vocab_size)
        if reads_features:
            self.session.add_features(outcome.features)
        if outcome.row_argmax and hasattr(self.session, "add_row_tokens"):
            self.session.add_row_tokens(base, outcome.token_ids, outcome.verified_ids, outcome.verified_parents, outcome.row_argmax)
        if features_only:
            return  # more of a step's features (core/features.py): nothing to re-plan
        self.k, self.overlap = outcome.num_speculative_tokens, outcome.overlap
        self.version += 1
        self._drafting_jit = False
        block = self._in_flight
        if block is not None and block.base_len == base and block.proposal.token_ids and outcome.token_ids:
            # The step committed its accepted drafts and then one token of its own.
            accepted = min(common_prefix_len(block.proposal.token_ids, outcome.token_ids), len(outcome.token_ids) - 1)
            rejected = int(accepted < len(block.proposal.token_ids))
            self.alpha = 0.9 * self.alpha + 0.1 * accepted / (accepted + rejected) if accepted + rejected else self.alpha
        self._set_in_flight(self._unused.take(self.committed))

    def _set_in_flight(self, block: DraftBlock | None) -> None:
        self._in_flight = block
        self._plan = plan_predrafts(block, self.alpha, MAX_PREDRAFTS) if block is not None and self.overlap else []

    def wants_just_in_time(self) -> bool:
        """A verifier waits for a block nobody is drafting yet."""
        return self.k > 0 and self._in_flight is None and not self._drafting_jit

    def next_work(self, batched: bool) -> Work | None:
        """What to draft next, or None: the just-in-time block first, then pre-drafts, likeliest first
        (all of them at once when the drafter can draft ``batched``)."""
        if self.k <= 0:
            return None
        if self._in_flight is None:
            if self._drafting_jit:
                return None
            predrafts: list[Predraft] = [JUST_IN_TIME]
        else:
            take = len(self._plan) if batched else 1
            predrafts, self._plan = self._plan[:take], self._plan[take:]
        room = self.context_length - len(self.committed) - 1  # never draft past the model's context
        fitting = [p for p in predrafts if len(p.assumed_ids) + self.k + int(p.bonus) <= room]
        if not fitting:
            return None  # the context is nearly full: the verifier decodes the rest itself
        self._drafting_jit = fitting[0] is JUST_IN_TIME
        num_tokens = self.k + int(any(p.bonus for p in fitting))
        sequences = tuple((*self.committed, *p.assumed_ids) for p in fitting)
        return Work(tuple(fitting), len(self.committed), sequences, num_tokens, self.version)

    def is_stale(self, work: Work) -> bool:
        """Whether work picked earlier can no longer give a usable block (polled while drafting)."""
        if work.version == self.version:
            return False
        probes = (DraftBlock(work.anchor_len, seq[work.anchor_len :], DraftProposal(())) for seq in work.sequences)
        return not any(could_continue(probe, self.committed) for probe in probes)

    def finish(self, work: Work, proposals: Sequence[DraftProposal]) -> None:
        """Turn drafted tokens into blocks and emit those that are (still) usable."""
        if work.predrafts[0] is JUST_IN_TIME and work.version == self.version:
            self._drafting_jit = False
        for predraft, sequence, proposal in zip(work.predrafts, work.sequences, proposals):
            assumed = sequence[work.anchor_len :]
            if predraft.bonus:  # the first drafted token is the guess of the bonus token
                if not proposal.token_ids:
                    continue
                assumed += proposal.token_ids[:1]
                proposal = DraftProposal(proposal.token_ids[1:], None if proposal.distributions is None else proposal.distributions[1:],
                                         proposal.draft_time_ns, proposal.alternatives[1:])
            block = DraftBlock(work.anchor_len, assumed, proposal.truncated(self.k) if self.k else proposal)
            if predraft is not JUST_IN_TIME and not block.proposal.token_ids:
                continue  # a pre-draft cut short before its first draft: the verifier would take it for a step without one
            if not could_continue(block, self.committed):
                continue  # an outcome arrived meanwhile and ruled this block out
            self.emit(block)
            if self._in_flight is None and block.continues(self.committed):
                self._set_in_flight(block)  # the verifier, waiting for exactly this, takes it at once
            else:
                self._unused.add(block)
