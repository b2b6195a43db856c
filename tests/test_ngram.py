"""Prompt lookup (n-gram) drafting, table-driven in the style of vLLM's tests/v1/spec_decode/test_ngram.py.

``lookup(tokens, k, ngram_max, ngram_min)`` tries suffix lengths ngram_max down to ngram_min; for the
first length whose suffix occurred earlier, it proposes the (at most k) tokens that followed the most
recent earlier occurrence.
"""
from __future__ import annotations

import pytest

from specdec.core.sampling import SamplingParams
from specdec.draft.ngram import NgramDrafter, lookup

CASES = [
    # (tokens, k, ngram_max, ngram_min, expected proposal)
    pytest.param([1, 2, 3, 4, 1, 2], 2, 3, 1, (3, 4), id="plain-match"),
    # No earlier occurrence of any suffix: nothing to propose (the loop then decodes plainly).
    pytest.param([1, 2, 3, 4, 5], 3, 3, 1, (), id="no-match"),
    # The only occurrence starts at index 0: the very start of the context counts.
    pytest.param([7, 8, 9, 7], 2, 3, 1, (8, 9), id="match-at-start"),
    # Longest n wins even though a shorter suffix occurs more recently: [1,2,3] (n=3) was followed by
    # 10, while the more recent [2,3] (n=2) was followed by 20.
    pytest.param([1, 2, 3, 10, 7, 2, 3, 20, 1, 2, 3], 3, 3, 1, (10, 7, 2), id="prefers-longest-n"),
    # The same context with ngram_max=2: now only [2,3] can match, and its latest occurrence wins.
    pytest.param([1, 2, 3, 10, 7, 2, 3, 20, 1, 2, 3], 3, 2, 1, (20, 1, 2), id="ngram-max-caps-n"),
    # ngram_min=3 refuses the short matches the context has ([2,3] and [3]): nothing proposed.
    pytest.param([9, 2, 3, 10, 5, 2, 3], 2, 4, 3, (), id="ngram-min-refuses-short-match"),
    # Two earlier occurrences of [1,2]: the most recent one (followed by 20) wins, not the first (10).
    pytest.param([1, 2, 10, 1, 2, 20, 1, 2], 1, 2, 1, (20,), id="prefers-most-recent"),
    # Overlapping repeats: for [5,5,5,5] the longest suffix [5,5,5] occurs earlier only at index 0, and
    # just one token follows it. Lookup copies what the context holds; it never extrapolates a repeat.
    pytest.param([5, 5, 5, 5], 3, 3, 1, (5,), id="overlapping-repeat"),
    # Same with ngram_max=1: the latest earlier [5] is at index 2, again followed by one token only.
    pytest.param([5, 5, 5, 5], 3, 1, 1, (5,), id="overlapping-repeat-n1"),
    # A period-2 repeat: [1,2,1,2] at index 0 overlaps the suffix itself; what follows it runs to the end.
    pytest.param([1, 2, 1, 2, 1, 2], 4, 4, 1, (1, 2), id="overlapping-period-2"),
    # k larger than what follows the match: the proposal is shorter than k, and it may run into the
    # suffix itself (here the trailing 1).
    pytest.param([1, 2, 3, 1], 5, 3, 1, (2, 3, 1), id="k-larger-than-follows"),
    # k = 0: nothing, even with a perfect match.
    pytest.param([1, 2, 3, 1, 2], 0, 3, 1, (), id="k-zero"),
    # Negative k is treated as 0.
    pytest.param([1, 2, 3, 1, 2], -1, 3, 1, (), id="k-negative"),
    # k = 1: only the next token.
    pytest.param([1, 2, 3, 1, 2], 1, 3, 1, (3,), id="k-one"),
    # Too short to hold a suffix and an earlier occurrence.
    pytest.param([], 3, 3, 1, (), id="empty"),
    pytest.param([4], 3, 3, 1, (), id="single-token"),
    # Two tokens: the suffix [4] occurred at index 0 and was followed by the last token.
    pytest.param([4, 4], 3, 3, 1, (4,), id="two-equal-tokens"),
    # ngram_max longer than the context: capped at len(tokens) - 1.
    pytest.param([3, 1, 3], 2, 10, 1, (1, 3), id="ngram-max-beyond-context"),
    # A suffix that matches only partially earlier ([8,2,3] vs [1,2,3]) falls back to the shorter [2,3].
    pytest.param([8, 2, 3, 6, 1, 2, 3], 2, 3, 2, (6, 1), id="falls-back-to-shorter-n"),
]


@pytest.mark.parametrize("tokens, k, ngram_max, ngram_min, expected", CASES)
def test_lookup(tokens, k, ngram_max, ngram_min, expected):
    assert lookup(tokens, k, ngram_max, ngram_min) == expected


@pytest.mark.parametrize("tokens, k, ngram_max, ngram_min, expected", CASES)
def test_lookup_accepts_any_sequence(tokens, k, ngram_max, ngram_min, expected):
    """The worker passes a list; tuples must give the same proposal."""
    assert lookup(tuple(tokens), k, ngram_max, ngram_min) == expected


def test_drafter_session_proposes_point_masses():
    session = NgramDrafter(ngram_max=3, ngram_min=1).open((1, 2, 3), SamplingParams(temperature=0.8, seed=3))
    proposal = session.propose([1, 2, 3, 4, 1, 2], 2)
    assert proposal.token_ids == (3, 4)
    assert proposal.distributions is None  # n-gram drafts are deterministic: no q is sent


@pytest.mark.parametrize("ngram_max, ngram_min", [(2, 3), (3, 0), (0, 0)])
def test_drafter_refuses_bad_ngram_bounds(ngram_max, ngram_min):
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(ngram_max, ngram_min)
