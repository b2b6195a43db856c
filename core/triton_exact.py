"""Batch-invariant kernels for exact numerics on CUDA, in Triton: the paged runner's linears and attention.

Why: exact numerics on CUDA ran each linear as 16-row tiles one after another and attention one
sequence at a time, each a kernel launch, many times a fast forward's cost at many sessions
(docs/performance.md, GPU check). Here one launch covers the whole batch, and a row's bits still
depend on nothing else in it:

- `linear`: every program computes a fixed 16 x 64 tile of ``x @ W^T`` over K in fixed 64-wide steps
  (one ``tl.dot`` each, accumulated in float32, no split of K), whatever M is. A row's outputs are
  its own dot products in one fixed order; other rows only share the tile.
- `attention`: one program per (row, head) walks that row's own keys (read in place from the paged
  pool through the batch's gather table) in fixed 64-key blocks up to its own limit, with an online
  softmax in float32; the blocks a row visits depend on its limit and mask alone.

Float32 inputs multiply in IEEE float32 (no TF32). Under ``TRITON_INTERPRET=1`` (set before this
module is imported) the same kernels run on CPU tensors: the test suite checks them so
(tests/test_triton_exact.py); only a GPU shows their speed.
"""
from __future__ import annotations

import functools

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # the linear's tile: fixed, so a row's reduction never changes
KEY_BLOCK = 64  # keys an attention program takes at a time
NUM_WARPS = 4


@functools.cache
def available() -> bool:
    """Whether Triton imports here (it is not a dependency: CUDA images bring it with torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


tl = None  # triton.language, once `_kernels` ran: the interpreter patches it where a kernel's globals hold it


@functools.cache
def _kernels():
    global tl
    import triton
    import triton.language

    tl = triton.language

    @triton.jit
    def linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, gather_ptr, seq_ptr, limit_ptr, allowed_ptr, out_ptr,
                         stride_qr, stride_qh, stride_kp, stride_kh, stride_gs, stride_ar, stride_or, group, scale,
                         D: tl.constexpr, BN: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.load(seq_ptr + row)
        limit = tl.load(limit_ptr + row)
        kvh = head // group
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d).to(tl.float32)
        top = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), dtype=tl.float32)
        acc = tl.zeros((D,), dtype=tl.float32)
        for n0 in range(0, limit, BN):
            n = n0 + tl.arange(0, BN)
            inside = n < limit
            see = inside & (tl.load(allowed_ptr + row * stride_ar + n, mask=inside, other=0) != 0)
            slot = tl.load(gather_ptr + seq * stride_gs + n, mask=inside, other=0)
            keys = tl.load(k_ptr + slot[:, None] * stride_kp + kvh * stride_kh + d[None, :], mask=see[:, None], other=0.0)
            s = tl.where(see, tl.sum(keys.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=0))
            base = tl.where(new_top == float("-inf"), 0.0, new_top)  # nothing seen yet: no inf - inf
            p = tl.where(see, tl.exp(s - base), 0.0)
            shrink = tl.exp(top - base)
            values = tl.load(v_ptr + slot[:, None] * stride_kp + kvh * stride_kh + d[None, :], mask=see[:, None], other=0.0)
            total = total * shrink + tl.sum(p, axis=0)
            acc = acc * shrink + tl.sum(p[:, None] * values.to(tl.float32), axis=0)
            top = new_top
        tl.store(out_ptr + row * stride_or + head * D + d, (acc / total).to(out_ptr.dtype.element_ty))

    return triton, linear_kernel, attention_kernel


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for rows ``x`` [M, K] and ``weight`` [N, K] (same dtype, last dimension contiguous):
    [M, N] in that dtype, each row's bits independent of M and of the other rows."""
    triton, kernel, _ = _kernels()
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"linear takes rows and a weight of one dtype with contiguous last dimensions; got "
                         f"{x.dtype} {x.stride()} and {weight.dtype} {weight.stride()}")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), BLOCK_M, BLOCK_N, BLOCK_K,
                     x.dtype == torch.float32, num_warps=NUM_WARPS)
    return y


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gather: torch.Tensor, seq_of_row: torch.Tensor,
              limits: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ``q`` [n, heads, d] over the paged pool's ``keys``/``values`` [slots, kv, d]: row r reads its
    sequence ``seq_of_row[r]``'s positions through ``gather`` [S, longest] (pool slots), below
    ``limits[r]`` and where ``allowed`` [n, longest] (uint8) is non-zero: [n, heads * d] in q's dtype."""
    triton, _, kernel = _kernels()
    n, heads, d = q.shape
    kv = keys.shape[1]
    if d & (d - 1) or keys.stride() != values.stride() or keys.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"attention takes a power-of-two head size and keys and values of one layout; got d = {d}, "
                         f"strides {keys.stride()} and {values.stride()}")
    out = torch.empty(n, heads * d, dtype=q.dtype, device=q.device)
    if n:
        kernel[(n, heads)](q, keys, values, gather, seq_of_row, limits, allowed, out, q.stride(0), q.stride(1),
                           keys.stride(0), keys.stride(1), gather.stride(0), allowed.stride(0), out.stride(0),
                           heads // kv, scale, d, KEY_BLOCK, num_warps=NUM_WARPS)
    return out
