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
(benchmarks/bench_contention.py measures the first effect; docs/performance.md, 1.7).
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


class LoadRegimes:
    """Under load, which way of choosing adaptive requests' k serves the batch best, found by trying each.

    The ways: ``CAPPED`` (each request's k capped by `load_cap`, the model above) and k = 2 for every
    adaptive request (k = 1, 2 and 3 as three ways were tried too, and measured worse: each way tried
    costs, and more ways meant more epochs on losing ones; docs/decisions/regime-ways-fixed-k.md). The model prices a draft token from fitted costs, and where those
    miss what drafting does to a batch (batches split while some sessions wait for their blocks, a
    batched draft forward's time counted once for each session drafted in it) it holds k at 0 where
    drafting pays, as measured in one process at 4 sessions (each request's own step-time model,
    asked instead, picked 0 as well; docs/decisions/goodput-cap-alone.md).

    Time is cut into epochs of ``epoch_s``, each run one way; an epoch's goodput is the tokens its
    batches committed over its wall time, kept per load level (open sessions, about a power of two) as
    an exponentially weighted mean per way. The best way runs; every ``explore_every`` epochs the
    next other way is tried again, an interval that doubles each time the way tried loses by more
    than ``margin`` (up to ``max_explore_every``) and starts again from ``explore_every`` when it
    does not: ways that keep losing by much cost little, and a close contest, where one noisy epoch
    could pick the wrong way, is looked at often (single epochs are noisy: docs/performance.md, 8). A fixed k that
    did worse at a lower load level, by any amount, is first tried at a higher one only after the
    longest interval (speculation pays less as the batch grows, and early tries of it under heavy load
    cost the level: docs/performance.md, 8). An epoch whose load level changed, or in which no adaptive request was open, is
    not counted. Pure: the caller passes the clock.
    """

    CAPPED = "capped"
    WAYS: tuple[str | int, ...] = (CAPPED, 2)

    def __init__(self, epoch_s: float = 0.5, explore_every: int = 4, max_explore_every: int = 32,
                 rate: float = 0.3, margin: float = 0.1, ways: tuple[str | int, ...] = WAYS) -> None:
        self.epoch_s = epoch_s
        self.margin = margin
        self.ways = ways
        self._explore_min = explore_every
        self._explore_max = max_explore_every
        self._rate = rate
        self.adaptive_sessions = 0  # open adaptive requests: the only ones this choice steers
        self.current: str | int = ways[0]
        self._level: int | None = None
        self._start = 0.0
        self._tokens = 0
        self._goodput: dict[tuple[int, str | int], float] = {}  # (level, way) -> tokens/s
        self._waited: dict[int, int] = {}  # level -> epochs since another way was last tried
        self._interval: dict[int, int] = {}  # level -> epochs between tries of another way
        self._turn: dict[int, int] = {}  # level -> which other way is tried next
        self._exploring = False  # the epoch running tries a way that was not the best

    @staticmethod
    def level(sessions: int) -> int:
        # Load levels centred on powers of two (3-5 sessions | 6-11 | 12-22 | 23-45 | 46-90 | ...), so a
        # load that sits at 16 and dips to 15 as requests end and begin keeps its level.
        return round(math.log2(max(1, sessions)))

    def goodput(self, sessions: int, way: str | int) -> float | None:
        return self._goodput.get((self.level(sessions), way))

    def observe(self, sessions: int, committed_tokens: int, now: float) -> None:
        """After each batch: the open sessions, the tokens the batch committed, the time it ended."""
        level = self.level(sessions)
        if level != self._level or self.adaptive_sessions <= 0:
            self._begin(level, now)
            return
        self._tokens += committed_tokens
        if now - self._start < self.epoch_s:
            return
        g = self._tokens / (now - self._start)
        key = (level, self.current)
        old = self._goodput.get(key)
        self._goodput[key] = g if old is None else (1 - self._rate) * old + self._rate * g
        self._begin(level, now, ended=True)

    def _lost(self, level: int, way: str | int, margin: float | None = None) -> bool:
        """Whether ``way``, tried at ``level``, trails the best way tried there by more than ``margin``
        (None: the class's margin)."""
        best = max(self._goodput.get((level, w), 0.0) for w in self.ways)
        return self._goodput[level, way] < (1 - (self.margin if margin is None else margin)) * best

    def _lost_below(self, level: int, way: str | int) -> bool:
        """Whether ``way``, a fixed k, did worse than the best way at some lower load level, by any
        amount: speculation pays less as the batch grows, so a higher level need not try it first
        (the model's way, ways[0], is always tried). By any amount, not by the margin: early tries
        under heavy load cost the level even where the fixed k had trailed under less load by less
        than the margin (docs/performance.md, 8)."""
        return way != self.ways[0] and any(self._lost(lower, w, margin=0.0) for lower, w in self._goodput if w == way and lower < level)

    def _begin(self, level: int, now: float, ended: bool = False) -> None:
        """Start an epoch at ``level``; ``ended``: the previous one was counted (else it was dropped)."""
        self._level, self._start, self._tokens = level, now, 0
        untried = [w for w in self.ways if (level, w) not in self._goodput]
        fresh = [w for w in untried if not self._lost_below(level, w)]
        if fresh:  # each way once first
            self.current = fresh[0]
            return
        best = max((w for w in self.ways if w not in untried), key=lambda w: self._goodput[level, w])
        # A fixed k that lost clearly under less load waits the longest interval before its first try here.
        interval = self._interval.setdefault(level, self._explore_max if untried else self._explore_min)
        if ended and self._exploring:  # the epoch just counted tried another way: did it lose clearly?
            interval = min(self._explore_max, 2 * interval) if self._lost(level, self.current) else self._explore_min
            self._interval[level] = interval
        self._exploring = False
        waited = self._waited.get(level, 0) + int(ended)
        others = [w for w in self.ways if w != best]
        if ended and others and waited >= interval:
            turn = self._turn.get(level, 0)
            self._turn[level] = turn + 1
            self._waited[level] = 0
            self._exploring = True
            self.current = others[turn % len(others)]
        else:
            self._waited[level] = waited
            self.current = best
