"""Exact attention: a row's output depends on its own sequence's keys only, never on the batch.

Used by exact numerics (core/exact_ops.py checks at load that it holds on the running CPU): in
float32 whatever the model's dtype, one batched GEMM per layer (per tile of `MAX_TILE` rows) over
(sequence, KV head) items; each sequence's query rows padded to the call's tile (at least the
plan's ``min_tile``), keys padded to a multiple of ``KEY_BLOCK`` positions and masked. Within the
shapes the load verified, MKL's batched fp32 GEMM gives an item the same bits whatever the batch
count, the item's place, the row's place in its tile, the tile's size or the thread count, and
masked keys (probability exactly 0) leave a row's sums unchanged. Not SDPA (its CPU kernel chooses
by shape and threads), not oneDNN's bf16 batched matmul (it picks its kernel by the whole
problem's size). Where specdec's C kernels run attention (``native_attention``), each row attends
alone over the keys it sees, in position order, and none of the tiling applies.

A KV backend (core/slab_backend.py) builds an `ExactGroup` per run of its storage and calls it per
layer; nothing here knows where the keys live beyond the ``layer_kv`` callback.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from specdec.core import native_kernels

KEY_BLOCK = 64  # keys are padded to a multiple of this many positions
MAX_TILE = 64  # query rows of one sequence per attention GEMM at most (a long prefill runs in tiles of this)

KVOfLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class TilePlan(Protocol):
    def tile(self, rows: int) -> int:
        """Query rows per sequence in the attention GEMMs of a call whose longest sequence feeds ``rows``."""


class AttentionShape(Protocol):
    """What an `ExactGroup` reads of the model it attends for."""

    n_heads: int
    n_kv: int
    head_dim: int
    dtype: torch.dtype  # the model's activations: the output's dtype
    native_attention: bool  # each row alone in C (core/native_kernels.py) instead of tiled GEMMs
    exact_plan: TilePlan | None


def attend_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [B, M, d] over ``keys``/``values`` [B, L, d] with additive ``bias`` [B, M, L] (0 or -inf),
    all float32: [B, M, d]. Each item is one (M, L) GEMM of a batch, so its bits depend on its own
    data, M and L only, within the classes `verify` checked."""
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)  # [B, M, L]
    return torch.bmm(torch.softmax(scores, dim=-1), values)


class ExactGroup:
    """The rows of a batch whose keys and values live in one tensor of ``S`` sequence slots.

    ``layer_kv(i)`` gives layer i's keys and values, each [S, kv_heads, >= length, head_dim] with the
    (slot, head) pair flattenable (a slot-major slab is not: see `ExactSlotPool`); every position below
    ``round_up(length, KEY_BLOCK)`` must hold finite values (masked keys are still multiplied, by 0).
    Row r of the batch (``rows``) is query row ``row_in_seq`` of slot ``slots`` and sees key positions
    below ``limits`` (causal attention), or where ``allowed`` [Ng, length] is True; with ``positions``
    given, its new key and value are written there first. Query rows go in tiles of ``tile`` rows by
    ``row_in_seq`` (default: the decoder's plan for the longest sequence here); a tile's padding rows
    see position 0 only, and their output is dropped. Where the decoder runs native attention
    (``dec.native_attention``) each row attends alone instead (core/native/kernels.c): no tiles, no padding.
    """

    native = False
    _flat = None  # ((kv, positions), each (row, head)'s row in a layer's [slots * kv * positions, d] view)

    def __init__(self, dec: AttentionShape, layer_kv: KVOfLayer, num_slots: int, rows: torch.Tensor, slots: torch.Tensor,
                 row_in_seq: torch.Tensor, limits: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, tile: int | None = None) -> None:
        self.dec = dec
        self.layer_kv = layer_kv
        self.num_slots = num_slots
        self.out_dtype = dec.dtype  # the model's; `verify` reads the float32 result itself
        rows_slice = _as_slice(rows)
        self.write = None if positions is None else (rows_slice, slots, positions)
        self.first_position = None if positions is None else int(positions[0])
        if dec.native_attention:
            self._native_init(rows, rows_slice, slots, limits, allowed, positions)
            return
        length = allowed.shape[1] if allowed is not None else int(limits.max())
        self.length = L = round_up(length, KEY_BLOCK)
        self.tile = tile = tile or dec.exact_plan.tile(int(row_in_seq.max()) + 1)
        S, kv, g = num_slots, dec.n_kv, dec.n_heads // dec.n_kv
        self.tiles = []  # (batch rows, slot, place in tile, bias [S * kv, tile * g, L])
        for t in range(int(row_in_seq.max()) // tile + 1):
            sel = (row_in_seq // tile) == t
            if not bool(sel.any()):
                continue
            place = row_in_seq[sel] - t * tile
            if allowed is None:
                limit = torch.ones(S, tile, dtype=torch.long)  # padding rows: position 0 (finite)
                limit[slots[sel], place] = limits[sel]
                see = torch.arange(L) < limit[:, :, None]  # [S, tile, L]
            else:
                see = torch.zeros(S, tile, L, dtype=torch.bool)
                see[:, :, 0] = True
                see[slots[sel], place] = F.pad(allowed[sel], (0, L - length))
            bias = torch.zeros(S, tile, L).masked_fill_(~see, float("-inf"))[:, None, :, None, :]
            bias = bias.expand(S, kv, tile, g, L).reshape(S * kv, tile * g, L)
            self.tiles.append((_as_slice(rows[sel]), slots[sel], place, bias))
        self.rows = torch.cat([rows[(row_in_seq // tile) == t] for t in range(len(self.tiles))])  # attend()'s row order
        self.in_order = bool(torch.equal(self.rows, torch.arange(len(self.rows))))
        # One sequence in one tile, rows in order: slices instead of index_put and gathers (a step's usual case).
        n = len(rows)
        self.one = (S == 1 and len(self.tiles) == 1 and isinstance(self.tiles[0][0], slice)
                    and bool(torch.equal(row_in_seq, torch.arange(n)))
                    and (positions is None or _is_run(positions)))

    def _native_init(self, rows: torch.Tensor, rows_slice: torch.Tensor | slice, slots: torch.Tensor,
                     limits: torch.Tensor | None, allowed: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """The native kernel's plan (core/native_kernels.py): every row over its own keys, no tiles or
        padding; a masked row sees keys up to its last allowed one. ``rows_slice``: `_as_slice(rows)`."""
        self.native = True
        self.rows = rows
        self.in_order = isinstance(rows_slice, slice) and rows_slice.start == 0
        self.query_rows = rows_slice
        self.slots = slots.to(torch.int64).contiguous()
        if allowed is not None:
            self.allowed = allowed.to(torch.uint8).contiguous()
            self.limits = (allowed.shape[1] - self.allowed.flip(1).argmax(1)).contiguous()
        else:
            self.allowed, self.limits = None, limits.to(torch.int64).contiguous()
        self.scratch = None  # a stretch of keys per thread, made on first `attend` (a one-call forward has its own)
        self.one = self.num_slots == 1 and isinstance(rows_slice, slice) and positions is not None and _is_run(positions)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows, slots, positions = self.write
        if self.one:
            p, n = self.first_position, len(positions)
            keys[0, :, p:p + n] = k[rows].transpose(0, 1)  # [kv, n, d]
            values[0, :, p:p + n] = v[rows].transpose(0, 1)
        elif keys.is_contiguous() and values.is_contiguous():  # one row copy per (row, head): no advanced-index put
            _, kv, cap, d = keys.shape
            if self._flat is None or self._flat[0] != (kv, cap):
                heads = torch.arange(kv)
                self._flat = (kv, cap), ((slots[:, None] * kv + heads) * cap + positions[:, None]).flatten()
            index = self._flat[1]
            keys.view(-1, d).index_copy_(0, index, k[rows].reshape(-1, d))
            values.view(-1, d).index_copy_(0, index, v[rows].reshape(-1, d))
        else:
            keys[slots, :, positions] = k[rows]  # [Ng, kv, d]
            values[slots, :, positions] = v[rows]

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer i: q [N, h, d], k and v [N, kv, d] of the whole batch; this group's rows, [Ng, h * d]."""
        dec = self.dec
        kv, d = dec.n_kv, dec.head_dim
        keys, values = self.layer_kv(i)  # [S, kv, >= L, d]
        if self.write is not None:
            self._write(keys, values, k, v)
        if self.native:
            if self.scratch is None:
                self.scratch = torch.empty(torch.get_num_threads() * (int(self.limits.max()) + 64))
            out = native_kernels.attention(q[self.query_rows].float(), keys, values, self.slots, self.limits, self.allowed,
                                           1.0 / math.sqrt(d), self.scratch)
            return out.to(self.out_dtype)
        g, tile, S, L = dec.n_heads // kv, self.tile, self.num_slots, self.length
        # float32 whatever the model's dtype: oneDNN's bf16 batched matmul picks its kernel by the whole
        # problem's size (one item of M = 2 and one of M = 6 differ in the last bit), MKL's fp32 one by
        # the item's shape only. The upcast copies keys and values (for float32 it is a view: no copy).
        keys3 = keys[:, :, :L].reshape(S * kv, L, d).float()  # [S * kv, L, d]
        values3 = values[:, :, :L].reshape(S * kv, L, d).float()
        out = []
        for rows, slots, place, bias in self.tiles:
            queries = torch.zeros(S, kv, tile, g, d)
            rows_q = q[rows].view(-1, kv, g, d)  # [n, kv, g, d]
            if self.one:
                queries[0, :, :len(place)] = rows_q.transpose(0, 1)
            else:
                queries[slots, :, place] = rows_q.float()
            att = attend_tiles(queries.view(S * kv, tile * g, d), keys3, values3, bias, 1.0 / math.sqrt(d))
            att = att.view(S, kv, tile, g, d)
            att = att[0, :, :len(place)].transpose(0, 1) if self.one else att[slots, :, place]  # [n, kv, g, d]
            out.append(att.reshape(-1, kv * g * d).to(self.out_dtype))
        return out[0] if len(out) == 1 else torch.cat(out)


def _is_run(index: torch.Tensor) -> bool:
    """Whether ``index`` is consecutive numbers (first, first + 1, ...)."""
    return isinstance(_as_slice(index), slice)


def _as_slice(index: torch.Tensor) -> torch.Tensor | slice:
    """A run of consecutive row numbers as a slice (a view, no gather), else the index itself."""
    first, n = int(index[0]), len(index)
    return slice(first, first + n) if n == 1 or torch.equal(index, torch.arange(first, first + n)) else index


def runs(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """[sum(lengths)]: s, s + 1, ..., s + n - 1 for each (s, n), in one pass (no tensor per sequence)."""
    if len(starts) == 1:
        return torch.arange(starts[0], starts[0] + lengths[0])
    starts, lengths = torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    before = torch.cumsum(lengths, 0) - lengths  # each run's first row
    return torch.repeat_interleave(starts - before, lengths) + torch.arange(int(lengths.sum()))


def causal_limits(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """[sum(lengths)]: row r of a sequence starting at s sees positions < s + r + 1."""
    return runs([s + 1 for s in starts], lengths)


def stacked_masks(members: list[tuple[int, int, int, int]], masks: Sequence[torch.Tensor | None], length: int) -> torch.Tensor:
    """Every member's rows' masks, causal where None, padded to ``length``: [sum(rows), length]."""
    out = []
    for (_, start, _, n), mask in zip(members, masks):
        if mask is None:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        out.append(F.pad(mask, (0, length - start - n)))
    return torch.cat(out)
