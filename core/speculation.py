"""Choosing the speculation length (num_speculative_tokens, "k" in formulas) for each step.

With per-token acceptance alpha, a step that drafts k tokens commits on average
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (Leviathan et al. 2023, eq. 1) and costs about
1 + c*k target-step units, c being a draft token's cost relative to a verification. The adaptive
policy estimates alpha online from the request's own accepted/drafted counts (a Beta posterior with
exponential forgetting) and picks the k that maximises E / (1 + c*k); k = 0 (plain decoding) when
speculation does not pay. It uses only acceptance counts, which are a deterministic function of the
seed, so a seeded request stays reproducible; measured timings feed the controller of a later issue.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from specdec.core.errors import InvalidRequest


class SpeculationMode(enum.Enum):
    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class SpeculationPolicy:
    mode: SpeculationMode = SpeculationMode.ADAPTIVE
    num_speculative_tokens: int = 4  # fixed: always this; adaptive: the starting point
    max_speculative_tokens: int = 8
    draft_cost_ratio: float = 0.1  # c: a draft token's cost relative to one verification step

    def __post_init__(self) -> None:
        # num_speculative_tokens first: when only it is given, max_speculative_tokens is derived from it.
        if not 0 <= self.num_speculative_tokens <= 64:
            raise InvalidRequest(f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}")
        if not 0 <= self.max_speculative_tokens <= 64:
            raise InvalidRequest(f"max_speculative_tokens must be in [0, 64], got {self.max_speculative_tokens}")
        if self.mode is SpeculationMode.ADAPTIVE and self.num_speculative_tokens > self.max_speculative_tokens:
            raise InvalidRequest(
                f"num_speculative_tokens {self.num_speculative_tokens} exceeds max_speculative_tokens {self.max_speculative_tokens}"
            )
        if not self.draft_cost_ratio >= 0:
            raise InvalidRequest(f"draft_cost_ratio must be >= 0, got {self.draft_cost_ratio}")


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, k): expected tokens committed by one step that drafts k tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpeculationController:
    """Per-request state: call ``next_k()`` before each step and ``observe()`` after it."""

    def __init__(self, policy: SpeculationPolicy, prior_accepted: float = 2.0, prior_rejected: float = 1.0, decay: float = 0.8) -> None:
        self.policy = policy
        self._accepted = prior_accepted  # Beta(a, b) pseudo-counts, forgotten geometrically
        self._rejected = prior_rejected
        self._decay = decay
        self._k = policy.num_speculative_tokens

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def next_k(self) -> int:
        return self._k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if self.policy.mode is SpeculationMode.FIXED:
            return
        if num_drafted > 0:
            # accepted tokens are successes; the first rejection (if any) is one failure.
            rejected = 1 if num_accepted < num_drafted else 0
            self._accepted = self._decay * self._accepted + num_accepted
            self._rejected = self._decay * self._rejected + rejected
        else:
            # Nothing drafted (k = 0 or an empty n-gram lookup): drift back towards speculating.
            self._accepted += 0.5
        self._k = self._best_k()

    def _best_k(self) -> int:
        c = self.policy.draft_cost_ratio
        alpha = self.alpha
        return max(range(self.policy.max_speculative_tokens + 1), key=lambda k: expected_tokens(alpha, k) / (1.0 + c * k))
