"""The paged model runner: Llama-family models on any device, every sequence's KV in one page pool.

A forward takes the scheduler's flat ragged batch (`Feed`s: k + 1 rows per verifying session, k = 0
included, prefills of hundreds of rows) and runs it as one batch of N rows (vLLM's flattened layout):
embeddings, fused QKV and gate/up linears over all N rows at once, rotary at each row's position,
the new keys and values written into each sequence's pages (core/paged_kv.py), attention of each
sequence's rows over its own pages, and logits only for the rows asked for.

Attention and the KV pages are the paged backend's (core/paged_backend.py): its strategy (fast
batched SDPA, one SDPA per sequence, or exact numerics in C, Triton or fixed tiles) is chosen here,
once, from ``numerics``, ``attention`` and ``exact_kernels``. Token trees (`Feed.parents`) and sliding
windows are the backend's masks; a batch with a tree runs eagerly, never through a CUDA graph (the
buckets' static masks are causal).

Exact numerics (``numerics="exact"``): a row's logits do not depend on what shares the forward.
Linears run in fixed-size row tiles and attention per sequence in float32 (core/exact_ops.py's
design: no kernel is chosen by the batch's shape). On the CPU the load checks that this holds with
core/exact_ops.verify; on CUDA the same fixed shapes make it deterministic per row (no split
depends on the batch), and its cost is measured by benchmarks/gpu_check.py.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases): RMSNorm, SiLU
gated MLP, GQA, head_dim from the config, tied or untied embeddings, rotary scalings whose
frequencies do not depend on the sequence's length.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.core import exact_ops, llama_model, native_kernels, triton_exact
from specdec.core.cuda_graphs import CudaGraphs, buckets_for
from specdec.core.models import WeightRelease, restore_weights, weights_released
from specdec.core.paged_backend import PagedBackend
from specdec.core.paged_kv import FIRST_PAGE, PagedKV, PageTable, pages_for_budget, pages_for_memory
from specdec.core.runner import Feed

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
        windows = layer_windows(cfg, cfg.num_hidden_layers)
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
        pages = PagedKV(self.layer_count, self.n_kv, self.head_dim,
                        self._pool_pages(num_pages, kv_budget_tokens, max_sessions, kv_memory_fraction),
                        page_tokens, self.dtype, self.device)
        strategy = f"exact-{self.exact_kernels}" if self.exact else attention
        self.kv = PagedBackend(pages, self.n_heads, self.n_kv, self.head_dim, self.dtype, windows, self.context_length,
                               strategy, self.exact_tile)
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
        return self.kv.new_cache()

    def truncate(self, cache: PageTable, length: int) -> None:
        self.kv.truncate(cache, length)

    def free(self, cache: PageTable) -> None:
        self.kv.free(cache)

    @property
    def pages_total(self) -> int:
        return self.kv.pages_total

    @property
    def pages_free(self) -> int:
        return self.kv.pages_free

    def kv_bytes(self) -> int:
        """Device bytes of the pages sequences hold now."""
        return self.kv.kv_bytes()

    def kv_token_capacity(self, sessions: int) -> int:
        return self.kv.kv_token_capacity(sessions)

    def read_kv(self, cache: PageTable, lo: int, hi: int) -> torch.Tensor:
        return self.kv.read_kv(cache, lo, hi)

    def write_prefix(self, cache: PageTable, kv: torch.Tensor) -> None:
        self.kv.write_prefix(cache, kv)

    def keep_path(self, cache: PageTable, first: int, path: Sequence[int]) -> None:
        self.kv.keep_path(cache, first, path)

    @torch.inference_mode()
    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """One forward over every feed's rows; logits [num_last, vocab] float32 per feed, in order."""
        batch = self.kv.plan(feeds)
        # None: no bucket holds it, or a tree (the buckets' masks are causal): eagerly
        wants_features = any(f.num_features for f in feeds)  # (the captured graphs return logits alone)
        out = self.graphs.run(batch) if self.graphs is not None and not batch.has_trees and not wants_features else None
        self.last_features = None
        if out is None:
            out = list(self._forward(batch.to(self.device), [f.num_features for f in feeds]).split(batch.num_last))
        self.kv.finish(batch)
        return out

    # ----------------------------------------------------------------------------------- the math

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return llama_model.rms_norm(x, weight, self.eps)

    def rotate(self, qk: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        """q and k rows ``qk`` [n, (h + kv) * d] turned by ``rotary`` [n, 1, d/2]: [n, h + kv, d]."""
        return llama_model.rotate(qk, rotary, self.n_heads + self.n_kv, self.head_dim)

    swiglu = staticmethod(llama_model.swiglu)

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]  # [n, hidden]

    def _forward(self, batch, num_features: Sequence[int] | None = None) -> torch.Tensor:
        """`llama_model.forward` over this runner's pages; logits of the batch's ``last`` rows [rows,
        vocab] float32 (a host `Batch` moved to the device, or core/cuda_graphs.py's static one).
        ``num_features``: per feed, final-norm rows left in ``last_features``."""
        logits, features = llama_model.forward(self, self.kv, batch, num_features)
        if features is not None:  # (a captured graph's static batch never asks)
            self.last_features = features
        return logits


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
