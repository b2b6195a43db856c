"""Speculation length under load: a draft token must pay for what it costs the whole batch.

When one forward verifies many sessions (continuous batching), a session's extra draft token makes
every session's step longer by the cost of one more row. Adding the k-th draft token gains that
session alpha^k expected tokens and costs the batch c seconds, in which the batch would have
committed c * G tokens (G: the batch's goodput, tokens per second). So it pays while
alpha^k > c * G (SmartSpec, Liu et al. 2024, maximises the batch's goodput; this is its marginal
form, one session at a time): alone, G is small and the cap rarely binds; under load G grows and
the cap falls to 0, where plain decoding serves the batch best; it grows back when load falls.
"""
from __future__ import annotations

import math


class BatchCostModel:
    """T_verify(rows) = base + per_row * rows, fitted online from the verifier's batches, and the
    batch's goodput (committed tokens per second of forward). Exponentially weighted: load changes."""

    def __init__(self, rate: float = 0.1, prior_per_row_fraction: float = 0.04) -> None:
        self._rate = rate
        self._prior = prior_per_row_fraction  # until rows vary enough to fit a slope: this share of a step per row
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._goodput: float | None = None
        self._draft_per_token: float | None = None  # over every session: a new one starts from it

    def observe(self, rows: int, seconds: float, committed_tokens: int, since_last_s: float | None = None) -> None:
        """After each batch: rows it verified (every session's k + 1), its forward's time, the tokens
        it committed, and the time since the previous batch ended (None: the first, or after idling).

        Goodput is over the whole cycle, the forward and what the sessions did between forwards
        (drafting, waiting for blocks): per forward second alone, speculation would look cheaper
        than it is."""
        if seconds <= 0:
            return
        cycle = since_last_s if since_last_s is not None and seconds <= since_last_s <= 10 * seconds + 0.05 else seconds
        keep = 1.0 - self._rate
        self._n = keep * self._n + 1.0
        self._x = keep * self._x + rows
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + rows * rows
        self._xy = keep * self._xy + rows * seconds
        g = committed_tokens / cycle
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
    def per_row_s(self) -> float:
        """Seconds one more verified row adds to a batch's forward."""
        if self._n == 0:
            return 0.0
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        prior = self._prior * mean_y
        if var < 1.0:  # rows hardly vary (one session at a fixed k): the slope is not identifiable
            return prior
        slope = (self._xy / self._n - mean_x * mean_y) / var
        return max(0.0, slope)


def load_cap(alpha: float, cost_per_token_s: float, goodput_tokens_per_s: float, max_k: int) -> int:
    """The largest k whose last draft token still pays for itself: alpha^k > cost * goodput."""
    price = cost_per_token_s * goodput_tokens_per_s  # tokens the batch gives up for one more draft token
    if price <= 0 or alpha >= 1.0:
        return max_k
    if price >= 1.0 or alpha <= 0.0:
        return 0
    return max(0, min(max_k, math.floor(math.log(price) / math.log(alpha))))
