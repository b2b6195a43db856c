"""Tests of specdec.core.sampling: SamplingParams validation, probs_from_logits, sample_from."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.core.errors import InvalidRequest, SpecdecError
from specdec.core.sampling import SamplingParams, probs_from_logits, sample_from, top_ids

MAX_UNIFORM = 1.0 - 2.0**-53  # the largest float64 uniform specdec.core.rng returns


def random_logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def support(probs: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in probs.reshape(-1, probs.shape[-1])]


# --------------------------------------------------------------------------------------------
# SamplingParams validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 1e-38}, "temperature"),  # logits / T would overflow to inf
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": -1e-12}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),  # a string is not a number, even if it parses as one
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": math.inf}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),  # seeds are 64-bit: 2**64 would alias seed 0 in the RNG
    ],
)
def test_invalid_params_raise_invalid_request_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=field) as excinfo:
        SamplingParams(**kwargs)
    assert isinstance(excinfo.value, SpecdecError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 0},
        {"temperature": 1e-4},  # the smallest non-greedy temperature (MIN_TEMPERATURE)
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"seed": 0},
        {"seed": 2**64 - 1},
    ],
)
def test_valid_boundary_params_accepted(kwargs):
    SamplingParams(**kwargs)


def test_params_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed == 0
    assert not SamplingParams(temperature=0.5).greedy
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# probs_from_logits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, expected_token",
    [
        ([0.5, 2.0, -1.0, 1.9], 1),
        ([1.0, 3.0, 3.0, 0.0], 1),  # tie between 1 and 2: lowest id
        ([0.0, 0.0, 0.0, 0.0], 0),  # all equal: token 0
        ([-5.0, -5.0, -7.0, -5.0], 0),
        ([-math.inf, -math.inf, 2.0, 2.0], 2),
    ],
)
def test_greedy_is_one_hot_at_argmax_with_ties_to_lowest_id(logits, expected_token):
    probs = probs_from_logits(torch.tensor([logits]), SamplingParams())
    expected = torch.zeros(1, 4)
    expected[0, expected_token] = 1.0
    assert torch.equal(probs, expected)


def test_greedy_ignores_top_k_and_top_p_and_keeps_batch_shape():
    logits = random_logits(2, 3, 20)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.3))
    assert probs.shape == (2, 3, 20) and probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 20).float())


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 10.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = random_logits(4, 32, seed=1)
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("input_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_output_is_float32_whatever_the_input_dtype(input_dtype):
    logits = random_logits(3, 10).to(input_dtype)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.9, top_k=4, top_p=0.8))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize(
    "top_k, expected_support",
    [
        (1, [1]),
        (2, [1, 3]),
        (4, [0, 1, 2, 3]),
        (5, [0, 1, 2, 3, 4]),  # k == vocab: no filter
        (50, [0, 1, 2, 3, 4]),  # k > vocab: no filter
        (0, [0, 1, 2, 3, 4]),  # 0 disables top-k
    ],
)
def test_top_k_literal(top_k, expected_support):
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=top_k))
    assert support(probs) == [expected_support]
    # Kept tokens keep their relative probabilities: softmax over the kept logits only.
    kept = torch.tensor(expected_support)
    torch.testing.assert_close(probs[0, kept], torch.softmax(logits[0, kept], dim=-1))


@pytest.mark.parametrize("top_k", [1, 3, 10, 49])
def test_top_k_keeps_exactly_k_highest(top_k):
    logits = random_logits(16, 50, seed=2)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=top_k))
    expected = torch.topk(logits, top_k, dim=-1).indices.sort(dim=-1).values.tolist()
    assert support(probs) == expected
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))


# Target distribution over tokens 0..3 is [0.15, 0.5, 0.05, 0.3]: by mass the order is 1, 3, 0, 2.
TOP_P_PROBS = [0.15, 0.5, 0.05, 0.3]


@pytest.mark.parametrize(
    "top_p, expected_support, expected_probs",
    [
        (1e-9, [1], [0.0, 1.0, 0.0, 0.0]),  # tiny top_p still keeps the most likely token
        (0.4, [1], [0.0, 1.0, 0.0, 0.0]),
        (0.75, [1, 3], [0.0, 0.625, 0.0, 0.375]),  # 0.5 < 0.75 <= 0.5 + 0.3
        (0.9, [0, 1, 3], [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),
        (0.99, [0, 1, 2, 3], TOP_P_PROBS),  # the last 0.05 is needed to reach 0.99
        (1.0, [0, 1, 2, 3], TOP_P_PROBS),
    ],
)
def test_top_p_literal(top_p, expected_support, expected_probs):
    logits = torch.tensor([TOP_P_PROBS]).log()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert support(probs) == [expected_support]
    torch.testing.assert_close(probs, torch.tensor([expected_probs]))


@pytest.mark.parametrize("top_p, expected_kept", [(0.25, 1), (0.5, 2), (0.6, 3), (0.75, 3), (0.76, 4)])
def test_top_p_prefix_that_reaches_top_p_exactly_is_enough(top_p, expected_kept):
    # Four equal logits: every probability is exactly 0.25, so prefix masses hit top_p exactly.
    # Mass 0.5 "reaches" top_p = 0.5: two tokens, not three. (Which of the tied tokens are kept
    # is unspecified, so only the count is checked.)
    probs = probs_from_logits(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=top_p))
    kept = probs[0] > 0
    assert int(kept.sum()) == expected_kept
    assert torch.equal(probs[0, kept], torch.full((expected_kept,), 1.0 / expected_kept))


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p):
    logits = random_logits(32, 40, seed=3)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    full = torch.softmax(logits.double(), dim=-1)
    for row in range(32):
        order = full[row].argsort(descending=True)
        cumulative = full[row, order].cumsum(0)
        size = int((cumulative < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        assert sorted(order[:size].tolist()) == support(probs[row : row + 1])[0], row
        assert probs[row].argmax() == logits[row].argmax()
        torch.testing.assert_close(probs[row, order[:size]].double(), full[row, order[:size]] / cumulative[size - 1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, top_k=7),
        SamplingParams(temperature=2.0, top_p=0.6),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1e-3),  # nearly greedy: must still be a distribution, no NaN
        SamplingParams(),
    ],
)
def test_rows_sum_to_one(params):
    probs = probs_from_logits(random_logits(3, 8, 100, seed=4, scale=10.0), params)
    assert not probs.isnan().any() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 8))


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.9),
        (0.6, 0, 0.3),
        (0.7, 10, 0.8),
        (2.0, 3, 0.5),
        (1.5, 40, 0.95),
    ],
)
def test_matches_transformers_logits_warpers(temperature, top_k, top_p):
    logits = random_logits(16, 64, seed=5)
    # HF's order in generate(): temperature, then top-k, then top-p; then softmax.
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)

    probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))

    assert support(probs) == support(expected)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# sample_from
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, uniform, expected",
    [
        ([0.25, 0.25, 0.5], 0.0, 0),
        ([0.25, 0.25, 0.5], 0.2499, 0),
        ([0.25, 0.25, 0.5], 0.25, 1),  # on a CDF step the next token is chosen: [0, 0.25) is token 0
        ([0.25, 0.25, 0.5], 0.5, 2),
        ([0.25, 0.25, 0.5], MAX_UNIFORM, 2),
        # Unnormalised weights (sum 8) behave like the normalised distribution.
        ([1.0, 2.0, 0.0, 5.0], 0.1, 0),
        ([1.0, 2.0, 0.0, 5.0], 0.125, 1),
        ([1.0, 2.0, 0.0, 5.0], 0.374, 1),
        ([1.0, 2.0, 0.0, 5.0], 0.375, 3),  # skips the zero-weight token 2
        # Leading and trailing zeros are never chosen, even at u = 0 and u just below 1.
        ([0.0, 0.0, 0.25, 0.75, 0.0], 0.0, 2),
        ([0.0, 0.0, 0.25, 0.75, 0.0], 0.25, 3),
        ([0.0, 0.0, 0.25, 0.75, 0.0], MAX_UNIFORM, 3),
        ([0.0, 1.0, 0.0], 0.0, 1),
        ([0.0, 1.0, 0.0], MAX_UNIFORM, 1),
    ],
)
def test_sample_from_literal(probs, uniform, expected):
    ids = sample_from(torch.tensor([probs]), torch.tensor([uniform], dtype=torch.float64))
    assert ids.tolist() == [expected]
    assert ids.dtype == torch.long


def test_sample_from_never_picks_zero_probability_tokens():
    gen = torch.Generator().manual_seed(6)
    probs = torch.rand(2000, 12, generator=gen)
    probs[torch.rand(2000, 12, generator=gen) < 0.6] = 0.0  # sparse rows, zeros at both ends too
    probs[torch.arange(2000), torch.randint(0, 12, (2000,), generator=gen)] = 0.01  # no empty row
    uniforms = torch.cat([torch.rand(1997, generator=gen, dtype=torch.float64), torch.tensor([0.0, MAX_UNIFORM, 1 - 2.0**-24], dtype=torch.float64)])
    ids = sample_from(probs, uniforms)
    assert (probs.gather(-1, ids[:, None]) > 0).all()
    # float32 uniforms (torch.rand's default) work the same
    ids32 = sample_from(probs, uniforms.float())
    assert (probs.gather(-1, ids32[:, None]) > 0).all()


@pytest.mark.parametrize("scale", [1.0, 7.3, 1e-3])
def test_sample_from_empirical_frequencies_match(scale):
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(10, generator=gen), dim=-1)
    probs[4] = 0.0
    n = 200_000
    ids = sample_from((probs * scale).expand(n, 10), torch.rand(n, generator=gen))
    empirical = torch.bincount(ids, minlength=10).double() / n
    target = probs.double() / probs.double().sum()
    assert empirical[4] == 0
    assert 0.5 * (empirical - target).abs().sum() < 0.01


def test_sample_from_is_deterministic_and_keeps_batch_shape():
    gen = torch.Generator().manual_seed(8)
    probs = torch.softmax(torch.randn(2, 3, 30, generator=gen), dim=-1)
    uniforms = torch.rand(2, 3, generator=gen, dtype=torch.float64)
    first = sample_from(probs, uniforms)
    assert first.shape == (2, 3)
    assert torch.equal(first, sample_from(probs.clone(), uniforms.clone()))
    # each entry is inverse-CDF sampling of its own row
    for i in range(2):
        for j in range(3):
            assert first[i, j] == sample_from(probs[i, j][None], uniforms[i, j][None])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_ids_are_argmaxs_ties_to_the_lowest_id_and_nan_first(dtype):
    """The rules' top_ids (max(dim=-1).indices, faster on the CPU) gives argmax's index in every case
    greedy equality depends on: ties, NaN, -inf rows, one row or many."""
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(50, 300, generator=g) * 4).round()  # rounded: many ties
    rows[3, 7] = rows[3, 9] = rows[3].max() + 1  # a tie at the top: the lower id wins
    rows[5, 11] = float("nan")
    rows[6] = float("-inf")
    rows = rows.to(dtype)
    assert torch.equal(top_ids(rows), rows.argmax(dim=-1))
    assert int(top_ids(rows)[3]) == 7 and int(top_ids(rows)[5]) == 11 and int(top_ids(rows)[6]) == 0
    assert torch.equal(top_ids(rows[0]), rows[0].argmax())
