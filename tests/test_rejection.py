"""Tests of the rejection rule (specdec.core.rejection.rejection_sample).

Modelled on vLLM's tests/v1/sample/test_rejection_sampler.py: greedy cases with the expected output
written out, seeded determinism, and a distribution test that the correct rule passes and two
deliberately wrong rules fail.
"""
from __future__ import annotations

import pytest
import torch

from specdec.core import rng
from specdec.core.rejection import greedy_verify, rejection_sample
from specdec.core.sampling import SamplingParams, probs_from_logits, sample_from

VOCAB = 8
PAD = -1
# The largest float64 uniform the counter-based RNG can return (53 random bits).
MAX_UNIFORM = 1.0 - 2.0**-53


def one_hot_logits(token_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Logits [len(token_ids), vocab]: +100 at each given token, -100 elsewhere."""
    logits = torch.full((len(token_ids), vocab), -100.0)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)] = 100.0
    return logits


def greedy_probs(token_ids: list[int]) -> torch.Tensor:
    """The greedy distribution [len(token_ids), VOCAB] whose argmax is each token."""
    return probs_from_logits(one_hot_logits(token_ids), SamplingParams())


# --------------------------------------------------------------------------------------------
# 1. Greedy: exact expected outputs.
# --------------------------------------------------------------------------------------------

# (draft_token_ids [k], target argmax at positions 0..k [k+1], expected output_ids, expected num_accepted)
GREEDY_CASES = [
    pytest.param([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3, id="all-accepted-plus-bonus"),
    # Drafts 2 and 3 match the target's argmax at their positions but follow a rejected token, so
    # they are dropped: only the recovered token (the argmax 5) is emitted.
    pytest.param([1, 2, 3], [5, 2, 3, 4], [5, PAD, PAD, PAD], 0, id="first-rejected"),
    pytest.param([1, 2, 3], [1, 6, 3, 4], [1, 6, PAD, PAD], 1, id="middle-rejected"),
    # Last draft rejected: the bonus position's argmax (4) is not emitted, the recovered 7 is.
    pytest.param([1, 2, 3], [1, 2, 7, 4], [1, 2, 7, PAD], 2, id="last-rejected"),
    pytest.param([0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], 3, id="token-0-repeated"),
    pytest.param([7], [7, 0], [7, 0], 1, id="k1-accepted"),
    pytest.param([7], [0, 7], [0, PAD], 0, id="k1-rejected"),
    # k = 0: nothing to verify; the step emits just the bonus token.
    pytest.param([], [3], [3], 0, id="k0-bonus-only"),
]


@pytest.mark.parametrize("draft_ids, target_argmax, expected_ids, expected_accepted", GREEDY_CASES)
@pytest.mark.parametrize("draft_kind", ["point-mass", "one-hot-probs"])
@pytest.mark.parametrize("uniform", [0.0, 0.5, MAX_UNIFORM], ids=["u=0", "u=0.5", "u=max"])
def test_greedy_exact(draft_ids, target_argmax, expected_ids, expected_accepted, draft_kind, uniform):
    k = len(draft_ids)
    draft_token_ids = torch.tensor([draft_ids], dtype=torch.long)  # [1, k]
    target_probs = greedy_probs(target_argmax).unsqueeze(0)  # [1, k+1, vocab]
    # A greedy drafter's distribution is the one-hot at its token: same result as a point mass.
    draft_probs = None if draft_kind == "point-mass" else greedy_probs(draft_ids).reshape(1, k, VOCAB)
    # Greedy outcomes must not depend on the uniforms; u=max checks that a uniform just below 1
    # still accepts a matching draft (float32 rounding of it to 1.0 once rejected it).
    accept_uniforms = torch.full((1, k), uniform, dtype=torch.float64)
    sample_uniforms = torch.full((1, k + 1), uniform, dtype=torch.float64)

    output_ids, num_accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, accept_uniforms, sample_uniforms)

    assert output_ids.tolist() == [expected_ids]
    assert num_accepted.tolist() == [expected_accepted]
    assert output_ids.dtype == torch.long and num_accepted.dtype == torch.long


@pytest.mark.parametrize("draft_ids, target_argmax, expected_ids, expected_accepted", GREEDY_CASES)
def test_greedy_verify_is_the_rule_at_temperature_0(draft_ids, target_argmax, expected_ids, expected_accepted):
    tokens, accepted = greedy_verify(tuple(draft_ids), one_hot_logits(target_argmax))
    assert accepted == expected_accepted
    assert list(tokens) == expected_ids[: expected_accepted + 1]


def test_greedy_verify_matches_rejection_sample_on_random_logits_with_ties():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        logits = torch.randint(0, 3, (k + 1, VOCAB), generator=gen).float()  # many ties
        drafts = torch.randint(0, VOCAB, (1, k), generator=gen)
        # Make some drafts agree with the argmax, so that accepting is exercised too.
        agree = torch.rand(k, generator=gen) < 0.6
        drafts[0, agree] = logits[:k].argmax(-1)[agree]
        output, num = rejection_sample(drafts, None, probs_from_logits(logits, SamplingParams())[None],
                                       torch.rand(1, k, generator=gen, dtype=torch.float64), torch.rand(1, k + 1, generator=gen, dtype=torch.float64))
        tokens, accepted = greedy_verify(tuple(drafts[0].tolist()), logits)
        assert accepted == int(num[0]) and list(tokens) == output[0, : accepted + 1].tolist()


def test_greedy_tie_in_target_logits_goes_to_lowest_id():
    # Target logits tie between tokens 2 and 4: greedy means token 2, so the draft 4 is rejected
    # even though it has the same (maximal) logit.
    logits = torch.full((2, VOCAB), -100.0)
    logits[0, [2, 4]] = 100.0
    logits[1, 5] = 100.0
    target_probs = probs_from_logits(logits, SamplingParams()).unsqueeze(0)  # [1, 2, vocab]
    output_ids, num_accepted = rejection_sample(
        torch.tensor([[4]]), None, target_probs, torch.zeros(1, 1), torch.zeros(1, 2)
    )
    assert output_ids.tolist() == [[2, PAD]]
    assert num_accepted.tolist() == [0]


def test_greedy_batch_rows_with_different_outcomes():
    draft_ids = [
        [1, 2, 3],  # all accepted, bonus 4
        [1, 2, 3],  # first rejected: recovered 5
        [1, 2, 3],  # middle rejected: recovered 6
        [6, 6, 6],  # last rejected: recovered 0
        [0, 1, 2],  # all accepted, bonus 0
    ]
    target_argmax = [
        [1, 2, 3, 4],
        [5, 2, 3, 4],
        [1, 6, 3, 4],
        [6, 6, 0, 1],
        [0, 1, 2, 0],
    ]
    expected_ids = [
        [1, 2, 3, 4],
        [5, PAD, PAD, PAD],
        [1, 6, PAD, PAD],
        [6, 6, 0, PAD],
        [0, 1, 2, 0],
    ]
    expected_accepted = [3, 0, 1, 2, 3]
    batch, k = len(draft_ids), 3
    target_probs = torch.stack([greedy_probs(row) for row in target_argmax])  # [batch, k+1, vocab]
    gen = torch.Generator().manual_seed(0)

    output_ids, num_accepted = rejection_sample(
        torch.tensor(draft_ids),
        None,
        target_probs,
        torch.rand(batch, k, generator=gen),
        torch.rand(batch, k + 1, generator=gen),
    )

    assert output_ids.tolist() == expected_ids
    assert num_accepted.tolist() == expected_accepted


def test_greedy_batch_with_k0():
    target_probs = torch.stack([greedy_probs([3]), greedy_probs([0]), greedy_probs([7])])  # [3, 1, vocab]
    output_ids, num_accepted = rejection_sample(
        torch.empty(3, 0, dtype=torch.long), None, target_probs, torch.empty(3, 0), torch.rand(3, 1)
    )
    assert output_ids.tolist() == [[3], [0], [7]]
    assert num_accepted.tolist() == [0, 0, 0]


# --------------------------------------------------------------------------------------------
# 2. Seeded determinism with the counter-based RNG.
# --------------------------------------------------------------------------------------------

POSITION_OFFSET = 17  # absolute position of the first draft token in the sequence


def random_case(batch: int, k: int, vocab: int = 12, case_seed: int = 1234):
    """Random but fixed target and draft distributions: target_probs [batch, k+1, vocab], draft_probs [batch, k, vocab]."""
    gen = torch.Generator().manual_seed(case_seed)
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    draft_logits = target_logits[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.95)
    return probs_from_logits(target_logits, params), probs_from_logits(draft_logits, params)


def row_uniforms(seed: int, stream: rng.Stream, k: int) -> torch.Tensor:
    return rng.uniforms(seed, stream, range(POSITION_OFFSET, POSITION_OFFSET + k))


def run_seeded(seeds: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor):
    """One step for rows keyed by ``seeds``: drafts drawn with the DRAFT_SAMPLE stream, then verified."""
    k = draft_probs.shape[1]
    draft_u = torch.stack([row_uniforms(s, rng.Stream.DRAFT_SAMPLE, k) for s in seeds])  # [batch, k]
    accept_u = torch.stack([row_uniforms(s, rng.Stream.ACCEPT, k) for s in seeds])  # [batch, k]
    sample_u = torch.stack([row_uniforms(s, rng.Stream.TARGET_SAMPLE, k + 1) for s in seeds])  # [batch, k+1]
    draft_token_ids = sample_from(draft_probs, draft_u)  # [batch, k]
    return rejection_sample(draft_token_ids, draft_probs, target_probs, accept_u, sample_u)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_same_seed_same_output(k, batch):
    target_probs, draft_probs = random_case(batch, k)
    seeds = [1000 + row for row in range(batch)]

    first = run_seeded(seeds, target_probs, draft_probs)
    second = run_seeded(seeds, target_probs.clone(), draft_probs.clone())

    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    # Each row depends only on its own seed and distributions, not on the batch it runs in.
    for row in range(batch):
        alone = run_seeded([seeds[row]], target_probs[row : row + 1], draft_probs[row : row + 1])
        assert torch.equal(alone[0][0], first[0][row])
        assert torch.equal(alone[1][0], first[1][row])


def test_different_seed_different_output():
    # 64 rows with k=5 over near-uniform distributions: identical outputs for two seeds would need
    # all 64 rows to agree, which is practically impossible.
    batch, k = 64, 5
    gen = torch.Generator().manual_seed(7)
    target_probs = torch.softmax(0.3 * torch.randn(batch, k + 1, 12, generator=gen), dim=-1)
    draft_probs = torch.softmax(0.3 * torch.randn(batch, k, 12, generator=gen), dim=-1)

    out_a, _ = run_seeded([1] * batch, target_probs, draft_probs)
    out_b, _ = run_seeded([2] * batch, target_probs, draft_probs)

    assert not torch.equal(out_a, out_b)


# --------------------------------------------------------------------------------------------
# 3. The distribution test: emitted tokens follow the target distribution, not the draft's.
# --------------------------------------------------------------------------------------------

TV_BOUND = 0.01
# Every position has the same target and draft distributions (context-free, i.i.d. per position),
# so every emitted token -- accepted, recovered or bonus, at any position -- must be distributed as
# TARGET. Token 7 has zero target probability but positive draft probability: it is drafted, and
# must never be emitted. TV(TARGET, DRAFT) = 0.41, so a rule that leaks the draft is clearly off.
TARGET = torch.tensor([0.55, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02, 0.00], dtype=torch.float64)
DRAFT = torch.tensor([0.20, 0.35, 0.05, 0.20, 0.05, 0.05, 0.05, 0.05], dtype=torch.float64)
# DRAFT truncated to its top 3 tokens (1, 0, 3) and renormalised: q = 0 where p > 0, so recovered
# tokens must come from tokens the drafter can never propose.
DRAFT_TOP3 = torch.tensor([0.20, 0.35, 0.0, 0.20, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64) / 0.75
MIN_SAMPLES_PER_POSITION = 30_000  # below this, sampling noise alone approaches the bound


def tv(empirical: torch.Tensor, expected: torch.Tensor) -> float:
    return 0.5 * (empirical - expected).abs().sum().item()


def make_drafts(kind: str, num_rows: int, k: int, gen: torch.Generator):
    """Draft tokens [num_rows, k] and the draft_probs to pass (None for point-mass drafts)."""
    if kind == "point-mass":
        # An n-gram-like drafter: proposes the target's mode (token 0) most of the time and an
        # arbitrary token otherwise (including token 7, which the target never emits). It reports
        # no distribution, so each draft is a point mass.
        mode = torch.zeros(num_rows, k, dtype=torch.long)
        other = torch.randint(0, VOCAB, (num_rows, k), generator=gen)
        return torch.where(torch.rand(num_rows, k, generator=gen) < 0.9, mode, other), None
    draft = {"full": DRAFT, "top3": DRAFT_TOP3}[kind].float()
    ids = torch.multinomial(draft, num_rows * k, replacement=True, generator=gen).view(num_rows, k)
    return ids, draft.expand(num_rows, k, VOCAB)


def accept_all_rule(draft_token_ids, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    """WRONG: keep every draft token and add a bonus token from the target."""
    batch, k = draft_token_ids.shape
    bonus = sample_from(target_probs[:, k], sample_uniforms[:, k])  # [batch]
    return torch.cat([draft_token_ids, bonus[:, None]], dim=1), torch.full((batch,), k, dtype=torch.long)


def resample_from_target_rule(draft_token_ids, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    """WRONG: correct accept test, but the token after a rejection is drawn from p, not norm(max(0, p - q))."""
    batch, k = draft_token_ids.shape
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_token_ids, target_probs.shape[-1]).to(target_probs.dtype)
    ids = draft_token_ids.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1).double()
    q_x = draft_probs.gather(-1, ids).squeeze(-1).double()
    accepted = accept_uniforms.double() * q_x < p_x  # [batch, k]
    num_accepted = torch.cumprod(accepted.long(), dim=-1).sum(dim=-1)  # [batch]
    rows = torch.arange(batch)
    final = sample_from(target_probs[rows, num_accepted], sample_uniforms[rows, num_accepted])
    output_ids = torch.cat([draft_token_ids, torch.full((batch, 1), PAD)], dim=1)
    output_ids[torch.arange(k + 1) > num_accepted[:, None]] = PAD
    output_ids[rows, num_accepted] = final
    return output_ids, num_accepted


def emitted_tvs(rule, kind: str, k: int, num_rows: int, seed: int) -> list[tuple[int, float]]:
    """(number of tokens, TV to TARGET) of the tokens emitted at each position 0..k."""
    gen = torch.Generator().manual_seed(seed)
    draft_token_ids, draft_probs = make_drafts(kind, num_rows, k, gen)
    target_probs = TARGET.float().expand(num_rows, k + 1, VOCAB)
    accept_uniforms = torch.rand(num_rows, k, generator=gen)
    sample_uniforms = torch.rand(num_rows, k + 1, generator=gen)

    output_ids, num_accepted = rule(draft_token_ids, draft_probs, target_probs, accept_uniforms, sample_uniforms)

    results = []
    for j in range(k + 1):
        emitted = output_ids[num_accepted >= j, j]  # rows that emitted a token at position j
        assert (emitted >= 0).all() and (emitted < VOCAB).all()
        counts = torch.bincount(emitted, minlength=VOCAB).double()
        results.append((emitted.numel(), tv(counts / counts.sum(), TARGET)))
    return results


@pytest.mark.parametrize("kind", ["full", "point-mass", "top3"])
@pytest.mark.parametrize("k, num_rows", [(1, 150_000), (3, 300_000)])
def test_emitted_tokens_follow_target_distribution(kind, k, num_rows):
    results = emitted_tvs(rejection_sample, kind, k, num_rows, seed=100 + k)
    for position, (count, distance) in enumerate(results):
        assert count >= MIN_SAMPLES_PER_POSITION, (position, count)
        assert distance <= TV_BOUND, f"position {position}: TV {distance:.4f} over {count} tokens"


def test_acceptance_rate_is_overlap_of_distributions():
    # P(accept a draft token drawn from q) = sum_x min(p(x), q(x)) = 1 - TV(p, q) = 0.59.
    num_rows = 150_000
    gen = torch.Generator().manual_seed(5)
    draft_token_ids, draft_probs = make_drafts("full", num_rows, 1, gen)
    _, num_accepted = rejection_sample(
        draft_token_ids, draft_probs, TARGET.float().expand(num_rows, 2, VOCAB),
        torch.rand(num_rows, 1, generator=gen), torch.rand(num_rows, 2, generator=gen),
    )
    expected = torch.minimum(TARGET, DRAFT).sum().item()
    assert abs(num_accepted.double().mean().item() - expected) < 0.01


@pytest.mark.parametrize(
    "rule, kind, expected_tv",
    [
        # Position 0 then emits DRAFT-distributed tokens: TV(TARGET, DRAFT) = 0.41.
        pytest.param(accept_all_rule, "full", 0.41, id="accept-all"),
        # Position 0 emits min(p, q) + 0.41 * p: TV from TARGET = 0.1335.
        pytest.param(resample_from_target_rule, "full", 0.1335, id="resample-from-target"),
        # Point-mass drafts, token d proposed with probability r(d) (r(0) = 0.9125, else 0.0125):
        # token x is emitted with p(x) * (r(x) + 1 - sum_d r(d) p(d)) = p(x) * (r(x) + 0.4925), so
        # token 0 gets 0.55 * 1.405 = 0.773 instead of 0.55: TV = 0.223.
        pytest.param(resample_from_target_rule, "point-mass", 0.223, id="resample-from-target-point-mass"),
    ],
)
def test_wrong_rules_fail_the_bound(rule, kind, expected_tv):
    results = emitted_tvs(rule, kind, k=1, num_rows=100_000, seed=11)
    count, distance = results[0]
    assert distance > 5 * TV_BOUND, f"wrong rule passed: TV {distance:.4f}"
    assert distance == pytest.approx(expected_tv, abs=0.01)


# --------------------------------------------------------------------------------------------
# 4. Argument validation.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target_shape, draft_shape",
    [
        pytest.param((2, 3, VOCAB), (2, 3, VOCAB), id="target-missing-bonus-position"),
        pytest.param((2, 5, VOCAB), (2, 3, VOCAB), id="target-one-position-too-many"),
        pytest.param((1, 4, VOCAB), (2, 3, VOCAB), id="target-wrong-batch"),
        pytest.param((4, VOCAB), (2, 3, VOCAB), id="target-2d"),
        pytest.param((2, 4, VOCAB), (2, 4, VOCAB), id="draft-k-plus-1-positions"),
        pytest.param((2, 4, VOCAB), (1, 3, VOCAB), id="draft-wrong-batch"),
        pytest.param((2, 4, VOCAB), (2, 3, VOCAB + 1), id="draft-wrong-vocab"),
        pytest.param((2, 4, VOCAB), (3, VOCAB), id="draft-2d"),
    ],
)
def test_wrong_shapes_raise_value_error(target_shape, draft_shape):
    draft_token_ids = torch.zeros(2, 3, dtype=torch.long)
    target_probs = torch.full(target_shape, 1.0 / VOCAB)
    draft_probs = torch.full(draft_shape, 1.0 / draft_shape[-1])
    with pytest.raises(ValueError, match="target_probs|draft_probs"):
        rejection_sample(draft_token_ids, draft_probs, target_probs, torch.rand(2, 3), torch.rand(2, 4))


def test_wrong_target_shape_raises_without_draft_probs():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), None, torch.full((2, 3, VOCAB), 0.125), torch.rand(2, 3), torch.rand(2, 4))
