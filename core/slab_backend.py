"""The CPU slab KV backend: every sequence's keys in a slot of a shared slab (core/kv_slots.py), and
how a forward's rows attend over them.

A forward's batch (`plan`) groups its sequences by where their keys live: the sequences of one pool
slab attend together (one SDPA call per layer and slab, or exact attention's fixed tiles,
core/exact_attention.py), a private cache (a buffer of its own, grown on demand) attends alone. The
strategy is the model's, fixed at load: fast (SDPA), exact in PyTorch (tiled batched GEMMs over an
`ExactSlotPool`), exact in C (each row over its own keys; and where every linear is specdec's C
kernel, each whole layer one C call, `run_layers`). The model's math (core/llama_model.py) asks the
backend only to `attend` a layer's rows; nothing here knows about weights.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specdec.core import llama_model, native_kernels
from specdec.core.exact_attention import KEY_BLOCK, AttentionShape, ExactGroup, causal_limits, round_up, stacked_masks
from specdec.core.kv_slots import DecodeCache, ExactSlotPool, SlotPool
from specdec.core.runner import Feed
from specdec.core.tree import feed_mask, feed_positions

INITIAL_CAPACITY = 64  # positions; a private cache (not a pool slot) doubles from here up to the model's context length


class SlabModel(AttentionShape, llama_model.LayerMath, Protocol):
    """What the slab backend reads of its model (core/llama_decode.py `LlamaDecoder`)."""

    exact: bool
    context_length: int
    capacity_limit: int  # positions a cache may hold: the context, rounded up to whole key blocks in exact mode
    hidden: int
    intermediate: int
    eps: float
    fused_macs: int | None  # where each layer runs as one C call: its widest linear's multiply-adds per row
    native_stack: native_kernels.DecoderStack | None  # then every layer in one call, where their keys allow


@dataclass
class SlabPlan:
    """One forward's layout over the slab backend (what `llama_model.forward` and `attend` read)."""

    token_ids: torch.Tensor  # [N] every feed's tokens, one feed after another
    positions: torch.Tensor  # [N] each row's position (a tree node's: its depth's)
    offsets: list[int]  # feed b's rows are offsets[b]:offsets[b + 1]
    last: torch.Tensor  # the rows whose logits are returned
    num_last: list[int]
    groups: list  # SlabGroup | AloneGroup | ExactGroup: who attends which rows over which keys
    # Each layer one C call (`run_layers`): the group whose keys it takes, the rows, and the order the
    # rows run in when the groups' rows interleave in the batch (None: the batch's own order).
    fused: tuple[ExactGroup, native_kernels.LayerRows, torch.Tensor | None] | None


class SlabBackend:
    """`KVBackend` (core/kv_backend.py) over slabs of sequence slots and private buffers, for one model."""

    def __init__(self, model: SlabModel) -> None:
        self.model = model
        pool = ExactSlotPool if model.exact else SlotPool
        self.pool = pool(len(model.layers), model.n_kv, model.capacity_limit, model.head_dim, model.dtype)

    # ---------------------------------------------------------------------------------- caches

    def new_cache(self) -> DecodeCache:
        """A slot of this backend's pool: batches of pooled caches attend together."""
        return self.pool.acquire()

    def private_cache(self) -> DecodeCache:
        """A cache with a buffer of its own (grown on demand), attended alone in a batch."""
        return DecodeCache(self._alloc(min(INITIAL_CAPACITY, self.model.context_length)))

    def truncate(self, cache: DecodeCache, length: int) -> None:
        pass  # a DecodeCache has no length of its own: positions past a feed's start are overwritten by it

    def free(self, cache: DecodeCache) -> None:
        cache.free()  # the slot goes back to the pool now (else when the cache is garbage)

    def read_kv(self, cache: DecodeCache, lo: int, hi: int) -> torch.Tensor:
        return cache.buf[:, :, :, lo:hi]  # a view of the slot

    def write_prefix(self, cache: DecodeCache, kv: torch.Tensor) -> None:
        """Adopt keys and values ``kv`` [layers, 2, kv_heads, n, head_dim] as positions [0, n) of ``cache``."""
        n = kv.shape[3]
        self.reserve(cache, n)
        cache.buf[:, :, :, :n] = kv
        if cache.pooled:
            self.pool.wrote(cache.slab, cache.slot, 0, n)

    def keep_path(self, cache: DecodeCache, first: int, path: Sequence[int]) -> None:
        """After a tree step whose nodes' keys and values lie at buffer positions ``first + node``: move
        the accepted ``path``'s to ``first, first + 1, ...``, where a chain's would be (exact rollback
        then keeps the first ``first + len(path)`` positions). Each source lies at or after its target."""
        buf = cache.buf
        for place, node in enumerate(path):
            if node != place:
                buf[:, :, :, first + place] = buf[:, :, :, first + node]

    def reserve(self, cache: DecodeCache, end: int) -> None:
        """Room in ``cache`` for positions [0, end): a private buffer grows (doubling), a slot has it."""
        model = self.model
        if end > model.context_length:
            raise ValueError(f"{end} positions exceed the model's context length {model.context_length}")
        need = round_up(end, KEY_BLOCK) if model.exact else end  # exact: keys in whole blocks
        if need <= cache.capacity:
            return
        capacity = cache.capacity
        while capacity < need:
            capacity *= 2
        grown = self._alloc(min(capacity, model.capacity_limit))
        grown[:, :, :, : cache.capacity] = cache.buf
        cache.buf = grown

    def _alloc(self, capacity: int) -> torch.Tensor:
        m = self.model
        return torch.zeros(len(m.layers), 2, m.n_kv, capacity, m.head_dim, dtype=m.dtype)

    # ---------------------------------------------------------------------------------- forwards

    def plan(self, feeds: Sequence[Feed]) -> SlabPlan:
        """Room for every feed, its rows flattened into one batch (ragged: N = the sum of the feeds'
        tokens), and who attends them: the feeds of each pool slab together, private caches alone."""
        lengths = [len(f.token_ids) for f in feeds]
        starts = [f.start for f in feeds]
        for f, n in zip(feeds, lengths):
            self.reserve(f.cache, f.start + n)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        masks = [feed_mask(f.start, n, f.parents) if f.parents else None for f, n in zip(feeds, lengths)]  # [n, s + n] each
        positions = torch.tensor([r for f, n in zip(feeds, lengths) for r in feed_positions(f.start, n, f.parents)])  # [N]
        groups = self._groups([f.cache for f in feeds], starts, offsets, lengths, masks)
        num_last = [f.num_last for f in feeds]
        last = torch.tensor([r for b, m in enumerate(num_last) for r in range(offsets[b + 1] - m, offsets[b + 1])])
        token_ids = torch.tensor([t for f in feeds for t in f.token_ids])
        return SlabPlan(token_ids, positions, offsets, last, num_last, groups, self._fused_plan(groups))

    def _groups(self, caches: Sequence[DecodeCache], starts: Sequence[int], offsets: Sequence[int],
                lengths: Sequence[int], masks: Sequence[torch.Tensor | None]) -> list:
        exact = self.model.exact
        by_slab: dict[int, list[int]] = {}
        groups: list = []
        for b, cache in enumerate(caches):
            if cache.pooled and cache.pool is self.pool:
                by_slab.setdefault(cache.slab, []).append(b)
            elif exact:
                groups.append(self._exact_alone(cache, starts[b], offsets[b], lengths[b], masks[b]))
            else:
                groups.append(AloneGroup(self.model, cache, starts[b], offsets[b], offsets[b + 1], masks[b]))
        for slab, members in by_slab.items():
            layout = [(caches[b].slot, starts[b], offsets[b], lengths[b]) for b in members]
            member_masks = [masks[b] for b in members] if any(masks[b] is not None for b in members) else None
            groups.append(self._exact_slab(slab, layout, member_masks) if exact
                          else SlabGroup(self.model, self.pool, slab, layout, member_masks))
        return groups

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SlabPlan) -> torch.Tensor:
        """Layer ``layer``'s new keys and values ``k``/``v`` [N, kv, d] written where each row's sequence
        keeps them; the rows' queries ``q`` [N, h, d] attended over their own keys: [N, h * d]."""
        groups = plan.groups
        if len(groups) == 1 and groups[0].in_order:
            return groups[0].attend(layer, q, k, v)
        m = self.model
        out = q.new_empty(plan.offsets[-1], m.n_heads * m.head_dim)
        for g in groups:
            out[g.rows] = g.attend(layer, q, k, v)
        return out

    def run_layers(self, model: SlabModel, x: torch.Tensor, rotary: torch.Tensor, plan: SlabPlan) -> torch.Tensor:
        """The model's layers over the plan's rows: one C call per layer where the plan allows
        (`_fused_plan`), else `llama_model.run_layers` with this backend's `attend`."""
        if plan.fused is not None:
            return self._layers_fused(model, x, rotary, *plan.fused)
        return llama_model.run_layers(model, x, rotary, lambda i, q, k, v: self.attend(i, q, k, v, plan))

    def finish(self, plan: SlabPlan) -> None:
        pass  # a slot's length is its feed's business (`truncate` is a no-op): nothing to record

    def buffer_attend(self, buf: torch.Tensor, start: int, n: int, mask: torch.Tensor | None) -> llama_model.Attend:
        """Attention of ``n`` rows at ``start`` over a bare buffer [layers, 2, kv, >= start + n, d] outside
        the pool (core/branch_decode.py's branches, a layer-skip draft over a slot): row r's keys go to
        position ``start + r``, each row sees positions [0, start + n) where ``mask`` [n, start + n]
        allows (None: all of them)."""
        model, end = self.model, start + n

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            buf[i, 0, :, start:end] = k.transpose(0, 1)  # keys [kv, n, d]
            buf[i, 1, :, start:end] = v.transpose(0, 1)  # values
            if model.exact:
                return _exact_masked(model, q, buf[i, 0, :, :end], buf[i, 1, :, :end], mask)
            return sdpa_rows(model, q, buf[i, 0, :, :end], buf[i, 1, :, :end], mask)

        return attend

    # ------------------------------------------------------------------ exact numerics' groups

    def _exact_slab(self, slab: int, members: list[tuple[int, int, int, int]],
                    masks: Sequence[torch.Tensor | None] | None = None) -> ExactGroup:
        """The batch's sequences in one slab of the `ExactSlotPool`: (slot, start, first row, rows) each;
        ``masks``: per member, [rows, start + rows] positions each row sees, or None (causal)."""
        model, pool = self.model, self.pool
        lo = min(slot for slot, _, _, _ in members)
        hi = max(slot for slot, _, _, _ in members) + 1
        length = max(start + n for _, start, _, n in members)
        if model.native_attention:  # the native kernel reads only the keys a row sees: no padding,
            for slot, start, _, n in members:  # but what this forward writes counts as finite for the pool's other readers
                pool.wrote(slab, slot, start, start + n)
        else:
            for slot in range(lo, hi):  # every slot the view spans, to the padded length (masked keys are still multiplied)
                pool.fill_to(slab, slot, round_up(length, KEY_BLOCK))
        tensor = pool.slabs[slab]  # [layers, 2, slots, kv, context, d]
        # Each row's batch row, slot, row in its sequence, and position, built as lists and made one tensor.
        rows, slots, in_seq, positions = (torch.tensor([
            [first + r for _, _, first, n in members for r in range(n)],
            [slot - lo for slot, _, _, n in members for _ in range(n)],
            [r for _, _, _, n in members for r in range(n)],
            [start + r for _, start, _, n in members for r in range(n)]]))
        return ExactGroup(
            model, lambda i: (tensor[i, 0, lo:hi], tensor[i, 1, lo:hi]), hi - lo, rows=rows, slots=slots,
            row_in_seq=in_seq, limits=positions + 1,  # causal: a row sees its own position and those before
            allowed=None if masks is None else stacked_masks(members, masks, length), positions=positions)

    def _exact_alone(self, cache: DecodeCache, start: int, first: int, n: int, mask: torch.Tensor | None = None) -> ExactGroup:
        """A cache outside this pool, batch rows first..first + n: a private buffer (zeroed past what it
        wrote, grown to whole key blocks by `reserve`) or another pool's slot. ``mask`` [n, start + n]:
        positions each row sees (None: causal)."""
        end = start + n
        if cache.pooled and self.model.native_attention:  # another pool's slot: what it writes is finite
            cache.pool.wrote(cache.slab, cache.slot, start, end)
        elif cache.pooled:  # finite up to the padded length (masked keys are still multiplied)
            cache.pool.fill_to(cache.slab, cache.slot, round_up(end, KEY_BLOCK))
        buf = cache.buf
        return ExactGroup(
            self.model, lambda i: (buf[i, 0][None], buf[i, 1][None]), 1, rows=torch.arange(first, first + n),
            slots=torch.zeros(n, dtype=torch.long), row_in_seq=torch.arange(n),
            limits=causal_limits([start], [n]), allowed=mask, positions=torch.arange(start, end))

    # ----------------------------------------------------------------- exact numerics in C, per layer

    def _fused_plan(self, groups: list) -> tuple[ExactGroup, native_kernels.LayerRows, torch.Tensor | None] | None:
        """Where each layer of this forward can be one C call (`_layers_fused`): exact numerics on native
        kernels, every row written where it attends; one cache or slab, or several slabs of this pool
        (causal rows), read through offsets from the first. Groups whose rows interleave in the batch
        (sessions of several slabs, fed in any order) run in group order, the rows gathered and put back:
        each row's bits depend on its own data alone. Returns the group whose keys a layer's call
        takes, the rows, and that order (None: the batch's); None: layer by layer in Python."""
        model = self.model
        if model.fused_macs is None or not all(isinstance(g, ExactGroup) and g.native and g.write is not None
                                               for g in groups):
            return None
        order = None
        if all(isinstance(g.write[0], slice) for g in groups):
            groups = sorted(groups, key=lambda g: g.write[0].start)
            if groups[0].write[0].start != 0 or any(a.write[0].stop != b.write[0].start for a, b in zip(groups, groups[1:])):
                return None
        else:  # (every row of the batch is in exactly one group: `_groups`)
            order = torch.cat([_index(g.write[0]) for g in groups])
        keys = [g.layer_kv(0) for g in groups]  # each ([slots, kv, positions, d] keys, values)
        first_k, first_v = keys[0]
        if len(groups) == 1:
            g = groups[0]
            return g, native_kernels.LayerRows(g.slots, g.write[2], g.limits, g.allowed, first_k.shape[0], first_k.shape[2]), order
        size = first_k.element_size()
        same = all(k.shape[1:] == first_k.shape[1:] and k.stride() == first_k.stride() and v.stride() == k.stride()
                   and v.data_ptr() - k.data_ptr() == first_v.data_ptr() - first_k.data_ptr()
                   and (k.data_ptr() - first_k.data_ptr()) % size == 0 for k, v in keys)
        if len(model.layers) > 1:  # each layer's keys the same distance on in every group: the offsets hold in every layer
            step = groups[0].layer_kv(1)[0].data_ptr() - first_k.data_ptr()
            same = same and all(g.layer_kv(1)[0].data_ptr() - k.data_ptr() == step for g, (k, _) in zip(groups, keys))
        if not same or any(g.allowed is not None for g in groups):
            return None
        offsets = torch.cat([(k.data_ptr() - first_k.data_ptr()) // size + g.slots * k.stride(0) for g, (k, _) in zip(groups, keys)])
        rows = native_kernels.LayerRows(offsets, torch.cat([g.write[2] for g in groups]), torch.cat([g.limits for g in groups]),
                                        None, 0, first_k.shape[2], slot_stride=1)
        return groups[0], rows, order

    @staticmethod
    def _layers_fused(model: SlabModel, x: torch.Tensor, rotary: torch.Tensor, group: ExactGroup,
                      rows: native_kernels.LayerRows, order: torch.Tensor | None) -> torch.Tensor:
        """`llama_model.run_layers` as a C call per layer (core/native_kernels.py `decoder_layer`): the
        same kernels in the same order, so the same bits, without the Python between them. ``order``:
        the batch's rows in the order ``rows`` lists them (None: as they are)."""
        if order is not None:
            out = torch.empty_like(x)
            out[order] = SlabBackend._layers_fused(model, x[order], rotary[order], group, rows, None)
            return out
        x = x.contiguous()  # (the embedding's gather: a fresh tensor, updated in place below)
        shape = (model.n_heads, model.n_kv, model.head_dim, model.intermediate)
        cos_sin = torch.view_as_real(rotary).contiguous()
        threads = native_kernels.threads_for(x.shape[0] * model.fused_macs)  # (its widest GEMM decides, as a NativeLinear's would)
        work = torch.empty(rows.work(model.hidden, shape, threads))
        keys, values = group.layer_kv(0)
        last = len(model.layers) - 1
        stride = (group.layer_kv(1)[0].data_ptr() - keys.data_ptr()) // keys.element_size() if last else 0
        end_k, end_v = group.layer_kv(last)
        if (end_k.data_ptr() - keys.data_ptr() == end_v.data_ptr() - values.data_ptr() == last * stride * keys.element_size()
                and end_k.stride() == keys.stride()):  # every layer's keys one stride on in one tensor: one call for all
            model.native_stack.run(x, shape, model.eps, cos_sin, keys, values, stride, rows, work, threads)
            return x
        for i, layer in enumerate(model.layers):
            keys, values = group.layer_kv(i)
            native_kernels.decoder_layer(x, layer, shape, model.eps, cos_sin, keys, values, rows, work, threads)
        return x


def _index(rows: torch.Tensor | slice) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def sdpa_rows(model: AttentionShape, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """Rows ``q`` [n, h, d] of one sequence over ``keys``/``values`` [kv, L, d] where ``mask`` [n, L]
    allows (None: everywhere): [n, h * d]."""
    n, h, d = q.shape
    # 4-D inputs: with 3-D ones PyTorch's CPU SDPA takes its slow math path (docs/performance.md 8).
    att = F.scaled_dot_product_attention(
        q[None].transpose(1, 2), keys[None], values[None],
        attn_mask=mask, scale=1.0 / math.sqrt(d), enable_gqa=model.n_kv != h,
    )  # [1, h, n, d]
    return att[0].transpose(0, 1).reshape(n, h * d)


def _exact_masked(model: AttentionShape, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """`sdpa_rows` in exact numerics. Keys are padded with zeros to whole blocks (a copy: a bare
    buffer past its end may hold anything)."""
    n, end = q.shape[0], keys.shape[1]
    pad = round_up(end, KEY_BLOCK) - end
    if pad:
        keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))  # [kv, L, d]
    allowed = mask if mask is not None else torch.ones(n, end, dtype=torch.bool)
    rows = torch.arange(n)
    group = ExactGroup(model, lambda _: (keys[None], values[None]), 1, rows, torch.zeros(n, dtype=torch.long), rows, allowed=allowed)
    return group.attend(0, q, None, None)  # in row order: one sequence, tiles in order


class AloneGroup:
    """A private cache's rows of a batch (fast numerics): attended on their own, one SDPA call per layer."""

    def __init__(self, model: AttentionShape, cache: DecodeCache, start: int, lo: int, hi: int,
                 mask: torch.Tensor | None = None) -> None:
        """``mask`` [n, start + n]: which positions each row sees (None: causal)."""
        self.model, self.cache, self.start, self.lo, self.hi = model, cache, start, lo, hi
        self.rows = slice(lo, hi)
        self.in_order = True  # its rows are one run of the batch's rows
        n = hi - lo
        if mask is None and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        self.mask = mask

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lo, hi, start = self.lo, self.hi, self.start
        end = start + hi - lo
        buf = self.cache.buf
        buf[i, 0, :, start:end] = k[lo:hi].transpose(0, 1)  # [kv, n, d]
        buf[i, 1, :, start:end] = v[lo:hi].transpose(0, 1)
        return sdpa_rows(self.model, q[lo:hi], buf[i, 0, :, :end], buf[i, 1, :, :end], self.mask)


class SlabGroup:
    """The rows of a batch's sequences that live in one pool slab (fast numerics), attended in one
    SDPA call per layer.

    The call covers slots ``lo..hi`` (every member, and any slot between them that is not in this
    batch: its query rows are padding whose output is dropped) and positions up to the longest
    member's end ``length``; each member's queries are padded to the batch's most rows ``n_max``,
    and a mask [slots, 1, n_max, length] lets query row r of a member starting at s see positions
    ``< s + r + 1`` (causal within its own new rows). Every slot in the range is made finite up to
    ``length`` first (core/kv_slots.py: masked positions are still multiplied). A slab's only member
    whose rows come first in the batch attends as a private cache does (`AloneGroup`): slices, no
    scatter or padding."""

    def __init__(self, model: AttentionShape, pool: SlotPool, slab: int, members: list[tuple[int, int, int, int]],
                 masks: list[torch.Tensor | None] | None = None) -> None:
        """``members``: (slot, start, first row in the batch, rows) per sequence; ``masks``: per member,
        [rows, start + rows] positions each row sees, or None (causal)."""
        self.model = model
        self.slab = pool.slabs[slab]  # [slots, layers, 2, kv, context, d]
        if len(members) == 1 and members[0][2] == 0:
            slot, start, _, n = members[0]
            pool.fill_to(slab, slot, start)  # (a no-op unless the cache skipped positions)
            pool.wrote(slab, slot, start, start + n)
            self.alone = AloneGroup(model, DecodeCache(self.slab[slot]), start, 0, n, masks[0] if masks else None)
            self.rows, self.in_order = self.alone.rows, True
            return
        self.alone = None
        self.lo = min(slot for slot, _, _, _ in members)
        hi = max(slot for slot, _, _, _ in members)
        self.length = max(start + n for _, start, _, n in members)
        self.n_max = max(n for _, _, _, n in members)
        for slot in range(self.lo, hi + 1):
            pool.fill_to(slab, slot, self.length)
        rows, slots, pos, row_in_seq = [], [], [], []
        for slot, start, first, n in members:
            rows.extend(range(first, first + n))
            slots.extend([slot] * n)
            pos.extend(range(start, start + n))
            row_in_seq.extend(range(n))
        self.in_order = rows == list(range(len(rows)))
        self.rows = torch.tensor(rows)  # where the members' rows sit in the batch [Ng]
        self.slots = torch.tensor(slots)  # [Ng]
        self.pos = torch.tensor(pos)  # [Ng]
        self.rel = self.slots - self.lo  # [Ng]
        self.row_in_seq = torch.tensor(row_in_seq)  # [Ng]
        self.span = hi + 1 - self.lo
        limit = torch.full((self.span, self.n_max), self.length)  # padding slots: everything (finite, dropped)
        firsts = torch.tensor([start for _, start, _, _ in members])
        limit[torch.tensor([slot - self.lo for slot, _, _, _ in members])] = firsts[:, None] + torch.arange(1, self.n_max + 1)
        full = (masks is None and self.n_max == 1 and self.span == len(members)
                and all(start + n == self.length for _, start, _, n in members))
        self.mask = None if full else (torch.arange(self.length) < limit[:, :, None])[:, None]  # [span, 1, n_max, length]
        for (slot, start, _, n), mask in zip(members, masks or ()):
            if mask is not None:
                self.mask[slot - self.lo, 0, :n] = F.pad(mask, (0, self.length - start - n))

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.alone is not None:
            return self.alone.attend(i, q, k, v)
        model = self.model
        keys, values = self.slab[:, i, 0], self.slab[:, i, 1]  # [slots, kv, context, d]
        if self.in_order:  # the batch's first Ng rows: views, no gather
            ng = len(self.rows)
            q, k, v = q[:ng], k[:ng], v[:ng]
        else:
            q, k, v = q[self.rows], k[self.rows], v[self.rows]
        keys[self.slots, :, self.pos] = k  # [Ng, kv, d] into each member's slot
        values[self.slots, :, self.pos] = v
        hi = self.lo + self.span
        queries = q.new_zeros(self.span, self.n_max, model.n_heads, model.head_dim)
        queries[self.rel, self.row_in_seq] = q
        att = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys[self.lo:hi, :, : self.length], values[self.lo:hi, :, : self.length],
            attn_mask=self.mask, scale=1.0 / math.sqrt(model.head_dim), enable_gqa=model.n_kv != model.n_heads,
        )  # [span, h, n_max, d]
        return att.transpose(1, 2)[self.rel, self.row_in_seq].reshape(-1, model.n_heads * model.head_dim)
