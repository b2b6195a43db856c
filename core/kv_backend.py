"""Where a model's keys and values live, and how a forward's rows attend over them: the `KVBackend` seam.

One Llama model (core/llama_model.py `forward`) runs any batch of feeds over a backend: it asks
the backend to lay the batch out (`plan`: room reserved, rows flattened, who attends what), then,
per layer, to store the rows' new keys and values and attend (`attend`), and at the end to record
what the feeds wrote (`finish`). Two backends:

- core/slab_backend.py: the CPU's slabs of sequence slots (and private buffers), attended per slab;
- core/paged_backend.py: a page pool on any device with a page table per sequence, where truncation
  is bookkeeping; core/cuda_graphs.py replays its forward from static buffers.

Fast, exact, native C and Triton attention are strategies of a backend, fixed when it is built.
The `ModelRunner` (core/runner.py) stays the outside interface: a runner is a model over a backend.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec.core.runner import Feed


class KVPlan(Protocol):
    """One forward's layout, as the model reads it (a backend adds what its attention needs)."""

    token_ids: torch.Tensor  # [N] every feed's tokens, one feed after another
    positions: torch.Tensor  # [N] each row's rotary position (a tree node's: its depth's)
    offsets: Sequence[int]  # feed b's rows are offsets[b]:offsets[b + 1]
    last: torch.Tensor  # the rows whose logits are returned, feed by feed
    num_last: Sequence[int]


class KVBackend(Protocol):
    def new_cache(self) -> object:
        """An empty cache for one sequence."""

    def truncate(self, cache: object, length: int) -> None:
        """Forget everything past the first ``length`` positions (exact rollback)."""

    def free(self, cache: object) -> None:
        """The sequence is over: its memory may be reused."""

    def read_kv(self, cache: object, lo: int, hi: int) -> torch.Tensor:
        """Positions [lo, hi): ``[layers, 2 (k, v), kv_heads, hi - lo, head_dim]``."""

    def write_prefix(self, cache: object, kv: torch.Tensor) -> None:
        """Adopt ``kv`` (as `read_kv` returns it) as positions [0, n) of ``cache``."""

    def keep_path(self, cache: object, first: int, path: Sequence[int]) -> None:
        """Move an accepted tree path's keys and values to where a chain's would be."""

    def plan(self, feeds: Sequence[Feed]) -> KVPlan:
        """Room for every feed (all or none), and the batch's layout."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: KVPlan) -> torch.Tensor:
        """Store layer ``layer``'s new keys and values ``k``/``v`` [N, kv, d] at each row's place and
        attend every row's query ``q`` [N, h, d] over the keys it may see: [N, h * d]."""

    def run_layers(self, model, x: torch.Tensor, rotary: torch.Tensor, plan: KVPlan) -> torch.Tensor:
        """The model's layers over the plan's rows (`llama_model.run_layers` with `attend`, or a
        strategy's own, such as one C call per layer)."""

    def finish(self, plan: KVPlan) -> None:
        """The forward ran: record how far each feed's cache now holds."""
