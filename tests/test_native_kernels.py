"""specdec's own float32 kernels (core/native_kernels.py): close to PyTorch's ops, and a row's bits
never depend on what shares its call (rows, their order, the thread split, masked keys between)."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from specdec.core import exact_ops, llama_decode, native_kernels
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.runner import Feed
from test_branch_decode import tiny_llama

pytestmark = pytest.mark.skipif(not native_kernels.available(),
                                reason="specdec's native kernels do not build here (no C compiler, or no AVX2 with FMA)")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("out_features,in_features", [(1000, 384), (33, 7), (64, 1024)])
def test_linear_matches_pytorch_and_gives_a_row_the_same_bits_in_any_call(out_features, in_features):
    g = gen(out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    rows = torch.randn(140, in_features, generator=g)
    linear = native_kernels.NativeLinear(weight)
    full = linear(rows)
    assert torch.allclose(full, F.linear(rows, weight), atol=1e-4, rtol=1e-4)
    for lo, hi in ((7, 8), (0, 1), (5, 7), (3, 11), (60, 125), (0, 140)):  # alone, at other places, other counts
        assert torch.equal(linear(rows[lo:hi]), full[lo:hi])
    assert linear(rows[:0]).shape == (0, out_features)


def test_linear_split_over_threads_changes_no_bit():
    g = gen(1)
    weight = torch.randn(300, 256, generator=g)
    rows = torch.randn(80, 256, generator=g)  # 80 * 300 * 256 multiply-adds: above the split threshold
    assert rows.shape[0] * weight.numel() >= native_kernels.PARALLEL_MACS
    linear = native_kernels.NativeLinear(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(rows)
        torch.set_num_threads(3)
        assert torch.equal(linear(rows), one)
    finally:
        torch.set_num_threads(before)


def test_linear_refuses_what_it_cannot_run():
    linear = native_kernels.NativeLinear(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"float32 rows \[n, 16\]"):
        linear(torch.randn(2, 15))
    with pytest.raises(ValueError, match="float32"):
        linear(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D weight in float32, bfloat16"):
        native_kernels.NativeLinear(torch.randn(8, 16).double())
    with pytest.raises(ValueError, match="2-D weight"):
        native_kernels.NativeLinear(torch.randn(8, 16, 2).bfloat16())


HALF = [dtype for dtype in (torch.bfloat16, torch.float16) if dtype in native_kernels.weight_dtypes()]


def test_sessions_of_several_slabs_fed_interleaved_run_one_call_with_the_per_op_paths_bits(monkeypatch):
    """Sessions of two pool slabs fed in an order that interleaves the slabs (as a verifier's batch
    lists them): the rows run in slab order in one call and are put back, and every logit and key is
    bitwise the per-op path's (and a row's bits do not depend on where the batch lists it)."""
    from specdec.core.kv_slots import SLAB_SLOTS

    fused, per_op, calls = fused_and_per_op(tiny_llama(2, seed=34), monkeypatch)
    sessions = SLAB_SLOTS + 3
    caches = [[d.new_cache() for _ in range(sessions)] for d in (fused, per_op)]
    prompts = [list(range(4 + s, 10 + s)) for s in range(sessions)]
    for d, cs in zip((fused, per_op), caches):
        d.forward_batch(cs, prompts, [0] * sessions, [1] * sessions)
    # the second slab's sessions each before one of the first's, the rest of the first backwards
    second = list(range(SLAB_SLOTS, sessions))
    order = [s for pair in zip(second, range(len(second))) for s in pair] + list(range(len(second), SLAB_SLOTS))[::-1]
    assert caches[0][order[0]].slab != caches[0][order[1]].slab and sorted(order) == list(range(sessions))
    calls.clear()
    blocks = [[7 + s % 5] * (1 + s % 3) for s in order]
    starts = [len(prompts[s]) for s in order]
    plan = fused.kv.plan([Feed(caches[0][s], st, b, len(b)) for s, st, b in zip(order, starts, blocks)])
    assert plan.fused is not None and plan.fused[2] is not None  # the groups' rows interleave: run in group order
    a = fused.forward_batch([caches[0][s] for s in order], blocks, starts, [len(b) for b in blocks])
    b = per_op.forward_batch([caches[1][s] for s in order], blocks, starts, [len(b) for b in blocks])
    assert calls == ["stack"] * len(fused.layers)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for s, block in zip(order, blocks):
        end = len(prompts[s]) + len(block)
        assert torch.equal(caches[0][s].buf[:, :, :, :end], caches[1][s].buf[:, :, :, :end])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("out_features,in_features", [(1000, 384), (33, 7), (64, 1024)])
def test_half_weight_linear_matches_float64_over_the_widened_weights(dtype, out_features, in_features):
    """Half-precision weights are widened exactly: the result is within float32 summation error of the
    float64 product over the widened weights, and bitwise the float32 kernel's over them."""
    g = gen(out_features + 7)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    rows = torch.randn(40, in_features, generator=g)
    linear = native_kernels.NativeLinear(weight)
    assert linear.panels.dtype == dtype and linear.panels.numel() * 2 == linear.panels.nbytes  # held at half the bytes
    got = linear(rows)
    wide = weight.double()
    reference = rows.double() @ wide.T
    bound = 1e-4 * (rows.double().abs() @ wide.abs().T) + 1e-30  # in * 2^-24 of the sum of |terms| bounds the error
    assert got.dtype == torch.float32 and ((got.double() - reference).abs() <= bound).all()
    assert torch.equal(got, native_kernels.NativeLinear(weight.float())(rows))
    # half-precision rows: widened exactly, the float32 result rounded to their dtype, like F.linear's
    assert torch.equal(linear(rows.to(dtype)), native_kernels.NativeLinear(weight.float())(rows.to(dtype).float()).to(dtype))


def order_free(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Small integers over 16: every product a multiple of 2^-8 and every partial sum exact in float32,
    so a result is the exact product whatever order it is summed in."""
    return torch.randint(-8, 9, shape, generator=g).float() / 16


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("data", ["order-free", "random"])
def test_half_weight_linear_gives_a_row_the_same_bits_alone_in_any_block_and_thread_split(dtype, data, monkeypatch):
    """A row alone and at every place of blocks of 5, 9 and 17 rows, at 1, 2 and 3 threads (every call
    split, whatever its size). Order-free data checks the structure against the exact product (a
    wrong panel, tail or row offset shows); random data, that the fixed summation order holds."""
    g = gen(11)
    out_features, in_features = 300, 200  # several panels, the last one partial; 200: not a multiple of any width
    make = order_free if data == "order-free" else (lambda shape, g: torch.randn(shape, generator=g))
    weight = make((out_features, in_features), g).to(dtype)
    rows = make((17, in_features), g)
    linear = native_kernels.NativeLinear(weight)
    monkeypatch.setattr(native_kernels, "PARALLEL_MACS", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([linear(rows[r:r + 1]) for r in range(17)])
        if data == "order-free":
            assert torch.equal(alone.double(), rows.double() @ weight.double().T)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for size in (5, 9, 17):
                for lo in range(0, 17 - size + 1, 4 if size < 17 else 1):
                    assert torch.equal(linear(rows[lo:lo + size]), alone[lo:lo + size]), (threads, size, lo)
    finally:
        torch.set_num_threads(before)


def test_the_avx2_build_compiles_and_gives_the_native_builds_bits(monkeypatch, tmp_path):
    """The kernels built for Haswell (AVX2, FMA, F16C: 8-lane vectors) run on any machine here, and each
    output is the same FMA chain whatever the vector width: bit for bit this machine's own build."""
    g = gen(13)
    weights = {dtype: torch.randn(70, 300, generator=g).to(dtype) for dtype in (torch.float32, *HALF)}
    rows = torch.randn(11, 300, generator=g)
    native = {dtype: native_kernels.NativeLinear(w)(rows) for dtype, w in weights.items()}
    monkeypatch.setenv("SPECDEC_NATIVE_MARCH", "haswell")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    native_kernels.library.cache_clear()
    try:
        assert native_kernels.available() and native_kernels.library().specdec_panel_width() == 16  # 2 x 8 lanes
        assert set(native_kernels.weight_dtypes()) >= set(weights)
        for dtype, w in weights.items():
            assert torch.equal(native_kernels.NativeLinear(w)(rows), native[dtype]), dtype
    finally:
        monkeypatch.undo()
        native_kernels.library.cache_clear()


def test_row_ops_match_pytorch_and_are_per_row():
    g = gen(2)
    x = torch.randn(9, 384, generator=g)
    w = torch.randn(384, generator=g)
    norm = native_kernels.rms_norm(x, w, 1e-6)
    assert torch.allclose(norm, F.rms_norm(x, (384,), w, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(native_kernels.rms_norm(x[4:5], w, 1e-6), norm[4:5])
    with pytest.raises(ValueError, match="float32 norm weight"):  # the C kernel would misread a bfloat16 one
        native_kernels.rms_norm(x, w.bfloat16(), 1e-6)
    gate_up = 6 * torch.randn(9, 2 * 200, generator=g)  # 200: a tail past the vector width
    gate, up = gate_up.chunk(2, dim=-1)
    h = native_kernels.swiglu(gate_up)
    assert torch.allclose(h, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(native_kernels.swiglu(gate_up[2:3]), h[2:3])
    qk = torch.randn(9, 3 * 8, generator=g)
    angles = torch.randn(9, 4, generator=g)
    turned = native_kernels.rotary(qk, 3, 8, torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous())
    pairs = torch.view_as_complex(qk.view(9, 3, 4, 2)) * torch.polar(torch.ones_like(angles), angles)[:, None]
    assert torch.allclose(turned, torch.view_as_real(pairs).view(9, 3, 8), atol=1e-6)


def reference_attention(q, keys, values, seen):
    """q [h, d] over keys/values [kv, L, d] at the positions ``seen``."""
    g = q.shape[0] // keys.shape[0]
    k, v = keys[:, seen].repeat_interleave(g, 0), values[:, seen].repeat_interleave(g, 0)
    p = torch.softmax(torch.einsum("hd,hld->hl", q.double(), k.double()) / math.sqrt(q.shape[1]), dim=-1)
    return torch.einsum("hl,hld->hd", p, v.double()).float().reshape(-1)


def test_attention_matches_softmax_and_a_row_alone():
    g = gen(3)
    slots, kv, heads, cap, d = 3, 2, 6, 150, 64
    slab = 3 * torch.randn(slots, 2, kv, cap, d, generator=g)
    keys, values = slab[:, 0], slab[:, 1]
    q = torch.randn(5, heads, d, generator=g)
    where = torch.tensor([0, 2, 2, 1, 0])
    limits = torch.tensor([1, 50, 51, 150, 9])
    out = native_kernels.attention(q, keys, values, where, limits, None, 1 / math.sqrt(d))
    for r in range(5):
        ref = reference_attention(q[r], keys[where[r]], values[where[r]], torch.arange(int(limits[r])))
        assert torch.allclose(out[r], ref, atol=1e-5), r
        assert torch.equal(native_kernels.attention(q[r:r + 1], keys, values, where[r:r + 1], limits[r:r + 1], None,
                                                    1 / math.sqrt(d))[0], out[r])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_split_over_threads_keep_their_bits(kv_dtype):
    """Rows split over the C thread team (by the keys each reads): 1, 2, 3 and 7 threads, a mask, rows
    of very different lengths, and a scratch too small (it is grown) give the same bits."""
    g = gen(31)
    slots, kv, heads, cap, d = 4, 2, 4, 300, 32
    slab = (2 * torch.randn(slots, 2, kv, cap, d, generator=g)).to(kv_dtype)
    keys, values = slab[:, 0], slab[:, 1]
    n = 9
    q = torch.randn(n, heads, d, generator=g)
    where = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2, 1])
    limits = torch.tensor([1, 300, 7, 8, 150, 2, 299, 40, 9])
    allowed = (torch.rand(n, cap, generator=g) < 0.7).to(torch.uint8)
    allowed[:, 0] = 1
    for mask in (None, allowed):
        want = native_kernels.attention(q, keys, values, where, limits, mask, 0.3, threads=1)
        for threads in (2, 3, 7):
            got = native_kernels.attention(q, keys, values, where, limits, mask, 0.3, torch.empty(1), threads=threads)
            assert torch.equal(got, want), (threads, mask is None)


def test_a_tree_node_gets_the_bits_of_its_chain_twin():
    """Siblings between a node's ancestors are masked: the node's output has the bits of the same
    token on a chain (its keys and values in the same order, nothing between)."""
    g = gen(4)
    kv, heads, d, prefix = 2, 4, 32, 40
    chain_k, chain_v = torch.randn(1, kv, prefix + 3, d, generator=g), torch.randn(1, kv, prefix + 3, d, generator=g)
    # the tree: the prefix, then a sibling of the node's parent, the parent, another sibling, the node
    order = list(range(prefix)) + [None, prefix, None, prefix + 1]
    tree_k, tree_v = torch.randn(1, kv, len(order), d, generator=g), torch.randn(1, kv, len(order), d, generator=g)
    for place, source in enumerate(order):
        if source is not None:
            tree_k[0, :, place], tree_v[0, :, place] = chain_k[0, :, source], chain_v[0, :, source]
    q = torch.randn(1, heads, d, generator=g)
    zero = torch.zeros(1, dtype=torch.int64)
    chain = native_kernels.attention(q, chain_k, chain_v, zero, torch.tensor([prefix + 2]), None, 0.2)
    allowed = torch.tensor([[source is not None for source in order]], dtype=torch.uint8)
    tree = native_kernels.attention(q, tree_k, tree_v, zero, torch.tensor([len(order)]), allowed, 0.2)
    assert torch.equal(tree, chain)


def test_attention_refuses_wrong_layouts():
    keys = torch.randn(1, 2, 8, 4)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        native_kernels.attention(torch.randn(1, 2, 4), keys, keys, torch.zeros(1, dtype=torch.int32), one, None, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16 keys"):
        native_kernels.attention(torch.randn(1, 2, 4), keys.double(), keys.double(), one - 1, one, None, 1.0)


def test_exact_decoder_runs_native_kernels_and_matches_the_fast_one():
    model = tiny_llama(2, seed=12)
    ids = list(range(3, 60))
    exact = LlamaDecoder(model, numerics="exact")
    assert exact.kernels == ("native", "native") and exact.native_ops
    fast = LlamaDecoder(model)
    a = exact.forward(exact.new_cache(), ids, 0)
    b = fast.forward(fast.new_cache(), ids, 0)
    assert (a - b).abs().max() < 1e-4 * b.abs().max()


def test_bfloat16_keys_and_values_give_the_bits_of_their_float32_widening():
    """bfloat16 caches are read in place, each value widened exactly: the result is the float32
    kernel's over the widened copy, bit for bit, for chains and masked (tree) rows alike."""
    g = gen(5)
    kv, heads, d, length = 2, 6, 48, 70  # d not a multiple of the vector width: the scalar tails too
    keys = torch.randn(3, kv, length, d, generator=g).bfloat16()
    values = torch.randn(3, kv, length, d, generator=g).bfloat16()
    q = torch.randn(4, heads, d, generator=g)
    where, limits = torch.tensor([0, 2, 1, 2]), torch.tensor([1, 70, 33, 64])
    allowed = (torch.rand(4, length, generator=g) < 0.7).to(torch.uint8)
    allowed[:, 0] = 1
    for mask in (None, allowed):
        got = native_kernels.attention(q, keys, values, where, limits, mask, 0.125)
        want = native_kernels.attention(q, keys.float(), values.float(), where, limits, mask, 0.125)
        assert torch.equal(got, want)


def test_without_native_kernels_exact_mode_keeps_onednn(monkeypatch):
    monkeypatch.setattr(native_kernels, "available", lambda: False)
    # the kernel choice only: whether oneDNN's attention keeps a row's bits is this CPU's to say (exact_ops.verify)
    monkeypatch.setattr(exact_ops, "_PLANS", {})
    monkeypatch.setattr(exact_ops, "verify", lambda *args: exact_ops.ExactPlan("flat", 1))
    dec = LlamaDecoder(tiny_llama(2, seed=12), numerics="exact")
    assert dec.kernels in (("packed", "packed"), ("plain", "plain")) and not dec.native_ops and not dec.native_attention
    with pytest.raises(ValueError, match="native kernel"):
        LlamaDecoder(tiny_llama(2, seed=12), single_row="native")


def test_a_compiler_that_fails_turns_native_kernels_off_with_a_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))  # nothing built yet here
    native_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="specdec.core.native_kernels"):
            assert native_kernels.library() is None
        assert "native kernels off" in caplog.text
        assert not llama_decode.native_usable(torch.float32)
    finally:
        monkeypatch.undo()
        native_kernels.library.cache_clear()
    assert native_kernels.available()  # built again (or found) with the real compiler


def fused_and_per_op(model, monkeypatch) -> tuple[LlamaDecoder, LlamaDecoder, list]:
    """Two exact decoders of ``model``: one fusing each layer into a C call (each layer's call counted
    in the list: "stack" where one call ran every layer, "layer" where a call ran one), one held to
    the per-op path."""
    fused, per_op = LlamaDecoder(model, numerics="exact"), LlamaDecoder(model, numerics="exact")
    monkeypatch.setattr(per_op.kv, "_fused_plan", lambda groups: None)
    calls = []
    real_layer, real_stack = native_kernels.decoder_layer, native_kernels.DecoderStack.run
    monkeypatch.setattr(native_kernels, "decoder_layer", lambda *a: (calls.append("layer"), real_layer(*a))[1])
    monkeypatch.setattr(native_kernels.DecoderStack, "run",
                        lambda self, *a: (calls.extend(["stack"] * len(self.layers)), real_stack(self, *a))[1])
    return fused, per_op, calls


def test_one_sequence_runs_a_c_call_per_layer_with_the_per_op_paths_bits(monkeypatch):
    """The exact forward of one sequence (prefill, single rows, a 3-row block) fuses each layer into one
    C call; its logits and its cache are bitwise the per-op path's."""
    fused, per_op, calls = fused_and_per_op(tiny_llama(2, seed=21), monkeypatch)
    caches = fused.new_cache(), per_op.new_cache()
    prompt = list(range(3, 60))
    feeds = [(prompt, 0, 1), ([5], 57, 1), ([9], 58, 1), ([7, 8, 9], 59, 3)]
    for tokens, start, last in feeds:
        a = fused.forward(caches[0], tokens, start, last)
        b = per_op.forward(caches[1], tokens, start, last)
        assert torch.equal(a, b), start
    assert calls == ["stack"] * (len(feeds) * len(fused.layers))  # every layer of a forward in one call
    assert torch.equal(caches[0].buf[:, :, :, :62], caches[1].buf[:, :, :, :62])


def test_layers_whose_keys_are_not_one_tensor_run_a_call_each_with_the_same_bits(monkeypatch):
    """Where a group's layers keep their keys in separate tensors (no single stride from one layer to
    the next), each layer is its own C call, with the one-call path's bits."""
    from specdec.core.slab_backend import SlabBackend

    fused, _, calls = fused_and_per_op(tiny_llama(2, seed=22), monkeypatch)
    assert len(fused.layers) == 2
    cache = fused.new_cache()
    fused.forward(cache, list(range(3, 40)), 0, 1)
    calls.clear()
    plan = fused.kv.plan([Feed(cache, 37, [5, 6], 2)])
    group, rows, order = plan.fused
    assert order is None  # one sequence: the batch's own order
    x = fused.embed_rows(plan.token_ids)
    rotary = fused.rotary[plan.positions]
    layers = [group.layer_kv(i) for i in range(len(fused.layers))]
    room = torch.stack([t for kv in layers for t in kv])  # keys 0, values 0, keys 1, values 1, ...
    room[[2, 3]] = room[[3, 2]].clone()  # layer 1's values before its keys: no one stride from layer to layer
    apart = [(room[0], room[1]), (room[3], room[2])]
    together = [tuple(t.clone() for t in group.layer_kv(i)) for i in range(len(fused.layers))]
    monkeypatch.setattr(group, "layer_kv", lambda i: apart[i])
    one_each = SlabBackend._layers_fused(fused, x.clone(), rotary, group, rows, None)
    assert calls == ["layer"] * len(fused.layers)
    keys = torch.stack([torch.stack(kv) for kv in together])  # [layers, 2, ...]: one tensor again
    monkeypatch.setattr(group, "layer_kv", lambda i: (keys[i, 0], keys[i, 1]))
    one_call = SlabBackend._layers_fused(fused, x.clone(), rotary, group, rows, None)
    assert calls[len(fused.layers):] == ["stack"] * len(fused.layers)
    assert torch.equal(one_each, one_call)
    assert all(torch.equal(a[j][:, :, :39], keys[i, j][:, :, :39]) for i, a in enumerate(apart) for j in (0, 1))  # (past: unwritten)


def test_many_sessions_over_several_slabs_run_a_c_call_per_layer_with_the_per_op_paths_bits(monkeypatch):
    """Twenty sessions, more than one pool slab holds, each feeding a block of its own length (a
    prefill, single rows, k + 1 rows), then a token tree in one slab: each layer is one C call over
    every session (rows reading their slab through offsets from the first), and every logit and key
    is bitwise the per-op path's."""
    from specdec.core.kv_slots import SLAB_SLOTS

    fused, per_op, calls = fused_and_per_op(tiny_llama(2, seed=33), monkeypatch)
    sessions = SLAB_SLOTS + 4
    caches = [[d.new_cache() for _ in range(sessions)] for d in (fused, per_op)]
    assert len({c.slab for c in caches[0]}) > 1
    prompts = [list(range(3 + s, 9 + 2 * s)) for s in range(sessions)]
    a = fused.forward_batch(caches[0], prompts, [0] * sessions, [1] * sessions)
    b = per_op.forward_batch(caches[1], prompts, [0] * sessions, [1] * sessions)
    assert len(calls) == len(fused.layers) and all(torch.equal(x, y) for x, y in zip(a, b))
    starts = [len(p) for p in prompts]
    blocks = [[5 + s % 7] * (1 + s % 4) for s in range(sessions)]
    a = fused.forward_batch(caches[0], blocks, starts, [len(x) for x in blocks])
    b = per_op.forward_batch(caches[1], blocks, starts, [len(x) for x in blocks])
    assert len(calls) == 2 * len(fused.layers) and all(torch.equal(x, y) for x, y in zip(a, b))
    # a tree in the first slab: nodes 1 and 2 both children of node 0 (a mask, one slab: still one call)
    starts = [s + len(x) for s, x in zip(starts, blocks)]
    tree = [0, 1, 2]
    a = fused.forward_batch(caches[0][:2], [tree, [4]], starts[:2], [3, 1], parents=[(-1, 0, 0), ()])
    b = per_op.forward_batch(caches[1][:2], [tree, [4]], starts[:2], [3, 1], parents=[(-1, 0, 0), ()])
    assert len(calls) == 3 * len(fused.layers) and all(torch.equal(x, y) for x, y in zip(a, b))
    written = [start + (3 if s == 0 else 1 if s == 1 else 0) for s, start in enumerate(starts)]
    for mine, theirs, end in zip(caches[0], caches[1], written):
        assert torch.equal(mine.buf[:, :, :, :end], theirs.buf[:, :, :, :end])


@pytest.mark.parametrize("dtype", HALF)
def test_a_fused_layer_with_half_weights_gives_the_bits_of_float32_ones_widened(dtype):
    """`decoder_layer` over bfloat16 (or float16) projections: the float32 layer's result over the widened
    weights, bit for bit, for the rows and the keys and values they write."""
    g = gen(17)
    heads, kv, d, inter, hidden, n, start = 4, 2, 32, 96, 128, 3, 5
    weights = [torch.randn(o, i, generator=g) / 8 for o, i in
               (((heads + 2 * kv) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter))]
    ln1, ln2 = 1 + torch.randn(hidden, generator=g) / 10, 1 + torch.randn(hidden, generator=g) / 10
    angles = torch.randn(n, d // 2, generator=g)
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
    x0 = torch.randn(n, hidden, generator=g)
    kv0 = torch.randn(2, kv, start + n, d, generator=g)
    shape = (heads, kv, d, inter)
    rows = native_kernels.causal_rows(start, n, start + n)
    work = torch.empty(rows.work(hidden, shape, 1))
    results = []
    for cast in (lambda w: w.to(dtype), lambda w: w.to(dtype).float()):
        q, o, gu, down = (native_kernels.NativeLinear(cast(w)) for w in weights)
        x, cache = x0.clone(), kv0.clone()
        native_kernels.decoder_layer(x, (ln1, q, o, ln2, gu, down), shape, 1e-6, cos_sin, cache[0][None], cache[1][None], rows,
                                     work)
        results.append((x, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], x0)
    mixed = (ln1, native_kernels.NativeLinear(weights[0].to(dtype)), *(native_kernels.NativeLinear(w) for w in weights[1:2]),
             ln2, *(native_kernels.NativeLinear(w) for w in weights[2:]))
    with pytest.raises(ValueError, match="one weight dtype"):
        native_kernels.decoder_layer(x0.clone(), mixed, shape, 1e-6, cos_sin, kv0[0][None].clone(), kv0[1][None].clone(), rows, work)
    with pytest.raises(ValueError, match="float32 norm weight"):
        native_kernels.decoder_layer(x0.clone(), (ln1.to(dtype), q, o, ln2, gu, down), shape, 1e-6, cos_sin,
                                     kv0[0][None].clone(), kv0[1][None].clone(), rows, work)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_a_fused_layer_has_the_same_bits_at_any_thread_count_and_beside_another_caller(dtype):
    """`decoder_layer`'s GEMMs split by columns over a team of threads in C: 1, 2, 3 and 5 threads give
    the same rows and keys, and so do two Python threads calling at once (one finds the team busy and
    runs alone)."""
    import threading

    g = gen(23)
    heads, kv, d, inter, hidden, n, start = 4, 2, 32, 200, 160, 5, 7
    weights = [torch.randn(o, i, generator=g) / 8 for o, i in
               (((heads + 2 * kv) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter))]
    layer_weights = [native_kernels.NativeLinear(w.to(dtype)) for w in weights]
    ln1, ln2 = 1 + torch.randn(hidden, generator=g) / 10, 1 + torch.randn(hidden, generator=g) / 10
    angles = torch.randn(n, d // 2, generator=g)
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
    x0, kv0 = torch.randn(n, hidden, generator=g), torch.randn(2, kv, start + n, d, generator=g)
    shape = (heads, kv, d, inter)
    layer = (ln1, layer_weights[0], layer_weights[1], ln2, layer_weights[2], layer_weights[3])

    def run(threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, cache = x0.clone(), kv0.clone()
        rows = native_kernels.causal_rows(start, n, start + n)
        work = torch.empty(rows.work(hidden, shape, threads))
        native_kernels.decoder_layer(x, layer, shape, 1e-6, cos_sin, cache[0][None], cache[1][None], rows, work, threads)
        return x, cache

    want = run(1)
    for threads in (2, 3, 5, 2):
        got = run(threads)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), threads
    results: list = [None] * 4

    def caller(i: int) -> None:
        for _ in range(20):
            results[i] = run(2)

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert all(torch.equal(r[0], want[0]) and torch.equal(r[1], want[1]) for r in results)


def test_the_draft_model_runs_the_one_call_path_where_the_c_kernels_run_its_weights(monkeypatch):
    """A draft's lean forward takes the exact numerics' one-C-call layers where specdec's kernels run
    its dtype (less per-op overhead), and fast numerics where they do not."""
    from specdec.draft import model_drafter

    decoder, _ = model_drafter._runner(tiny_llama(2, seed=5), True, torch.float32, 4)
    assert decoder.exact and decoder.native_stack is not None
    monkeypatch.setattr(model_drafter, "native_usable", lambda dtype: False)
    decoder, _ = model_drafter._runner(tiny_llama(2, seed=5), True, torch.float32, 4)
    assert not decoder.exact and decoder.native_stack is None
