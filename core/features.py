"""The target's features for drafters that draft from them (EAGLE heads): what crosses from the
verifier to such a drafter, and its bounds.

A *feature* is the target's last hidden state after its final norm at one position (the tensor its
LM head multiplies; core/eagle_head.py). A head drafting at position ``p`` reads the pair
(``f_p``, token ``p + 1``), so the verifier sends a position's feature once the token after it is
committed: after a prefill of ``P`` prompt tokens, positions ``0 .. P - 2``; after a step that
committed ``m`` tokens to reach ``n``, the ``m`` positions ``n - m - 1 .. n - 2`` (the verify
forward's rows of the last committed token and the accepted drafts). No extra forward: these are
rows the forward computed anyway.

On the wire a chunk is bfloat16 (bytes per position = width × 2) and at most
``MAX_CHUNK_BYTES``; a prompt's features go in as many chunks as that takes. No pickling: the
bytes are raw little-endian bfloat16, shape from the message's fields.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdec.core.errors import InvalidRequest

# Drafters that read the target's features: the verifier computes and sends them only for these.
FEATURE_DRAFTERS = frozenset({"eagle", "eagle_tree"})
MAX_CHUNK_BYTES = 3 << 20  # under gRPC's default 4 MiB message, with room for the rest of the outcome
MAX_WIDTH = 1 << 16
WIRE_DTYPE = torch.bfloat16


# Drafters that iterate on the target's own guesses (Jacobi, lookahead): the verifier sends them its
# likeliest token after each draft of the block it verified (`StepOutcome.row_argmax`).
ROW_TOKEN_DRAFTERS = frozenset({"jacobi", "lookahead"})


def needs_features(drafter: str) -> bool:
    return drafter in FEATURE_DRAFTERS


def needs_row_tokens(drafter: str) -> bool:
    return drafter in ROW_TOKEN_DRAFTERS


@dataclass(frozen=True)
class FeatureChunk:
    """Features of consecutive positions ``first_position ..``: ``values`` [n, width], bfloat16, on the host."""

    first_position: int
    values: torch.Tensor

    @property
    def end(self) -> int:
        return self.first_position + self.values.shape[0]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


def positions_per_chunk(width: int) -> int:
    return max(1, MAX_CHUNK_BYTES // (width * WIRE_DTYPE.itemsize))


def to_chunks(first_position: int, rows: torch.Tensor) -> Iterator[FeatureChunk]:
    """``rows`` [n, width] (any device or dtype) as bounded host chunks in the wire's dtype, one transfer."""
    host = rows.detach().to(device="cpu", dtype=WIRE_DTYPE)
    step = positions_per_chunk(host.shape[1])
    for lo in range(0, host.shape[0], step):
        yield FeatureChunk(first_position + lo, host[lo : lo + step])


def encode(chunk: FeatureChunk) -> tuple[int, int, bytes]:
    """(first position, width, raw bfloat16 bytes)."""
    values = chunk.values.to(WIRE_DTYPE).contiguous()
    return chunk.first_position, values.shape[1], values.view(torch.int16).numpy().tobytes()


def decode(first_position: int, width: int, data: bytes) -> FeatureChunk:
    """The inverse of `encode`, checked: InvalidRequest for a chunk that cannot be one."""
    if not 0 < width <= MAX_WIDTH:
        raise InvalidRequest(f"features.width must be in [1, {MAX_WIDTH}], got {width}")
    if len(data) > MAX_CHUNK_BYTES:
        raise InvalidRequest(f"a feature chunk holds at most {MAX_CHUNK_BYTES} bytes, got {len(data)}: split it")
    row = width * WIRE_DTYPE.itemsize
    if not data or len(data) % row:
        raise InvalidRequest(f"features.bfloat16 must be a positive multiple of width × 2 = {row} bytes, got {len(data)}")
    values = torch.frombuffer(bytearray(data), dtype=torch.int16).view(WIRE_DTYPE).reshape(-1, width)
    if not torch.isfinite(values).all():
        raise InvalidRequest("features must be finite")
    return FeatureChunk(first_position, values)
