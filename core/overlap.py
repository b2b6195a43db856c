"""Overlap bookkeeping shared by drafter and verifier: which draft blocks are still good, and what to pre-draft.

While the verifier checks block n, the drafter drafts for the likeliest outcomes of block n
(as SSD / Saguaro, "speculative speculative decoding", key drafts by accepted count and recovered
token; PEARL's post-verify is the all-accepted case): "j drafts accepted, then recovered token g" for small j and
the draft's own next-best guesses g, and "all accepted, then bonus token g". Each such block names
the exact committed sequence it continues (``DraftBlock.continues``), so a block whose guess was
wrong is simply never used: stale blocks are dropped, never patched, and every token that is
verified was drafted from exactly the sequence it follows. Which blocks exist changes only speed.

Pure: no threads, no grpc.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.steps import DraftBlock

# How often the target's token is the draft's top choice (BONUS_HIT) and, after a rejection, its
# next choices in turn (GUESS_HIT), as measured on the demo pair (docs/performance.md, 8). Only the
# order of pre-drafts depends on these, never what is committed.
GUESS_HIT = (0.37, 0.17, 0.08)
BONUS_HIT = 0.62


def could_continue(block: DraftBlock, committed: Sequence[int]) -> bool:
    """Whether ``block`` continues ``committed`` now or may once more tokens are committed."""
    n = len(committed)
    if block.base_len < n or block.anchor_len > n:
        return False
    return tuple(committed[block.anchor_len :]) == block.assumed_ids[: n - block.anchor_len]


class BlockBuffer:
    """Blocks received and not yet used, in arrival order; the verifier takes the first that continues."""

    def __init__(self) -> None:
        self._blocks: list[DraftBlock] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, block: DraftBlock) -> None:
        self._blocks.append(block)

    def take(self, committed: Sequence[int]) -> DraftBlock | None:
        """Remove and return the first block that continues ``committed``; drop the ones that never can."""
        keep: list[DraftBlock] = []
        found = None
        for block in self._blocks:
            if found is None and block.continues(committed):
                found = block
            elif could_continue(block, committed) and not block.continues(committed):
                keep.append(block)
        self._blocks = keep
        return found


@dataclass(frozen=True)
class Predraft:
    """One block worth drafting ahead: it assumes ``assumed_ids`` get committed next.

    ``bonus``: the guess of the last assumed token is the drafter's own next token, so the block is
    drafted one token longer and its first token becomes that guess.
    """

    assumed_ids: tuple[int, ...]
    bonus: bool
    likelihood: float


def plan_predrafts(in_flight: DraftBlock, alpha: float, max_blocks: int) -> list[Predraft]:
    """Blocks to draft for the outcomes of ``in_flight``, likeliest first; each assumes tokens after
    the committed sequence that ``in_flight`` continues.

    P(j accepted, then a rejection) = alpha^j (1 - alpha), times the chance that the guess is the
    recovered token; P(all accepted) = alpha^m, times the chance that the draft's next token is the bonus.
    """
    drafts = in_flight.proposal.token_ids
    alternatives = in_flight.proposal.alternatives
    m = len(drafts)
    plans = [Predraft(drafts, True, alpha**m * BONUS_HIT)]
    for j in range(min(m, len(alternatives))):
        for rank, guess in enumerate(alternatives[j][: len(GUESS_HIT)]):
            plans.append(Predraft(drafts[:j] + (guess,), False, alpha**j * (1 - alpha) * GUESS_HIT[rank]))
    plans.sort(key=lambda p: -p.likelihood)
    return plans[:max_blocks]


class BlockInbox:
    """The verifier's end of a drafter: blocks as they arrive, and a wait for the one that fits.

    Lives on one event loop; ``add`` and ``fail`` are called there (a thread hands blocks over with
    ``loop.call_soon_threadsafe``).
    """

    def __init__(self) -> None:
        self._buffer = BlockBuffer()
        self._arrived = asyncio.Event()
        self.failed: BaseException | None = None
        self.received = 0

    def add(self, block: DraftBlock) -> None:
        self._buffer.add(block)
        self.received += 1
        self._arrived.set()

    def fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
        self._arrived.set()

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            block = self._buffer.take(committed)
            if block is not None or self.failed is not None:
                return block
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return None
