"""The paged KV backend: every sequence's keys in one page pool on the model's device (core/paged_kv.py),
and how a forward's flat ragged batch attends over them.

A forward's rows are the feeds' tokens one after another (vLLM's flattened layout, `Batch`): each
row's key and value go to its page slot, and each sequence's rows attend over its own pages. The
attention strategy is fixed when the backend is built:

- "batched" (fast numerics, the default): each layer gathers every sequence's keys and values from
  its pages into a padded ``[sessions, kv_heads, longest, head_dim]`` batch and calls SDPA once with
  a mask ``[sessions, 1, most rows, longest]`` (causal, sliding window, padding), measured against
  one SDPA per sequence and FlexAttention in docs/performance.md ("GPU runner"). The mask is built
  per row as the positions it may attend to (core/paged_kv.py `allowed_positions`), not as a causal
  flag, so a row may see any set of positions. core/cuda_graphs.py replays this from static buffers.
- "loop": one SDPA per sequence over its gathered pages.
- "exact-native" (the CPU's C kernel: each row over the keys it sees, in order), "exact-triton"
  (core/triton_exact.py), "exact-tiles" (per sequence in float32, keys padded to whole
  `KEY_BLOCK`s, query rows in tiles of a size fixed by the sequence's row count): a row's output
  depends on its own sequence only.

Token trees (`Feed.parents`): a node's rows of the mask are its tree's (the rows before the tree and
its own ancestors; core/paged_kv.py `tree_allowed`) in every strategy; sliding windows count
positions, not buffer indices. `keep_path` then moves the accepted path's keys and values to where
a chain's would be. Sliding-window models keep their whole cache and mask keys older than the
window, so rollback stays exact (a rolling buffer would have dropped them).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.core import llama_model, native_kernels, triton_exact
from specdec.core.exact_attention import KEY_BLOCK, attend_tiles, round_up
from specdec.core.paged_kv import ZERO_PAGE, PagedKV, PageTable, allowed_positions, tree_allowed
from specdec.core.runner import Feed
from specdec.core.tree import feed_positions

STRATEGIES = ("batched", "loop", "exact-native", "exact-triton", "exact-tiles")


class Batch:
    """A forward's flat layout, built on the host; `to` moves it to the device in a few tensors.

    Rows are the feeds' tokens one after another (N in all). ``write``: each row's flat KV slot
    (page * page_tokens + offset); ``gather`` [S, longest]: each sequence's slots for positions
    [0, longest), the zero page's first slot past its end; ``grid``: each row's place in the
    padded [S, n_max] query grid; ``last``: the rows whose logits are returned; ``positions``: each
    row's position (a tree node's is its depth's, `feed_positions`; a row's buffer position, where
    its keys and values go, is always its feed's start + row); ``parents``: each feed's tree (empty:
    a chain)."""

    def __init__(self, alloc, feeds: Sequence[Feed]) -> None:
        pt = alloc.page_tokens
        self.lengths = [len(f.token_ids) for f in feeds]
        self.starts = [f.start for f in feeds]
        self.ends = [s + n for s, n in zip(self.starts, self.lengths)]
        self.num_last = [f.num_last for f in feeds]
        self.parents = [tuple(f.parents) for f in feeds]
        self.has_trees = any(self.parents)
        self.n = sum(self.lengths)
        self.n_max = max(self.lengths)
        self.longest = max(self.ends)
        offsets = [0]
        for n in self.lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        self.tables = tables = [f.cache for f in feeds]  # each feed's page table (`PagedBackend.finish` sets lengths)
        self.token_ids = torch.tensor([t for f in feeds for t in f.token_ids])  # [N]
        self.positions = torch.tensor([r for s, n, p in zip(self.starts, self.lengths, self.parents)
                                       for r in feed_positions(s, n, p)])  # [N]
        self.write = torch.tensor([slot for t, s, e in zip(tables, self.starts, self.ends) for slot in alloc.slots(t, s, e)])
        self.last = torch.tensor([r for b, m in enumerate(self.num_last) for r in range(offsets[b + 1] - m, offsets[b + 1])])
        table = torch.full((len(feeds), alloc.pages_for(self.longest)), ZERO_PAGE, dtype=torch.long)
        for b, t in enumerate(tables):
            used = alloc.pages_for(self.ends[b])
            table[b, :used] = torch.tensor(t.pages[:used], dtype=torch.long)
        gather = (table[:, :, None] * pt + torch.arange(pt)).flatten(1)[:, : self.longest]  # [S, longest]
        self.gather = torch.where(torch.arange(self.longest) < torch.tensor(self.ends)[:, None], gather, ZERO_PAGE * pt)
        self.grid = torch.cat([torch.arange(n) + b * self.n_max for b, n in enumerate(self.lengths)])  # [N]
        self.device = torch.device("cpu")
        self.gather_host = self.gather
        self._masks: dict[int | None, torch.Tensor] = {}

    def to(self, device: torch.device) -> Batch:
        self.gather_host = self.gather  # (exact attention slices it per sequence on the host)
        for name in ("token_ids", "positions", "write", "last", "gather", "grid"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def mask(self, window: int | None) -> torch.Tensor:
        """[S, 1, n_max, longest] bool for the layers of this window (built once per forward and window):
        causal rows, and a tree feed's rows its tree's (`tree_allowed`)."""
        if window not in self._masks:
            allowed = allowed_positions(torch.tensor(self.starts), torch.tensor(self.lengths), self.longest, window, self.n_max)
            for b, parents in enumerate(self.parents):
                if parents:  # (past its end a tree row sees nothing either way: causal rows stop there too)
                    allowed[b, :self.lengths[b], :self.ends[b]] = self.tree_allowed(b, window)
            self._masks[window] = allowed[:, None].to(self.device)
        return self._masks[window]

    def tree_allowed(self, b: int, window: int | None) -> torch.Tensor:
        """[rows, end] bool on the host: the buffer positions tree feed b's rows see (core/paged_kv.py)."""
        return tree_allowed(self.starts[b], self.lengths[b], self.parents[b], window)


class PagedBackend:
    """`KVBackend` (core/kv_backend.py) over a page pool: ``pages`` (`PagedKV`), ``windows`` (each
    layer's sliding window, None: full attention), ``strategy`` (one of `STRATEGIES`) and, for
    "exact-tiles", ``exact_tile(rows)``: query rows per attention tile for a sequence of that many rows."""

    verifies_trees = True

    def __init__(self, pages: PagedKV, n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 windows: Sequence[int | None], context_length: int, strategy: str = "batched",
                 exact_tile: Callable[[int], int] | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
        self.pages, self.strategy, self.exact_tile = pages, strategy, exact_tile
        self.n_heads, self.n_kv, self.head_dim, self.dtype = n_heads, n_kv, head_dim, dtype
        self.windows = list(windows)
        self.context_length = context_length
        self.page_tokens = pages.page_tokens
        self.device = pages.pages.device

    # ---------------------------------------------------------------------------------- caches

    def new_cache(self) -> PageTable:
        return self.pages.alloc.new_table()

    def truncate(self, cache: PageTable, length: int) -> None:
        self.pages.alloc.truncate(cache, length)

    def free(self, cache: PageTable) -> None:
        self.pages.alloc.free(cache)

    @property
    def pages_total(self) -> int:
        return self.pages.alloc.pages_total

    @property
    def pages_free(self) -> int:
        return self.pages.alloc.pages_free

    def kv_bytes(self) -> int:
        """Device bytes of the pages sequences hold now."""
        return self.pages.alloc.pages_used * self.pages.page_bytes

    def kv_token_capacity(self, sessions: int) -> int:
        """Tokens the pool can promise ``sessions`` sequences: all its pages but two per sequence (one
        for rounding a reservation up to pages, one for drafts verified past a reservation's end)."""
        return max(0, self.pages_total - 2 * sessions) * self.page_tokens

    def read_kv(self, cache: PageTable, lo: int, hi: int) -> torch.Tensor:
        """Keys and values of positions [lo, hi): [layers, 2, kv_heads, hi - lo, head_dim], on this
        runner's device (the lean cache's ``buf[:, :, :, lo:hi]`` layout, which core/kv_blocks.py encodes)."""
        if hi > cache.length:
            raise ValueError(f"positions up to {hi} asked of a cache holding {cache.length}")
        slots = torch.tensor(self.pages.alloc.slots(cache, lo, hi), device=self.device)
        flat = self.pages.pages.flatten(2, 3)  # [layers, 2, pages * page_tokens, kv, d]
        return flat[:, :, slots].transpose(2, 3)

    def write_prefix(self, cache: PageTable, kv: torch.Tensor) -> None:
        """Adopt ``kv`` [layers, 2, kv_heads, n, head_dim] as positions [0, n) of ``cache``."""
        n = kv.shape[3]
        alloc = self.pages.alloc
        alloc.truncate(cache, 0)
        alloc.reserve([cache], [n])
        slots = torch.tensor(alloc.slots(cache, 0, n), device=self.device)
        flat = self.pages.pages.flatten(2, 3)
        flat[:, :, slots] = kv.to(self.device, self.dtype).transpose(2, 3)
        cache.length = n

    def keep_path(self, cache: PageTable, first: int, path: Sequence[int]) -> None:
        """After a tree feed whose nodes' keys and values lie at positions ``first + node``: move the
        accepted ``path``'s to ``first, first + 1, ...`` (every layer, keys and values), where a
        chain's would be; truncating to ``first + len(path)`` then keeps exactly the accepted tokens'.
        A path's nodes increase and node >= place, so each source lies at or after its target and no
        move reads a slot an earlier one wrote (the gather below reads them all first anyway)."""
        moves = [(first + place, first + node) for place, node in enumerate(path) if node != place]
        if not moves:
            return
        if max(source for _, source in moves) >= cache.length:
            raise ValueError(f"path {list(path)} after position {first} reaches past the cache's {cache.length} positions")
        alloc = self.pages.alloc
        targets = torch.tensor([alloc.slots(cache, t, t + 1)[0] for t, _ in moves], device=self.device)
        sources = torch.tensor([alloc.slots(cache, s, s + 1)[0] for _, s in moves], device=self.device)
        flat = self.pages.pages.flatten(2, 3)  # [layers, 2, pages * page_tokens, kv, d] (a view)
        flat[:, :, targets] = flat[:, :, sources]

    # ---------------------------------------------------------------------------------- forwards

    def plan(self, feeds: Sequence[Feed]) -> Batch:
        """Room for every feed (all or none: refused, no sequence has changed), what lies past a feed's
        start forgotten, and the batch's flat layout on the host (`Batch.to` moves it)."""
        alloc = self.pages.alloc
        for f in feeds:
            if f.start > f.cache.length:
                raise ValueError(f"a feed starts at {f.start} but its cache holds {f.cache.length} positions")
            if len(f.parents) > len(f.token_ids):
                raise ValueError(f"a feed of {len(f.token_ids)} rows cannot hold a tree of {len(f.parents)} nodes")
            if f.start + len(f.token_ids) > self.context_length:
                raise ValueError(f"{f.start + len(f.token_ids)} positions exceed the model's context length {self.context_length}")
        ends = [f.start + len(f.token_ids) for f in feeds]
        alloc.reserve([f.cache for f in feeds], ends)
        for f, end in zip(feeds, ends):
            alloc.truncate(f.cache, end)  # pages past the feed's end go back
            f.cache.length = min(f.cache.length, f.start)
        return Batch(alloc, feeds)

    def finish(self, batch: Batch) -> None:
        for table, end in zip(batch.tables, batch.ends):
            table.length = end

    def run_layers(self, model, x: torch.Tensor, rotary: torch.Tensor, batch: Batch) -> torch.Tensor:
        return llama_model.run_layers(model, x, rotary, lambda i, q, k, v: self.attend(i, q, k, v, batch))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer ``layer``'s new keys and values ``k``/``v`` [N, kv, d] into each row's page slot, then every
        row's query ``q`` [N, h, d] over its own sequence's pages, by this backend's strategy: [N, h * d]."""
        keys, values = self.pages.flat(layer, 0), self.pages.flat(layer, 1)  # [pages * page_tokens, kv, d]
        keys[batch.write] = k
        values[batch.write] = v
        window = self.windows[layer]
        if self.strategy == "loop":
            return self._attend_loop(batch, q, keys, values, window)
        if self.strategy != "batched":
            return self._attend_exact(batch, q, keys, values, window)
        h, d = self.n_heads, self.head_dim
        S, R = batch.gather.shape[0], batch.n_max
        queries = q.new_zeros(S * R, h, d)
        queries[batch.grid] = q
        k = keys[batch.gather].transpose(1, 2)  # [S, kv, longest, d]
        v = values[batch.gather].transpose(1, 2)
        att = F.scaled_dot_product_attention(
            queries.view(S, R, h, d).transpose(1, 2), k, v, attn_mask=batch.mask(window),
            scale=1.0 / math.sqrt(d), enable_gqa=self.n_kv != h)  # [S, h, R, d]
        return att.transpose(1, 2).reshape(S * R, h * d)[batch.grid]  # [N, h * d]

    def _attend_loop(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     window: int | None) -> torch.Tensor:
        """One SDPA per sequence over its gathered pages (the alternative `attention="loop"`)."""
        h, d = self.n_heads, self.head_dim
        out = q.new_empty(batch.n, h * d)
        mask = batch.mask(window)
        for b, (lo, n, end) in enumerate(zip(batch.offsets, batch.lengths, batch.ends)):
            index = batch.gather[b, :end]
            att = F.scaled_dot_product_attention(
                q[lo:lo + n].transpose(0, 1)[None], keys[index].transpose(0, 1)[None], values[index].transpose(0, 1)[None],
                attn_mask=None if n == 1 and window is None else mask[b, :, :n, :end],
                scale=1.0 / math.sqrt(d), enable_gqa=self.n_kv != h)  # [1, h, n, d]
            out[lo:lo + n] = att[0].transpose(0, 1).reshape(n, h * d)
        return out

    def _attend_exact(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: int | None) -> torch.Tensor:
        """Per sequence, in float32: keys zero-padded to whole `KEY_BLOCK`s, query rows in
        tiles of a size fixed by this sequence's row count, each tile one batched GEMM over the KV
        heads (`attend_tiles`): a row's bits depend on its own sequence only."""
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        if self.strategy == "exact-native":
            return self._attend_native(batch, q, keys, values, window)
        if self.strategy == "exact-triton":
            seq_of_row, limits, allowed = self._row_masks(batch, window)
            return triton_exact.attention(q, keys, values, batch.gather, seq_of_row, limits, allowed, 1.0 / math.sqrt(d))
        g = h // kv
        out = q.new_empty(batch.n, h * d)
        for lo, index, tiles in self._exact_layout(batch, window):
            k3 = keys[index].transpose(0, 1).float()  # [kv, L, d]
            v3 = values[index].transpose(0, 1).float()
            for t0, rows, bias in tiles:  # bias [kv, tile * g, L]
                tile = bias.shape[1] // g
                queries = q.new_zeros(tile, h, d, dtype=torch.float32)
                queries[:rows] = q[lo + t0:lo + t0 + rows].float()
                queries = queries.view(tile, kv, g, d).transpose(0, 1).reshape(kv, tile * g, d)
                att = attend_tiles(queries, k3, v3, bias, 1.0 / math.sqrt(d))  # [kv, tile * g, d]
                att = att.view(kv, tile, g, d).transpose(0, 1)[:rows]  # [rows, kv, g, d]
                out[lo + t0:lo + t0 + rows] = att.reshape(rows, h * d).to(self.dtype)
        return out

    def _attend_native(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       window: int | None) -> torch.Tensor:
        """Every row over its own sequence's gathered pages in C (core/native_kernels.py `attention`):
        it reads only the keys its mask lets it see, in position order, so nothing else in the batch
        touches its bits."""
        slots, limits, allowed = self._row_masks(batch, window)
        scratch = batch.__dict__.setdefault("_scratch", torch.empty(batch.longest + 64))
        k = keys[batch.gather].permute(0, 2, 1, 3)  # [S, kv, longest, d], one copy for every row
        v = values[batch.gather].permute(0, 2, 1, 3)
        out = native_kernels.attention(q.float().contiguous(), k, v, slots, limits, allowed, 1.0 / math.sqrt(self.head_dim),
                                       scratch)
        return out.to(self.dtype)

    @staticmethod
    def _row_masks(batch: Batch, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row of the batch: its sequence, one past its last visible position, and the positions it
        sees [N, longest] (uint8), on the batch's device; built once per forward and window."""
        cache = batch.__dict__.setdefault("_row_masks", {})
        if window not in cache:
            allowed = batch.mask(window)[:, 0].reshape(-1, batch.longest)[batch.grid].to(torch.uint8).contiguous()  # [N, longest]
            limits = batch.longest - allowed.flip(1).argmax(1)  # one past each row's last seen key
            seqs = torch.repeat_interleave(torch.arange(len(batch.lengths)), torch.tensor(batch.lengths)).to(allowed.device)
            cache[window] = (seqs, limits.contiguous(), allowed)
        return cache[window]

    def _exact_layout(self, batch: Batch, window: int | None) -> list:
        """Per sequence (first row, gather index [L] on the device, [(first row of tile, rows, bias)]),
        built once per forward and window (every layer of that window uses it)."""
        cache = batch.__dict__.setdefault("_exact", {})
        if window in cache:
            return cache[window]
        kv, g = self.n_kv, self.n_heads // self.n_kv
        layout = []
        for b, (lo, n, start, end) in enumerate(zip(batch.offsets, batch.lengths, batch.starts, batch.ends)):
            length = round_up(end, KEY_BLOCK)
            index = torch.full((length,), ZERO_PAGE * self.page_tokens, dtype=torch.long)
            index[:end] = batch.gather_host[b, :end]
            tile = self.exact_tile(n)
            tiles = []
            tree = batch.tree_allowed(b, window) if batch.parents[b] else None  # [n, end]
            for t0 in range(0, n, tile):
                rows = min(tile, n - t0)
                if tree is None:
                    see = allowed_positions(torch.tensor([start + t0]), torch.tensor([rows]), length, window, tile)[0]  # [tile, L]
                else:  # the tree's rows; padding rows see position 0 only, as `allowed_positions` gives them
                    see = torch.zeros(tile, length, dtype=torch.bool)
                    see[:rows, :end] = tree[t0:t0 + rows]
                    see[rows:, 0] = True
                bias = torch.zeros(tile, length).masked_fill_(~see, float("-inf"))
                bias = bias[None, :, None, :].expand(kv, tile, g, length).reshape(kv, tile * g, length)
                tiles.append((t0, rows, bias.to(self.device)))
            layout.append((lo, index.to(self.device), tiles))
        cache[window] = layout
        return layout
