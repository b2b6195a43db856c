"""core/triton_exact.py's CUDA kernels for exact numerics, run by Triton's interpreter on the CPU:
their results against PyTorch's, and a row's bits alone and in any batch (the paged runner on them:
tests/test_paged_runner.py's exact test, parametrized; a GPU shows their speed: benchmarks/gpu_check.py)."""
from __future__ import annotations

import math
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (tests/conftest.py sets it first)
pytest.importorskip("triton")

from specdec.core import triton_exact  # noqa: E402
from specdec.core.models import load_causal_lm  # noqa: E402
from specdec.core.paged_runner import PagedRunner  # noqa: E402
from test_paged_runner import family, ids, steps  # noqa: E402,F401  (family: the fixture)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="Triton 3.9's interpreter returns garbage from a bfloat16 tl.dot (errors of 1e11 on this very kernel, "
           "float32 right); benchmarks/gpu_check.py checks bfloat16 on a GPU"))])
def test_linear_matches_pytorch_and_a_row_keeps_its_bits_in_any_batch(dtype):
    g = gen(1)
    weight = torch.randn(100, 80, generator=g).to(dtype)  # neither dimension a multiple of the tiles
    x = torch.randn(40, 80, generator=g).to(dtype)
    y = triton_exact.linear(x, weight)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), (x.float() @ weight.float().T), atol=tol * 10, rtol=tol)
    for lo, hi in ((0, 1), (3, 4), (5, 22), (16, 40)):
        assert torch.equal(triton_exact.linear(x[lo:hi], weight), y[lo:hi]), (lo, hi)


def test_linear_on_order_free_inputs_is_exact_in_any_batch():
    """Small integers over 2^4: every partial sum is exact in float32, so no summation order (the
    kernel's, numpy's in the interpreter, a GPU's) can change a bit; a wrong index, mask or tile can."""
    g = gen(3)
    weight = torch.randint(-8, 9, (100, 80), generator=g).float() / 16
    x = torch.randint(-8, 9, (40, 80), generator=g).float() / 16
    want = (x.double() @ weight.double().T).float()  # exact: the float64 sums hold every bit
    for lo, hi in ((0, 40), (0, 1), (3, 4), (5, 22), (16, 40)):
        assert torch.equal(triton_exact.linear(x[lo:hi], weight), want[lo:hi]), (lo, hi)


def reference_attention(q, keys, values, positions, scale):
    """One row [heads, d] over the keys [len, kv, d] at ``positions``, in float64."""
    heads, kv = q.shape[0], keys.shape[1]
    k = keys[positions].double().repeat_interleave(heads // kv, dim=1)  # [n, heads, d]
    v = values[positions].double().repeat_interleave(heads // kv, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, v).reshape(-1)


def test_attention_reads_pages_through_the_gather_and_keeps_a_row_alone_bitwise():
    g = gen(2)
    kv, heads, d, slots = 2, 4, 16, 300
    keys, values = torch.randn(slots, kv, d, generator=g), torch.randn(slots, kv, d, generator=g)
    gather = torch.stack([torch.randperm(slots, generator=g)[:150] for _ in range(3)])  # [S, longest]: scattered pages
    seqs = torch.tensor([0, 0, 1, 2, 2, 2])
    limits = torch.tensor([70, 71, 1, 130, 131, 150])
    allowed = (torch.arange(150)[None, :] < limits[:, None]).to(torch.uint8)
    allowed[5, 60:100] = 0  # a tree row: a run of keys it may not see, past a whole masked block
    q = torch.randn(6, heads, d, generator=g)
    scale = 1 / math.sqrt(d)
    out = triton_exact.attention(q, keys, values, gather, seqs, limits, allowed, scale)
    for r in range(6):
        seen = gather[seqs[r], allowed[r].nonzero().flatten()]
        torch.testing.assert_close(out[r].double(), reference_attention(q[r], keys, values, seen, scale), atol=1e-5, rtol=1e-5)
        alone = triton_exact.attention(q[r:r + 1], keys, values, gather, seqs[r:r + 1], limits[r:r + 1], allowed[r:r + 1], scale)
        assert torch.equal(alone[0], out[r]), r


def test_the_triton_forward_matches_the_fast_one(family):  # noqa: F811
    model = load_causal_lm(family["mistral"]).model  # GQA and a sliding window
    exact = PagedRunner(model, page_tokens=4, num_pages=200, numerics="exact", exact_kernels="triton")
    fast = PagedRunner(model, page_tokens=4, num_pages=200)
    prompts = [ids(30), ids(5), ids(21)]
    caches_e, caches_f = [exact.new_cache() for _ in prompts], [fast.new_cache() for _ in prompts]
    for feeds_e, feeds_f in zip(steps(exact, caches_e, prompts), steps(fast, caches_f, prompts)):
        for runner, feeds in ((exact, feeds_e), (fast, feeds_f)):
            for f in feeds:
                runner.truncate(f.cache, f.start)  # the third step goes on after a rejection
        for got, want in zip(exact.forward(feeds_e), fast.forward(feeds_f)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_asking_for_kernels_that_cannot_run_is_refused(family, monkeypatch):  # noqa: F811
    model = load_causal_lm(family["llama"]).model
    with pytest.raises(ValueError, match="exact_kernels must be one of"):
        PagedRunner(model, numerics="exact", exact_kernels="cublas")
    monkeypatch.setattr(triton_exact, "available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        PagedRunner(model, numerics="exact", exact_kernels="triton")
