"""Tensor parallelism for the Llama math, the parts that are plain arithmetic: how a layer's weights
split over N ranks (Megatron-LM, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053), how the
partial outputs are summed, and the per-step plan rank 0 sends the other ranks.

Sharding, for rank r of N (heads, KV heads, MLP units and vocabulary in N equal contiguous parts):
- column-parallel: q, k and v by heads (rank r holds q heads [r h/N, (r+1) h/N) and KV heads
  [r kv/N, (r+1) kv/N): with N dividing kv, every q head of a rank reads a KV head of the same
  rank), gate and up by units; each rank computes its heads' attention and its units' SwiGLU;
- row-parallel: o_proj and down_proj by the matching input columns; each rank's product is a
  partial sum of the full output, so one all-reduce after each (two per layer);
- the LM head by vocabulary rows (padded to N equal parts), gathered: logits are concatenated, not summed;
- embedding and norms whole on every rank (the residual stream is the same on every rank).

Reductions: "fast" is the backend's all-reduce; "exact" gathers every rank's partial and sums them
in rank order, so an element's bits depend only on the N partials of its own row: for a fixed N a
row's logits are bitwise the same whatever shares the batch (the kernels of each shard hold that
already, core/exact_ops.py).

The plan codec: rank 0 owns the scheduler; each step it sends one `StepPlan` (caches made, freed,
tree paths kept, then the feeds of the forward) as int64 tensors (`encode_plan` / `decode_plan`);
nothing is pickled.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from specdec.core.errors import SpecdecError


class TensorParallelError(SpecdecError):
    """A tensor-parallel verifier cannot start as configured, or one of its ranks failed."""


# ----------------------------------------------------------------------------- sharding math
@dataclass(frozen=True)
class Dims:
    """The shapes a Llama shards by."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def check_degree(n: int, dims: Dims) -> None:
    """TensorParallelError unless ``n`` ranks can split these heads, KV heads and MLP units evenly."""
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel must be at least 1; got {n}")
    uneven = [f"{what} ({count})" for what, count in (("attention heads", dims.heads), ("KV heads", dims.kv_heads),
                                                      ("MLP units", dims.intermediate)) if count % n]
    if uneven:
        raise TensorParallelError(f"--tensor-parallel {n} does not divide this model's {', '.join(uneven)}: "
                                  f"each rank must hold whole heads; use a degree that divides {dims.heads} heads "
                                  f"and {dims.kv_heads} KV heads")


def part(total: int, rank: int, n: int) -> slice:
    """Rank ``rank``'s contiguous 1/n of ``total`` (n divides total)."""
    size = total // n
    return slice(rank * size, (rank + 1) * size)


def vocab_part(vocab: int, n: int) -> int:
    """Rows of the LM head each rank holds: the vocabulary in n equal parts, the last padded with zero rows."""
    return -(-vocab // n)


def column_shard(weight: torch.Tensor, rank: int, n: int, unit: int = 1) -> torch.Tensor:
    """Rows of ``weight`` [out, in] for rank ``rank``: the ``rank``-th of n groups of whole ``unit``s
    (a head's ``head_dim`` rows): [out / n, in], a copy (the full weight may then be freed)."""
    rows = part(weight.shape[0] // unit, rank, n)
    return weight[rows.start * unit: rows.stop * unit].clone()


def row_shard(weight: torch.Tensor, rank: int, n: int, unit: int = 1) -> torch.Tensor:
    """Input columns of ``weight`` [out, in] for rank ``rank``, matching a column shard: [out, in / n], a copy."""
    cols = part(weight.shape[1] // unit, rank, n)
    return weight[:, cols.start * unit: cols.stop * unit].contiguous().clone()


def vocab_shard(weight: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """LM head rows of rank ``rank`` [vocab_part, hidden]; the last rank's padded with zero rows."""
    size = vocab_part(weight.shape[0], n)
    rows = weight[rank * size: (rank + 1) * size]
    if rows.shape[0] < size:
        rows = torch.cat([rows, rows.new_zeros(size - rows.shape[0], weight.shape[1])])
    return rows.clone()


def shard_llama(params: Mapping[str, torch.Tensor], dims: Dims, rank: int, n: int) -> dict[str, torch.Tensor]:
    """A Llama's parameters (HF names) as rank ``rank`` of ``n`` holds them: attention by heads, the MLP
    by units, the LM head by vocabulary rows; embedding and norms as they are (shared, not copied)."""
    d = dims.head_dim
    out = {}
    for name, w in params.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if leaf in ("q_proj", "k_proj", "v_proj"):
            out[name] = column_shard(w, rank, n, d)
        elif leaf in ("gate_proj", "up_proj"):
            out[name] = column_shard(w, rank, n)
        elif leaf == "o_proj":
            out[name] = row_shard(w, rank, n, d)
        elif leaf == "down_proj":
            out[name] = row_shard(w, rank, n)
        elif name == "lm_head.weight":
            out[name] = vocab_shard(w, rank, n)
        else:  # embedding, norms
            out[name] = w
    return out


# ----------------------------------------------------------------------------- reductions
Gather = Callable[[torch.Tensor], list[torch.Tensor]]  # every rank's tensor of this shape, in rank order


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...``, left to right: the exact mode's reduction (a fixed order per element)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def gather_vocab(parts: Sequence[torch.Tensor], vocab: int) -> torch.Tensor:
    """Every rank's logits [rows, vocab_part] side by side, the padding cut: [rows, vocab]."""
    return torch.cat(list(parts), dim=-1)[..., :vocab]


# ----------------------------------------------------------------------------- the plan codec
MAGIC, VERSION = 0x5350_5450, 1  # "SPTP"
OP_FORWARD, OP_PING, OP_STOP = 1, 2, 3
HEADER = 4  # int64s: magic, version, op, payload length


@dataclass(frozen=True)
class FeedPlan:
    """One sequence's part of a forward, as every rank applies it (core/runner.py `Feed`, its cache by id)."""

    cache: int
    start: int
    token_ids: tuple[int, ...]
    num_last: int
    parents: tuple[int, ...] = ()
    num_features: int = 0


@dataclass(frozen=True)
class StepPlan:
    """What every rank does next, in this order: make caches ``new``, move the tree ``keep`` paths
    (cache, first, path) into place, free caches ``free``, then run the forward of ``feeds``."""

    new: tuple[int, ...] = ()
    keep: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    free: tuple[int, ...] = ()
    feeds: tuple[FeedPlan, ...] = ()


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """``plan`` as a flat int64 tensor: counts, then each record's fields (lists prefixed by their length)."""
    out: list[int] = [len(plan.new), *plan.new, len(plan.keep)]
    for cache, first, path in plan.keep:
        out += [cache, first, len(path), *path]
    out += [len(plan.free), *plan.free, len(plan.feeds)]
    for f in plan.feeds:
        out += [f.cache, f.start, f.num_last, f.num_features, len(f.token_ids), *f.token_ids, len(f.parents), *f.parents]
    return torch.tensor(out, dtype=torch.int64)


def decode_plan(payload: torch.Tensor) -> StepPlan:
    """The plan `encode_plan` wrote; ValueError for anything else (a count past the end, a negative
    count, bytes left over)."""
    values = payload.tolist()
    at = 0

    def take(count: int) -> list[int]:
        nonlocal at
        if count < 0 or at + count > len(values):
            raise ValueError(f"malformed tensor-parallel plan: {count} values wanted at {at} of {len(values)}")
        at += count
        return values[at - count: at]

    def items() -> list[int]:
        return take(take(1)[0])

    new = tuple(items())
    keep = []
    for _ in range(take(1)[0]):
        cache, first = take(2)
        keep.append((cache, first, tuple(items())))
    free = tuple(items())
    feeds = []
    for _ in range(take(1)[0]):
        cache, start, num_last, num_features = take(4)
        tokens = tuple(items())
        feeds.append(FeedPlan(cache, start, tokens, num_last, tuple(items()), num_features))
    if at != len(values):
        raise ValueError(f"malformed tensor-parallel plan: {len(values) - at} values left over")
    return StepPlan(new, tuple(keep), free, tuple(feeds))


def header(op: int, payload_len: int) -> torch.Tensor:
    return torch.tensor([MAGIC, VERSION, op, payload_len], dtype=torch.int64)


def read_header(t: torch.Tensor) -> tuple[int, int]:
    """(op, payload length) of a header; ValueError where it is not one of this version's."""
    magic, version, op, length = t.tolist()
    if magic != MAGIC or version != VERSION or op not in (OP_FORWARD, OP_PING, OP_STOP) or length < 0:
        raise ValueError(f"not a tensor-parallel plan header of version {VERSION}: {t.tolist()}")
    return op, length
