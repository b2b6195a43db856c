"""Memory that stays flat: a worker's decoder, fed batches of ever new row counts, holds no more
memory after the first few (benchmarks/soak.py is the end-to-end check: rounds of 300 requests
through `specdec up --replicas 2`).

oneDNN and ideep (PyTorch's wrapper) cache a primitive per input shape, about 0.55 MiB of process
memory per row count per weight shape, in caches of 1,024 entries each; a verifier's batches and
prefills come in hundreds of row counts, so unbucketed a worker grew by hundreds of MiB over a few
thousand sessions. `bucket_rows` pads a packed linear's rows to 27 sizes. What sessions
free stays in glibc's arenas; `FreedMemory` trims them once a worker's sessions have closed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import random
import threading
import time

import pytest
import torch

from specdec.core.llama_decode import LlamaDecoder
from specdec.core.session_table import FreedMemory, SessionTable
from test_branch_decode import VOCAB, tiny_llama


def _malloc_held_mib() -> float:
    """Bytes glibc's malloc hands out now (arenas in use + mmapped chunks), in MiB."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def test_bucket_rows_covers_every_count_with_few_sizes_and_little_padding():
    from specdec.core.llama_decode import MAX_CALL_ROWS, bucket_rows

    sizes = {bucket_rows(n) for n in range(1, MAX_CALL_ROWS + 1)}
    assert len(sizes) <= 30 and max(sizes) == MAX_CALL_ROWS  # more rows go in calls of MAX_CALL_ROWS
    for n in range(1, MAX_CALL_ROWS + 1):
        m = bucket_rows(n)
        assert n <= m <= max(n + 7, n * 1.25), n  # up to 64 rows: the next multiple of 8; past it: +25% at most
        assert bucket_rows(m) == m  # a bucket is its own bucket
    assert [bucket_rows(n) for n in range(1, 9)] == list(range(1, 9))  # a step of k <= 7 runs unpadded


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed linear only")
def test_a_decoder_fed_new_row_counts_stops_growing():
    """Forwards of 65..127 rows after ones of 1..64: the first pass has cached every shape the
    second needs but four, so memory grows by a few MiB (unbucketed: 63 row counts x 5 weight
    shapes x 0.55 MiB, about 170 MiB)."""
    decoder = LlamaDecoder(tiny_llama(2, seed=3), single_row="packed", multi_row="packed")
    rnd = random.Random(0)

    def forward(rows: int) -> None:
        decoder.forward(decoder.private_cache(), [rnd.randrange(VOCAB) for _ in range(rows)], 0)  # logits of every row

    for rows in range(1, 65):
        forward(rows)
    before = _malloc_held_mib()
    for rows in range(65, decoder.context_length):
        forward(rows)
    grown = _malloc_held_mib() - before
    assert grown < 40, f"malloc'd memory grew {grown:.0f} MiB over 63 new row counts"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed linear only")
def test_padded_rows_give_each_row_its_unpadded_logits():
    """Padding is zero rows below the real ones: a 20-row feed (padded to 24) gives the HF forward's
    logits for all 20 rows."""
    model = tiny_llama(2, seed=5)
    decoder = LlamaDecoder(model, single_row="packed", multi_row="packed")
    ids = [random.Random(1).randrange(VOCAB) for _ in range(20)]
    lean = decoder.forward(decoder.private_cache(), ids, 0)  # [20, vocab]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]  # [20, vocab]
    torch.testing.assert_close(lean, reference, atol=1e-4, rtol=1e-4)


def test_freed_memory_trims_once_the_last_session_closes_and_otherwise_at_most_once_an_interval():
    now = [0.0]
    trimmed = threading.Event()
    freed = FreedMemory(delay_s=0.0, interval_s=60.0, trim=trimmed.set, clock=lambda: now[0])
    table: SessionTable[str] = SessionTable(4, 30.0, clock=lambda: now[0], freed=freed)
    table.add("a" * 32, "A")
    table.add("b" * 32, "B")
    table.pop("a" * 32)  # one left, no interval passed: nothing to do yet
    assert freed.trims == 0 and not trimmed.wait(0.2)
    table.pop("b" * 32)  # idle: trim
    assert trimmed.wait(60.0)
    _wait_for(lambda: freed.trims == 1)
    trimmed.clear()
    table.add("c" * 32, "C")
    table.add("d" * 32, "D")
    now[0] += 61.0  # busy for over an interval: a close trims though sessions remain
    table.pop("c" * 32)
    assert trimmed.wait(60.0)
    _wait_for(lambda: freed.trims == 2)


def test_an_expired_session_counts_as_closed():
    now = [0.0]
    trimmed = threading.Event()
    table: SessionTable[str] = SessionTable(4, 30.0, clock=lambda: now[0],
                                            freed=FreedMemory(delay_s=0.0, trim=trimmed.set, clock=lambda: now[0]))
    table.add("a" * 32, "A")
    now[0] += 31.0
    assert table.reap_idle() == ["a" * 32]
    assert trimmed.wait(60.0)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed linear only")
def test_a_packed_linear_gives_every_row_count_its_rows_padded_or_split():
    from specdec.core.llama_decode import MAX_CALL_ROWS, _onednn_linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    linear = _onednn_linear(weight, 8)
    for n in (1, 7, 9, 65, MAX_CALL_ROWS - 1, MAX_CALL_ROWS, MAX_CALL_ROWS + 1, 2 * MAX_CALL_ROWS + 77):
        x = torch.randn(n, 64, generator=gen)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-4)
