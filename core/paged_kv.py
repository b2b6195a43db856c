"""A paged KV cache: one pool of fixed-size pages on the model's device, a page table per sequence.

The bookkeeping (`PageAllocator`, `PageTable`) is plain Python, apart from any tensor, so it is
unit-tested on its own: a sequence's table lists the pages that hold its positions in order
(position p lives in page ``pages[p // page_tokens]`` at offset ``p % page_tokens``), and its
``length`` is how many positions hold valid keys and values. Growing a sequence takes pages from
the free list; truncating it (exact rollback after a rejected draft) and freeing it give pages
back, and the next sequence reuses them. Running out of pages is refused before anything changes
(`KVPagesExhausted`, one of the Overloaded errors: RESOURCE_EXHAUSTED to the caller), so no
sequence is ever left half-grown.

`PagedKV` adds the storage: ``pages`` is ``[layers, 2 (k, v), num_pages, page_tokens, kv_heads,
head_dim]`` in the model's dtype on its device (vLLM's block layout with both caches in one
tensor). Pages 0 and 1 are never handed out: page 0 is zeroed once and padded gathers point at it,
so a padded read is finite (a masked key is still multiplied by its probability 0, and NaN * 0 is
NaN); page 1 takes the writes of padding rows, whose keys nobody reads.
"""
from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.core.errors import Overloaded
from specdec.core.tree import feed_mask, feed_positions

ZERO_PAGE = 0  # never allocated: holds zeros, the target of padded gathers
SCRATCH_PAGE = 1  # never allocated: padding rows (core/cuda_graphs.py) write their keys and values here
FIRST_PAGE = 2


class KVPagesExhausted(Overloaded):
    """The page pool has too few free pages for this forward; nothing was changed."""


@dataclass
class PageTable:
    """One sequence's pages, in position order, and how many positions hold valid keys and values."""

    pages: list[int] = field(default_factory=list)  # the same list for the table's life (its finalizer holds it)
    length: int = 0
    freed: bool = False
    release: weakref.finalize | None = field(default=None, repr=False, compare=False)


class PageAllocator:
    """The free list of a pool of ``num_pages`` pages of ``page_tokens`` positions (pages 0 and 1 excluded)."""

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        if num_pages <= FIRST_PAGE or page_tokens < 1:
            raise ValueError(f"a page pool needs at least {FIRST_PAGE + 1} pages (two are reserved) and 1 token a page; "
                             f"got {num_pages} pages of {page_tokens}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        # A heap, lowest page first: the live sequences stay packed in the first pages.
        self._free = list(range(FIRST_PAGE, num_pages))
        # A table's pages come back when it is garbage too (a session that expired without a close),
        # and a finalizer may run on any thread: the free list is locked (reentrant: a collection
        # inside a locked section may run one on this thread).
        self._lock = threading.RLock()

    @property
    def pages_total(self) -> int:
        """Pages sequences can hold (the reserved pages are not)."""
        return self.num_pages - FIRST_PAGE

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.pages_total - self.pages_free

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_tokens)

    def new_table(self) -> PageTable:
        table = PageTable()
        table.release = weakref.finalize(table, self._give_back, table.pages)
        return table

    def _give_back(self, pages: list[int]) -> None:
        with self._lock:
            for page in pages:
                heapq.heappush(self._free, page)
            pages.clear()

    def reserve(self, tables: Sequence[PageTable], ends: Sequence[int]) -> None:
        """Give each table enough pages for positions [0, end): all of them, or (too few free pages)
        none, raising `KVPagesExhausted`. Lengths do not change: the caller sets them once written."""
        for t in tables:
            if t.freed:
                raise ValueError("a freed sequence's cache was used again")
        with self._lock:
            self._reserve(tables, ends)

    def _reserve(self, tables: Sequence[PageTable], ends: Sequence[int]) -> None:
        need = [max(0, self.pages_for(end) - len(t.pages)) for t, end in zip(tables, ends)]
        if sum(need) > len(self._free):
            raise KVPagesExhausted(
                f"the paged KV cache has {self.pages_free} free pages of {self.page_tokens} tokens "
                f"({self.pages_total} in all) and this forward needs {sum(need)}: lower max_sessions or "
                "max_kv_tokens, give the cache more memory (--kv-memory-fraction), or retry once sessions close")
        for t, n in zip(tables, need):
            for _ in range(n):
                t.pages.append(heapq.heappop(self._free))

    def truncate(self, table: PageTable, length: int) -> None:
        """Forget positions past ``length``: pages wholly past it go back to the free list."""
        if length < 0:
            raise ValueError(f"cannot truncate to {length}")
        table.length = min(table.length, length)
        keep = self.pages_for(length)
        with self._lock:
            while len(table.pages) > keep:
                heapq.heappush(self._free, table.pages.pop())

    def free(self, table: PageTable) -> None:
        """The sequence is over: every page goes back (idempotent)."""
        table.length = 0
        table.freed = True
        if table.release is not None:
            table.release()
        else:
            self._give_back(table.pages)

    def slots(self, table: PageTable, lo: int, hi: int) -> list[int]:
        """Flat slot indices (page * page_tokens + offset) of positions [lo, hi) of ``table``."""
        pt = self.page_tokens
        return [table.pages[p // pt] * pt + p % pt for p in range(lo, hi)]


class PagedKV:
    """The page pool's tensor and its allocator (one model, one dtype, one device)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, page_tokens: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.alloc = PageAllocator(num_pages, page_tokens)
        self.page_tokens = page_tokens
        # empty: on the CPU the OS commits a page of memory only when first written; on a GPU the
        # pool is allocated at start-up, as sized (`pages_for_memory`).
        self.pages = torch.empty(layers, 2, num_pages, page_tokens, kv_heads, head_dim, dtype=dtype, device=device)
        self.pages[:, :, ZERO_PAGE] = 0

    @property
    def page_bytes(self) -> int:
        return self.pages[:, :, 0].numel() * self.pages.element_size()

    def flat(self, layer: int, which: int) -> torch.Tensor:
        """Layer ``layer``'s keys (0) or values (1) as [num_pages * page_tokens, kv_heads, head_dim] (a view)."""
        return self.pages[layer, which].flatten(0, 1)


def pages_for_budget(budget_tokens: int, page_tokens: int, sessions: int) -> int:
    """Pages for a KV budget in tokens: every session's reservation rounded up to whole pages, one
    more page each for drafts verified past a reservation's end, and the reserved pages."""
    return -(-budget_tokens // page_tokens) + 2 * sessions + FIRST_PAGE


def pages_for_memory(free_bytes: int, fraction: float, page_bytes: int) -> int:
    """Pages in ``fraction`` of ``free_bytes`` (the device's free memory once the weights are loaded)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1]; got {fraction}")
    return int(free_bytes * fraction) // page_bytes


def allowed_positions(starts: torch.Tensor, rows: torch.Tensor, length: int, window: int | None,
                      n_max: int | None = None) -> torch.Tensor:
    """[S, n_max, length] bool: row r of a sequence whose feed starts at ``starts[b]`` (at position
    starts[b] + r) may attend to position p: causal, and within ``window`` when given (HF's sliding
    window: p > position - window). Rows past a feed's ``rows[b]`` (padding) see position 0 only
    (their output is dropped; a row that sees nothing would make NaN)."""
    n_max = n_max or int(rows.max())
    pos = starts[:, None] + torch.arange(n_max)  # [S, R]
    p = torch.arange(length)
    allowed = p <= pos[:, :, None]
    if window is not None:
        allowed &= p > (pos - window)[:, :, None]
    pad = torch.arange(n_max)[None, :] >= rows[:, None]  # [S, R]
    allowed[pad] = p == 0
    return allowed


def tree_allowed(start: int, rows: int, parents: Sequence[int], window: int | None) -> torch.Tensor:
    """[rows, start + rows] bool: the buffer positions each row of a feed whose last ``len(parents)``
    rows are a token tree's nodes may attend to (core/tree.py `feed_mask`: the rows before the tree
    and its own ancestors), and within ``window`` of its *position* (`feed_positions`: a node sits at
    its parent's position + 1, not at its buffer index). A key's position is its buffer index before
    the tree and its node's depth position within; the keys a node sees (the prefix and its
    ancestors) lie at consecutive positions along its path, as in the chain of that path."""
    allowed = feed_mask(start, rows, parents)
    if window is not None:
        pos = torch.tensor(feed_positions(start, rows, parents))  # [rows]
        key_pos = torch.cat([torch.arange(start), pos])  # [start + rows]: buffer index -> position
        allowed &= key_pos > (pos - window)[:, None]
    return allowed
