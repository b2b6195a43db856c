"""Counter-based randomness: every uniform is a pure function of (seed, stream, position).

A request's output then does not depend on which process ran a step or on what else that process
did (docs/guarantees.md, "Reproducibility"): a replica that resumes a session from Redis draws
the very same numbers. The mixer is SplitMix64 (Steele et al. 2014), a bijective 64-bit finaliser;
three rounds over the fields give independent-looking streams for neighbouring counters.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

_MASK = (1 << 64) - 1


class Stream(enum.IntEnum):
    """Which decision a uniform feeds. Separate streams keep the decisions independent."""

    DRAFT_SAMPLE = 1  # the drafter picks a draft token at this position
    ACCEPT = 2  # the verifier's accept/reject test of the draft token at this position
    TARGET_SAMPLE = 3  # the verifier samples a recovered or bonus token at this position
    # The accept test of a token tree's later sibling at this position (the first uses ACCEPT, so a
    # chain-shaped tree decides as the chain does): keyed by position and the sibling's rank.
    TREE_ACCEPT = 5  # (4 is specdec.core.noise.GUMBEL_STREAM)


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, stream: Stream, position: int) -> float:
    """One uniform in [0, 1) for (seed, stream, position); 53 random bits, like ``random.random``."""
    x = _mix(_mix(_mix(seed & _MASK) ^ int(stream)) ^ (position & _MASK))
    return (x >> 11) * (1.0 / (1 << 53))


def uniform_ranked(seed: int, stream: Stream, position: int, rank: int) -> float:
    """One uniform for (seed, stream, position, rank): several independent draws at one position."""
    x = _mix(_mix(_mix(_mix(seed & _MASK) ^ int(stream)) ^ (position & _MASK)) ^ (rank & _MASK))
    return (x >> 11) * (1.0 / (1 << 53))


def uniforms(seed: int, stream: Stream, positions: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniforms for several positions of one sequence: float64 tensor [len(positions)] on ``device``.

    Made in Python integers and exact in float64, so the same bits on every device."""
    return torch.tensor([uniform(seed, stream, p) for p in positions], dtype=torch.float64, device=device)
