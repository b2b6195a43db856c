"""Exact numerics for the lean forward: a row's logits never depend on what else shares the forward.

In fast mode a row's logits move in the last bits with the rows beside it: a position verified alone
and as row j of a k+1 block, or beside other sessions, runs through GEMM kernels chosen by the call's
shape (MKL and oneDNN pick blocking, even the instruction path, by M, N, batch size and thread count)
and through SDPA, whose CPU kernel picks its splits and packing by sequence length, batch and threads.
In bf16 that flips greedy tokens: speculation would change greedy output. Exact mode fixes what a
row's arithmetic depends on (measurements: benchmarks/results/numerics/):

- Linears: one kernel, a oneDNN-packed weight, which gives a row the same bits for every row count
  on the CPUs measured (MKL's ``F.linear`` does not: row 0 changes from M = 2 on). The load checks it
  (`verify`); where it fails, rows are padded to ``LINEAR_TILE`` per call, or run tile by tile.
- Attention (`ExactGroup`), in float32 whatever the model's dtype: one batched GEMM per layer (per
  tile of `MAX_TILE` rows) over (sequence, KV head) items; each sequence's query rows padded to the
  call's tile (at least the plan's ``min_tile``), keys padded to a multiple of ``KEY_BLOCK`` positions
  and masked. Within the shapes the load verified, MKL's batched fp32 GEMM gives an item the same bits
  whatever the batch count, the item's place, the row's place in its tile, the tile's size or the
  thread count, and masked keys (probability exactly 0) leave a row's sums unchanged. Not SDPA (its
  CPU kernel chooses by shape and threads), not oneDNN's bf16 batched matmul (it picks its kernel by
  the whole problem's size). This needs a layer's (sequence, KV head) pairs to form one strided
  batch, so a pool's slab is laid out [layers, 2, slots, kv, context, d] (`ExactSlotPool`).
- RMSNorm, rotary, SwiGLU and the residual adds are per-row already (checked at load too).

Nothing is timed: no kernel or thread count is chosen by measurement, so machine load cannot change a
logit. What holds is verified on the running CPU for the model's shapes and the thread counts in use,
with data whose sums cancel, so that a different summation order shows even through bf16 rounding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.core import native_kernels
from specdec.core.kv_slots import DecodeCache, SlotPool

KEY_BLOCK = 64  # keys are padded to a multiple of this many positions
MAX_TILE = 64  # query rows of one sequence per attention GEMM at most (a long prefill runs in tiles of this)
TILE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # the fewest rows per attention GEMM, tried in this order at load
LINEAR_TILE = 16  # rows per tile when a linear needs fixed-size row tiles (an AMX tile is 16 rows)
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 129, 160)  # row counts a linear is checked at
LINEAR_MODES = ("flat", "padded", "tiled")  # one call of any rows | rows padded to LINEAR_TILE | one call per tile

Linear = Callable[[torch.Tensor], torch.Tensor]
KVOfLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class ExactNumericsUnavailable(ValueError):
    """This CPU's kernels give a row different bits with different batch shapes even in exact mode."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ExactPlan:
    """What `verify` found holds on this CPU. ``linear_mode``: one of `LINEAR_MODES`; ``min_tile``:
    the fewest query rows per sequence an attention GEMM may have (MKL's fp32 GEMM, for one, takes
    another path below 4 rows: M = 1, 2-3 and 4+ give a row different bits)."""

    linear_mode: str
    min_tile: int

    def tile(self, rows: int) -> int:
        """Query rows per sequence in the attention GEMMs of a call whose longest sequence feeds ``rows``."""
        return min(max(rows, self.min_tile), MAX_TILE)


class ExactSlotPool(SlotPool):
    """`SlotPool` with each slab laid out [layers, 2, slots, kv_heads, context, head_dim]: a layer's
    keys of a run of slots are then one [slots * kv_heads, positions, head_dim] strided batch (no
    copy). A slot's ``buf`` is a view [layers, 2, kv_heads, context, head_dim], as in the slot-major pool."""

    def acquire(self) -> DecodeCache:
        with self._lock:
            if not self._free:
                self._add_slab()
            slab, slot = self._free.pop(0)
        return DecodeCache(self.slabs[slab][:, :, slot], self, slab, slot)

    def _add_slab(self) -> None:
        layers, two, kv, context, d = self.shape
        self.slabs.append(torch.empty(layers, two, self.slab_slots, kv, context, d, dtype=self.dtype))
        self.finite.append([0] * self.slab_slots)
        n = len(self.slabs) - 1
        self._free.extend((n, s) for s in range(self.slab_slots))
        self._free.sort()

    def fill_to(self, slab: int, slot: int, length: int) -> None:
        finite = self.finite[slab]
        if finite[slot] < length:
            self.slabs[slab][:, :, slot, :, finite[slot]:length] = 0
            finite[slot] = length


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

    def __init__(self, dec, layer_kv: KVOfLayer, num_slots: int, rows: torch.Tensor, slots: torch.Tensor,
                 row_in_seq: torch.Tensor, limits: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, tile: int | None = None) -> None:
        self.dec = dec
        self.layer_kv = layer_kv
        self.num_slots = num_slots
        self.out_dtype = dec.dtype  # the model's; `verify` reads the float32 result itself
        self.write = None if positions is None else (_as_slice(rows), slots, positions)
        self.first_position = None if positions is None else int(positions[0])
        if getattr(dec, "native_attention", False):
            self._native_init(rows, slots, limits, allowed, positions)
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

    def _native_init(self, rows: torch.Tensor, slots: torch.Tensor, limits: torch.Tensor | None,
                     allowed: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """The native kernel's plan (core/native_kernels.py): every row over its own keys, no tiles or
        padding; a masked row sees keys up to its last allowed one."""
        self.native = True
        self.rows = rows
        self.in_order = bool(torch.equal(rows, torch.arange(len(rows))))
        self.query_rows = _as_slice(rows)
        self.slots = slots.to(torch.int64).contiguous()
        if allowed is not None:
            self.allowed = allowed.to(torch.uint8).contiguous()
            self.limits = (allowed.shape[1] - self.allowed.flip(1).argmax(1)).contiguous()
        else:
            self.allowed, self.limits = None, limits.to(torch.int64).contiguous()
        self.scratch = torch.empty(torch.get_num_threads() * (int(self.limits.max()) + 64))  # a stretch per thread
        self.one = self.num_slots == 1 and self.write is not None and isinstance(self.write[0], slice) and _is_run(positions)

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
    first = int(index[0])
    return slice(first, first + len(index)) if torch.equal(index, torch.arange(first, first + len(index))) else index


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


def slab_group(dec, slab: int, members: list[tuple[int, int, int, int]],
               masks: Sequence[torch.Tensor | None] | None = None) -> ExactGroup:
    """The batch's sequences in one slab of ``dec``'s `ExactSlotPool`: (slot, start, first row, rows)
    each; ``masks``: per member, [rows, start + rows] positions each row sees, or None (causal)."""
    lo = min(slot for slot, _, _, _ in members)
    hi = max(slot for slot, _, _, _ in members) + 1
    length = max(start + n for _, start, _, n in members)
    if getattr(dec, "native_attention", False):  # the native kernel reads only the keys a row sees: no padding,
        for slot, start, _, n in members:  # but what this forward writes counts as finite for the pool's other readers
            dec.pool.wrote(slab, slot, start, start + n)
    else:
        for slot in range(lo, hi):  # every slot the view spans, to the padded length (masked keys are still multiplied)
            dec.pool.fill_to(slab, slot, round_up(length, KEY_BLOCK))
    tensor = dec.pool.slabs[slab]  # [layers, 2, slots, kv, context, d]
    slots, starts, firsts, lengths = (list(column) for column in zip(*members))
    return ExactGroup(
        dec, lambda i: (tensor[i, 0, lo:hi], tensor[i, 1, lo:hi]), hi - lo,
        rows=runs(firsts, lengths),
        slots=torch.repeat_interleave(torch.tensor(slots) - lo, torch.tensor(lengths)),
        row_in_seq=runs([0] * len(members), lengths),
        limits=causal_limits(starts, lengths),
        allowed=None if masks is None else _stacked_masks(members, masks, length),
        positions=runs(starts, lengths))


def _stacked_masks(members: list[tuple[int, int, int, int]], masks: Sequence[torch.Tensor | None], length: int) -> torch.Tensor:
    """Every member's rows' masks, causal where None, padded to ``length``: [sum(rows), length]."""
    out = []
    for (_, start, _, n), mask in zip(members, masks):
        if mask is None:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        out.append(F.pad(mask, (0, length - start - n)))
    return torch.cat(out)


def alone_group(dec, cache: DecodeCache, start: int, first: int, n: int, mask: torch.Tensor | None = None) -> ExactGroup:
    """A cache outside ``dec``'s pool, batch rows first..first + n: a private buffer (zeroed past what it
    wrote, grown to whole key blocks by the decoder) or another pool's slot. ``mask`` [n, start + n]:
    positions each row sees (None: causal)."""
    end = start + n
    if cache.pooled and getattr(dec, "native_attention", False):  # another pool's slot: what it writes is finite
        cache.pool.wrote(cache.slab, cache.slot, start, end)
    elif cache.pooled:  # finite up to the padded length (masked keys are still multiplied)
        cache.pool.fill_to(cache.slab, cache.slot, round_up(end, KEY_BLOCK))
    buf = cache.buf
    return ExactGroup(
        dec, lambda i: (buf[i, 0][None], buf[i, 1][None]), 1, rows=torch.arange(first, first + n),
        slots=torch.zeros(n, dtype=torch.long), row_in_seq=torch.arange(n),
        limits=causal_limits([start], [n]), allowed=mask, positions=torch.arange(start, end))


def masked_attention(dec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Rows ``q`` [n, h, d] of one sequence over ``keys``/``values`` [kv, end, d] where ``mask``
    [n, end] allows (None: everywhere): [n, h * d]. Keys are padded with zeros to whole blocks (a copy:
    a buffer past ``end`` may hold anything). For `LlamaDecoder.layers_forward` (the branch forward)."""
    n, end = q.shape[0], keys.shape[1]
    pad = round_up(end, KEY_BLOCK) - end
    if pad:
        keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))  # [kv, L, d]
    allowed = mask if mask is not None else torch.ones(n, end, dtype=torch.bool)
    rows = torch.arange(n)
    group = ExactGroup(dec, lambda _: (keys[None], values[None]), 1, rows, torch.zeros(n, dtype=torch.long), rows, allowed=allowed)
    return group.attend(0, q, None, None)  # in row order: one sequence, tiles in order


class RowTiled:
    """A linear on rows padded with zeros to a multiple of ``tile``: one call (``loop`` False) or one per tile."""

    def __init__(self, linear: Linear, tile: int, loop: bool) -> None:
        self.linear, self.tile, self.loop = linear, tile, loop

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        m = round_up(n, self.tile)
        if m != n:
            x = torch.cat([x, x.new_zeros(m - n, x.shape[1])])
        out = torch.cat([self.linear(t) for t in x.split(self.tile)]) if self.loop else self.linear(x)
        return out[:n]


def wrap_linear(linear: Linear, mode: str) -> Linear:
    if mode == "flat":
        return linear
    return RowTiled(linear, LINEAR_TILE, loop=mode == "tiled")


# ----------------------------------------------------------------------------------------- load-time checks

def _same_rows(run: Callable[[int, int], torch.Tensor], rows: int, threads: Sequence[int]) -> str | None:
    """None if ``run(lo, hi)`` (the results of rows lo..hi of some input, computed in one call) gives
    every row the same bits alone, among the first m rows for every m of PROBE_ROWS below ``rows``,
    among all ``rows``, at every thread count; else what differed."""
    ref = None
    for count in threads:
        torch.set_num_threads(count)
        full = run(0, rows)
        if ref is None:
            ref = full
            for r in (0, 1, rows // 2, rows - 1):
                if not torch.equal(run(r, r + 1)[0], ref[r]):
                    return f"row {r} alone differs from row {r} of {rows}"
        elif not torch.equal(full, ref):
            return f"{rows} rows differ at {count} threads"
        for m in PROBE_ROWS:
            if m < rows and not torch.equal(run(0, m), ref[:m]):
                return f"the first {m} rows differ from the same rows of {rows} at {count} threads"
    return None


def _probe_attention(dec, threads: Sequence[int], gen: torch.Generator, min_tile: int) -> str | None:
    """A row's attention output alone in the smallest tile, at other places of tiles of every size
    from ``min_tile`` to MAX_TILE (sampled), beside other sequences, with more padded key blocks, at
    every thread count: None if always the same bits, else what differed."""
    kv, d = dec.n_kv, dec.head_dim
    slots, cap = 3, 3 * KEY_BLOCK
    keys = torch.randn(slots, kv, cap, d, generator=gen).to(dec.dtype)  # the probed sequence's are the last slot's
    values = torch.randn(slots, kv, cap, d, generator=gen).to(dec.dtype)
    # large queries: scores spread far enough for probabilities to underflow (subnormals are a kernel-dependent path)
    query = (8 * torch.randn(dec.n_heads, d, generator=gen)).to(dec.dtype)
    others = (8 * torch.randn(MAX_TILE, dec.n_heads, d, generator=gen)).to(dec.dtype)
    see = KEY_BLOCK - 7  # the probed row sees its first positions; the rest are masked

    def strided(parts: torch.Tensor) -> torch.Tensor:  # [n, kv, cap, d] with a batch stride, as a slab's
        out = torch.zeros(parts.shape[0], kv, 2 * cap, d, dtype=dec.dtype)
        out[:, :, :cap] = parts
        return out[:, :, :cap]

    # n slots: other sequences first, the probed one last
    kv_of = {n: (strided(torch.cat([keys[: n - 1], keys[-1:]])), strided(torch.cat([values[: n - 1], values[-1:]])))
             for n in (1, 2, 3)}

    def one(tile: int, place: int, num_slots: int, length: int) -> torch.Tensor:
        q = others[:tile].clone()
        q[place] = query
        rows = torch.arange(tile)
        allowed = torch.arange(length)[None, :] <= rows[:, None] + KEY_BLOCK  # its neighbours see other keys
        allowed[place] = torch.arange(length) < see
        k, v = kv_of[num_slots]
        group = ExactGroup(dec, lambda i: (k, v), num_slots, rows, torch.full((tile,), num_slots - 1), rows,
                           allowed=allowed, tile=tile)
        group.out_dtype = torch.float32  # every bit of the result, not its bf16 rounding
        return group.attend(0, q, None, None)[place]

    sizes = sorted({t for t in (min_tile, min_tile + 1, 2 * min_tile + 1, 9, 16, 17, 33, MAX_TILE)
                    if min_tile <= t <= MAX_TILE})
    ref = None
    for count in threads:
        torch.set_num_threads(count)
        for tile in sizes:
            for place, num_slots, length in ((0, 1, KEY_BLOCK), (tile - 1, 3, cap), (tile // 2, 2, 2 * KEY_BLOCK - 5)):
                got = one(tile, place, num_slots, length)
                if ref is None:
                    ref = got
                elif not torch.equal(got, ref):
                    return (f"a row at place {place} of a {tile}-row tile, {num_slots} slots, {length} keys, "
                            f"{count} threads differs from the row alone")
    return None


_PLANS: dict[tuple, ExactPlan] = {}  # what `verify` found, per shapes/dtype/threads: kernels depend on nothing else


def verified_plan(key: tuple, check: Callable[[], ExactPlan]) -> ExactPlan:
    """``check()``'s plan, run once per process for each ``key`` (everything the kernels are chosen by:
    shapes, dtype, thread counts), so a second decoder of one model does not check again."""
    if key not in _PLANS:
        _PLANS[key] = check()
    return _PLANS[key]


def _cancelling(out_features: int, in_features: int, rows: int, dtype: torch.dtype,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] and rows [rows, in] whose products cancel: each output is small next to its
    partial sums, so a different summation order shows even through bf16 rounding (random data would
    hide it in all but one output in tens of thousands)."""
    third = in_features // 3
    weight = torch.randn(out_features, in_features, generator=gen) * 0.5
    weight[:, third:2 * third] = weight[:, :third]
    x = torch.randn(rows, in_features, generator=gen) * 64
    x[:, third:2 * third] = -x[:, :third]
    x[:, 2 * third:] *= 1e-3
    return weight.to(dtype).contiguous(), x.to(dtype)


@torch.inference_mode()
def verify(dec, shapes: Sequence[tuple[int, int]], make_linear: Callable[[torch.Tensor], Linear],
           threads: Sequence[int]) -> ExactPlan:
    """Check on this CPU that the decoder's kernels give a row the same bits whatever shares its call,
    and return the cheapest plan that holds: the linear mode (`LINEAR_MODES`, cheapest first) and the
    fewest rows per attention GEMM (`TILE_CANDIDATES`). ``shapes``: each [out, in] of the decoder's
    linears; ``make_linear``: how the decoder builds one (kernels are chosen by shape, so a weight of
    that shape built for the check stands for them). Raises ExactNumericsUnavailable when nothing holds."""
    from specdec.core.cpu_features import describe_cpu

    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)  # never the global RNG
    try:
        problems = []
        mode_found = None
        rows = max(PROBE_ROWS)
        probes = []
        for shape in shapes:
            weight, x = _cancelling(*shape, rows, dec.dtype, gen)
            probes.append((shape, make_linear(weight), x))
        for mode in LINEAR_MODES:
            failed = None
            for shape, f, x in probes:
                failed = _same_rows(lambda lo, hi: wrap_linear(f, mode)(x[lo:hi]), rows, threads)
                if failed:
                    failed = f"{mode} linear {shape}: {failed}"
                    break
            if failed is None:
                mode_found = mode
                break
            problems.append(failed)
        if mode_found is None:
            raise ExactNumericsUnavailable("exact numerics: no linear kernel mode keeps a row's bits on this CPU ("
                                           f"{describe_cpu()}): " + "; ".join(problems))
        hidden = dec.hidden
        x = torch.randn(rows, hidden, generator=gen).to(dec.dtype)
        w = torch.randn(hidden, generator=gen).to(dec.dtype)
        inter = torch.randn(rows, 2 * dec.intermediate, generator=gen).to(dec.dtype)
        qk = torch.randn(rows, (dec.n_heads + dec.n_kv) * dec.head_dim, generator=gen).to(dec.dtype)
        rotary = dec.rotary[torch.arange(rows) % dec.context_length]
        # the decoder's own ops where it has them (the lean decoder's may be native), else PyTorch's
        norm = getattr(dec, "norm", lambda rows, weight: F.rms_norm(rows, (hidden,), weight, dec.eps))
        swiglu = getattr(dec, "swiglu", lambda rows: (lambda gate, up: F.silu(gate) * up)(*rows.chunk(2, dim=-1)))
        checks = {
            "RMSNorm": lambda lo, hi: norm(x[lo:hi], w),
            "SwiGLU": lambda lo, hi: swiglu(inter[lo:hi]),
            "rotary": lambda lo, hi: dec.rotate(qk[lo:hi], rotary[lo:hi]),
        }
        for name, run in checks.items():
            failed = _same_rows(run, rows, threads)
            if failed:
                raise ExactNumericsUnavailable(f"exact numerics: {name} is not row-invariant on this CPU ({describe_cpu()}): {failed}")
        problems = []
        for min_tile in TILE_CANDIDATES:
            failed = _probe_attention(dec, threads, gen, min_tile)
            if failed is None:
                return ExactPlan(mode_found, min_tile)
            problems.append(f"from {min_tile} rows: {failed}")
        raise ExactNumericsUnavailable(f"exact numerics: batched attention GEMMs are not shape-invariant on this CPU "
                                       f"({describe_cpu()}): " + "; ".join(problems))
    finally:
        torch.set_num_threads(before)
