"""Speculation length under load: a draft token must pay for what it costs the whole batch.

When one forward verifies many sessions (continuous batching), a session's extra draft token makes
every session's step longer by the cost of one more row. Adding the k-th draft token gains that
session alpha^k expected tokens and costs the batch c seconds, in which the batch would have
committed c * G tokens (G: the batch's goodput, tokens per second). So it pays while
alpha^k > c * G (SmartSpec, Liu et al. 2024, maximises the batch's goodput; this is its marginal
form, one session at a time): alone, G is small and the cap rarely binds; under load G grows and
the cap falls to 0, where plain decoding serves the batch best; it grows back when load falls.

A draft token can cost the batch more than its row: where the drafter shares cores with the
verifier (this machine), drafting slows the forward it overlaps, and a session that waits for its
block holds the whole batch back. So the cost of a draft token is also fitted as it is seen, over
whole cycles (forward and the gap before it): cycle seconds = a + b * sessions + c * drafts, and c
is used when it is known and larger than the row-and-drafting estimate
(benchmarks/bench_contention.py measures the first effect: a verification 1.27x as long while
another process drafts).
"""
from __future__ import annotations

import math

from specdec.core.ewfit import EwLine


class BatchCostModel:
    """T_verify(rows) = base + per_row * rows, fitted online from the verifier's batches, and the
    batch's goodput (committed tokens per second of forward). Exponentially weighted: load changes."""

    def __init__(self, rate: float = 0.1, prior_per_row_fraction: float = 0.04) -> None:
        self._rate = rate
        self._prior = prior_per_row_fraction  # until rows vary enough to fit a slope: this share of a step per row
        self._rows = EwLine(rate)  # forward seconds against rows verified
        self._goodput: float | None = None
        self._draft_per_token: float | None = None  # over every session: a new one starts from it
        self._cycles = _CycleFit()

    def observe(self, rows: int, seconds: float, committed_tokens: int, since_last_s: float | None = None,
                drafts: int = 0) -> None:
        """After each batch: rows it verified (every session's k + 1), its forward's time, the tokens
        it committed, the time since the previous batch ended (None: the first, or after idling), and
        how many of its rows were draft tokens.

        Goodput is over the whole cycle, the forward and what the sessions did between forwards
        (drafting, waiting for blocks): per forward second alone, speculation would look cheaper
        than it is."""
        if seconds <= 0:
            return
        whole_cycle = since_last_s is not None and seconds <= since_last_s <= 10 * seconds + 0.05  # else: idled between
        cycle = since_last_s if whole_cycle else seconds
        keep = 1.0 - self._rate
        self._rows.add(rows, seconds)
        g = committed_tokens / cycle
        if whole_cycle:
            self._cycles.add(rows - drafts, drafts, cycle)
        self._goodput = g if self._goodput is None else keep * self._goodput + self._rate * g

    def observe_draft(self, seconds_per_token: float) -> None:
        """A block's drafting time per token, as its session measured it."""
        d = self._draft_per_token
        self._draft_per_token = seconds_per_token if d is None else (1 - self._rate) * d + self._rate * seconds_per_token

    @property
    def draft_per_token_s(self) -> float:
        return self._draft_per_token or 0.0

    @property
    def goodput_tokens_per_s(self) -> float:
        return self._goodput or 0.0

    @property
    def draft_token_cost_s(self) -> float | None:
        """Seconds of batch cycle one more draft token adds, fitted (None until drafts have varied)."""
        return self._cycles.draft_slope()

    @property
    def per_row_s(self) -> float:
        """Seconds one more verified row adds to a batch's forward."""
        fit = self._rows
        if fit.n == 0:
            return 0.0
        if fit.var_x < 1.0:  # rows hardly vary (one session at a fixed k): the slope is not identifiable
            return self._prior * fit.mean_y
        return max(0.0, fit.slope)


class _CycleFit:
    """Exponentially weighted least squares of y = a + b * sessions + c * drafts; slow (rate 0.01),
    because most batches under load hold no drafts at all."""

    def __init__(self, rate: float = 0.01) -> None:
        self._keep = 1.0 - rate
        self._sums = [0.0] * 9  # n, s, d, y, ss, sd, dd, sy, dy

    def add(self, sessions: int, drafts: int, y: float) -> None:
        s, d = float(sessions), float(drafts)
        terms = (1.0, s, d, y, s * s, s * d, d * d, s * y, d * y)
        self._sums = [self._keep * old + new for old, new in zip(self._sums, terms)]

    def draft_slope(self) -> float | None:
        n, s, d, y, ss, sd, dd, sy, dy = self._sums
        if n < 20:
            return None
        ms, md, my = s / n, d / n, y / n
        css, csd, cdd = ss / n - ms * ms, sd / n - ms * md, dd / n - md * md
        csy, cdy = sy / n - ms * my, dy / n - md * my
        if cdd < 0.05:  # drafts hardly varied: not identifiable
            return None
        if css < 0.05:  # one batch size throughout: drafts alone explain the rest
            return max(0.0, cdy / cdd)
        det = css * cdd - csd * csd
        if det < 0.05 * css * cdd:  # drafts moved with the batch size: the two are not separable
            return None
        return max(0.0, (css * cdy - csd * csy) / det)


def load_cap(alpha: float, cost_per_token_s: float, goodput_tokens_per_s: float, max_k: int) -> int:
    """The largest k whose last draft token still pays for itself: alpha^k > cost * goodput."""
    price = cost_per_token_s * goodput_tokens_per_s  # tokens the batch gives up for one more draft token
    if price <= 0 or alpha >= 1.0:
        return max_k
    if price >= 1.0 or alpha <= 0.0:
        return 0
    return max(0, min(max_k, math.floor(math.log(price) / math.log(alpha))))
