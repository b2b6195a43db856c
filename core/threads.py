"""How many torch threads a model call should use, chosen by measuring both ways.

On 2 cores a target forward is bound by reading weights and keys/values, and two threads read
them faster than one while nothing else wants the second core; with another busy process on it,
OpenMP's barrier waits for a thread that is not running and the same forward is several times
slower than with one thread (the figures: docs/performance.md, section 1.2 and "OpenMP spinning").
Neither is known in advance and both change while a server runs, so the count is chosen as a
speculation length is: by the measured time of the calls themselves.

Calls are compared only with calls of about the same size (rows, in powers of two): each count's
seconds per call is an exponentially weighted mean per size, the faster count is used, and the
other count runs once every ``explore_every`` calls of a size, an interval that doubles (up to
``max_interval``) while those tries change nothing, so a slower count costs little once it is known
to be slower, and a change of the machine's load is still seen within a few hundred calls (at once
when the count in use gets slower: it is measured on every call). A size not seen before starts
from the count the largest smaller size measured fastest (more rows never scale worse), so rare
large calls (a prefill of many prompts) do not spend their first calls on the slower count. Pure:
the caller sets the count and times the call. Under exact numerics (core/exact_ops.py, checked at
load for the counts a chooser may pick) the count changes a forward's speed, never its logits.
"""
from __future__ import annotations

from collections.abc import Sequence


class ThreadChooser:
    def __init__(self, counts: Sequence[int], explore_every: int = 32, rate: float = 0.25, first_samples: int = 3,
                 max_interval: int = 256) -> None:
        if not counts or min(counts) < 1:
            raise ValueError(f"thread counts must be >= 1, got {tuple(counts)}")
        self.counts = tuple(sorted(set(counts)))
        self._explore_every = explore_every
        self._first = first_samples  # calls each count gets before any comparison (one call is noisy)
        self._seen: dict[tuple[int, int], int] = {}  # (size, count) -> calls observed
        self._rate = rate
        self._mean: dict[tuple[int, int], float] = {}  # (size, count) -> seconds per call
        self._calls: dict[int, int] = {}  # size -> calls so far
        self._max_interval = max(explore_every, max_interval)
        self._interval: dict[int, int] = {}  # size -> calls between tries of the other counts
        self._next_try: dict[int, int] = {}  # size -> the call that tries next
        self._best_at_try: dict[int, int] = {}  # size -> the best count when the last try was made
        self._tries: dict[int, int] = {}  # size -> tries so far (which other count goes next)

    @staticmethod
    def size_of(rows: int) -> int:
        return max(1, rows).bit_length()  # 1 | 2-3 | 4-7 | 8-15 | ...

    def choose(self, rows: int) -> int:
        """The count for a call of ``rows`` rows: each count's first few calls first, then the
        faster, with a periodic try of each slower one."""
        size = self.size_of(rows)
        n = self._calls.get(size, 0)
        self._calls[size] = n + 1
        untried = [c for c in self.counts if self._seen.get((size, c), 0) < self._first]
        borrowed = self._smaller_best(size) if untried else None
        if untried and borrowed is None:
            return untried[0]
        if untried:
            # A size first seen (a prefill of many prompts at once: rare, large) starts from the
            # count the largest known smaller size measured fastest, as its own first calls at the
            # slower count would cost whole forwards; the other counts are tried once every
            # `explore_every` calls, and once each has a time, this size's own times decide.
            never = [c for c in self.counts if c != borrowed and (size, c) not in self._seen]
            if never:
                return never[0] if n % self._explore_every == self._explore_every - 1 else borrowed
        best = self.best(rows)
        if len(self.counts) == 1:
            return best
        if size not in self._next_try:
            self._next_try[size] = n + self._explore_every
            return best
        if n < self._next_try[size]:
            return best
        # Time to try another count. The tries since the best last changed changed nothing: wait
        # twice as long for the next one; after a change, try again soon.
        unchanged = self._best_at_try.get(size) == best
        interval = min(2 * self._interval.get(size, self._explore_every), self._max_interval) if unchanged else self._explore_every
        self._interval[size], self._best_at_try[size] = interval, best
        self._next_try[size] = n + interval
        tries = self._tries[size] = self._tries.get(size, 0) + 1
        others = [c for c in self.counts if c != best]
        return others[tries % len(others)]

    def _smaller_best(self, size: int) -> int | None:
        """The fastest count at the largest smaller size where every count has its first calls, or None."""
        known = [other for other in {s for s, _ in self._seen} if other < size
                 and all(self._seen.get((other, c), 0) >= self._first for c in self.counts)]
        if not known:
            return None
        other = max(known)
        return min((self._mean[(other, c)], c) for c in self.counts)[1]

    def best(self, rows: int) -> int:
        """The count measured fastest for calls of this size (the fewest threads until measured)."""
        size = self.size_of(rows)
        seen = [(self._mean[(size, c)], c) for c in self.counts if (size, c) in self._mean]
        return min(seen)[1] if seen else self.counts[0]

    def observe(self, rows: int, count: int, seconds: float) -> None:
        key = (self.size_of(rows), count)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        rate = max(self._rate, 1.0 / seen)  # a plain mean over the first calls, then weighted to the recent
        if count != self.best(rows):
            rate = max(rate, 0.5)  # a count tried once per period: its samples are few, so each counts for more
        old = self._mean.get(key, seconds)
        self._mean[key] = (1 - rate) * old + rate * seconds

    def seconds(self, rows: int, count: int) -> float | None:
        """The measured mean for calls of this size at this count (None: not yet tried)."""
        return self._mean.get((self.size_of(rows), count))
