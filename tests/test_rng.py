"""Tests of the counter-based RNG (specdec.core.rng): every uniform is a pure function of
(seed, stream, position), the same in every process, and looks uniform."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdec.core import rng
from specdec.core.rng import Stream, uniform, uniform_ranked, uniforms

N = 20_000

KEYS = [
    (0, Stream.DRAFT_SAMPLE, 0),
    (0, Stream.ACCEPT, 0),
    (0, Stream.TARGET_SAMPLE, 0),
    (1, Stream.ACCEPT, 1),
    (12345, Stream.TARGET_SAMPLE, 678),
    (2**63, Stream.DRAFT_SAMPLE, 10**9),
    (2**64 - 1, Stream.ACCEPT, 2**40),
]


def test_mixer_is_splitmix64():
    # Published SplitMix64 outputs (first value of the generator seeded with 0 and with 1).
    assert rng._mix(0) == 0xE220A8397B1DCDAF
    assert rng._mix(1) == 0x910A2DEC89025CC1


def test_stream_ids_are_stable():
    # The stream id is hashed into every uniform: renumbering a stream changes every seeded output.
    assert {s.name: int(s) for s in Stream} == {"DRAFT_SAMPLE": 1, "ACCEPT": 2, "TARGET_SAMPLE": 3, "TREE_ACCEPT": 5}


@pytest.mark.parametrize(
    "key, expected_hex",
    [
        # Pinned values: a changed mixer would make a replica resuming a session from Redis draw
        # different numbers than the one that started it (if they run different versions).
        ((0, Stream.DRAFT_SAMPLE, 0), "0x1.1396e6040319ep-2"),
        ((0, Stream.ACCEPT, 0), "0x1.abe12b532e28fp-1"),
        ((12345, Stream.TARGET_SAMPLE, 678), "0x1.02c613f99a048p-4"),
        ((2**64 - 1, Stream.ACCEPT, 2**40), "0x1.729d4921e0c70p-5"),
    ],
)
def test_pinned_values(key, expected_hex):
    assert uniform(*key).hex() == expected_hex


def test_values_in_unit_interval_with_53_bits():
    values = [uniform(seed, stream, pos) for seed in range(3) for stream in Stream for pos in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    # Multiples of 2**-53 (so exactly representable, and never rounded up to 1.0).
    assert all((v * 2**53).is_integer() for v in values)


def test_deterministic_across_calls():
    first = [uniform(*key) for key in KEYS]
    assert [uniform(*key) for key in KEYS] == first
    tensor = uniforms(77, Stream.ACCEPT, [5, 6, 7, 1000])
    assert tensor.dtype == torch.float64 and tensor.shape == (4,)
    assert tensor.tolist() == [uniform(77, Stream.ACCEPT, p) for p in [5, 6, 7, 1000]]
    assert torch.equal(tensor, uniforms(77, Stream.ACCEPT, [5, 6, 7, 1000]))
    assert uniforms(77, Stream.ACCEPT, []).shape == (0,)


def test_deterministic_across_processes():
    code = (
        "import json, sys\n"
        "from specdec.core.rng import Stream, uniform, uniforms\n"
        "keys = json.loads(sys.argv[1])\n"
        "print(json.dumps({'single': [uniform(s, Stream(t), p).hex() for s, t, p in keys],\n"
        "                  'batch': [v.hex() for v in uniforms(9, Stream.TARGET_SAMPLE, range(100)).tolist()]}))\n"
    )
    keys = [[seed, int(stream), pos] for seed, stream, pos in KEYS]
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(keys)], capture_output=True, text=True, timeout=120, check=True
    )
    other = json.loads(result.stdout)
    assert other["single"] == [uniform(*key).hex() for key in KEYS]
    assert other["batch"] == [v.hex() for v in uniforms(9, Stream.TARGET_SAMPLE, range(100)).tolist()]


def test_different_seeds_streams_positions_differ():
    grid = [(seed, stream, pos) for seed in range(20) for stream in Stream for pos in range(50)]
    values = [uniform(*key) for key in grid]
    assert len(set(values)) == len(values)  # 3000 draws of 53 bits: a collision would mean a bug
    # Neighbouring keys in each coordinate, including very large ones.
    assert uniform(2**64 - 1, Stream.ACCEPT, 0) != uniform(2**64 - 2, Stream.ACCEPT, 0)
    assert uniform(5, Stream.ACCEPT, 2**63) != uniform(5, Stream.ACCEPT, 2**63 + 1)


def _check_uniform(values: torch.Tensor) -> None:
    """Loose uniformity checks on float64 values: mean, Kolmogorov-Smirnov and chi-square."""
    n = values.numel()
    assert abs(values.mean().item() - 0.5) < 0.01  # std of the mean is 0.29 / sqrt(n) = 0.002
    assert abs(values.var().item() - 1 / 12) < 0.005
    ordered = values.sort().values
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max().item()
    assert ks < 0.02  # critical value at the 0.1% level is 1.95 / sqrt(n) = 0.014
    counts = torch.bincount((values * 20).long(), minlength=20).double()
    expected = n / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 60  # 19 degrees of freedom: the 99.99% quantile is about 45


@pytest.mark.parametrize(
    "make_values",
    [
        pytest.param(lambda: uniforms(7, Stream.ACCEPT, range(N)), id="over-positions"),
        pytest.param(lambda: torch.tensor([uniform(s, Stream.TARGET_SAMPLE, 0) for s in range(N)], dtype=torch.float64), id="over-seeds"),
    ],
)
def test_roughly_uniform(make_values):
    _check_uniform(make_values())


def test_neighbouring_positions_and_streams_uncorrelated():
    a = uniforms(3, Stream.ACCEPT, range(N))
    b = uniforms(3, Stream.TARGET_SAMPLE, range(N))
    lag1 = torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1].item()
    cross = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    # std of a sample correlation is 1 / sqrt(N) = 0.007
    assert abs(lag1) < 0.04
    assert abs(cross) < 0.04


def test_ranked_uniforms_are_pinned_and_apart():
    # A token tree's later siblings at one position draw these; a changed mixer would change seeded tree outputs.
    assert uniform_ranked(7, Stream.TREE_ACCEPT, 100, 1).hex() == "0x1.e328d1af26332p-2"
    assert uniform_ranked(7, Stream.TREE_ACCEPT, 100, 2).hex() == "0x1.82d50b1cc76d0p-3"
    draws = {uniform_ranked(7, Stream.TREE_ACCEPT, 100, r) for r in range(64)}
    assert len(draws) == 64
