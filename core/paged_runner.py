"""The paged model runner: Llama-family models on any device, every sequence's KV in one page pool.

A forward takes the scheduler's flat ragged batch (`Feed`s: k + 1 rows per verifying session, k = 0
included, prefills of hundreds of rows) and runs it as one batch of N rows (vLLM's flattened layout):
embeddings, fused QKV and gate/up linears over all N rows at once, rotary at each row's position,
the new keys and values written into each sequence's pages (core/paged_kv.py), attention of each
sequence's rows over its own pages, and logits only for the rows asked for.

Attention, fast numerics: each layer gathers every sequence's keys and values from its pages into a
padded ``[sessions, kv_heads, longest, head_dim]`` batch and calls SDPA once with a mask
``[sessions, 1, most rows, longest]`` (causal, sliding window, padding). Measured against one SDPA
per sequence and FlexAttention in docs/performance.md ("GPU runner"). The mask is built per row as
the positions it may attend to (core/paged_kv.py `allowed_positions`), not as a causal flag, so a
row may see any set of positions.

Token trees (core/tree.py; `Feed.parents`): the last ``len(parents)`` rows of a feed are a tree's
nodes. A node's rotary angle is its position (its parent's + 1, `feed_positions`), its keys and
values go to buffer position start + row like any row's, and its rows of the mask are the tree's
(`feed_mask`: the rows before the tree and its own ancestors; core/paged_kv.py `tree_allowed`), in
both attention modes and in exact numerics. Sliding windows count positions, not buffer indices:
a node sees the keys within the window of its own position (the prefix and its ancestors lie at
consecutive positions along its path, as in the chain of that path). `keep_path` then moves the
accepted path's keys and values to where a chain's would be. A batch with a tree runs eagerly,
never through a CUDA graph (the buckets' static masks are causal).

Sliding-window models (Mistral, Qwen2's sliding layers) keep their whole cache and mask keys
older than the window, so rollback stays exact (a rolling buffer would have dropped them).

Exact numerics (``numerics="exact"``): a row's logits do not depend on what shares the forward.
Linears run in fixed-size row tiles and attention per sequence in float32, queries in fixed tiles
and keys padded to whole blocks (core/exact_ops.py's design: no kernel is chosen by the batch's
shape). On the CPU the load checks that this holds with core/exact_ops.verify; on CUDA the same
fixed shapes make it deterministic per row (no split depends on the batch), and its cost is
measured by benchmarks/gpu_check.py.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases): RMSNorm, SiLU
gated MLP, GQA, head_dim from the config, tied or untied embeddings, rotary scalings whose
frequencies do not depend on the sequence's length.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.core import exact_ops, llama_model, native_kernels, triton_exact
from specdec.core.cuda_graphs import CudaGraphs, buckets_for
from specdec.core.llama_model import final_features
from specdec.core.models import WeightRelease, restore_weights, weights_released
from specdec.core.paged_kv import (FIRST_PAGE, ZERO_PAGE, PagedKV, PageTable, allowed_positions, pages_for_budget,
                                   pages_for_memory, tree_allowed)
from specdec.core.runner import Feed
from specdec.core.tree import feed_positions

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load (dynamic NTK and longrope are not)
NUMERICS = ("fast", "exact")
EXACT_KERNELS = ("auto", "native", "triton", "tiles")
DEFAULT_MEMORY_FRACTION = 0.9  # without kv_memory_fraction: the budget's pages, at most this much of the memory
CUDA_EXACT_PLAN = exact_ops.ExactPlan("tiled", 16)  # exact_kernels="tiles" off the CPU: checked on an H200 by benchmarks/gpu_check.py

Linear = Callable[[torch.Tensor], torch.Tensor]


def supports(model: torch.nn.Module) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return (type(model).__name__ in ARCHITECTURES and cfg.hidden_act == "silu"
            and rope.get("rope_type", rope.get("type", "default")) in STATIC_ROPE)


def layer_windows(cfg, layers: int) -> list[int | None]:
    """Each layer's sliding window (keys older than ``window`` positions are masked), None: full attention."""
    window = getattr(cfg, "sliding_window", None)
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if window is None or getattr(cfg, "use_sliding_window", True) is False or (context and window >= context):
        return [None] * layers
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * layers


class Batch:
    """A forward's flat layout, built on the host; `to` moves it to the device in a few tensors.

    Rows are the feeds' tokens one after another (N in all). ``write``: each row's flat KV slot
    (page * page_tokens + offset); ``gather`` [S, longest]: each sequence's slots for positions
    [0, longest), the zero page's first slot past its end; ``grid``: each row's place in the
    padded [S, n_max] query grid; ``last``: the rows whose logits are returned; ``positions``: each
    row's position (a tree node's is its depth's, `feed_positions`; a row's buffer position, where
    its keys and values go, is always its feed's start + row); ``parents``: each feed's tree (empty:
    a chain)."""

    def __init__(self, alloc, feeds: Sequence[Feed]) -> None:
        pt = alloc.page_tokens
        self.lengths = [len(f.token_ids) for f in feeds]
        self.starts = [f.start for f in feeds]
        self.ends = [s + n for s, n in zip(self.starts, self.lengths)]
        self.num_last = [f.num_last for f in feeds]
        self.parents = [tuple(f.parents) for f in feeds]
        self.has_trees = any(self.parents)
        self.n = sum(self.lengths)
        self.n_max = max(self.lengths)
        self.longest = max(self.ends)
        offsets = [0]
        for n in self.lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        tables = [f.cache for f in feeds]
        self.token_ids = torch.tensor([t for f in feeds for t in f.token_ids])  # [N]
        self.positions = torch.tensor([r for s, n, p in zip(self.starts, self.lengths, self.parents)
                                       for r in feed_positions(s, n, p)])  # [N]
        self.write = torch.tensor([slot for t, s, e in zip(tables, self.starts, self.ends) for slot in alloc.slots(t, s, e)])
        self.last = torch.tensor([r for b, m in enumerate(self.num_last) for r in range(offsets[b + 1] - m, offsets[b + 1])])
        table = torch.full((len(feeds), alloc.pages_for(self.longest)), ZERO_PAGE, dtype=torch.long)
        for b, t in enumerate(tables):
            used = alloc.pages_for(self.ends[b])
            table[b, :used] = torch.tensor(t.pages[:used], dtype=torch.long)
        gather = (table[:, :, None] * pt + torch.arange(pt)).flatten(1)[:, : self.longest]  # [S, longest]
        self.gather = torch.where(torch.arange(self.longest) < torch.tensor(self.ends)[:, None], gather, ZERO_PAGE * pt)
        self.grid = torch.cat([torch.arange(n) + b * self.n_max for b, n in enumerate(self.lengths)])  # [N]
        self.device = torch.device("cpu")
        self._masks: dict[int | None, torch.Tensor] = {}

    def to(self, device: torch.device) -> Batch:
        for name in ("token_ids", "positions", "write", "last", "gather", "grid"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def mask(self, window: int | None) -> torch.Tensor:
        """[S, 1, n_max, longest] bool for the layers of this window (built once per forward and window):
        causal rows, and a tree feed's rows its tree's (`tree_allowed`)."""
        if window not in self._masks:
            allowed = allowed_positions(torch.tensor(self.starts), torch.tensor(self.lengths), self.longest, window, self.n_max)
            for b, parents in enumerate(self.parents):
                if parents:  # (past its end a tree row sees nothing either way: causal rows stop there too)
                    allowed[b, :self.lengths[b], :self.ends[b]] = self.tree_allowed(b, window)
            self._masks[window] = allowed[:, None].to(self.device)
        return self._masks[window]

    def tree_allowed(self, b: int, window: int | None) -> torch.Tensor:
        """[rows, end] bool on the host: the buffer positions tree feed b's rows see (core/paged_kv.py)."""
        return tree_allowed(self.starts[b], self.lengths[b], self.parents[b], window)


class PagedRunner:
    """`ModelRunner` over a paged KV cache, for the model's own device and dtype.

    ``page_tokens``: positions per page. The pool's size: ``num_pages`` if given; else, with
    ``kv_memory_fraction`` on a CUDA device, that fraction of the device's free memory now (load
    the weights first); else enough pages for ``kv_budget_tokens`` over ``max_sessions`` sequences
    (`pages_for_budget`). ``numerics``: "fast" or "exact" (see the module's docstring).
    ``own_weights``: the HF modules' weights are released as soon as their fused copies exist
    (core/models.py `WeightRelease`), so a model is held once. ``attention``: "batched" (one SDPA
    per layer over padded gathers, the default) or "loop" (one SDPA per sequence). ``cuda_graphs``:
    capture the fast forward at start-up for buckets of up to ``max_batch_sessions`` sessions
    (core/cuda_graphs.py); None: on CUDA in fast numerics. ``probe_threads``: CPU thread counts
    exact numerics are checked at (as `LlamaDecoder`). ``exact_kernels``: what exact numerics run on:
    "native" (the CPU's C kernels), "triton" (core/triton_exact.py: one launch per linear and per
    layer's attention), "tiles" (PyTorch GEMMs in fixed tiles, one sequence at a time); "auto":
    native on a CPU where it builds, triton on CUDA where it imports, else tiles."""
    verifies_trees = True  # feeds with parents: each node at its depth's position, masked to its ancestors
    last_features = None

    def __init__(self, model: torch.nn.Module, page_tokens: int = 16, num_pages: int | None = None,
                 kv_budget_tokens: int | None = None, max_sessions: int = 1, kv_memory_fraction: float | None = None,
                 numerics: str = "fast", own_weights: bool = False, attention: str = "batched",
                 cuda_graphs: bool | None = None, max_batch_sessions: int = 64,
                 probe_threads: tuple[int, ...] | None = None, exact_kernels: str = "auto") -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a Llama-family model the paged runner serves "
                             f"({', '.join(ARCHITECTURES)} with SiLU and static rotary); use the HF runner")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {numerics!r}")
        if attention not in ("batched", "loop"):
            raise ValueError(f"attention must be batched or loop; got {attention!r}")
        if exact_kernels not in EXACT_KERNELS:
            raise ValueError(f"exact_kernels must be one of {', '.join(EXACT_KERNELS)}; got {exact_kernels!r}")
        if weights_released(model):
            restore_weights(model)  # an earlier runner or decoder took them over: read them from the folder again
        cfg = model.config
        base = model.model
        self.embed = base.embed_tokens.weight.detach()  # [vocab, hidden], shared with the model
        self.device, self.dtype = self.embed.device, self.embed.dtype  # the model's: every weight is moved there
        self.numerics, self.exact, self.attention = numerics, numerics == "exact", attention
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.context_length = cfg.max_position_embeddings
        self.page_tokens = page_tokens
        self.windows = layer_windows(cfg, cfg.num_hidden_layers)
        release = WeightRelease(model, (self.embed,)) if own_weights else (lambda *modules: None)
        with torch.no_grad():
            self.rotary = llama_model.rotary_table(model, self.head_dim, self.context_length, self.device)  # [context, 1, d/2]
            self.final_norm = self._weight(base.norm.weight)
            self.exact_kernels = self._exact_kernels(exact_kernels) if self.exact else None
            self.layers = [self._layer(layer, release) for layer in base.layers]
            self.lm_head = self._linear(self._weight(model.lm_head.weight), None)  # (norms, o, down and the head as they are)
        self.layer_count = len(self.layers)
        # exact attention in C (each row over the keys it sees, in order); the load check below probes it
        self.native_attention = self.exact_kernels == "native"
        self.exact_plan = self._exact_plan(probe_threads) if self.exact else None
        # Query rows per attention tile for a sequence of n rows: the plan's (checked) on the CPU, one
        # fixed size on CUDA, where nothing checked that other tile sizes keep a row's bits.
        self.exact_tile: Callable[[int], int] | None = None
        if self.exact:
            self.exact_tile = self.exact_plan.tile if self.device.type == "cpu" else (lambda n: CUDA_EXACT_PLAN.min_tile)
        self.kv = PagedKV(self.layer_count, self.n_kv, self.head_dim,
                          self._pool_pages(num_pages, kv_budget_tokens, max_sessions, kv_memory_fraction),
                          page_tokens, self.dtype, self.device)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not self.exact and attention == "batched"
        if cuda_graphs and (self.exact or attention != "batched"):
            raise ValueError("CUDA graphs replay the fast forward with batched attention; exact numerics run eagerly")
        # (last: the pool exists, and capture sees the memory left once it is allocated)
        self.graphs = CudaGraphs(self, buckets_for(max_batch_sessions, self.context_length)) if cuda_graphs else None

    # ------------------------------------------------------------------------------------------ load

    def _weight(self, param: torch.Tensor) -> torch.Tensor:
        """A weight on this runner's device and dtype (itself where it is already: no copy)."""
        return param.detach().to(self.device, self.dtype)

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> _Linear:
        """``weight`` [out, in] and its bias, run by this runner's kernel (chosen once, here)."""
        if not self.exact:
            return _Linear(weight, bias, F.linear)
        if self.exact_kernels == "triton":
            return _Linear(weight, bias, _bias_after(triton_exact.linear))
        return _Linear(weight, bias, _bias_after(self._tiled))

    def _tiled(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exact_ops.wrap_linear(lambda rows: F.linear(rows, weight), self.exact_plan.linear_mode)(x)

    def _layer(self, layer: torch.nn.Module, release: Callable[..., None]) -> llama_model.Layer:
        a, m = layer.self_attn, layer.mlp
        w = self._weight

        def bias(linear: torch.nn.Module) -> torch.Tensor | None:
            return None if linear.bias is None else w(linear.bias)

        qkv = self._linear(*llama_model.fused_qkv(a, self.n_heads, self.n_kv, self.head_dim, w))  # [(h + 2kv) * d, hidden]
        release(a.q_proj, a.k_proj, a.v_proj)
        o = self._linear(w(a.o_proj.weight), bias(a.o_proj))
        gate_up = self._linear(*llama_model.fused_gate_up(m, w))  # [2 * inter, hidden]
        release(m.gate_proj, m.up_proj)
        down = self._linear(w(m.down_proj.weight), bias(m.down_proj))
        return w(layer.input_layernorm.weight), qkv, o, w(layer.post_attention_layernorm.weight), gate_up, down

    def _exact_kernels(self, asked: str) -> str:
        native = self.device.type == "cpu" and self.dtype in native_kernels.KV_DTYPES and native_kernels.available()
        if asked == "auto":
            return "native" if native else "triton" if self.device.type == "cuda" and triton_exact.available() else "tiles"
        if asked == "native" and not native:
            raise ValueError("exact_kernels='native' needs the CPU, float32 or bfloat16, and kernels that build here")
        if asked == "triton" and not triton_exact.available():
            raise ValueError("exact_kernels='triton' needs Triton installed")
        return asked

    def _exact_plan(self, probe_threads: tuple[int, ...] | None) -> exact_ops.ExactPlan:
        """What keeps a row's bits on this device: checked on the CPU (core/exact_ops.verify), the
        fixed plan elsewhere and for the Triton kernels (whose tiles never change with the batch)."""
        if self.device.type != "cpu" or self.exact_kernels == "triton":
            log.info("exact numerics on %s: %s (not checked at load; benchmarks/gpu_check.py checks and times it)", self.device,
                     "Triton kernels of fixed tiles" if self.exact_kernels == "triton" else
                     f"linears in {CUDA_EXACT_PLAN.min_tile}-row tiles, attention per sequence in fixed tiles")
            return CUDA_EXACT_PLAN
        shapes = tuple(dict.fromkeys([tuple(self.lm_head.weight.shape)] + [
            tuple(f.weight.shape) for layer in self.layers for f in (layer[1], layer[2], layer[4], layer[5])]))
        threads = probe_threads or tuple(sorted({1, 2, torch.get_num_threads()}))
        key = ("paged", self.dtype, shapes, self.n_heads, self.n_kv, self.head_dim, self.hidden, self.intermediate, threads)
        return exact_ops.verified_plan(key, lambda: exact_ops.verify(self, shapes, _plain_linear, threads))

    def _pool_pages(self, num_pages: int | None, budget: int | None, sessions: int, fraction: float | None) -> int:
        if num_pages is not None:
            return num_pages
        page_bytes = 2 * self.layer_count * self.page_tokens * self.n_kv * self.head_dim * self.dtype.itemsize
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if fraction is not None and free is not None:
            return pages_for_memory(free, fraction, page_bytes)
        pages = pages_for_budget(budget or sessions * self.context_length, self.page_tokens, sessions)
        # A budget past the memory there is: what fits (the engine's budget then follows the pool). On
        # the CPU the pool's pages are committed as written, but an allocation past the machine's
        # memory is refused outright.
        free = free if free is not None else _host_memory_bytes()
        return max(FIRST_PAGE + 1, min(pages, pages_for_memory(free, DEFAULT_MEMORY_FRACTION, page_bytes)))

    # -------------------------------------------------------------------------------- ModelRunner

    def new_cache(self) -> PageTable:
        return self.kv.alloc.new_table()

    def truncate(self, cache: PageTable, length: int) -> None:
        self.kv.alloc.truncate(cache, length)

    def free(self, cache: PageTable) -> None:
        self.kv.alloc.free(cache)

    @property
    def pages_total(self) -> int:
        return self.kv.alloc.pages_total

    @property
    def pages_free(self) -> int:
        return self.kv.alloc.pages_free

    def kv_bytes(self) -> int:
        """Device bytes of the pages sequences hold now."""
        return self.kv.alloc.pages_used * self.kv.page_bytes

    def kv_token_capacity(self, sessions: int) -> int:
        """Tokens the pool can promise ``sessions`` sequences: all its pages but two per sequence (one
        for rounding a reservation up to pages, one for drafts verified past a reservation's end)."""
        return max(0, self.pages_total - 2 * sessions) * self.page_tokens

    def read_kv(self, cache: PageTable, lo: int, hi: int) -> torch.Tensor:
        """Keys and values of positions [lo, hi): [layers, 2, kv_heads, hi - lo, head_dim], on this
        runner's device (the lean cache's ``buf[:, :, :, lo:hi]`` layout, which core/kv_blocks.py encodes)."""
        if hi > cache.length:
            raise ValueError(f"positions up to {hi} asked of a cache holding {cache.length}")
        slots = torch.tensor(self.kv.alloc.slots(cache, lo, hi), device=self.device)
        flat = self.kv.pages.flatten(2, 3)  # [layers, 2, pages * page_tokens, kv, d]
        return flat[:, :, slots].transpose(2, 3)

    def write_prefix(self, cache: PageTable, kv: torch.Tensor) -> None:
        """Adopt ``kv`` [layers, 2, kv_heads, n, head_dim] as positions [0, n) of ``cache``."""
        n = kv.shape[3]
        alloc = self.kv.alloc
        alloc.truncate(cache, 0)
        alloc.reserve([cache], [n])
        slots = torch.tensor(alloc.slots(cache, 0, n), device=self.device)
        flat = self.kv.pages.flatten(2, 3)
        flat[:, :, slots] = kv.to(self.device, self.dtype).transpose(2, 3)
        cache.length = n

    def keep_path(self, cache: PageTable, first: int, path: Sequence[int]) -> None:
        """After a tree feed whose nodes' keys and values lie at positions ``first + node``: move the
        accepted ``path``'s to ``first, first + 1, ...`` (every layer, keys and values), where a
        chain's would be; truncating to ``first + len(path)`` then keeps exactly the accepted tokens'.
        A path's nodes increase and node >= place, so each source lies at or after its target and no
        move reads a slot an earlier one wrote (the gather below reads them all first anyway)."""
        moves = [(first + place, first + node) for place, node in enumerate(path) if node != place]
        if not moves:
            return
        if max(source for _, source in moves) >= cache.length:
            raise ValueError(f"path {list(path)} after position {first} reaches past the cache's {cache.length} positions")
        alloc = self.kv.alloc
        targets = torch.tensor([alloc.slots(cache, t, t + 1)[0] for t, _ in moves], device=self.device)
        sources = torch.tensor([alloc.slots(cache, s, s + 1)[0] for _, s in moves], device=self.device)
        flat = self.kv.pages.flatten(2, 3)  # [layers, 2, pages * page_tokens, kv, d] (a view)
        flat[:, :, targets] = flat[:, :, sources]

    @torch.inference_mode()
    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """One forward over every feed's rows; logits [num_last, vocab] float32 per feed, in order."""
        alloc = self.kv.alloc
        for f in feeds:
            if f.start > f.cache.length:
                raise ValueError(f"a feed starts at {f.start} but its cache holds {f.cache.length} positions")
            if len(f.parents) > len(f.token_ids):
                raise ValueError(f"a feed of {len(f.token_ids)} rows cannot hold a tree of {len(f.parents)} nodes")
            if f.start + len(f.token_ids) > self.context_length:
                raise ValueError(f"{f.start + len(f.token_ids)} positions exceed the model's context length {self.context_length}")
        ends = [f.start + len(f.token_ids) for f in feeds]
        alloc.reserve([f.cache for f in feeds], ends)  # all or none: refused, no sequence has changed
        for f, end in zip(feeds, ends):
            alloc.truncate(f.cache, end)  # pages past the feed's end go back
            f.cache.length = min(f.cache.length, f.start)  # what lies past the feed's start is forgotten
        batch = Batch(alloc, feeds)
        # None: no bucket holds it, or a tree (the buckets' masks are causal): eagerly
        wants_features = any(f.num_features for f in feeds)  # (the captured graphs return logits alone)
        out = self.graphs.run(batch) if self.graphs is not None and not batch.has_trees and not wants_features else None
        self.last_features = None
        if out is None:
            gathers_cpu = batch.gather
            out = list(self._forward(batch.to(self.device), gathers_cpu, [f.num_features for f in feeds]).split(batch.num_last))
        for f, end in zip(feeds, batch.ends):
            f.cache.length = end
        return out

    # ----------------------------------------------------------------------------------- the math

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return llama_model.rms_norm(x, weight, self.eps)

    def rotate(self, qk: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        """q and k rows ``qk`` [n, (h + kv) * d] turned by ``rotary`` [n, 1, d/2]: [n, h + kv, d]."""
        return llama_model.rotate(qk, rotary, self.n_heads + self.n_kv, self.head_dim)

    swiglu = staticmethod(llama_model.swiglu)

    def _forward(self, batch: Batch, gathers_cpu: torch.Tensor | None = None,
                 num_features: Sequence[int] | None = None) -> torch.Tensor:
        """Every layer over the batch's rows; logits of its ``last`` rows [rows, vocab] float32.
        ``gathers_cpu``: the batch's gather index on the host (exact mode slices it per sequence);
        ``num_features``: per feed, final-norm rows left in ``last_features``."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.kv.flat(i, 0), self.kv.flat(i, 1)  # [pages * page_tokens, kv, d]
            keys[batch.write] = k
            values[batch.write] = v
            return self._attend(batch, q, keys, values, self.windows[i], gathers_cpu)  # [N, h * d]

        x = llama_model.run_layers(self, self.embed[batch.token_ids], self.rotary[batch.positions], attend)
        if num_features and any(num_features):  # (a captured graph's static batch never asks)
            self.last_features = final_features(x, batch.offsets, num_features, self.final_norm, self.eps)
        return self.lm_head(self.norm(x[batch.last], self.final_norm)).float()  # [sum(num_last), vocab]

    def _attend(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                window: int | None, gathers_cpu: torch.Tensor | None) -> torch.Tensor:
        if self.exact:
            return self._attend_exact(batch, q, keys, values, window, gathers_cpu)
        if self.attention == "loop":
            return self._attend_loop(batch, q, keys, values, window)
        h, d = self.n_heads, self.head_dim
        S, R = batch.gather.shape[0], batch.n_max
        queries = q.new_zeros(S * R, h, d)
        queries[batch.grid] = q
        k = keys[batch.gather].transpose(1, 2)  # [S, kv, longest, d]
        v = values[batch.gather].transpose(1, 2)
        att = F.scaled_dot_product_attention(
            queries.view(S, R, h, d).transpose(1, 2), k, v, attn_mask=batch.mask(window),
            scale=1.0 / math.sqrt(d), enable_gqa=self.n_kv != h)  # [S, h, R, d]
        return att.transpose(1, 2).reshape(S * R, h * d)[batch.grid]  # [N, h * d]

    def _attend_loop(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     window: int | None) -> torch.Tensor:
        """One SDPA per sequence over its gathered pages (the alternative `attention="loop"`)."""
        h, d = self.n_heads, self.head_dim
        out = q.new_empty(batch.n, h * d)
        mask = batch.mask(window)
        for b, (lo, n, end) in enumerate(zip(batch.offsets, batch.lengths, batch.ends)):
            index = batch.gather[b, :end]
            att = F.scaled_dot_product_attention(
                q[lo:lo + n].transpose(0, 1)[None], keys[index].transpose(0, 1)[None], values[index].transpose(0, 1)[None],
                attn_mask=None if n == 1 and window is None else mask[b, :, :n, :end],
                scale=1.0 / math.sqrt(d), enable_gqa=self.n_kv != h)  # [1, h, n, d]
            out[lo:lo + n] = att[0].transpose(0, 1).reshape(n, h * d)
        return out

    def _attend_exact(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: int | None, gathers_cpu: torch.Tensor) -> torch.Tensor:
        """Per sequence, in float32: keys zero-padded to whole `exact_ops.KEY_BLOCK`s, query rows in
        tiles of a size fixed by this sequence's row count, each tile one batched GEMM over the KV
        heads (`exact_ops.attend_tiles`): a row's bits depend on its own sequence only."""
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        if self.native_attention:
            return self._attend_native(batch, q, keys, values, window)
        if self.exact_kernels == "triton":
            seq_of_row, limits, allowed = self._row_masks(batch, window)
            return triton_exact.attention(q, keys, values, batch.gather, seq_of_row, limits, allowed, 1.0 / math.sqrt(d))
        g = h // kv
        out = q.new_empty(batch.n, h * d)
        for lo, index, tiles in self._exact_layout(batch, window, gathers_cpu):
            k3 = keys[index].transpose(0, 1).float()  # [kv, L, d]
            v3 = values[index].transpose(0, 1).float()
            for t0, rows, bias in tiles:  # bias [kv, tile * g, L]
                tile = bias.shape[1] // g
                queries = q.new_zeros(tile, h, d, dtype=torch.float32)
                queries[:rows] = q[lo + t0:lo + t0 + rows].float()
                queries = queries.view(tile, kv, g, d).transpose(0, 1).reshape(kv, tile * g, d)
                att = exact_ops.attend_tiles(queries, k3, v3, bias, 1.0 / math.sqrt(d))  # [kv, tile * g, d]
                att = att.view(kv, tile, g, d).transpose(0, 1)[:rows]  # [rows, kv, g, d]
                out[lo + t0:lo + t0 + rows] = att.reshape(rows, h * d).to(self.dtype)
        return out

    def _attend_native(self, batch: Batch, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       window: int | None) -> torch.Tensor:
        """Every row over its own sequence's gathered pages in C (core/native_kernels.py `attention`):
        it reads only the keys its mask lets it see, in position order, so nothing else in the batch
        touches its bits."""
        slots, limits, allowed = self._row_masks(batch, window)
        scratch = batch.__dict__.setdefault("_scratch", torch.empty(batch.longest + 64))
        k = keys[batch.gather].permute(0, 2, 1, 3)  # [S, kv, longest, d], one copy for every row
        v = values[batch.gather].permute(0, 2, 1, 3)
        out = native_kernels.attention(q.float().contiguous(), k, v, slots, limits, allowed, 1.0 / math.sqrt(self.head_dim),
                                       scratch)
        return out.to(self.dtype)

    @staticmethod
    def _row_masks(batch: Batch, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row of the batch: its sequence, one past its last visible position, and the positions it
        sees [N, longest] (uint8), on the batch's device; built once per forward and window."""
        cache = batch.__dict__.setdefault("_row_masks", {})
        if window not in cache:
            allowed = batch.mask(window)[:, 0].reshape(-1, batch.longest)[batch.grid].to(torch.uint8).contiguous()  # [N, longest]
            limits = batch.longest - allowed.flip(1).argmax(1)  # one past each row's last seen key
            seqs = torch.repeat_interleave(torch.arange(len(batch.lengths)), torch.tensor(batch.lengths)).to(allowed.device)
            cache[window] = (seqs, limits.contiguous(), allowed)
        return cache[window]

    def _exact_layout(self, batch: Batch, window: int | None, gathers_cpu: torch.Tensor) -> list:
        """Per sequence (first row, gather index [L] on the device, [(first row of tile, rows, bias)]),
        built once per forward and window (every layer of that window uses it)."""
        cache = batch.__dict__.setdefault("_exact", {})
        if window in cache:
            return cache[window]
        kv, g = self.n_kv, self.n_heads // self.n_kv
        layout = []
        for b, (lo, n, start, end) in enumerate(zip(batch.offsets, batch.lengths, batch.starts, batch.ends)):
            length = exact_ops.round_up(end, exact_ops.KEY_BLOCK)
            index = torch.full((length,), ZERO_PAGE * self.page_tokens, dtype=torch.long)
            index[:end] = gathers_cpu[b, :end]
            tile = self.exact_tile(n)
            tiles = []
            tree = batch.tree_allowed(b, window) if batch.parents[b] else None  # [n, end]
            for t0 in range(0, n, tile):
                rows = min(tile, n - t0)
                if tree is None:
                    see = allowed_positions(torch.tensor([start + t0]), torch.tensor([rows]), length, window, tile)[0]  # [tile, L]
                else:  # the tree's rows; padding rows see position 0 only, as `allowed_positions` gives them
                    see = torch.zeros(tile, length, dtype=torch.bool)
                    see[:rows, :end] = tree[t0:t0 + rows]
                    see[rows:, 0] = True
                bias = torch.zeros(tile, length).masked_fill_(~see, float("-inf"))
                bias = bias[None, :, None, :].expand(kv, tile, g, length).reshape(kv, tile * g, length)
                tiles.append((t0, rows, bias.to(self.device)))
            layout.append((lo, index.to(self.device), tiles))
        cache[window] = layout
        return layout


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: no cap
        return 1 << 62


def _plain_linear(weight: torch.Tensor) -> Linear:
    return lambda x: F.linear(x, weight)


class _Linear:
    """A weight [out, in] with its bias, and the kernel ``kernel(x, weight, bias)`` that runs it."""

    __slots__ = ("weight", "bias", "kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]) -> None:
        self.weight, self.bias, self.kernel = weight, bias, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def _bias_after(gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """An exact kernel with its bias added after the GEMM: an elementwise, per-row add."""
    def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = gemm(x, weight)
        return out if bias is None else out + bias
    return kernel
