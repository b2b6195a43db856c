"""Tests of coupled verification: the noise (specdec.core.noise) and the rule (specdec.core.coupled).

The noise must be a pure function of (seed, position, token id), bit for bit, in any process and at
any thread count; the rule must commit exactly what target-only coupled sampling commits, whatever the
drafter and k; and the committed tokens must follow the target's distribution, which a deliberately
wrong rule does not.
"""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from specdec.core import noise as noise_module
from specdec.core import rng
from specdec.core.coupled import (
    coupled_draft,
    coupled_token,
    coupled_verify,
    coupled_verify_one,
    processed_logprobs,
)
from specdec.core.noise import gumbel_noise, noise_uniforms
from specdec.core.sampling import SamplingParams, probs_from_logits

_MASK = (1 << 64) - 1
EULER_GAMMA = 0.5772156649015329


def reference_uniform(seed: int, position: int, token: int) -> float:
    """The uniform of (seed, position, token) in pure Python, from the definition in noise.py."""
    key = rng._mix(rng._mix(rng._mix(seed) ^ noise_module.GUMBEL_STREAM) ^ position)
    h = rng._mix((key + (token // 2) * 0x9E3779B97F4A7C15) & _MASK)
    v = (h >> (32 * (token % 2))) & 0xFFFFFFFF
    return float(np.float32((v + 0.5) * 2.0**-32))  # exact in float64, then one rounding


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


# ----------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize("seed, positions, vocab", [
    (0, [0, 1, 2], 6),
    (12345, [678, 5, 10**9], 11),  # odd vocab: the last hash feeds one token only
    (2**64 - 1, [2**64 - 1, 2**63, 0], 7),
])
def test_uniforms_are_splitmix64_of_seed_position_token(seed, positions, vocab):
    u = noise_uniforms(seed, positions, vocab)
    expected = [[reference_uniform(seed, p, t) for t in range(vocab)] for p in positions]
    assert u.dtype == torch.float32 and u.tolist() == expected


def test_noise_is_gumbel_of_the_uniforms():
    w = noise_uniforms(3, range(4), 1000).double()
    g = gumbel_noise(3, range(4), 1000)
    assert g.dtype == torch.float32 and g.shape == (4, 1000)
    exact = -torch.log(-torch.log1p(-w))
    assert ((g.double() - exact).abs() <= 1e-6 * (1 + exact.abs())).all()


def test_uniforms_strictly_inside_the_unit_interval(monkeypatch):
    w = noise_uniforms(1, range(200), 6144)
    assert 0.0 < w.min().item() and w.max().item() < 1.0
    assert torch.isfinite(gumbel_noise(1, range(200), 6144)).all()
    # The extreme bit patterns: 0 and 2**32 - 1 (which rounds to 1.0 in float32 without the cap).
    monkeypatch.setattr(noise_module, "_bits", lambda *_: np.array([[0, 2**32 - 1]], dtype=np.uint32))
    assert noise_uniforms(0, [0], 2).tolist() == [[2.0**-33, 1.0 - 2.0**-24]]
    g = gumbel_noise(0, [0], 2)
    assert torch.isfinite(g).all()
    assert g[0, 0].item() == pytest.approx(-math.log(2.0**-33), rel=1e-6)  # the largest noise, 22.9


def test_noise_looks_gumbel():
    g = gumbel_noise(7, range(160), 6144).double().flatten()  # ~1M values
    assert g.mean().item() == pytest.approx(EULER_GAMMA, abs=0.005)
    assert g.var().item() == pytest.approx(math.pi**2 / 6, abs=0.01)
    # Neighbouring tokens share a hash (low and high halves): they must not be correlated.
    pairs = g.reshape(-1, 2)
    assert abs(torch.corrcoef(pairs.T)[0, 1].item()) < 0.005


def test_a_position_does_not_depend_on_the_rest_of_the_block():
    for vocab in (6144, 1001):
        block = gumbel_noise(5, [3, 4, 5], vocab)
        assert torch.equal(block[1], gumbel_noise(5, [4], vocab)[0])
        # Any order, tensor or list, any company: row for row the same bits.
        shuffled = gumbel_noise(5, torch.tensor([9, 5, 3, 4]), vocab)
        assert torch.equal(shuffled[1:], block[[2, 0, 1]])
    # A long block with an odd vocab puts each row at a different offset from the vector lanes.
    long = gumbel_noise(11, range(50, 90), 1001)
    assert all(torch.equal(long[i], gumbel_noise(11, [50 + i], 1001)[0]) for i in (0, 1, 17, 39))


def test_different_seeds_and_positions_differ():
    rows = gumbel_noise(0, range(1000), 64)
    assert len({digest(r) for r in rows}) == 1000
    assert not torch.equal(gumbel_noise(0, [5], 64), gumbel_noise(1, [5], 64))
    assert not torch.equal(gumbel_noise(2**64 - 1, [5], 64), gumbel_noise(2**64 - 2, [5], 64))
    assert not torch.equal(gumbel_noise(9, [2**63], 64), gumbel_noise(9, [2**63 + 1], 64))


def test_noise_bit_identical_across_thread_counts():
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(digest(gumbel_noise(42, range(100, 164), 50257)))  # 3.2M values: split across threads
    finally:
        torch.set_num_threads(before)
    assert len(set(outputs)) == 1


def test_noise_bit_identical_in_another_process():
    cases = [(42, list(range(100, 109)), 6144), (2**64 - 1, [0, 2**40, 17], 1001)]
    code = (
        "import hashlib, json, sys, torch\n"
        "from specdec.core.noise import gumbel_noise\n"
        "torch.set_num_threads(1)\n"
        "cases = json.loads(sys.argv[1])\n"
        "out = [hashlib.sha256(gumbel_noise(s, p, v).numpy().tobytes()).hexdigest() for s, p, v in cases]\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                            timeout=120, check=True)
    assert json.loads(result.stdout) == [digest(gumbel_noise(s, p, v)) for s, p, v in cases]


def test_noise_does_not_touch_the_global_rng():
    state = torch.get_rng_state()
    gumbel_noise(1, range(3), 100)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("seed, positions, vocab", [
    (-1, [0], 8), (2**64, [0], 8), (0, [-1], 8), (0, torch.tensor([-1]), 8), (0, [0], 0),
    (0, torch.tensor([0.5]), 8),
])
def test_noise_rejects_bad_arguments(seed, positions, vocab):
    with pytest.raises(ValueError):
        gumbel_noise(seed, positions, vocab)


# ------------------------------------------------------------------------------- the coupled rule


def test_processed_logprobs_is_log_of_probs_from_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    lp = processed_logprobs(logits, params)
    assert torch.equal(lp.exp() > 0, probs_from_logits(logits, params) > 0)
    assert torch.isinf(lp).any()  # filtered tokens are -inf, so the coupled token is never one of them
    assert (lp.exp() - probs_from_logits(logits, params)).abs().max().item() < 1e-6
    with pytest.raises(ValueError):
        processed_logprobs(logits, SamplingParams(temperature=0.0))


def test_verify_outputs_written_out():
    vocab = 4
    lp = torch.full((1, 3, vocab), -50.0)
    lp[0, 0, 2] = lp[0, 1, 1] = lp[0, 2, 3] = 0.0  # noise-proof coupled tokens: 2, 1, 3
    noise = torch.zeros(1, 3, vocab)
    for drafts, expected, accepted in [
        ([2, 1], [2, 1, 3], 2),  # all accepted, then the bonus token
        ([2, 0], [2, 1, -1], 1),  # the second is replaced by the recovered token 1
        ([0, 1], [2, -1, -1], 0),  # a mismatch ends the step even if a later draft would match
    ]:
        out, n = coupled_verify(torch.tensor([drafts]), lp, noise)
        assert out.tolist() == [expected] and n.tolist() == [accepted]
        assert coupled_verify_one(tuple(drafts), lp[0], noise[0]) == (tuple(t for t in expected if t >= 0), accepted)
    out, n = coupled_verify(torch.zeros(1, 0, dtype=torch.long), lp[:, :1], noise[:, :1])  # k = 0
    assert out.tolist() == [[2]] and n.tolist() == [0]
    with pytest.raises(ValueError):
        coupled_verify(torch.tensor([[2, 1]]), lp[:, :2], noise[:, :2])


class MarkovModel:
    """A toy language model: next-token logits depend on the last token (a [vocab, vocab] table)."""

    def __init__(self, vocab: int, seed: int, sharpness: float = 2.0) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * sharpness
        self._processed: dict[SamplingParams, torch.Tensor] = {}

    def logprobs(self, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
        """[len(prefixes), vocab]: the processed distribution after each prefix."""
        if params not in self._processed:
            self._processed[params] = processed_logprobs(self.table, params)  # [vocab, vocab], row by row
        return self._processed[params][[p[-1] for p in prefixes]]


VOCAB = 12
PARAMS = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=5, seed=99),
          SamplingParams(temperature=1.3, top_p=0.8, seed=2**64 - 5)]
PROMPT = [1, 4, 7]


def target_only(target: MarkovModel, params: SamplingParams, n: int) -> list[int]:
    """Target-only coupled sampling: at each position the target's coupled token."""
    seq = list(PROMPT)
    while len(seq) < len(PROMPT) + n:
        lp = target.logprobs([seq], params)[0]
        seq.append(int(coupled_token(lp, gumbel_noise(params.seed, [len(seq)], VOCAB)[0])))
    return seq[len(PROMPT):]


Drafter = Callable[[list[int], SamplingParams], int]


def speculative(target: MarkovModel, drafter: Drafter, params: SamplingParams, k: int,
                n: int) -> tuple[list[int], list[int]]:
    """Coupled speculative decoding until n tokens: (the tokens, num_accepted of each step)."""
    seq, accepted = list(PROMPT), []
    while len(seq) < len(PROMPT) + n:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(drafter(seq + drafts, params))
        start = len(seq)
        extended = seq + drafts
        prefixes = [extended[: start + j] for j in range(k + 1)]  # the prefix before each position
        lp = target.logprobs(prefixes, params)  # [k+1, vocab]
        noise = gumbel_noise(params.seed, range(start, start + k + 1), VOCAB)  # [k+1, vocab]
        out, num = coupled_verify(torch.tensor([drafts], dtype=torch.long).reshape(1, k), lp[None], noise[None])
        tokens, num_one = coupled_verify_one(tuple(drafts), lp, noise)
        assert tokens == tuple(out[0, : int(num[0]) + 1].tolist()) and num_one == int(num[0])
        seq.extend(tokens)
        accepted.append(num_one)
    return seq[len(PROMPT): len(PROMPT) + n], accepted


def model_drafter(model: MarkovModel, noise_seed_offset: int = 0) -> Drafter:
    def draft(seq: list[int], params: SamplingParams) -> int:
        noise = gumbel_noise((params.seed + noise_seed_offset) & _MASK, [len(seq)], VOCAB)[0]
        return coupled_draft(model.logprobs([seq], params)[0], noise)
    return draft


def adversarial_drafter(target: MarkovModel) -> Drafter:
    """Always wrong: one past the target's coupled token."""
    def draft(seq: list[int], params: SamplingParams) -> int:
        lp = target.logprobs([seq], params)[0]
        return (int(coupled_token(lp, gumbel_noise(params.seed, [len(seq)], VOCAB)[0])) + 1) % VOCAB
    return draft


@pytest.mark.parametrize("params", PARAMS)
def test_committed_tokens_equal_target_only_coupled_sampling(params):
    target, n = MarkovModel(VOCAB, seed=0), 30
    expected = target_only(target, params, n)
    drafters = {
        "model": model_drafter(MarkovModel(VOCAB, seed=1)),
        "same model": model_drafter(target),
        "model, independent noise": model_drafter(target, noise_seed_offset=1),
        "adversarial": adversarial_drafter(target),
        "constant (like an n-gram miss)": lambda seq, p: 0,
    }
    for name, drafter in drafters.items():
        for k in (0, 1, 3, 5):
            tokens, accepted = speculative(target, drafter, params, k, n)
            assert tokens == expected, (name, k)
            if name == "same model":
                assert all(a == k for a in accepted), (name, k)  # draft == target: everything accepted
            if name == "adversarial":
                assert all(a == 0 for a in accepted), (name, k)


def test_batched_verify_equals_one_request_at_a_time():
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 6, 4, 32
    lp = torch.log_softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    noise = torch.stack([gumbel_noise(seed, range(10, 10 + k + 1), vocab) for seed in range(batch)])
    targets = coupled_token(lp, noise)  # [batch, k+1]
    drafts = targets[:, :k].clone()
    for row, wrong_at in enumerate([0, 1, 2, 3, None, None]):  # a mismatch at each position, or none
        if wrong_at is not None:
            drafts[row, wrong_at] = (drafts[row, wrong_at] + 1) % vocab
    out, num = coupled_verify(drafts, lp, noise)
    assert num.tolist() == [0, 1, 2, 3, 4, 4]
    for row in range(batch):
        tokens, accepted = coupled_verify_one(tuple(drafts[row].tolist()), lp[row], noise[row])
        assert out[row].tolist() == list(tokens) + [-1] * (k - accepted) and num[row] == accepted


# ------------------------------------------------------------------------------ the distribution

DIST_VOCAB = 8
DIST_STEPS = 120_000  # samples of the first committed token
DIST_K = 2


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(tokens, minlength=probs.shape[-1]).double() / tokens.numel()
    return 0.5 * (empirical - probs.double()).abs().sum().item()


@pytest.fixture(scope="module")
def distribution_case():
    """Target and draft distributions far apart (draft peaked where the target is not), and the noise
    of DIST_STEPS steps of k+1 positions each."""
    params = SamplingParams(temperature=1.0, top_k=7, seed=2024)  # top-k: one token filtered out
    target_logits = torch.tensor([0.3, 0.1, -0.2, 0.5, 0.0, -0.4, 0.2, -1.0])
    draft_logits = torch.tensor([-1.0, -1.0, -1.0, -1.0, 2.5, -1.0, -1.0, -1.0])
    target_lp = processed_logprobs(target_logits, params)  # [vocab]
    draft_lp = processed_logprobs(draft_logits, params)  # [vocab]
    noise = gumbel_noise(params.seed, range(DIST_STEPS * (DIST_K + 1)), DIST_VOCAB)
    return params, target_lp, draft_lp, noise.reshape(DIST_STEPS, DIST_K + 1, DIST_VOCAB)


def test_distribution_of_committed_tokens_is_the_targets(distribution_case):
    params, target_lp, draft_lp, noise = distribution_case
    target_probs, draft_probs = target_lp.exp(), draft_lp.exp()
    drafts = coupled_token(draft_lp.expand(DIST_STEPS, DIST_K, DIST_VOCAB), noise[:, :DIST_K])  # [steps, k]
    out, num = coupled_verify(drafts, target_lp.expand(DIST_STEPS, DIST_K + 1, DIST_VOCAB), noise)
    first = out[:, 0]
    assert total_variation(first, target_probs) <= 0.01
    assert total_variation(first, draft_probs) > 0.3  # converges to the target's, not the draft's
    # Every committed token, at any position of a step, is a target sample too.
    committed = out[out >= 0]
    assert committed.numel() >= DIST_STEPS and total_variation(committed, target_probs) <= 0.01
    assert 0 < num.float().mean().item() < DIST_K  # some drafts accepted, some not: the rule was exercised
    # The filtered-out token (top-k) is never committed.
    assert not (committed == int(target_lp.argmin())).any()


def test_a_wrong_rule_fails_the_distribution_test(distribution_case):
    """Wrong: accept the draft token when it equals a target sample drawn with noise independent of
    the one that draws the replacement (a verifier keying its accept test and its recovered token to
    different streams). The first committed token then leans toward the draft's favourite."""
    params, target_lp, draft_lp, noise = distribution_case
    target_probs = target_lp.exp()
    other = gumbel_noise(params.seed + 1, range(DIST_STEPS), DIST_VOCAB)  # [steps, vocab], independent
    draft = coupled_token(draft_lp.expand(DIST_STEPS, DIST_VOCAB), noise[:, 0])  # [steps]
    accept = draft == coupled_token(target_lp.expand(DIST_STEPS, DIST_VOCAB), other)
    replacement = coupled_token(target_lp.expand(DIST_STEPS, DIST_VOCAB), noise[:, 0])
    first = torch.where(accept, draft, replacement)
    tv = total_variation(first, target_probs)
    assert tv > 0.01, tv
    favourite = int(draft_lp.argmax())
    assert (first == favourite).double().mean().item() > target_probs[favourite].item() + 0.01


def test_draft_equal_to_target_accepts_everything(distribution_case):
    params, target_lp, _, noise = distribution_case
    lp = target_lp.expand(DIST_STEPS, DIST_K + 1, DIST_VOCAB)
    drafts = coupled_token(lp[:, :DIST_K], noise[:, :DIST_K])
    _, num = coupled_verify(drafts, lp, noise)
    assert (num == DIST_K).all()
