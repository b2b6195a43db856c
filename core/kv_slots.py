"""Every sequence's keys and values in a few shared slabs, so a batch attends in one call per layer.

A sequence cache used to be its own growing buffer, which made a batched forward call attention
once per sequence and layer: at 64 decoding sessions that loop (and its slicing) cost more than
every GEMM of the forward together (docs/performance.md, 8). Here a
*slab* holds ``SLAB_SLOTS`` sequences, ``[slots, layers, 2 (k, v), kv_heads, context, head_dim]``; a
sequence owns one slot (a view of it is its ``buf``), and the sessions of a batch that share a
slab attend as one ``[slots, kv_heads, length, head_dim]`` view, no copy, one SDPA per layer.

Memory: a slab is allocated empty, so the operating system commits its pages only as they are
written; a slot's pages for positions it never reaches are never touched. Reading a view across
slots reads, for every slot in it, positions up to the longest member's length, and positions that
were never written may hold any bits (NaN included, which would poison the softmax even where
masked). So each slot keeps ``finite``: positions ``[0, finite)`` hold written or zeroed values, and
before a batched read the decoder zeroes each slot's gap up to the read's length (`fill_to`). Each
position of a slot is zeroed at most once in the slot's life. A slot keeps its pages when its
sequence ends (the next sequence in it reuses them), so the memory held is the peak of what the live
sessions reached, plus page rounding (measured on the demo target: docs/performance.md, 8).

Slots are handed out lowest first, so the live sequences stay packed in the first slabs and a
batch's view wastes few rows. A slot is released when its cache is garbage (a finalizer) or freed
explicitly. One decoder's caches are used by one thread at a time (the engine's model thread);
only the free list is locked, because a finalizer may run on any thread.
"""
from __future__ import annotations

import threading
import weakref

import torch

SLAB_SLOTS = 16  # sequences per slab: one SDPA call per slab and layer; a new slab when all are taken


class DecodeCache:
    """One sequence's keys and values: ``buf`` is ``[layers, 2 (k, v), kv_heads, capacity, head_dim]``.

    Either a slot of a `SlotPool` (``slab``/``slot`` set, capacity = the model's context length) or
    a private buffer (``DecodeCache(tensor)``: grown by the decoder on demand, attended alone)."""

    def __init__(self, buf: torch.Tensor, pool: SlotPool | None = None, slab: int = -1, slot: int = -1) -> None:
        self.buf = buf
        self.pool = pool
        self.slab = slab
        self.slot = slot
        self._release = weakref.finalize(self, pool.release, slab, slot) if pool is not None else None

    @property
    def capacity(self) -> int:
        return self.buf.shape[3]

    @property
    def pooled(self) -> bool:
        return self.pool is not None

    def free(self) -> None:
        """Give the slot back now (idempotent); the cache must not be used after."""
        if self._release is not None:
            self._release()


class SlotPool:
    """Slabs of sequence slots for one decoder (one model, one dtype)."""

    def __init__(self, layers: int, kv_heads: int, context: int, head_dim: int, dtype: torch.dtype,
                 slab_slots: int = SLAB_SLOTS) -> None:
        self.shape = (layers, 2, kv_heads, context, head_dim)  # one slot
        self.dtype = dtype
        self.slab_slots = slab_slots
        self.slabs: list[torch.Tensor] = []  # each [slab_slots, layers, 2, kv_heads, context, head_dim]
        self.finite: list[list[int]] = []  # per slab, per slot: positions [0, finite) hold finite values
        self._free: list[tuple[int, int]] = []  # (slab, slot), kept sorted: lowest first
        # Reentrant: a garbage collection inside acquire() may run a finalizer, i.e. release(), on this thread.
        self._lock = threading.RLock()

    def acquire(self) -> DecodeCache:
        with self._lock:
            if not self._free:
                self._add_slab()
            slab, slot = self._free.pop(0)
        return DecodeCache(self.slabs[slab][slot], self, slab, slot)

    def release(self, slab: int, slot: int) -> None:
        with self._lock:
            self._free.append((slab, slot))
            self._free.sort()

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self.slabs) * self.slab_slots - len(self._free)

    def _add_slab(self) -> None:
        # empty, not zeros: pages are committed when first written (`fill_to` zeroes what a read needs)
        self.slabs.append(torch.empty(self.slab_slots, *self.shape, dtype=self.dtype))
        self.finite.append([0] * self.slab_slots)
        n = len(self.slabs) - 1
        self._free.extend((n, s) for s in range(self.slab_slots))
        self._free.sort()

    def wrote(self, slab: int, slot: int, start: int, end: int) -> None:
        """Positions [start, end) of the slot were just written."""
        finite = self.finite[slab]
        if start > finite[slot]:
            self.fill_to(slab, slot, start)  # never leave an unwritten gap below `finite`
        finite[slot] = max(finite[slot], end)

    def fill_to(self, slab: int, slot: int, length: int) -> None:
        """Make positions [0, length) of the slot finite, zeroing only those never written."""
        finite = self.finite[slab]
        if finite[slot] < length:
            self.slabs[slab][slot, :, :, :, finite[slot]:length] = 0
            finite[slot] = length


class ExactSlotPool(SlotPool):
    """`SlotPool` with each slab laid out [layers, 2, slots, kv_heads, context, head_dim]: a layer's
    keys of a run of slots are then one [slots * kv_heads, positions, head_dim] strided batch (no
    copy), as exact attention's batched GEMMs read them (core/exact_attention.py). A slot's ``buf`` is
    a view [layers, 2, kv_heads, context, head_dim], as in the slot-major pool."""

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
