"""Sampling parameters and the one function that turns logits into the distribution tokens are drawn from.

Drafter and verifier both call :func:`probs_from_logits`, so temperature, top-k and top-p are applied
identically on both sides (a requirement for the rejection rule to be lossless).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from specdec.core.errors import InvalidRequest


MIN_TEMPERATURE = 1e-4


class VerificationRule(str, enum.Enum):
    """How sampled draft tokens are checked (greedy needs neither: it is exact-match at the argmax).

    REJECTION: Leviathan et al.'s rule (specdec.core.rejection): the target's distribution; a seed
    reproduces the output only under the same speculation schedule.
    COUPLED: per-position Gumbel noise shared by drafter and verifier (specdec.core.coupled): every
    token is the one target-only sampling with that seed picks, whatever k, drafter or replica.
    """

    REJECTION = "rejection"
    COUPLED = "coupled"


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax, ties to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0  # keys the counter-based RNG (specdec.core.rng); irrelevant when greedy
    rule: VerificationRule = VerificationRule.REJECTION

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature}")
        if math.isinf(self.temperature):
            raise InvalidRequest("temperature must be finite")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / T overflows to inf below this; such a temperature is greedy in all but name.
            raise InvalidRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.rule, VerificationRule):
            raise InvalidRequest(f"rule must be one of {[r.value for r in VerificationRule]}, got {self.rule!r}")

    @property
    def coupled(self) -> bool:
        """Sampled (not greedy) under the coupled rule."""
        return not self.greedy and self.rule is VerificationRule.COUPLED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_ids(scores: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value over the last dim, ties to the lowest id (NaN counts as
    largest): ``argmax``'s result, from ``max``, which PyTorch's CPU build computes faster
    (docs/performance.md, section 8)."""
    return scores.max(dim=-1).indices


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution to sample from: ``logits`` [..., vocab] -> probabilities [..., vocab], float32.

    Greedy gives a one-hot at the argmax, so the rejection rule needs no greedy special case:
    with one-hot target and draft distributions it accepts exactly the tokens that match the argmax.
    Order as in HF's ``generate``: temperature, then top-k, then top-p.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(top_ids(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: ``probs`` [..., vocab] (need not sum to 1), ``uniforms`` [...] in [0, 1).

    Returns token ids [...]. Tokens of zero probability are never chosen. Deterministic given the
    uniforms, which is what makes outputs reproducible across processes.
    """
    cdf = probs.double().cumsum(dim=-1)  # [..., vocab]
    total = cdf[..., -1:]
    target = uniforms.double().unsqueeze(-1) * total  # [..., 1]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_max(probs.shape[-1] - 1)
