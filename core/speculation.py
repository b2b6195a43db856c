"""Choosing the speculation length (num_speculative_tokens, "k" in formulas) for each step.

With per-token acceptance alpha, a step that drafts k tokens commits on average
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (Leviathan et al. 2023, eq. 1) and costs about
1 + c*k target-step units, c being a draft token's cost relative to a verification. The adaptive
policy estimates alpha online from the request's own accepted/drafted counts (a Beta posterior with
exponential forgetting) and picks the k that maximises expected committed tokens per second,
E(alpha, k) / T(k); k = 0 (plain decoding) when speculation does not pay. Until a request has
measured its own steps, T(k) is the cost model 1 + c*k; from then on T(k) comes from its measured
step times (``StepTiming``): the verify time as a line in k, what the step waited for its block
(under overlap a pre-drafted block is ready at once, so only misses wait: the block's drafting
time, a line in k too) and the rest of the step. Timings make k depend on the machine, so the k of every step is
recorded with the session (a seeded request under the rejection rule replays that schedule).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from specdec.core.errors import InvalidRequest
from specdec.core.ewfit import EwLine


class SpeculationMode(enum.Enum):
    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class SpeculationPolicy:
    mode: SpeculationMode = SpeculationMode.ADAPTIVE
    num_speculative_tokens: int = 4  # fixed: always this; adaptive: the starting point
    max_speculative_tokens: int = 8
    draft_cost_ratio: float = 0.1  # c: a draft token's cost relative to one verification step (before measurements)
    overlap: bool = True  # draft the next block while this one is verified; changes speed only

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

    def resumed_at(self, last_k: int | None) -> "SpeculationPolicy":
        """The policy a session resumed elsewhere goes on with: an adaptive one from the speculation
        length it had reached (``last_k``, its last step's), not from the request's starting point,
        since the controller it had learnt went with its verifier. Fixed k, or no step yet: unchanged."""
        if self.mode is not SpeculationMode.ADAPTIVE or last_k is None:
            return self
        return dataclasses.replace(self, num_speculative_tokens=min(max(0, last_k), self.max_speculative_tokens))


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, k): expected tokens committed by one step that drafts k tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class StepTiming:
    """What one step cost, in seconds, as the verifier measured it."""

    verify_s: float  # the target forward and the rejection rule
    wait_s: float  # waiting for the step's draft block
    step_s: float  # the whole step, wait and verify included
    draft_s: float = 0.0  # the drafter's own time for the block used (0: none)
    predrafted: bool = False  # the block was drafted while the previous step was verified


class _Ema:
    def __init__(self, rate: float) -> None:
        self.rate, self.value, self.count = rate, None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.rate) * self.value + self.rate * x
        self.count += 1

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


SEEN_ENOUGH = 3  # verifications at one k before its own mean prices it (one slow step is not its cost)


class StepCostModel:
    """Expected seconds of a step that verifies k drafts, from the request's own measured steps."""

    def __init__(self, rate: float = 0.2) -> None:
        # Verify seconds against k (does a draft token make the forward longer, and by how much?);
        # fitted more slowly than a mean, because a slope needs more steps.
        self.verify = _LineFit(rate / 4)
        # ...and each k's own mean once seen: a forward's cost is not a line in its rows (a kernel
        # blocks rows by the register tile, so a block past the tile costs a second pass).
        self.verify_by_k: dict[int, _Ema] = {}
        self._verify_rate = rate
        self.draft_per_token = _Ema(rate)  # a block's drafting time over its tokens (what the batch's load cap uses)
        # A block's drafting time against k: a block's first token also feeds the tokens the last
        # step committed (a cost per block, not per token), so at k = 1 the time per token is well
        # above the marginal one: charged per token, it kept k at 1 where 3 paid (docs/performance.md, 1.4).
        self.draft = _LineFit(rate / 4, prior_slope=None)
        self.miss = _Ema(rate)  # fraction of speculating steps that had to wait for their block
        self.miss_overhead = _Ema(rate)  # a wait's cost beyond the drafting itself (the hop)
        self.other = _Ema(rate)  # the rest of a step: hand-offs, sampling, messages
        self.steps = 0

    def observe(self, k: int, timing: StepTiming) -> None:
        self.steps += 1
        self.verify.add(k, timing.verify_s)
        self.verify_by_k.setdefault(k, _Ema(self._verify_rate)).add(timing.verify_s)
        self.other.add(max(0.0, timing.step_s - timing.verify_s - timing.wait_s))
        if k > 0:
            if timing.draft_s > 0:
                self.draft_per_token.add(timing.draft_s / k)
                self.draft.add(k, timing.draft_s)
            waited = not timing.predrafted
            self.miss.add(float(waited))
            if waited:
                self.miss_overhead.add(max(0.0, timing.wait_s - timing.draft_s))

    def verify_seconds(self, k: int) -> float:
        """A verification of k drafts: its own mean once seen `SEEN_ENOUGH` times, else the line."""
        own = self.verify_by_k.get(k)
        return own.value if own is not None and own.count >= SEEN_ENOUGH else self.verify.at(k)

    def seconds(self, k: int) -> float:
        verify = self.verify_seconds(k)
        t = verify + self.other.get(0.0)
        if k > 0:
            t += self.miss.get(1.0) * (self.draft_seconds(k) + self.miss_overhead.get(0.0))
        return t

    def draft_seconds(self, k: int) -> float:
        """A block of k tokens' drafting time: a line in k once k has varied, else in proportion to k."""
        if self.draft.n == 0:
            return 0.1 * k * self.verify.at(0)
        return self.draft.at(k)


class _LineFit:
    """y = a + b * k, exponentially weighted; b is fitted once k has varied, because machines
    differ. Until then, ``prior_slope``: b as a share of the mean per draft token (the verify time:
    4%, the demo pair's slope on one machine; on another a forward bound by reading weights costs
    about the same for 1 row or 5, docs/performance.md, 8, and a prior that charges every draft
    token a slope the machine does not have makes k too short), or None:
    y in proportion to k (a block's drafting time, whose fixed part cannot be told apart yet)."""

    PRIOR_SLOPE = 0.04

    def __init__(self, rate: float, prior_slope: float | None = PRIOR_SLOPE) -> None:
        self._fit = EwLine(rate)
        self._prior_slope = prior_slope

    @property
    def n(self) -> float:
        return self._fit.n

    def add(self, k: float, y: float) -> None:
        self._fit.add(k, y)

    def at(self, k: float) -> float:
        fit, prior = self._fit, self._prior_slope
        if fit.n == 0:
            return 1e-3 * (1 + (prior or 0.0) * k)
        mx, my = fit.mean_x, fit.mean_y
        if fit.var_x < 0.25:  # k hardly varied: the slope is not identifiable
            if prior is None:
                return my * k / mx
            base = my / (1 + prior * mx)
            return base * (1 + prior * k)
        return max(1e-6, my + max(0.0, fit.slope) * (k - mx))


IDLE_RELAX = 0.2  # per step without drafts: the share of the way back to the prior alpha
EXPLORE_AFTER = 16  # steps in the starting mode before the other one is first measured
EXPLORE_EVERY = 96  # steps in the chosen mode between two measurements of the other
EXPLORE_STEPS = 12  # steps a measurement runs, besides the two that straddle each switch


class SpeculationController:
    """Per-request state: call ``next_k()`` before each step, ``next_overlap()`` when telling the
    drafter a step's outcome, and ``observe()`` after each step.

    Adaptive requests that allow overlap also choose, by measurement, whether the drafter drafts
    ahead: on a machine where drafter and verifier share cores, drafting during a verification
    slows that verification (benchmarks/bench_contention.py; docs/performance.md, 1.7) by about as
    much as a pre-drafted block saves, so sequential
    steps can be the faster ones; across
    machines, overlap wins. The request keeps a cost model per mode, runs in the better one, and
    every ``EXPLORE_EVERY`` steps spends ``EXPLORE_STEPS`` in the other to keep its figures fresh.
    A step's timing belongs to the mode of the two outcomes before it (the last one decides what the
    drafter did during its verification, the one before whether its block was drafted ahead); the
    two steps after a switch are counted in neither. Overlap changes speed only, never tokens.
    """

    def __init__(self, policy: SpeculationPolicy, prior_accepted: float = 2.0, prior_rejected: float = 1.0, decay: float = 0.8) -> None:
        self.policy = policy
        self._accepted = prior_accepted  # Beta(a, b) pseudo-counts, forgotten geometrically
        self._rejected = prior_rejected
        self._prior = (prior_accepted, prior_rejected)
        self._decay = decay
        self._k = policy.num_speculative_tokens  # the k last worked out
        self._stale = False  # observed since: next_k works it out again
        self._overlap = policy.overlap
        chooses = policy.mode is SpeculationMode.ADAPTIVE and policy.overlap
        self._models = {True: StepCostModel(), False: StepCostModel()} if chooses else {policy.overlap: StepCostModel()}
        self._sent: list[bool] = []  # the overlap flags of the last two outcomes told to the drafter
        self._in_mode = 0  # steps since the mode last changed
        self._exploring = False
        self._explore_after = EXPLORE_AFTER

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    @property
    def costs(self) -> StepCostModel:
        """The cost model of the mode the request runs in now."""
        return self._models[self._overlap]

    def next_k(self) -> int:
        if self._stale:  # worked out when asked: under load the cap often decides without it
            self._k, self._stale = self._best_k(self.costs)[0], False
        return self._k

    @property
    def overlap(self) -> bool:
        """The mode the request runs in now: True while the drafter drafts ahead."""
        return self._overlap

    def next_overlap(self) -> bool:
        """Whether the drafter should draft ahead after the outcome being sent now."""
        self._sent = [*self._sent[-1:], self._overlap]
        return self._overlap

    def observe(self, num_drafted: int, num_accepted: int, timing: StepTiming | None = None) -> None:
        if self.policy.mode is SpeculationMode.FIXED:
            return
        if timing is not None:
            mode = self._step_mode()
            if mode is not None:
                self._models[mode].observe(num_drafted, timing)
        if num_drafted > 0:
            # accepted tokens are successes; the first rejection (if any) is one failure.
            rejected = 1 if num_accepted < num_drafted else 0
            self._accepted = self._decay * self._accepted + num_accepted
            self._rejected = self._decay * self._rejected + rejected
        else:
            # Nothing drafted (k = 0 or an empty n-gram lookup): no evidence, so the estimate relaxes
            # towards the prior, slowly; a request that stopped drafting tries again in time. (Not
            # towards 1: under load that made every idle session burst into k = 8 now and then.)
            a0, b0 = self._prior
            self._accepted += IDLE_RELAX * (a0 - self._accepted)
            self._rejected += IDLE_RELAX * (b0 - self._rejected)
        if len(self._models) == 2:
            self._choose_mode()
        self._stale = True

    def _step_mode(self) -> bool | None:
        if not self._sent:
            return self._overlap
        if len(self._sent) == 2 and self._sent[0] != self._sent[1]:
            return None  # straddles a switch
        return self._sent[-1]

    def _choose_mode(self) -> None:
        self._in_mode += 1
        if self._exploring:
            if self._in_mode < EXPLORE_STEPS + 2:
                return
            self._exploring = False
            best = max(self._models, key=lambda m: self._best_k(self._models[m])[1])
            if best != self._overlap:
                self._overlap, self._in_mode = best, 0
            self._explore_after = EXPLORE_EVERY
        elif self._in_mode >= self._explore_after and self._k > 0:  # at k = 0 the mode makes no difference
            self._overlap, self._in_mode, self._exploring = not self._overlap, 0, True

    def _cost(self, costs: StepCostModel):
        """A step's cost as a function of k: ``costs``' measured seconds, or 1 + c k before any step."""
        if costs.steps == 0:
            c = self.policy.draft_cost_ratio
            return lambda k: 1.0 + c * k
        return costs.seconds

    def _best_k(self, costs: StepCostModel) -> tuple[int, float]:
        """The k that maximises expected committed tokens per second under ``costs``, and that rate."""
        alpha, cost = self.alpha, self._cost(costs)
        rates = [expected_tokens(alpha, k) / cost(k) for k in range(self.policy.max_speculative_tokens + 1)]
        k = max(range(len(rates)), key=rates.__getitem__)  # the smallest k of the best rate
        return k, rates[k]


# Drafters whose blocks are token trees of k nodes: their accepted length is not the chain's
# E(alpha, k), so their adaptive budget is chosen by `TreeBudgetController`.
TREE_DRAFTERS = frozenset({"tree", "eagle_tree", "lookahead"})


class TreeBudgetController(SpeculationController):
    """The adaptive node budget of a tree drafter, from measurements: each budget of a ladder
    (0, 1, 3, 7, 15, ... up to the maximum, and the starting one) keeps the tokens its steps
    committed (an exponential mean), and the budget with the most tokens per second under the
    request's measured step costs is chosen. A budget not yet measured is priced at the chain's
    E(alpha, k) times the gain trees showed at the nearest measured budget (measured tokens over
    E(alpha, k) there), so a tree that beats a chain is expected to go on beating it and larger
    budgets get tried."""

    def __init__(self, policy: SpeculationPolicy, **kwargs) -> None:
        super().__init__(policy, **kwargs)
        top = policy.max_speculative_tokens
        self.ladder = sorted({0, top, policy.num_speculative_tokens} | {2 ** i - 1 for i in range(1, 7) if 2 ** i - 1 <= top})
        self._tokens: dict[int, _Ema] = {}

    def observe(self, num_drafted: int, num_accepted: int, timing: StepTiming | None = None) -> None:
        if num_drafted > 0 and self.policy.mode is SpeculationMode.ADAPTIVE:
            self._tokens.setdefault(num_drafted, _Ema(0.2)).add(num_accepted + 1.0)
        super().observe(num_drafted, num_accepted, timing)

    def tokens_per_step(self, k: int) -> float:
        """Measured tokens a step of budget k commits, or the estimate for a budget not yet measured."""
        if k == 0:
            return 1.0
        if k in self._tokens:
            return self._tokens[k].get(1.0)
        chain = expected_tokens(self.alpha, k)
        if not self._tokens:
            return chain
        near = min(self._tokens, key=lambda m: abs(m - k))
        return chain * self._tokens[near].get(1.0) / expected_tokens(self.alpha, near)

    def _best_k(self, costs: StepCostModel) -> tuple[int, float]:
        cost = self._cost(costs)
        rates = {k: self.tokens_per_step(k) / cost(k) for k in self.ladder}
        k = max(self.ladder, key=lambda b: (rates[b], -b))  # the smallest budget of the best rate
        return k, rates[k]
