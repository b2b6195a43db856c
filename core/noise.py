"""Counter-based Gumbel noise for coupled verification: a pure function of (seed, position, token id).

The coupled rule (specdec.core.coupled) gives every position of a request one row of noise over the
vocabulary. Drafter and verifier recompute the same row from (seed, position) alone, so they exchange
nothing, and a replica that resumes a session from Redis draws the very same noise
(docs/guarantees.md, "Reproducibility").

How a row is made (the integer steps in wrapping unsigned 64-bit arithmetic, numpy's ``uint64``):

* row key = mix(mix(mix(seed) ^ GUMBEL_STREAM) ^ position), with ``mix`` SplitMix64's output
  function (Steele et al. 2014, https://doi.org/10.1145/2714064.2660195): the key scheme of
  ``specdec.core.rng``, with a stream id of its own.
* hash j = mix(row key + j * 0x9E3779B97F4A7C15), the (j+1)-th output of a SplitMix64 generator
  started at the row key. Token 2j takes its low 32 bits v, token 2j+1 its high 32 bits (one hash
  per two tokens: hashing is the dearer part after the logs).
* uniform w = (v + 0.5) * 2**-32, the midpoint of one of 2**32 equal cells (exact in float64),
  rounded once to float32 and capped at 1 - 2**-24: strictly inside (0, 1).
* Gumbel noise g = -log(-log(1 - w)), computed as -log(-log1p(-w)) in float32.

Why float32, and w rather than u = 1 - w: the noise is added to float32 log-probabilities
(specdec.core.coupled.processed_logprobs), and float32 logs cost half what float64 ones do. What
decides the noise's quality is the largest values, where the winning tokens come from, i.e. small w;
there w is exact (below 2**-9) and log1p keeps full precision. The largest noise is
-log(-log1p(-2**-33)) = 22.9, so a token can still win against one e**22.9 (9e9) times more likely;
a float32 u = m * 2**-24 would cap that at e**16.6 (2e7), and cell floors instead of midpoints would
shift every token's noise the same way.

Bit-identity: unsigned integer arithmetic wraps by definition, so every w is the same on every machine
(tests/test_coupled.py holds it to pure-Python SplitMix64). log1p and log are elementwise torch
kernels; on one build they give the same bits whatever the thread count, the process, or where the
element sits in the block (tested). Another build or vector unit could differ in a last bit, which
changes a token only at an exact float32 tie. Noise is therefore computed on the CPU whatever the
logits' device, and moved there once (``device``): the hashing would give the same bits in int64 torch
ops on a GPU, but CUDA's float32 log and log1p are not the CPU's, and a CPU drafter and a GPU
verifier (or two replicas) must draw the very same noise. Its cost on a GPU verifier: docs/operations.md, Devices.

Cost: a small fraction of a verify step, about half of it the two logs and a quarter the hashing
(measured per block size: docs/performance.md, 3).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.core import rng

# Beside specdec.core.rng.Stream's DRAFT_SAMPLE = 1, ACCEPT = 2, TARGET_SAMPLE = 3, TREE_ACCEPT = 5: hashed into every
# row key, so renumbering it changes every seeded coupled output.
GUMBEL_STREAM = 4

_MAX_UNIFORM = 1.0 - 2.0**-24  # the float32 below 1: w = 1 would make the noise -inf
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, elementwise and in place on a uint64 array (= rng._mix)."""
    x += _GOLDEN
    x ^= x >> _S30
    x *= _MUL1
    x ^= x >> _S27
    x *= _MUL2
    x ^= x >> _S31
    return x


def _positions_array(positions: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(positions, torch.Tensor):
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(f"positions must be a 1-D integer tensor, got {positions.dtype} {list(positions.shape)}")
        array = positions.detach().cpu().numpy()
        if array.size and array.min() < 0:
            raise ValueError("positions must be >= 0")
        return array.astype(np.uint64)
    values = list(positions)
    if any(not 0 <= p < 2**64 for p in values):
        raise ValueError("positions must be in [0, 2**64)")
    return np.array(values, dtype=np.uint64)


def _row_keys(seed: int, positions: np.ndarray) -> np.ndarray:
    """One SplitMix64 state per position: [len(positions)] uint64."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    request = rng._mix(rng._mix(seed) ^ GUMBEL_STREAM)  # the part shared by all positions, in Python ints
    return _mix(positions ^ np.uint64(request))


def _bits(seed: int, positions: Sequence[int] | torch.Tensor, vocab: int) -> np.ndarray:
    """32 random bits per (position, token id): [len(positions), vocab] uint32, possibly a strided view."""
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    keys = _row_keys(seed, _positions_array(positions))  # [rows]
    steps = np.arange((vocab + 1) // 2, dtype=np.uint64) * _GOLDEN  # [ceil(vocab/2)]
    hashes = _mix(keys[:, None] + steps[None, :])  # [rows, ceil(vocab/2)]
    # Token 2j: low half of hash j; token 2j+1: high half. '<u8' is a no-op on little-endian machines
    # and a byte swap elsewhere, so the halves land in the same order on every machine.
    halves = hashes.astype("<u8", copy=False).view("<u4")  # [rows, 2 * ceil(vocab/2)]
    return halves[:, :vocab]


def noise_uniforms(seed: int, positions: Sequence[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms w behind :func:`gumbel_noise`: [len(positions), vocab] float32 in [2**-33, 1 - 2**-24].

    w = (v + 0.5) * 2**-32 for 32 hashed bits v (exact in float64), rounded once to float32 (exact
    below 2**-9) and capped below 1.
    """
    v = torch.from_numpy(np.ascontiguousarray(_bits(seed, positions, vocab), dtype=np.uint32))  # [rows, vocab]
    return v.double().add_(0.5).mul_(2.0**-32).float().clamp_max_(_MAX_UNIFORM)


def gumbel_noise(seed: int, positions: Sequence[int] | torch.Tensor, vocab: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise for each (position, token id): [len(positions), vocab] float32 on ``device``.

    g = -log(-log(1 - w)) for the uniforms w of :func:`noise_uniforms`. Row i depends only on
    (seed, positions[i]) and entry [i, t] only on (seed, positions[i], t): not on the other positions
    in the block, nor on the thread count. Uses no global RNG. Computed on the CPU on every device
    (the module docstring says why), so the same bits everywhere.
    """
    w = noise_uniforms(seed, positions, vocab)  # [rows, vocab]
    # -log(1 - w) = -log1p(-w): exact inputs and full precision for small w, i.e. for the largest noise.
    return w.neg_().log1p_().neg_().log_().neg_().to(device)
