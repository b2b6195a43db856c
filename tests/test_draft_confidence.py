"""Blocks that end where the draft is unsure (``DraftConfig.min_confidence``): a block stops after a
token the draft gives less probability than the threshold, every way a drafter drafts (one
session, many at once, branches drafted ahead), and what it drafts is a prefix of the full block."""
from __future__ import annotations

import statistics

import pytest
import torch

from specdec.core.models import load_causal_lm
from specdec.core.sampling import SamplingParams
from specdec.draft.model_drafter import ModelDrafter, propose_together

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 7, 7], [250, 1, 30, 64, 12, 9, 80, 2], [100, 200]]
K = 8


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return load_causal_lm(tiny_pair[1])


def confidences(draft, committed, tokens) -> list[float]:
    """The draft's probability of each of ``tokens`` after ``committed`` (greedy: its argmax)."""
    with torch.no_grad():
        logits = draft.model(torch.tensor([list(committed) + list(tokens)])).logits[0, len(committed) - 1 : -1]
    return torch.softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def full_blocks(draft):
    drafter = ModelDrafter(draft, 32)
    return [drafter.open(p, SamplingParams()).propose(p, K).token_ids for p in PROMPTS]


def median_confidence(draft) -> float:
    """The median confidence of full greedy blocks' tokens: a threshold at which some blocks end
    early and some go on."""
    drafter = ModelDrafter(draft, 32)
    blocks = [drafter.open(p, SamplingParams()).propose(p, K).token_ids for p in PROMPTS]
    return statistics.median(c for p, block in zip(PROMPTS, blocks) for c in confidences(draft, p, block))


@pytest.fixture(scope="module")
def threshold(draft) -> float:
    return median_confidence(draft)


def check_cut(draft, prompt, full, cut, threshold) -> None:
    assert 1 <= len(cut) <= K and tuple(cut) == tuple(full[: len(cut)]), "a block drafts the full block's first tokens"
    conf = confidences(draft, prompt, cut)
    assert all(c >= threshold for c in conf[:-1]), "a block went on past a token under the threshold"
    assert len(cut) == K or conf[-1] < threshold, "a block ended on a token the draft was sure of"


def test_a_block_ends_after_the_first_token_under_min_confidence(draft, full_blocks, threshold):
    drafter = ModelDrafter(draft, 32, min_confidence=threshold)
    cuts = [drafter.open(p, SamplingParams()).propose(p, K).token_ids for p in PROMPTS]
    for prompt, full, cut in zip(PROMPTS, full_blocks, cuts):
        check_cut(draft, prompt, full, cut, threshold)
    assert any(len(c) < K for c in cuts), "no block ended early: the threshold tests nothing"


def test_sessions_drafting_together_end_their_blocks_as_each_alone(draft, full_blocks, threshold):
    drafter = ModelDrafter(draft, 32, min_confidence=threshold)
    sessions = drafter.open_many([(p, SamplingParams()) for p in PROMPTS])
    together = propose_together([(s, p, K) for s, p in zip(sessions, PROMPTS)])
    alone = [drafter.open(p, SamplingParams()).propose(p, K).token_ids for p in PROMPTS]
    assert [b.token_ids for b in together] == alone
    for prompt, full, block in zip(PROMPTS, full_blocks, together):
        check_cut(draft, prompt, full, block.token_ids, threshold)


def test_branches_drafted_ahead_end_as_a_block_drafted_just_in_time(draft, threshold):
    drafter = ModelDrafter(draft, 32, min_confidence=threshold)
    base = PROMPTS[2]
    session = drafter.open(base, SamplingParams())
    branches = [base + [t] for t in (4, 60, 123)]
    ahead = session.propose_branches(branches, K)
    assert ahead is not None, "the lean forward drafts branches in one batch"
    for branch, block in zip(branches, ahead):
        assert block.token_ids == drafter.open(branch, SamplingParams()).propose(branch, K).token_ids
    assert any(len(b.token_ids) < K for b in ahead), "no branch ended early: the threshold tests nothing"


def test_a_threshold_outside_zero_to_one_is_refused(draft):
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="min_confidence"):
            ModelDrafter(draft, 32, min_confidence=bad)
