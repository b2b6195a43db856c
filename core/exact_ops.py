"""Exact numerics, checked at load: a row's logits never depend on what else shares the forward.

In fast mode a row's logits move in the last bits with the rows beside it: a position verified alone
and as row j of a k+1 block, or beside other sessions, runs through GEMM kernels chosen by the call's
shape (MKL and oneDNN pick blocking, even the instruction path, by M, N, batch size and thread count)
and through SDPA, whose CPU kernel picks its splits and packing by sequence length, batch and threads.
In bf16 that flips greedy tokens: speculation would change greedy output. Exact mode fixes what a
row's arithmetic depends on, and this module checks on the running CPU that it holds:

- Linears: one kernel (specdec's C kernel, or a oneDNN-packed weight), which gives a row the same
  bits for every row count on the CPUs measured (MKL's ``F.linear`` does not). `verify` checks it;
  where it fails, rows are padded to ``LINEAR_TILE`` per call, or run tile by tile (`wrap_linear`).
- Attention: core/exact_attention.py; `verify` finds the fewest query rows per tile that keep a
  row's bits (`ExactPlan.min_tile`).
- RMSNorm, rotary, SwiGLU and the residual adds are per-row already (checked here too).

Nothing is timed: no kernel or thread count is chosen by measurement, so machine load cannot change a
logit. What holds is verified for the model's shapes and the thread counts in use, with data whose
sums cancel, so that a different summation order shows even through bf16 rounding.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.core.exact_attention import KEY_BLOCK, MAX_TILE, AttentionShape, ExactGroup, round_up

TILE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # the fewest rows per attention GEMM, tried in this order at load
LINEAR_TILE = 16  # rows per tile when a linear needs fixed-size row tiles (an AMX tile is 16 rows)
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 129, 160)  # row counts a linear is checked at
LINEAR_MODES = ("flat", "padded", "tiled")  # one call of any rows | rows padded to LINEAR_TILE | one call per tile

Linear = Callable[[torch.Tensor], torch.Tensor]


class CheckedModel(AttentionShape, Protocol):
    """What `verify` reads of a model (core/llama_decode.py `LlamaDecoder`, core/paged_runner.py
    `PagedRunner`): its shape and the per-row ops its forward runs."""

    hidden: int
    intermediate: int
    eps: float
    context_length: int
    rotary: torch.Tensor  # [context, 1, d/2] complex64

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotate(self, qk: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor: ...


class ExactNumericsUnavailable(ValueError):
    """This CPU's kernels give a row different bits with different batch shapes even in exact mode."""


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


def _probe_attention(dec: AttentionShape, threads: Sequence[int], gen: torch.Generator, min_tile: int) -> str | None:
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
def verify(dec: CheckedModel, shapes: Sequence[tuple[int, int]], make_linear: Callable[[torch.Tensor], Linear],
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
        checks = {  # the model's own ops (the lean decoder's may be native)
            "RMSNorm": lambda lo, hi: dec.norm(x[lo:hi], w),
            "SwiGLU": lambda lo, hi: dec.swiglu(inter[lo:hi]),
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
