"""CUDA graphs for the paged runner's forward: captured at start-up per bucket, replayed with padding.

A verify step of a few rows per session is bound by launch overhead on a GPU (hundreds of small
kernels per forward). A CUDA graph replays a captured forward in one launch, but only for the shapes
and buffers it was captured with. So the forward is captured once per *bucket* (sessions, rows per
session, KV positions per session), at start-up and never on the request path; a batch is padded
into the smallest bucket that holds it (`choose_bucket`, `pad_batch`), the bucket's static input
buffers are overwritten, the graph replays, and each feed's logits are cut out of the padded output
(`unpad_logits`). A batch no bucket holds (a long prefill) runs eagerly.

Padding never touches a real sequence: padding sessions and rows read the zero page and write
their keys and values into the scratch page (core/paged_kv.py), and see only position 0.

Only the bookkeeping here is pure (bucket ladders, padding, unpadding), and it runs on the CPU too:
`CudaGraphs(capture=False)` replays the padded batch eagerly, which is how the padding is tested
without a GPU. Every torch.cuda call sits behind ``capture``, so this module imports anywhere.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.paged_kv import SCRATCH_PAGE, ZERO_PAGE, allowed_positions
from specdec.core.speculation import SpeculationPolicy

log = logging.getLogger(__name__)

SESSION_LADDER_MAX = 64  # sessions per forward: 1, 2, 4, .. 64
# rows per session (k + 1): 1, 2, 4, 8, 9, up to the default longest draft's block, which would
# otherwise run eagerly, at several times a captured step's cost (docs/performance.md, section 8)
ROW_LADDER_MAX = SpeculationPolicy.max_speculative_tokens + 1
FIRST_LENGTH = 256  # KV positions per session: 256, 1024, 4096, .. (x4), then the context
# A bucket's sessions x positions at most: each layer gathers that many keys and values (a 1B-class
# model's 64 x 4096 in bfloat16 is ~0.5 GiB a gather); longer batches run eagerly.
MAX_BUCKET_TOKENS = 64 * 4096


@dataclass(frozen=True, order=True)
class GraphBucket:
    """One captured shape: ``sessions`` feeds of at most ``rows`` rows each, ending by position ``length``."""

    sessions: int
    rows: int
    length: int

    @property
    def cost(self) -> int:
        return self.sessions * self.rows * self.length


def ladder(limit: int, first: int = 1, factor: int = 2) -> tuple[int, ...]:
    """first, first * factor, .. while below ``limit``, then ``limit`` itself."""
    out = []
    n = first
    while n < limit:
        out.append(n)
        n *= factor
    return (*out, limit)


def buckets_for(max_sessions: int, context: int, max_rows: int = ROW_LADDER_MAX,
                max_tokens: int = MAX_BUCKET_TOKENS) -> list[GraphBucket]:
    """Every (sessions, rows, length) of the ladders, at most ``max_sessions`` sessions, ``context``
    positions and ``max_tokens`` sessions x positions."""
    sessions = ladder(min(max_sessions, SESSION_LADDER_MAX))
    rows = ladder(max_rows)
    lengths = ladder(context, min(FIRST_LENGTH, context), 4)
    return [GraphBucket(s, r, n) for s in sessions for r in rows for n in lengths if s * n <= max_tokens]


def choose_bucket(buckets: Sequence[GraphBucket], sessions: int, rows: int, length: int) -> GraphBucket | None:
    """The cheapest bucket holding ``sessions`` feeds of at most ``rows`` rows ending by ``length``; None: run eagerly."""
    fits = [b for b in buckets if b.sessions >= sessions and b.rows >= rows and b.length >= length]
    return min(fits, key=lambda b: (b.cost, b)) if fits else None


@dataclass
class PaddedBatch:
    """A batch laid out as a bucket's static inputs (host tensors): row b * rows + r is row r of feed b."""

    token_ids: torch.Tensor  # [sessions * rows]
    positions: torch.Tensor  # [sessions * rows]; padding rows: 0
    write: torch.Tensor  # [sessions * rows] flat KV slot; padding rows: the scratch page
    gather: torch.Tensor  # [sessions, length] flat KV slots; past a feed's end: the zero page
    starts: torch.Tensor  # [sessions]; padding sessions: 0
    rows: torch.Tensor  # [sessions] real rows per feed; padding sessions: 0


def pad_batch(batch, bucket: GraphBucket, page_tokens: int) -> PaddedBatch:
    """``batch`` (core/paged_runner.py `Batch`, host tensors) padded to ``bucket``."""
    S, R, L = bucket.sessions, bucket.rows, bucket.length
    place = torch.cat([torch.arange(n) + b * R for b, n in enumerate(batch.lengths)])  # [N] row -> padded row
    token_ids = torch.zeros(S * R, dtype=torch.long)
    token_ids[place] = batch.token_ids
    positions = torch.zeros(S * R, dtype=torch.long)
    positions[place] = batch.positions
    write = torch.full((S * R,), SCRATCH_PAGE * page_tokens, dtype=torch.long)
    write[place] = batch.write
    gather = torch.full((S, L), ZERO_PAGE * page_tokens, dtype=torch.long)
    gather[: batch.gather.shape[0], : batch.gather.shape[1]] = batch.gather
    starts = torch.zeros(S, dtype=torch.long)
    starts[: len(batch.starts)] = torch.tensor(batch.starts)
    rows = torch.zeros(S, dtype=torch.long)
    rows[: len(batch.lengths)] = torch.tensor(batch.lengths)
    return PaddedBatch(token_ids, positions, write, gather, starts, rows)


def unpad_logits(logits: torch.Tensor, lengths: Sequence[int], num_last: Sequence[int], rows: int) -> list[torch.Tensor]:
    """Each feed's last ``num_last`` rows of the padded output ``logits`` [sessions * rows, vocab]
    (copies: the graph's output buffer is overwritten by its next replay)."""
    index = torch.tensor([b * rows + r for b, (n, m) in enumerate(zip(lengths, num_last)) for r in range(n - m, n)],
                         device=logits.device)
    return list(logits.index_select(0, index).split(list(num_last)))


class StaticBatch:
    """A bucket's input buffers on the device, in the shape `PagedRunner._forward` reads a batch."""

    def __init__(self, bucket: GraphBucket, windows: Sequence[int | None], device: torch.device) -> None:
        S, R, L = bucket.sessions, bucket.rows, bucket.length
        self.bucket = bucket
        self.n, self.n_max, self.longest = S * R, R, L
        self.token_ids = torch.zeros(S * R, dtype=torch.long, device=device)
        self.positions = torch.zeros(S * R, dtype=torch.long, device=device)
        self.write = torch.zeros(S * R, dtype=torch.long, device=device)
        self.gather = torch.zeros(S, L, dtype=torch.long, device=device)
        self.grid = torch.arange(S * R, device=device)  # already laid out [sessions, rows]
        self.last = torch.arange(S * R, device=device)  # logits of every row: `unpad_logits` picks
        self.masks = {w: torch.zeros(S, 1, R, L, dtype=torch.bool, device=device) for w in dict.fromkeys(windows)}

    def mask(self, window: int | None) -> torch.Tensor:
        return self.masks[window]

    def load(self, padded: PaddedBatch) -> None:
        for name in ("token_ids", "positions", "write", "gather"):
            getattr(self, name).copy_(getattr(padded, name))
        for window, mask in self.masks.items():
            mask.copy_(allowed_positions(padded.starts, padded.rows, self.longest, window, self.n_max)[:, None])


class CudaGraphs:
    """The paged runner's forward per bucket: captured CUDA graphs (``capture``, default on CUDA) or,
    without, the same padded static batch run eagerly (the CPU path, for tests)."""

    def __init__(self, runner, buckets: Sequence[GraphBucket], capture: bool | None = None) -> None:
        self.runner = runner
        self.buckets = sorted(buckets)
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.static = {b: StaticBatch(b, runner.kv.windows, runner.device) for b in self.buckets}
        self.graphs: dict[GraphBucket, tuple[object, torch.Tensor]] = {}
        self.replays = 0  # forwards served by a bucket (captured or not)
        if self.capture:
            self._capture_all()

    def _capture_all(self) -> None:
        """Capture every bucket, largest first (later, smaller ones reuse the shared pool's memory)."""
        pool = torch.cuda.graph_pool_handle()
        pt = self.runner.page_tokens
        for bucket in sorted(self.buckets, reverse=True):
            static = self.static[bucket]
            empty = PaddedBatch(torch.zeros(static.n, dtype=torch.long), torch.zeros(static.n, dtype=torch.long),
                                torch.full((static.n,), SCRATCH_PAGE * pt, dtype=torch.long),
                                torch.full((bucket.sessions, bucket.length), ZERO_PAGE * pt, dtype=torch.long),
                                torch.zeros(bucket.sessions, dtype=torch.long), torch.zeros(bucket.sessions, dtype=torch.long))
            static.load(empty)  # every row padding: writes only the scratch page
            with torch.inference_mode():
                side = torch.cuda.Stream(self.runner.device)
                side.wait_stream(torch.cuda.current_stream(self.runner.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: allocator, kernel selection, lazy inits
                        self.runner._forward(static)
                torch.cuda.current_stream(self.runner.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.runner._forward(static)
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.runner.device)
        log.info("captured %d CUDA graphs of the verify forward", len(self.graphs))

    def run(self, batch) -> list[torch.Tensor] | None:
        """Logits per feed of ``batch`` (host `Batch`) through its bucket, or None where no bucket holds it."""
        bucket = choose_bucket(self.buckets, len(batch.lengths), batch.n_max, batch.longest)
        if bucket is None:
            return None
        static = self.static[bucket]
        static.load(pad_batch(batch, bucket, self.runner.page_tokens))
        if bucket in self.graphs:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self.runner._forward(static)
        self.replays += 1
        return unpad_logits(out, batch.lengths, batch.num_last, bucket.rows)
