"""decide_batch (specdec.core.batch_rules): every rule over a flat ragged batch in one call gives, step
by step, exactly what the per-session rules give (decide_one: greedy_verify, coupled_verify_one,
rejection_sample), whatever else is in the batch.

Batches are random but seeded: mixed rules, k in 0..8, temperatures, top-k, top-p, seeds, draft
distributions sent or not, vocabularies of 50-300, and logits with ties, -inf entries and very
peaked rows. Draft tokens are often the target's own choice, so every accepted length occurs.
"""
from __future__ import annotations

import random

import pytest
import torch

from specdec.core.batch_rules import RuleStep, decide_batch, decide_one
from specdec.core.coupled import processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.sampling import SamplingParams, VerificationRule

MAX_K = 8
RULES = ("greedy", "coupled", "rejection")


def random_logits(r: random.Random, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 logits of one of several shapes, some adversarial."""
    g = torch.Generator().manual_seed(r.getrandbits(32))
    kind = r.choice(["normal", "ties", "neg_inf", "peaked", "flat", "wide"])
    logits = torch.randn(rows, vocab, generator=g) * r.choice([0.5, 2.0, 5.0])
    if kind == "ties":  # few distinct values: argmax, top-k and top-p all meet ties
        logits = logits.round()
    elif kind == "neg_inf":  # banned tokens, never all of a row
        banned = torch.rand(rows, vocab, generator=g) < 0.5
        banned[:, r.randrange(vocab)] = False
        logits = logits.masked_fill(banned, float("-inf"))
    elif kind == "peaked":  # one token holds nearly all the mass (p/q near 1 at the accept test)
        logits[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] += 50.0
    elif kind == "flat":  # a whole row tied
        logits[: max(1, rows // 2)] = 1.0
    elif kind == "wide":
        logits = logits * 40.0
    return logits


def random_sampling(r: random.Random, rule: str, vocab: int) -> SamplingParams:
    if rule == "greedy":
        return SamplingParams(temperature=0.0, rule=r.choice(list(VerificationRule)))
    return SamplingParams(
        temperature=r.choice([0.3, 0.7, 1.0, 1.5, round(r.uniform(0.05, 2.0), 6)]),
        top_k=r.choice([0, 0, 1, 5, 20, vocab - 1, vocab, vocab + 7]),
        top_p=r.choice([1.0, 1.0, 0.9, 0.5, 0.999999999, r.uniform(0.05, 1.0)]),
        seed=r.getrandbits(64),
        rule=VerificationRule.COUPLED if rule == "coupled" else VerificationRule.REJECTION,
    )


def random_draft_probs(r: random.Random, draft_ids: list[int], vocab: int) -> torch.Tensor:
    """[k, vocab] normalised, sparse, positive at each draft token (what dense_draft_probs gives)."""
    g = torch.Generator().manual_seed(r.getrandbits(32))
    probs = torch.rand(len(draft_ids), vocab, generator=g) ** 4
    probs[torch.rand(len(draft_ids), vocab, generator=g) < 0.7] = 0.0
    for j, token in enumerate(draft_ids):
        probs[j, token] += r.choice([1e-3, 0.2, 5.0])
    return probs / probs.sum(-1, keepdim=True)


def target_choice(r: random.Random, row: torch.Tensor, sampling: SamplingParams, position: int) -> int:
    """A draft token the target would likely pick: accepted far more often than a random one."""
    if sampling.coupled:
        noise = gumbel_noise(sampling.seed, (position,), row.shape[-1])[0]
        return int((processed_logprobs(row, sampling) + noise).argmax())
    return int(row.argmax())


def random_batch(r: random.Random, sessions: int, vocab: int) -> tuple[torch.Tensor, list[RuleStep]]:
    steps, blocks = [], []
    for _ in range(sessions):
        rule, k = r.choice(RULES), r.randint(0, MAX_K)
        sampling = random_sampling(r, rule, vocab)
        position = r.randrange(0, 5000)
        logits = random_logits(r, k + 1, vocab)
        draft_ids = [target_choice(r, logits[j], sampling, position + j) if r.random() < 0.8 else r.randrange(vocab)
                     for j in range(k)]
        draft_probs = random_draft_probs(r, draft_ids, vocab) if k and r.random() < 0.5 else None
        steps.append(RuleStep(tuple(draft_ids), draft_probs, sampling, position))
        blocks.append(logits)
    return torch.cat(blocks), steps


def per_session(logits: torch.Tensor, steps: list[RuleStep]) -> list:
    """The reference: each step's rule over its own rows, one call per step."""
    out, row = [], 0
    for step in steps:
        out.append(decide_one(logits[row : row + step.k + 1], step))
        row += step.k + 1
    return out


def rule_of(step: RuleStep) -> str:
    return "greedy" if step.sampling.greedy else "coupled" if step.sampling.coupled else "rejection"


def test_equals_per_session_rules_on_random_ragged_batches():
    r = random.Random(20261203)
    seen = set()  # (rule, num_accepted, all accepted)
    for _ in range(60):
        logits, steps = random_batch(r, r.randint(1, 24), r.randint(50, 300))
        expected = per_session(logits, steps)
        before = logits.clone()
        assert decide_batch(logits, steps) == expected
        assert torch.equal(logits, before)  # the caller's logits are left as they were
        seen |= {(rule_of(s), a, a == s.k) for s, (_, a) in zip(steps, expected)}
    # The batches exercised what they claim to: every rule accepting everything and stopping
    # early, every accepted length 0..8 under each rule.
    for rule in RULES:
        assert (rule, MAX_K, True) in seen, rule
        assert {a for rule_, a, _ in seen if rule_ == rule} == set(range(MAX_K + 1)), rule
        assert any(rule_ == rule and not full for rule_, _, full in seen), rule


@pytest.mark.parametrize("rule", RULES)
def test_one_rule_batches_equal_per_session_rules(rule):
    """Batches of a single rule take decide_batch's path without row selection."""
    r = random.Random(hash(rule) % 1000)
    for _ in range(10):
        vocab = r.randint(50, 300)
        steps, blocks = [], []
        for _ in range(r.randint(2, 16)):
            k = r.randint(0, MAX_K)
            sampling = random_sampling(r, rule, vocab)
            logits = random_logits(r, k + 1, vocab)
            position = r.randrange(5000)
            draft_ids = tuple(target_choice(r, logits[j], sampling, position + j) for j in range(k))
            draft_probs = random_draft_probs(r, list(draft_ids), vocab) if k and r.random() < 0.5 else None
            steps.append(RuleStep(draft_ids, draft_probs, sampling, position))
            blocks.append(logits)
        logits = torch.cat(blocks)
        assert decide_batch(logits, steps) == per_session(logits, steps)


def test_bfloat16_and_inference_mode_logits():
    """The verifier's forward may run in bf16 and under torch.inference_mode: same outcomes as the rules."""
    r = random.Random(11)
    for _ in range(5):
        logits, steps = random_batch(r, r.randint(1, 16), r.randint(50, 300))
        with torch.inference_mode():
            logits = logits.bfloat16().clone()
        assert decide_batch(logits, steps) == per_session(logits, steps)


def test_outcome_does_not_depend_on_the_rest_of_the_batch():
    r = random.Random(7)
    for _ in range(20):
        logits, steps = random_batch(r, r.randint(2, 24), r.randint(50, 300))
        outcomes = decide_batch(logits, steps)
        blocks = list(torch.split(logits, [s.k + 1 for s in steps]))
        order = list(range(len(steps)))
        r.shuffle(order)
        shuffled = decide_batch(torch.cat([blocks[i] for i in order]), [steps[i] for i in order])
        assert [shuffled[order.index(i)] for i in range(len(steps))] == outcomes
        # Alone, and beside copies of itself at other rows.
        i = r.randrange(len(steps))
        assert decide_batch(blocks[i], [steps[i]]) == [outcomes[i]]
        assert decide_batch(torch.cat([blocks[i]] * 3), [steps[i]] * 3) == [outcomes[i]] * 3


def test_greedy_exact_cases():
    """Logits of +-100, outcomes written out."""
    def logits_for(argmaxes, vocab=10):
        logits = torch.full((len(argmaxes), vocab), -100.0)
        logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 100.0
        return logits

    greedy = SamplingParams()
    steps = [RuleStep((3, 5, 7), None, greedy, 4),  # the third draft token differs: recovered 2
             RuleStep((1, 2), None, greedy, 0),  # all accepted: bonus 9
             RuleStep((), None, greedy, 9),  # k = 0: the target's own token
             RuleStep((0,), None, greedy, 2)]  # rejected at once
    logits = torch.cat([logits_for([3, 5, 2, 9]), logits_for([1, 2, 9]), logits_for([6]), logits_for([8, 1])])
    assert decide_batch(logits, steps) == [((3, 5, 2), 2), ((1, 2, 9), 2), ((6,), 0), ((8,), 0)]


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, 6)
    logits[:, [2, 4]] = 1.0
    steps = [RuleStep((4,), None, SamplingParams(), 0), RuleStep((2,), None, SamplingParams(), 0)]
    assert decide_batch(torch.cat([logits, logits]), steps) == [((2,), 0), ((2, 2), 1)]


def test_coupled_tokens_are_target_only_sampling_for_every_k():
    """Seed-exactness: a coupled step commits the target-only coupled token of each position, alone
    (k = 0 is target-only sampling itself) and beside another session."""
    vocab, seed, n = 97, 1234, 40
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, rule=VerificationRule.COUPLED)
    logits = random_logits(random.Random(3), 9, vocab)
    target_only = [int((processed_logprobs(logits[j], sampling) + gumbel_noise(seed, (n + j,), vocab)[0]).argmax())
                   for j in range(9)]
    other = RuleStep((5, 6), None, SamplingParams(temperature=1.0, seed=9, rule=VerificationRule.COUPLED), 7)
    for k in range(MAX_K + 1):
        step = RuleStep(tuple(target_only[:k]), None, sampling, n)
        assert decide_batch(logits[: k + 1], [step]) == [(tuple(target_only[: k + 1]), k)]
        assert decide_batch(torch.cat([logits[: k + 1], logits[:3]]), [step, other])[0] == (tuple(target_only[: k + 1]), k)


def test_empty_batch():
    assert decide_batch(torch.zeros(0, 10), []) == []


@pytest.mark.parametrize("logits, steps, message", [
    (torch.zeros(3, 10), [RuleStep((1, 2, 3), None, SamplingParams(), 0)], r"logits has 3 rows but the steps need sum\(k\+1\) = 4"),
    (torch.zeros(5, 10), [RuleStep((1,), None, SamplingParams(), 0), RuleStep((), None, SamplingParams(), 0)],
     r"logits has 5 rows but the steps need sum\(k\+1\) = 3"),
    (torch.zeros(3, 10), [RuleStep((1, 2), torch.full((3, 10), 0.1), SamplingParams(temperature=1.0), 0)],
     r"step 0: draft_probs must be \[k, vocab\] = \[2, 10\], got \[3, 10\]"),
    (torch.zeros(2, 10), [RuleStep((1,), torch.full((1, 11), 0.1), SamplingParams(temperature=1.0), 0)],
     r"step 0: draft_probs must be \[k, vocab\] = \[1, 10\], got \[1, 11\]"),
    (torch.zeros(2, 10), [RuleStep((10,), None, SamplingParams(), 0)], r"inside the vocabulary \[0, 10\)"),
    (torch.zeros(10), [RuleStep((), None, SamplingParams(), 0)], r"logits must be \[sum\(k\+1\), vocab\]"),
    (torch.zeros(1, 10), [RuleStep((), None, SamplingParams(), -1)], r"position must be >= 0"),
])
def test_bad_shapes_raise(logits, steps, message):
    with pytest.raises(ValueError, match=message):
        decide_batch(logits, steps)
