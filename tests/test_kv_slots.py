"""Pool slots (core/kv_slots.py): a batch of pooled caches attends slab by slab and gets the logits
each sequence gets alone; unwritten slot memory never reaches a result; slots come back and are
reused lowest first."""
from __future__ import annotations

import gc
import random
import threading

import pytest
import torch

from specdec.core.kv_slots import SlotPool
from specdec.core.llama_decode import LlamaDecoder
from test_branch_decode import VOCAB, tiny_llama


@pytest.fixture(params=[2, 4], ids=["gqa", "mha"])
def decoder(request) -> LlamaDecoder:
    dec = LlamaDecoder(tiny_llama(request.param, seed=request.param + 20))
    dec.kv.pool = SlotPool(len(dec.layers), dec.n_kv, dec.context_length, dec.head_dim, dec.dtype, slab_slots=4)  # several slabs
    return dec


def poison(pool: SlotPool) -> None:
    """What an unwritten page may hold: NaN everywhere nobody wrote (a finite position stays as it is)."""
    for slab, finite in zip(pool.slabs, pool.finite):
        for slot, n in enumerate(finite):
            slab[slot, :, :, :, n:] = float("nan")


def test_a_batch_over_slabs_holes_and_private_caches_matches_each_sequence_alone(decoder):
    rnd = random.Random(3)
    caches = [decoder.new_cache() for _ in range(11)]  # 3 slabs of 4
    seqs = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(2, 40))] for _ in caches]
    for cache, ids in zip(caches, seqs):
        decoder.forward(cache, ids, 0, 1)
    for gone in (9, 5, 1):  # holes inside slabs: their slots sit between members as padding rows
        del caches[gone], seqs[gone]
    caches.append(decoder.private_cache())  # attended alone, in the same forward
    seqs.append([rnd.randrange(VOCAB) for _ in range(17)])
    decoder.forward(caches[-1], seqs[-1], 0, 1)
    gc.collect()
    for step in range(4):
        poison(decoder.pool)
        chosen = sorted(rnd.sample(range(len(caches)), rnd.randint(3, len(caches))))
        rnd.shuffle(chosen)  # batch order need not follow slot order
        feeds = {i: [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 6))] for i in chosen}  # ragged: 1 + k rows
        got = decoder.forward_batch([caches[i] for i in chosen], [feeds[i] for i in chosen],
                                    [len(seqs[i]) for i in chosen], [len(feeds[i]) for i in chosen])
        for i, logits in zip(chosen, got):
            want = decoder.forward(decoder.private_cache(), seqs[i] + feeds[i], 0, len(feeds[i]))
            assert torch.isfinite(logits).all(), f"step {step}: sequence {i} read unwritten memory"
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=f"step {step}, sequence {i}")
            seqs[i] = seqs[i] + feeds[i]


@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "verify"])
def test_full_slabs_with_equal_rows_in_any_order_match_each_sequence_alone(decoder, rows):
    """Every slot of each slab in the batch with the same rows (a decode or a fixed-k verify step of
    a full server), the batch in shuffled order: the case with no padding slots nor padded rows."""
    rnd = random.Random(rows)
    caches = [decoder.new_cache() for _ in range(8)]  # 2 full slabs of 4
    seqs = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(2, 30))] for _ in caches]
    for cache, ids in zip(caches, seqs):
        decoder.forward(cache, ids, 0, 1)
    order = list(range(len(caches)))
    for step in range(3):
        poison(decoder.pool)
        rnd.shuffle(order)
        feeds = {i: [rnd.randrange(VOCAB) for _ in range(rows)] for i in order}
        got = decoder.forward_batch([caches[i] for i in order], [feeds[i] for i in order],
                                    [len(seqs[i]) for i in order], [rows] * len(order))
        for i, logits in zip(order, got):
            want = decoder.forward(decoder.private_cache(), seqs[i] + feeds[i], 0, rows)
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=f"step {step}, sequence {i}")
            seqs[i] = seqs[i] + feeds[i]


def test_slots_come_back_when_a_cache_is_freed_or_dropped_and_are_reused_lowest_first(decoder):
    pool = decoder.pool
    a, b, c = decoder.new_cache(), decoder.new_cache(), decoder.new_cache()
    assert [(x.slab, x.slot) for x in (a, b, c)] == [(0, 0), (0, 1), (0, 2)]
    assert pool.slots_in_use == 3
    b.free()
    b.free()  # idempotent: the slot is not listed twice
    del a
    gc.collect()
    assert pool.slots_in_use == 1
    d, e, f = decoder.new_cache(), decoder.new_cache(), decoder.new_cache()
    assert [(x.slab, x.slot) for x in (d, e, f)] == [(0, 0), (0, 1), (0, 3)]
    more = [decoder.new_cache() for _ in range(2)]  # the first slab is full: a second one
    assert [(x.slab, x.slot) for x in more] == [(1, 0), (1, 1)]
    assert pool.slots_in_use == 6 and len(pool.slabs) == 2
    del c, d, e, f, more


def test_a_reused_slot_holds_nothing_of_the_sequence_before(decoder):
    rnd = random.Random(5)
    first = decoder.new_cache()
    decoder.forward(first, [rnd.randrange(VOCAB) for _ in range(30)], 0, 1)
    slot = (first.slab, first.slot)
    first.free()
    again = decoder.new_cache()
    assert (again.slab, again.slot) == slot
    ids = [rnd.randrange(VOCAB) for _ in range(5)]
    other = decoder.new_cache()
    decoder.forward(other, [rnd.randrange(VOCAB) for _ in range(12)], 0, 1)
    got = decoder.forward_batch([again, other], [ids, [3]], [0, 12], [5, 1])[0]  # 30 stale positions past its 5
    torch.testing.assert_close(got, decoder.forward(decoder.private_cache(), ids, 0), atol=1e-4, rtol=1e-4)


def test_only_what_a_read_reaches_is_made_finite(decoder):
    pool = decoder.pool
    short, long_ = decoder.new_cache(), decoder.new_cache()
    decoder.forward(short, [1, 2, 3], 0, 1)
    decoder.forward(long_, list(range(1, 41)), 0, 1)
    assert pool.finite[0][:2] == [3, 40]
    decoder.forward_batch([short, long_], [[4], [5]], [3, 40], [1, 1])
    assert pool.finite[0][:2] == [41, 41]  # the short one's gap up to the longest read, and no further
    assert pool.finite[0][2:] == [0, 0]  # slots outside the batch's range are untouched


def test_a_slot_freed_by_a_garbage_collection_inside_acquire_does_not_deadlock(decoder):
    pool = decoder.pool
    caches = [decoder.new_cache() for _ in range(pool.slab_slots)]  # the first slab full
    cyclic = caches.pop()
    cyclic.itself = cyclic  # garbage that only a collection frees, and then on whatever thread runs it
    del cyclic
    grow = pool._add_slab
    pool._add_slab = lambda: (gc.collect(), grow())  # the collection happens inside acquire()
    done = threading.Event()
    threading.Thread(target=lambda: (decoder.new_cache(), done.set()), daemon=True).start()
    assert done.wait(60), "acquire() deadlocked on its own lock"
    del caches
