"""Speculation-length control: the expected-tokens formula and the adaptive policy's choices."""
from __future__ import annotations

import pytest

from specdec.core.errors import InvalidRequest
from specdec.core.speculation import SpeculationController, SpeculationMode, SpeculationPolicy, expected_tokens


@pytest.mark.parametrize(
    "alpha, k, expected",
    [
        (0.0, 5, 1.0),  # nothing accepted: every step yields just its recovered/bonus token
        (1.0, 4, 5.0),  # everything accepted: k drafts + the bonus
        (0.5, 1, 1.5),
        (0.5, 3, 1.875),  # 1 + .5 + .25 + .125
        (0.8, 0, 1.0),  # k = 0 is plain decoding
    ],
)
def test_expected_tokens(alpha, k, expected):
    assert expected_tokens(alpha, k) == pytest.approx(expected)


def test_fixed_policy_never_moves():
    c = SpeculationController(SpeculationPolicy(SpeculationMode.FIXED, 3, 8))
    for drafted, accepted in [(3, 0), (3, 0), (3, 3), (3, 1)]:
        c.observe(drafted, accepted)
        assert c.next_k() == 3


def test_adaptive_grows_on_acceptance_and_shrinks_on_rejection():
    c = SpeculationController(SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8, draft_cost_ratio=0.1))
    for _ in range(6):
        c.observe(c.next_k(), c.next_k())  # all accepted
    high = c.next_k()
    assert high == 8
    for _ in range(12):
        c.observe(c.next_k(), 0)  # first draft always rejected
    assert c.next_k() < high
    assert c.alpha < 0.4


def test_adaptive_stops_speculating_when_it_does_not_pay():
    # Drafts as costly as verification and rarely accepted: plain decoding (k = 0) is best.
    c = SpeculationController(SpeculationPolicy(SpeculationMode.ADAPTIVE, 2, 8, draft_cost_ratio=1.0))
    for _ in range(10):
        c.observe(max(1, c.next_k()), 0)
    assert c.next_k() == 0


def test_adaptive_choice_maximises_tokens_per_cost():
    c = SpeculationController(SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8, draft_cost_ratio=0.2))
    for _ in range(5):
        c.observe(4, 2)
    alpha = c.alpha
    best = max(range(9), key=lambda k: expected_tokens(alpha, k) / (1 + 0.2 * k))
    assert c.next_k() == best


def test_same_observations_same_choices():
    history = [(4, 4), (5, 1), (3, 0), (4, 2), (0, 0), (2, 2)]
    runs = []
    for _ in range(2):
        c = SpeculationController(SpeculationPolicy())
        ks = []
        for d, a in history:
            c.observe(d, a)
            ks.append(c.next_k())
        runs.append(ks)
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"max_speculative_tokens": 65}, "max_speculative_tokens"),
        ({"num_speculative_tokens": 9, "max_speculative_tokens": 8}, "max_speculative_tokens"),
        ({"draft_cost_ratio": -0.1}, "draft_cost_ratio"),
    ],
)
def test_policy_validation(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        SpeculationPolicy(**kwargs)
