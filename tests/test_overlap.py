"""Overlap: which draft blocks stay usable, what is pre-drafted, and exact rollback on both workers
when every position of a block is rejected while the next blocks are already drafted."""
from __future__ import annotations

import queue
import secrets

import pytest
import torch

from specdec.core.overlap import BlockBuffer, could_continue, plan_predrafts
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftBlock, DraftProposal, SessionSpec, StepOutcome
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.target.engine import TargetConfig, VerifierEngine


def block(anchor: int, assumed: tuple[int, ...], drafts: tuple[int, ...] = (9,), alternatives=()) -> DraftBlock:
    return DraftBlock(anchor, assumed, DraftProposal(drafts, alternatives=alternatives))


COMMITTED = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("b, continues, could", [
    (block(5, ()), True, True),  # drafted just in time for exactly this sequence
    (block(3, (4, 5)), True, True),  # pre-drafted at length 3, assuming the 4, 5 that were committed
    (block(3, (4, 6)), False, False),  # assumed a 6 where a 5 was committed: never usable
    (block(5, (6,)), False, True),  # assumes a token not committed yet: may still come true
    (block(4, (5, 6, 7)), False, True),
    (block(4, ()), False, False),  # for a shorter sequence than is committed: stale
    (block(6, ()), False, False),  # anchored past what is committed: not from this session's history
])
def test_block_continues_exactly_its_sequence(b, continues, could):
    assert b.continues(COMMITTED) is continues
    assert could_continue(b, COMMITTED) is could


def test_buffer_takes_the_first_match_and_drops_only_dead_blocks():
    buf = BlockBuffer()
    dead, future, first, second = block(3, (4, 6)), block(5, (6,)), block(3, (4, 5), (7,)), block(5, (), (8,))
    for b in (dead, future, first, second):
        buf.add(b)
    assert buf.take(COMMITTED) is first  # arrival order decides, as on the drafter's mirror
    assert len(buf) == 1  # `second` continued the same sequence and is dropped with the dead one
    assert buf.take(COMMITTED + [6]) is future


def test_predrafts_cover_the_likeliest_outcomes_first():
    b = block(5, (), drafts=(10, 11, 12), alternatives=((20, 21), (30, 31), (40, 41)))
    plans = plan_predrafts(b, alpha=0.6, max_blocks=20)
    assumed = [p.assumed_ids for p in plans]
    # Every outcome: reject at j with each guess, or all accepted (then the bonus guess is drafted).
    assert set(assumed) == {(20,), (21,), (10, 30), (10, 31), (10, 11, 40), (10, 11, 41), (10, 11, 12)}
    assert [p.bonus for p in plans].count(True) == 1 and plans[[p.assumed_ids for p in plans].index((10, 11, 12))].bonus
    likelihoods = [p.likelihood for p in plans]
    assert likelihoods == sorted(likelihoods, reverse=True)
    assert assumed[0] == (20,)  # rejecting the first draft, recovered = its 2nd choice, is likeliest at alpha 0.6
    assert len(plan_predrafts(b, 0.6, 3)) == 3


# ----------------------------------------------------------------------------- both workers, real models


class Blocks:
    """Collects what a DraftEngine emits (on its own thread); ``until`` looks at unclaimed ones first."""

    def __init__(self) -> None:
        self.q: queue.Queue[DraftBlock] = queue.Queue()
        self.backlog: list[DraftBlock] = []

    def emit(self, b: DraftBlock) -> None:
        self.q.put(b)

    def until(self, predicate, timeout_s: float = 60.0) -> DraftBlock:
        for b in self.backlog:
            if predicate(b):
                self.backlog.remove(b)
                return b
        while True:
            b = self.q.get(timeout=timeout_s)
            if predicate(b):
                return b
            self.backlog.append(b)

    def pending(self) -> list[DraftBlock]:
        while not self.q.empty():
            self.backlog.append(self.q.get_nowait())
        return list(self.backlog)


def fresh_block(engine: DraftEngine, committed: list[int], k: int) -> DraftBlock:
    """What a drafter with no history drafts just in time for ``committed``."""
    blocks = Blocks()
    sid = secrets.token_hex(16)
    engine.open(SessionSpec(sid, tuple(committed), SamplingParams(), "model"), blocks.emit).result(timeout=30)
    engine.outcome(sid, StepOutcome(len(committed), (), 4, overlap=False))
    b = blocks.until(lambda b: b.continues(committed))
    engine.close(sid)
    return b


def test_drafter_rollback_after_a_rejection_at_every_position_with_blocks_drafted_ahead(tiny_pair):
    """Reject the block in flight at position j = 0..k-1 in turn, after its pre-drafts are out; the
    recovered token is the drafter's own guess on even j (a pre-draft hit) and an unguessed token on
    odd j (a miss). The drafter must follow exactly, and in the end draft what a drafter with no
    history drafts for the same tokens: nothing of a rejected or pre-drafted branch leaks."""
    target_path, draft_path = tiny_pair
    drafter = DraftEngine.from_config(DraftConfig(draft_path, target_path))
    reference = DraftEngine.from_config(DraftConfig(draft_path, target_path))
    k = 4
    sid = secrets.token_hex(16)
    committed = [5, 17, 42, 8, 99, 3]
    blocks = Blocks()
    drafter.open(SessionSpec(sid, tuple(committed), SamplingParams(), "model"), blocks.emit).result(timeout=30)
    drafter.outcome(sid, StepOutcome(len(committed), (), k, overlap=True))
    try:
        current = blocks.until(lambda b: b.continues(committed))
        for j in range(k):
            drafts = current.proposal.token_ids
            assert len(drafts) == k
            ahead = [blocks.until(lambda b: b.anchor_len == len(committed) and b.assumed_ids)]  # drafted ahead
            blocks.backlog.extend(ahead)
            guessed = {b.assumed_ids[-1] for b in ahead + blocks.pending() if len(b.assumed_ids) == j + 1}
            recovered = current.proposal.alternatives[j][0] if j % 2 == 0 else \
                next(t for t in range(300) if t != drafts[j] and t not in guessed and t not in current.proposal.alternatives[j])
            step = drafts[:j] + (recovered,)
            committed += list(step)
            drafter.outcome(sid, StepOutcome(len(committed), step, k, overlap=True))
            assert drafter.sessions.peek(sid).committed == committed
            current = blocks.until(lambda b: b.continues(committed))
            if j % 2 == 0:
                assert current.assumed_ids == step, "the pre-drafted block for this outcome was not the one in flight"
            else:
                assert current.assumed_ids == (), "a miss must be drafted just in time"
            # Every block is drafted from exactly the sequence it names.
            assert current.proposal.token_ids == fresh_block(reference, committed, k).proposal.token_ids
    finally:
        drafter.shutdown()
        reference.shutdown()


def test_verifier_rollback_after_a_rejection_at_every_position(tiny_pair):
    """Force the target to reject at position j = 0..k-1 in turn (the draft there is wrong on
    purpose); afterwards the session computes exactly what a fresh one does for the same tokens."""
    target_path, _ = tiny_pair
    verifier = VerifierEngine.from_config(TargetConfig(target_path))
    sid = secrets.token_hex(16)
    committed = [5, 17, 42, 8, 99, 3]
    verifier.open(SessionSpec(sid, tuple(committed), SamplingParams()))
    k = 4
    for j in range(k):
        greedy = target_greedy(verifier, committed, k)
        wrong = (greedy[j] + 1) % 300
        outcome = verifier.verify(sid, DraftProposal(greedy[:j] + (wrong,) + greedy[j + 1 :]))
        assert outcome.num_accepted == j
        assert outcome.token_ids == greedy[: j + 1]  # accepted drafts, then the target's own token
        committed += list(outcome.token_ids)
        assert outcome.committed_len == len(committed)
    probe = DraftProposal(target_greedy(verifier, committed, k)[:2] + (7, 7))
    fresh = secrets.token_hex(16)
    verifier.open(SessionSpec(fresh, tuple(committed), SamplingParams()))
    after, reference = verifier.verify(sid, probe), verifier.verify(fresh, probe)
    assert (after.token_ids, after.num_accepted, after.committed_len) == (reference.token_ids, reference.num_accepted, reference.committed_len)


def target_greedy(verifier: VerifierEngine, committed: list[int], n: int) -> tuple[int, ...]:
    """Target-only greedy continuation of ``committed``, by full forwards of the HF model (no cache)."""
    seq = list(committed)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(verifier.loaded.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return tuple(seq[len(committed):])
