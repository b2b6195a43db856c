"""Exact numerics (core/exact_ops.py): a row's logits are bitwise the same (torch.equal) alone, as row
j of a k+1 block, and inside a batch of 16 sessions of mixed lengths and k = 0..8, in float32 and
bfloat16, at 1 and 2 torch threads, whatever kernel fast mode would have timed. Fast mode fails these
(its rows move in the last bits with the rows beside them), which is the point of the mode."""
from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from specdec.core import cpu_features, exact_ops, llama_decode
from specdec.core.cpu_features import describe_cpu
from specdec.core.kv_slots import ExactSlotPool
from specdec.core.llama_decode import KERNELS, MULTI_ROW_KERNELS, LlamaDecoder, bfloat16_supported, native_usable
from specdec.core.models import load_causal_lm
from test_branch_decode import VOCAB, tiny_llama

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        not bfloat16_supported(), reason=f"bf16 needs native bf16 (avx512_bf16/amx_bf16) or specdec's kernels; this one: {describe_cpu()}")),
]
THREADS = [1, 2]
_decoders: dict = {}


@contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=[2, 4], ids=["gqa", "mha"])
def kv_heads(request) -> int:
    return request.param


def exact_decoder(kv_heads: int, dtype: torch.dtype) -> LlamaDecoder:
    """One per model and dtype for the module: the load-time checks run once."""
    key = (kv_heads, dtype)
    if key not in _decoders:
        _decoders[key] = LlamaDecoder(tiny_llama(kv_heads, seed=40 + kv_heads), dtype=dtype, numerics="exact")
    return _decoders[key]


def alone(dec: LlamaDecoder, prefix: list[int], block: list[int]) -> torch.Tensor:
    """Each token of ``block`` verified alone (one row per forward) after ``prefix``, at one thread: [len(block), vocab]."""
    with torch_threads(1):
        cache = dec.new_cache()
        dec.forward(cache, prefix, 0, 1)
        return torch.cat([dec.forward(cache, [t], len(prefix) + j, 1) for j, t in enumerate(block)])


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for j in range(want.shape[0]):
        assert torch.equal(got[j], want[j]), f"{what}: row {j} differs by {(got[j] - want[j]).abs().max().item():.3g}"


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_and_as_row_j_of_a_k_plus_1_block_is_bitwise_the_same(kv_heads, dtype, threads):
    dec = exact_decoder(kv_heads, dtype)
    rnd = random.Random(kv_heads)
    for k in range(9):
        prefix = [rnd.randrange(VOCAB) for _ in range(rnd.randint(3, 70))]
        block = [rnd.randrange(VOCAB) for _ in range(k + 1)]
        want = alone(dec, prefix, block)
        with torch_threads(threads):
            cache = dec.new_cache()
            dec.forward(cache, prefix, 0, 1)
            got = dec.forward(cache, block, len(prefix), k + 1)
        assert_rows_equal(got, want, f"k = {k}")


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_inside_a_batch_of_16_mixed_sessions_is_bitwise_the_same(kv_heads, dtype, threads):
    dec = exact_decoder(kv_heads, dtype)
    rnd = random.Random(100 + kv_heads)
    prefixes = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(2, 110))] for _ in range(16)]
    blocks = [[rnd.randrange(VOCAB) for _ in range(i % 9 + 1)] for i in range(16)]  # k = 0..8
    wants = [alone(dec, p, b) for p, b in zip(prefixes, blocks)]
    with torch_threads(threads):
        caches = [dec.new_cache() for _ in prefixes]
        dec.forward_batch(caches, prefixes, [0] * 16, [1] * 16)  # the prompts, prefilled together
        got = dec.forward_batch(caches, blocks, [len(p) for p in prefixes], [len(b) for b in blocks])
    for i, (g, want) in enumerate(zip(got, wants)):
        assert_rows_equal(g, want, f"session {i} (k = {len(blocks[i]) - 1})")


def poison(pool: ExactSlotPool, caches: list, lengths: list[int]) -> None:
    """What an unwritten page may hold: NaN wherever nobody wrote a live sequence's keys and values, or
    made them finite for attention that multiplies masked keys (the GEMM path's padding)."""
    written = {(c.slab, c.slot): n for c, n in zip(caches, lengths) if c.pooled}
    for slab_index, (slab, finite) in enumerate(zip(pool.slabs, pool.finite)):
        for slot, n in enumerate(finite):
            slab[:, :, slot, :, max(n, written.get((slab_index, slot), 0)):] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES)
def test_slabs_with_holes_and_a_private_cache_still_give_each_row_its_own_bits(kv_heads, dtype):
    dec = LlamaDecoder(tiny_llama(kv_heads, seed=60 + kv_heads), dtype=dtype, numerics="exact")
    dec.kv.pool = ExactSlotPool(len(dec.layers), dec.n_kv, dec.capacity_limit, dec.head_dim, dec.dtype, slab_slots=4)
    rnd = random.Random(7)
    prefixes = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(2, 60))] for _ in range(11)]  # 3 slabs of 4
    caches = [dec.new_cache() for _ in prefixes]
    for cache, p in zip(caches, prefixes):
        dec.forward(cache, p, 0, 1)
    for gone in (9, 5, 1):  # holes: their slots sit between members as padding items
        del caches[gone], prefixes[gone]
    caches.append(dec.private_cache())
    prefixes.append([rnd.randrange(VOCAB) for _ in range(30)])
    dec.forward(caches[-1], prefixes[-1], 0, 1)
    poison(dec.pool, caches, [len(p) for p in prefixes])
    blocks = [[rnd.randrange(VOCAB) for _ in range(i % 5 + 1)] for i in range(len(caches))]
    wants = [alone(dec, p, b) for p, b in zip(prefixes, blocks)]
    got = dec.forward_batch(caches, blocks, [len(p) for p in prefixes], [len(b) for b in blocks])
    for i, (g, want) in enumerate(zip(got, wants)):
        assert_rows_equal(g, want, f"sequence {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_prefilled_alone_beside_others_or_token_by_token_leaves_the_same_cache(dtype):
    """Prefill rows are rows too: a 70-token prompt (two tiles of 64 query rows) gives the same next
    logits and the same keys and values however it was fed."""
    dec = exact_decoder(2, dtype)
    rnd = random.Random(5)
    prompt = [rnd.randrange(VOCAB) for _ in range(70)]
    others = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (3, 70)]
    alone_cache, batch_caches, steps_cache = dec.new_cache(), [dec.new_cache() for _ in range(3)], dec.new_cache()
    first = dec.forward(alone_cache, prompt, 0, 1)
    beside = dec.forward_batch(batch_caches, [others[0], prompt, others[1]], [0, 0, 0], [1, 1, 1])[1]
    for j, t in enumerate(prompt):
        steps = dec.forward(steps_cache, [t], j, 1)
    assert torch.equal(first, beside) and torch.equal(first, steps)
    for cache in (batch_caches[1], steps_cache):
        assert torch.equal(cache.buf[:, :, :, :70], alone_cache.buf[:, :, :, :70])
    nxt = [rnd.randrange(VOCAB) for _ in range(3)]
    assert torch.equal(dec.forward(alone_cache, nxt, 70, 3), dec.forward(steps_cache, nxt, 70, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_mode_ignores_the_kernel_choice_and_never_times_kernels(dtype, monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("exact mode timed kernels at load")

    monkeypatch.setattr(LlamaDecoder, "_time_kernels", no_timing)
    model = tiny_llama(2, seed=9)
    rnd = random.Random(9)
    prefix = [rnd.randrange(VOCAB) for _ in range(40)]
    block = [rnd.randrange(VOCAB) for _ in range(4)]
    results = []
    for single_row in ("measure", *KERNELS):
        for multi_row in ("measure", *MULTI_ROW_KERNELS):
            dec = LlamaDecoder(model, dtype=dtype, single_row=single_row, multi_row=multi_row, numerics="exact")
            assert dec.kernels == (("native", "native") if native_usable(dtype) else ("packed", "packed"))
            cache = dec.new_cache()
            dec.forward(cache, prefix, 0, 1)
            results.append(dec.forward(cache, block, len(prefix), len(block)))
    assert all(torch.equal(r, results[0]) for r in results)


def test_exact_logits_stay_close_to_fast_ones():
    """Exact mode changes the summation order, not the math."""
    model = tiny_llama(2, seed=11)
    ids = list(range(3, 60))
    fast_dec, exact_dec = LlamaDecoder(model), LlamaDecoder(model, numerics="exact")
    fast = fast_dec.forward(fast_dec.new_cache(), ids, 0)
    exact = exact_dec.forward(exact_dec.new_cache(), ids, 0)
    assert (fast - exact).abs().max() < 1e-4 * fast.abs().max()


def test_a_cpu_whose_kernels_do_not_hold_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(exact_ops, "_PLANS", {})  # check again, not what an earlier decoder found
    monkeypatch.setattr(exact_ops, "_probe_attention", lambda *args: "a row differs")
    with pytest.raises(exact_ops.ExactNumericsUnavailable, match="torch CPU capability"):
        LlamaDecoder(tiny_llama(2, seed=1), numerics="exact")
    with pytest.raises(ValueError, match="numerics must be one of"):
        LlamaDecoder(tiny_llama(2, seed=1), numerics="exakt")


def test_the_default_is_exact_and_falls_back_to_fast_only_where_the_cpu_cannot_hold_it(tiny_pair, monkeypatch, caplog):
    from specdec.target.engine import TargetConfig, VerifierEngine

    assert VerifierEngine.from_config(TargetConfig(tiny_pair[0])).numerics == "exact"
    assert VerifierEngine.from_config(TargetConfig(tiny_pair[0], fast_forward=False)).numerics == "fast"  # the reference forward
    monkeypatch.setattr(exact_ops, "_PLANS", {})
    monkeypatch.setattr(exact_ops, "_probe_attention", lambda *args: "a row differs")
    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0]))
    assert engine.numerics == "fast" and not engine.decoder.exact
    assert "exact numerics unavailable" in caplog.text and "a row differs" in caplog.text
    with pytest.raises(exact_ops.ExactNumericsUnavailable):  # asked for by name, it is refused instead
        VerifierEngine.from_config(TargetConfig(tiny_pair[0], numerics="exact"))


def test_bfloat16_is_refused_on_a_cpu_without_native_bf16(tiny_pair, monkeypatch):
    from specdec.core import models, native_kernels

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    monkeypatch.setattr(llama_decode, "native_bf16", lambda: False)
    monkeypatch.setattr(native_kernels, "weight_dtypes", lambda: ())  # (with them: tests/test_half_weights.py)
    monkeypatch.setattr(models, "weight_dtypes", lambda: ())
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16"):
        load_causal_lm(tiny_pair[0], dtype="bfloat16")
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16"):
        LlamaDecoder(tiny_llama(2, seed=1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_causal_lm(tiny_pair[0], dtype="float16")


@pytest.mark.skipif(not bfloat16_supported(), reason=f"neither native bf16 nor specdec's kernels on this CPU ({describe_cpu()})")
def test_the_target_loads_and_verifies_in_bfloat16_with_exact_numerics(tiny_pair):
    from specdec.target.engine import TargetConfig, VerifierEngine

    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0], dtype="bfloat16", numerics="exact"))
    assert next(engine.loaded.model.parameters()).dtype == torch.bfloat16
    assert engine.decoder.weight_dtype == torch.bfloat16 and engine.decoder.exact
    with pytest.raises(ValueError, match="the lean or the paged runner"):
        VerifierEngine(engine.loaded, TargetConfig(tiny_pair[0], fast_forward=False, numerics="exact"))
