"""A lean decode path for Hugging Face Llama checkpoints: same weights, same math, far fewer ops.

On small models the per-call overhead of ``LlamaForCausalLM.forward`` (masks, cache objects, output
records, ~40 framework ops per layer) dwarfs the arithmetic. This is the gpt-fast / llama.cpp style
forward instead:

- the model's math from core/llama_model.py (fused QKV and gate/up weights, rotary pairs adjacent,
  the layer loop), with this runner's kernels as its strategy;
- oneDNN-packed weights where PyTorch has them: MKL's small-M GEMM is slow on this CPU kind, and
  oneDNN with a prepacked weight runs 5 rows in about the time of one, which is what makes verifying
  k drafts cost little more than one step (docs/performance.md 8).
  Single-row calls and calls of more rows each go to the kernel measured fastest at load
  (`_Layouts`: MKL's GEMM on a transposed copy at one row on an Intel Xeon);
- every sequence's KV in a slot of a shared slab (core/kv_slots.py), so a batch attends slab by
  slab, and logits only for the rows asked for
  (a prefill needs one row, not 500);
- each weight held once where asked (``own_weights``, ``layouts_per_weight=1``): built layer by layer,
  each HF weight let go as soon as its fused or packed copy exists, kernels timed on one weight per
  shape, so a model's load peaks near its weights' bytes (benchmarks/results/big_target/).

- ``numerics="exact"`` (core/exact_ops.py) trades the timed kernels and SDPA for fixed-shape ones, so
  a row's logits are bitwise the same whatever else shares its forward (its block, other sessions,
  thread count): speculation then cannot change greedy output, not even in bf16.

Logits match the HF forward to ~1e-5 (summation order differs); the tests hold it to that. Both the
drafter and the verifier use it; the verifier's output distribution is by definition the one this
forward computes, and ``TargetConfig.fast_forward=False`` falls back to the HF forward.
Supported: ``LlamaForCausalLM`` with default RoPE, no attention/MLP bias, SiLU.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.core import exact_ops, llama_model, native_kernels
from specdec.core.cpu_features import describe_cpu, native_bf16
from specdec.core.exact_attention import KEY_BLOCK, round_up
from specdec.core.kv_slots import DecodeCache
from specdec.core.models import WeightRelease, restore_weights, weights_released
from specdec.core.runner import Feed
from specdec.core.slab_backend import SlabBackend

PACK_ROWS = 8  # a verification feeds 1 + k rows; oneDNN packs each weight for about this many
# A packed linear's calls: up to EXACT_ROWS rows as they come, more padded to a bucket
# (`bucket_rows`), more than MAX_CALL_ROWS in calls of that many rows (weight reads are a small part
# of a call that large).
EXACT_ROWS = 8
MAX_CALL_ROWS = 512


def bucket_rows(n: int) -> int:
    """The row count a packed oneDNN linear is called with for ``n <= MAX_CALL_ROWS`` rows: ``n`` up
    to EXACT_ROWS, then the next multiple of 8 up to 64, then four buckets per power of two (at
    most 25% padding): 27 sizes in all.

    oneDNN and ideep (PyTorch's wrapper) each cache one primitive per input shape, in caches of 1,024
    entries by default: 0.55 MiB of process memory per new row count per weight shape (torch 2.13,
    whatever the weight's size). A verifier's batches and prefills come in hundreds of row counts,
    so unbucketed a worker grew by hundreds of MiB over thousands of sessions until the caches
    filled (benchmarks/soak.py; tests/test_memory.py); with buckets a linear sees at most 27 shapes,
    cached after warm-up, and no primitive is rebuilt (milliseconds each) on the request path."""
    if n <= EXACT_ROWS:
        return n
    if n <= 64:
        return round_up(n, 8)
    return round_up(n, 1 << (n.bit_length() - 3))


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def supports(model: torch.nn.Module) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    return (
        type(model).__name__ == "LlamaForCausalLM"
        and rope.get("rope_type", "default") == "default"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and cfg.hidden_act == "silu"
    )


Linear = Callable[[torch.Tensor], torch.Tensor]


class _PlainLinear:
    """``F.linear`` on the [out, in] weight, where no packed kernel exists."""

    __slots__ = ("weight", "shape")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.shape = weight, tuple(weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _onednn_linear(weight: torch.Tensor, rows_hint: int, check: bool = True) -> Linear | None:
    """A oneDNN linear on a prepacked copy of ``weight``, or None where this build lacks it or (``check``)
    disagrees with ``F.linear``: the op is private, so it is trusted once per shape and dtype."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        op = torch.ops.mkldnn._linear_pointwise

        def linear(x: torch.Tensor) -> torch.Tensor:  # x [n, in]
            n = x.shape[0]
            if n > MAX_CALL_ROWS:
                return torch.cat([linear(part) for part in x.split(MAX_CALL_ROWS)])
            m = bucket_rows(n)  # zero rows below the real ones (like any batch size, may move a row's last bits)
            if m == n:
                return op(x, packed, None, "none", [], "")
            return op(torch.cat([x, x.new_zeros(m - n, x.shape[1])]), packed, None, "none", [], "")[:n]

        if not check:
            return linear
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)  # not the global RNG
        tol = 1e-4 if weight.dtype == torch.float32 else 3e-2  # bf16 keeps 8 bits of mantissa
        if not torch.allclose(linear(probe).float(), F.linear(probe, weight).float(), atol=tol, rtol=tol):
            return None  # a private op: trust it only when it gives the same numbers
        return linear
    except (AttributeError, RuntimeError):
        return None


NUMERICS = ("fast", "exact")
KERNELS = ("packed", "plain", "transposed", "native")
MULTI_ROW_KERNELS = ("packed", "transposed", "native")  # F.linear loses to these from a few rows up
MEASURE_ROWS = 4  # the rows of a k = 3 verification: what "more rows" is timed at
WARMUP_REPS, TIMED_REPS = 2, 7  # calls of each kernel at load: the first warm up, the median of the rest decides
MIN_TIMED_REPS, TIMING_BUDGET_S = 3, 0.05  # a weight whose calls take longer times fewer: large calls vary little


def native_usable(dtype: torch.dtype) -> bool:
    """Whether specdec's own kernel (core/native_kernels.py) can run weights of this dtype here."""
    return native_kernels.available() and dtype in native_kernels.weight_dtypes()


def bfloat16_supported() -> bool:
    """Whether a bfloat16 decoder runs here: a bf16 dot in the CPU, or specdec's kernels to read bf16 weights."""
    return native_bf16() or native_usable(torch.bfloat16)


def half_weights_here(dtype: torch.dtype, numerics: str) -> bool:
    """Whether a ``dtype`` (bfloat16) decoder holds half-precision weights in specdec's C kernels,
    widened exactly in registers, with float32 activations, norms and KV: where the CPU has no
    bf16 dot (any AVX2 CPU), and in exact numerics everywhere (one kernel, every row's bits its own)."""
    return dtype == torch.bfloat16 and native_usable(dtype) and (numerics == "exact" or not native_bf16())


def native_attention_usable(dtype: torch.dtype) -> bool:
    """Whether specdec's own attention kernel can read this dtype's keys and values here."""
    return dtype in native_kernels.KV_DTYPES and native_kernels.available()


class _Layouts:
    """One weight, in the layouts its calls use, and which kernel runs single-row calls (``one``)
    and calls of more rows (``many``): "packed" (oneDNN, prepacked), "plain" (``F.linear`` on the
    [out, in] weight), "transposed" (``torch.mm`` on an [in, out] copy: MKL's GEMM without a
    transposed operand, the fastest at one row on an Intel Xeon: docs/performance.md 8) or
    "native" (core/native_kernels.py, float32 where it builds).
    Layouts no chosen kernel uses are dropped, so at most two copies of the weight stay."""

    __slots__ = ("packed", "weight", "transposed", "native", "one", "many", "shape")

    def __init__(self, packed: Linear | None, weight: torch.Tensor) -> None:
        self.packed, self.weight, self.transposed, self.native = packed, weight, None, None  # copies only once a kernel needs them
        self.shape = tuple(weight.shape)  # [out, in], kept when the plain layout is dropped
        self.one = self.many = packed

    def kernel(self, name: str) -> Linear:
        if name == "packed":
            return self.packed
        if name == "plain":
            weight = self.weight
            return lambda x: F.linear(x, weight)
        if name == "native":
            if self.native is None:
                self.native = native_kernels.NativeLinear(self.weight)
            return self.native
        if self.transposed is None:
            self.transposed = self.weight.t().contiguous()
        transposed = self.transposed
        return lambda x: torch.mm(x, transposed)

    def use(self, one: str, many: str) -> None:
        self.one, self.many = self.kernel(one), self.kernel(many)
        kept = {one, many}
        if "packed" not in kept:
            self.packed = None
        if "plain" not in kept:
            self.weight = None
        if "transposed" not in kept:
            self.transposed = None
        if "native" not in kept:
            self.native = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.one(x) if x.shape[0] == 1 else self.many(x)


def fastest(times: dict[str, list[float]], default: str = "packed") -> str:
    """The kernel with the lowest median time, if that is at least 5% under ``default``'s; else ``default``
    (noise alone should not cost a second copy of the weights)."""
    best = min(times, key=lambda name: statistics.median(times[name]))
    return best if statistics.median(times[best]) < 0.95 * statistics.median(times[default]) else default


class LlamaDecoder:
    """Weights shared by every sequence of one model. ``pack_rows``: rows per call to pack for (None: no packing).

    ``dtype``: float32 (the default; the verifier's distribution) or bfloat16. bf16 halves the bytes each
    step reads, which bounds a step once a model is past a few million parameters. Where the CPU has
    no bf16 dot, and in exact numerics, the weights (embeddings included) are held in bf16 in
    specdec's C kernels and widened exactly in registers, while activations, norms and the KV cache
    stay float32 (``half_weights``); elsewhere weights, activations and the KV cache are bf16 (rotary
    and the returned logits stay fp32). Either changes the numbers, so it suits the drafter (proposals
    never change what the verifier accepts) and a target only when that target is then always run so.

    ``numerics``: "fast" (kernels timed at load, SDPA: a row's logits move in the last bits with the
    rows beside it) or "exact" (core/exact_ops.py: a row's logits are bitwise the same alone, as row j
    of a k+1 block, or beside any other sessions, at any thread count; nothing is timed, and the load
    checks on this CPU that its kernels keep that, raising ExactNumericsUnavailable where not).
    """

    def __init__(self, model: torch.nn.Module, pack_rows: int | None = PACK_ROWS, dtype: torch.dtype = torch.float32,
                 single_row: str = "measure", multi_row: str = "measure", numerics: str = "fast",
                 probe_threads: tuple[int, ...] | None = None, own_weights: bool = False,
                 layouts_per_weight: int = 2) -> None:
        """``single_row``: the kernel for one-row calls of packed weights, one of `KERNELS` or
        "measure" (time them all at load, keep the fastest); ``multi_row``: the same for calls of
        more rows ("packed", "transposed" or "measure"). Exact numerics ignore both: every call goes
        to one kernel. ``probe_threads``: the torch thread counts exact mode is checked at (default
        1, 2, the current count and this process's cores): a thread chooser's counts belong here.

        ``own_weights``: take ``model``'s weights over: each layer's weights leave the model
        (core/models.py `WeightRelease`) as soon as this decoder holds them, so the process does not
        hold them twice. For a model that nothing else runs (the verifier's own load); its HF forward
        still works, reading back what it lost first.

        ``layouts_per_weight``: 2 (measured kernels may keep two layouts of every weight, one for
        single-row calls and one for more rows: twice the memory) or 1 (where both are measured and
        differ, the one kernel fastest over both row counts serves every call: each weight held once,
        single-row calls possibly slower; benchmarks/results/big_target/)."""
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama; use the HF forward")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {numerics!r}")
        if layouts_per_weight not in (1, 2):
            raise ValueError(f"layouts_per_weight must be 1 or 2; got {layouts_per_weight!r}")
        self.half_weights = half_weights_here(dtype, numerics)
        if dtype == torch.bfloat16 and not native_bf16() and not self.half_weights:
            raise ValueError("bfloat16 decoding needs a CPU with native bf16 (cpuinfo flag avx512_bf16 or amx_bf16) or "
                             f"specdec's native kernels, which did not build here ({describe_cpu()})")
        self.weight_dtype = dtype  # the linears' weights
        self.dtype = torch.float32 if self.half_weights else dtype  # activations, norms, the KV cache
        self.pack_rows = pack_rows
        self.numerics = numerics
        self.exact = numerics == "exact"
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.context_length = cfg.max_position_embeddings
        self.intermediate = cfg.intermediate_size
        # Exact mode pads keys to whole blocks: caches hold the context rounded up to one.
        self.capacity_limit = round_up(self.context_length, KEY_BLOCK) if self.exact else self.context_length
        d = self.head_dim
        if weights_released(model):
            restore_weights(model)  # an earlier decoder took them over: read them from the folder again
        base = model.model
        self.owns_weights = own_weights
        self._packs: dict[tuple[int, int], bool] = {}  # per weight shape: whether oneDNN packing agreed with F.linear
        keep = (base.embed_tokens.weight,)  # shared with this decoder (same dtype); model.device and fingerprints read it
        with torch.no_grad():
            # in the weights' dtype (half weights: bf16, rounded as the head is; rows widened as gathered)
            self.embed = self._weight(base.embed_tokens.weight)
            self.final_norm = self._cast(base.norm.weight)
            layers = list(base.layers)
            if self.exact or self.half_weights:  # one kernel, never timed
                self.kernels = (("native", "native") if native_usable(self.weight_dtype) else
                                ("packed", "packed") if self._packing_works() else ("plain", "plain"))
            else:
                self.kernels = self._choose_kernels(model, single_row, multi_row, one_layout=layouts_per_weight == 1)
            # exact numerics on native kernels: norms, SwiGLU, rotary and attention in C too (one call each, not ~10 ops)
            self.native_ops = self.exact and self.kernels == ("native", "native")
            self.norm, self.swiglu, self.rotate = self._row_ops()
            # attention in C whenever exact and built: bf16 too (oneDNN's and MKL's batched GEMMs are not
            # shape-invariant on every CPU: AVX-512 and AMX machines give a row other bits beside others)
            self.native_attention = self.exact and native_attention_usable(self.dtype)
            # the model's copy of each weight goes as soon as this decoder's arrives
            release = WeightRelease(model, keep) if own_weights else (lambda *modules: None)

            self.lm_head = self._linear(model.lm_head.weight)
            release(model.lm_head, base.norm)
            self.layers = [self._layer(layer, release) for layer in layers]
            self.rotary = llama_model.rotary_table(model, d, self.context_length)  # [context, 1, d/2] complex64
        self.kv = SlabBackend(self)  # where its sequences' keys live (a runner may put it over another backend)
        self.exact_plan: exact_ops.ExactPlan | None = None
        if self.exact:
            self.exact_plan = self._verify_exact(probe_threads)
        # a layer can be one C call (`_layers_fused`) when every projection is a bare NativeLinear (an
        # exact plan may have wrapped them); the widest one's multiply-adds per row, else None
        linears = [f for layer in self.layers for f in (layer[1], layer[2], layer[4], layer[5])]
        self.fused_macs = (max(f.shape[0] * f.shape[1] for f in linears) if self.native_ops and all(
            isinstance(f, native_kernels.NativeLinear) for f in linears) else None)
        self.native_stack = native_kernels.DecoderStack(self.layers, self.hidden) if self.fused_macs else None
        if own_weights:
            release.trim_heap()  # the load's transients (fused copies, the exact check's probes) back to the system

    def embed_rows(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The embeddings of ``token_ids`` in this decoder's activation dtype: [n, hidden], a fresh tensor."""
        return self.embed[torch.as_tensor(token_ids)].to(self.dtype)

    def _cast(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` in this decoder's dtype, contiguous: ``w`` itself where it already is."""
        return w.detach().to(self.dtype).contiguous()

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        """A weight matrix in the dtype the linears hold, contiguous (itself where it already is)."""
        return w.detach().to(self.weight_dtype).contiguous()

    def _qkv_weight(self, attn: torch.nn.Module) -> torch.Tensor:
        """q, k and v stacked [(h + 2kv) * d, hidden], rotary pairs adjacent, in the linears' dtype."""
        return llama_model.fused_qkv(attn, self.n_heads, self.n_kv, self.head_dim, self._weight)[0]

    def _gate_up_weight(self, mlp: torch.nn.Module) -> torch.Tensor:
        return llama_model.fused_gate_up(mlp, self._weight)[0]  # [2 * inter, hidden]

    def _layer(self, layer: torch.nn.Module, release: Callable[..., None]) -> tuple:
        """A decoder layer as this forward runs it: (input norm, QKV, o, post-attention norm, gate/up,
        down). ``release(*modules)`` is called as soon as a copy of their weights is made, before it is
        packed, so at most one fused weight, its packed copy and what it was made from exist at once."""
        a, m = layer.self_attn, layer.mlp
        wqkv = self._qkv_weight(a)
        release(a.q_proj, a.k_proj, a.v_proj)
        qkv = self._linear(wqkv)
        del wqkv  # (gone unless its plain layout runs)
        o = self._linear(a.o_proj.weight)
        release(a.o_proj)
        wgu = self._gate_up_weight(m)
        release(m.gate_proj, m.up_proj)
        gate_up = self._linear(wgu)
        del wgu
        down = self._linear(m.down_proj.weight)
        release(m.down_proj)
        ln1, ln2 = self._cast(layer.input_layernorm.weight), self._cast(layer.post_attention_layernorm.weight)
        release(layer.input_layernorm, layer.post_attention_layernorm)
        return ln1, qkv, o, ln2, gate_up, down

    def _linear(self, weight: torch.Tensor, kernels: tuple[str, str] | None = None) -> Linear:
        """``weight`` [out, in] held only in the layouts of ``kernels`` (default: the decoder's choice),
        the packed one built without keeping the plain copy when only it runs; every layout with None."""
        weight = self._weight(weight)
        one, many = kernels or self.kernels
        if (one, many) == ("plain", "plain"):
            return _PlainLinear(weight)
        if (one, many) == ("native", "native"):
            return native_kernels.NativeLinear(weight)  # its panels alone: the weight held once
        every = (one, many) == ("measure", "measure")
        packed = None
        shape = tuple(weight.shape)
        if self.pack_rows and (every or "packed" in (one, many)) and self._packs.get(shape, True):
            packed = _onednn_linear(weight, self.pack_rows, check=shape not in self._packs)
            self._packs[shape] = packed is not None
        if packed is None and (every or "packed" in (one, many)):
            return _PlainLinear(weight)  # no oneDNN here: F.linear for every call
        layouts = _Layouts(packed, weight)
        if not every:
            layouts.use(one, many)
        return layouts

    def _exact_linear(self, weight: torch.Tensor) -> Linear:
        """The kernel exact mode runs ``weight`` [out, in] (this decoder's dtype) with: what `verify` checks."""
        if self.kernels == ("native", "native"):
            return native_kernels.NativeLinear(self._weight(weight))
        packed = _onednn_linear(weight, self.pack_rows) if self.pack_rows else None
        if packed is None:
            return _PlainLinear(weight)
        layouts = _Layouts(packed, weight)
        layouts.use("packed", "packed")
        return layouts

    def _verify_exact(self, probe_threads: tuple[int, ...] | None) -> exact_ops.ExactPlan:
        """Check exact numerics on this CPU (core/exact_ops.py) and wrap the linears in the mode that holds."""
        linears = [self.lm_head] + [f for layer in self.layers for f in (layer[1], layer[2], layer[4], layer[5])]
        one_per_shape = list({f.shape: f for f in linears}.values())
        threads = probe_threads or tuple(sorted({1, 2, torch.get_num_threads(), _available_cores()}))
        shapes = tuple(f.shape for f in one_per_shape)
        key = (self.dtype, self.weight_dtype, shapes, self.n_heads, self.n_kv, self.head_dim, self.hidden, self.intermediate,
               self.pack_rows, threads, type(one_per_shape[0]).__name__)
        plan = exact_ops.verified_plan(key, lambda: exact_ops.verify(self, shapes, self._exact_linear, threads))
        if plan.linear_mode != "flat":
            wrap = lambda f: exact_ops.wrap_linear(f, plan.linear_mode)  # noqa: E731
            self.lm_head = wrap(self.lm_head)
            self.layers = [(ln1, wrap(qkv), wrap(o), ln2, wrap(gu), wrap(down)) for ln1, qkv, o, ln2, gu, down in self.layers]
        return plan

    def _layouts(self) -> list[_Layouts]:
        linears = [self.lm_head] + [f for layer in self.layers for f in (layer[1], layer[2], layer[4], layer[5])]
        return [f for f in linears if isinstance(f, _Layouts)]

    @staticmethod
    def _check_kernel_names(single_row: str, multi_row: str) -> tuple[str, str]:
        if single_row not in ("measure", *KERNELS):
            raise ValueError(f"single_row must be measure, packed, plain, transposed or native; got {single_row!r}")
        if multi_row not in ("measure", *MULTI_ROW_KERNELS):
            raise ValueError(f"multi_row must be measure, packed, transposed or native; got {multi_row!r}")
        return single_row, multi_row

    def _packing_works(self) -> bool:
        return bool(self.pack_rows) and _onednn_linear(torch.ones(8, 8, dtype=self.dtype), self.pack_rows) is not None

    @torch.inference_mode()
    def _choose_kernels(self, model: torch.nn.Module, single_row: str, multi_row: str, one_layout: bool) -> tuple[str, str]:
        """The kernels for single-row calls and for more rows, each timed unless given (candidates
        alternated, at the torch thread count in force). Timed on one weight of each shape of a
        forward: the output layer and the first layer's linears, whose shapes every layer repeats, each
        counted as often as a forward calls its shape, so the sums are those of a whole forward's
        linears. With ``one_layout``, where both are measured and differ, the one kernel with the least
        time for both row counts serves both: two kernels would keep two copies of every weight.
        Returns (single-row kernel, multi-row kernel)."""
        self._check_kernel_names(single_row, multi_row)
        if "native" in (single_row, multi_row) and not native_usable(self.dtype):
            raise ValueError(f"the native kernel runs float32 on a CPU with AVX2 and FMA or AVX-512, built by a C compiler; "
                             f"not available for {self.dtype} here ({describe_cpu()}): use packed")
        if not self._packing_works():
            return "plain", "plain"
        if "measure" not in (single_row, multi_row):
            return single_row, multi_row
        base = model.model
        first = base.layers[0]
        samples = [(model.lm_head.weight, 1)] + [(w, len(base.layers)) for w in (
            self._qkv_weight(first.self_attn), first.self_attn.o_proj.weight, self._gate_up_weight(first.mlp), first.mlp.down_proj.weight)]
        shared = one_layout and single_row == multi_row == "measure"  # one kernel for both: one that runs any rows
        here = lambda names: tuple(n for n in names if n != "native" or native_usable(self.dtype))  # noqa: E731
        one_times = {name: [0.0] * TIMED_REPS for name in here(MULTI_ROW_KERNELS if shared else KERNELS)}  # a forward's seconds, per sample
        many_times = {name: [0.0] * TIMED_REPS for name in here(MULTI_ROW_KERNELS)}
        while samples:  # one weight's layouts at a time: the transient copies stay small
            weight, count = samples.pop(0)
            layouts = self._linear(weight, ("measure", "measure"))
            for totals, rows, asked in ((one_times, 1, single_row), (many_times, MEASURE_ROWS, multi_row)):
                if asked != "measure":
                    continue
                for name, times in self._time_kernels(layouts, rows, tuple(totals)).items():
                    totals[name] = [total + count * t for total, t in zip(totals[name], times)]  # (the fewest samples)
            del weight, layouts
        one = single_row if single_row != "measure" else fastest(one_times)
        many = multi_row if multi_row != "measure" else fastest(many_times)
        if shared and one != many:
            both = {name: [a + b for a, b in zip(one_times[name], many_times[name])] for name in many_times}
            one = many = fastest(both)
        return one, many

    def _time_kernels(self, layouts: _Layouts, rows: int, names: tuple[str, ...]) -> dict[str, list[float]]:
        """Seconds of one call of each kernel ``names`` of ``layouts`` on ``rows`` rows, alternated:
        `TIMED_REPS` samples each, or `MIN_TIMED_REPS` once the timed calls took `TIMING_BUDGET_S`."""
        x = torch.zeros(rows, layouts.shape[1], dtype=self.dtype)
        kernels = {name: layouts.kernel(name) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        spent = 0.0
        for rep in range(WARMUP_REPS + TIMED_REPS):
            if rep >= WARMUP_REPS + MIN_TIMED_REPS and spent > TIMING_BUDGET_S:
                break
            for name in names:
                t = time.perf_counter()
                kernels[name](x)
                if rep >= WARMUP_REPS:  # the first calls warm up
                    times[name].append(time.perf_counter() - t)
                    spent += times[name][-1]
        return times

    @property
    def pool(self):
        """The slot pool of this decoder's slab backend (core/kv_slots.py)."""
        return self.kv.pool

    def new_cache(self) -> DecodeCache:
        """A slot of this decoder's pool (core/slab_backend.py): batches of pooled caches attend together."""
        return self.kv.new_cache()

    def private_cache(self) -> DecodeCache:
        """A cache with a buffer of its own (grown on demand), attended alone in a batch."""
        return self.kv.private_cache()

    def write_prefix(self, cache: DecodeCache, kv: torch.Tensor) -> None:
        """Adopt keys and values ``kv`` [layers, 2, kv_heads, n, head_dim] as positions [0, n) of ``cache``."""
        self.kv.write_prefix(cache, kv)

    def keep_path(self, cache: DecodeCache, first: int, path: Sequence[int]) -> None:
        self.kv.keep_path(cache, first, path)

    def layers_forward(self, x: torch.Tensor, rotary: torch.Tensor, buf: torch.Tensor, start: int,
                       mask: torch.Tensor | None, only: Sequence[int] | None = None) -> torch.Tensor:
        """Every decoder layer over rows ``x`` [n, hidden] at rotary angles ``rotary`` [n, 1, d/2].

        Row r's keys and values are written at ``buf`` position ``start + r`` (``buf``:
        [layers, 2, kv_heads, >= start + n, head_dim]), and each row attends to positions
        ``[0, start + n)`` where ``mask`` [n, start + n] allows (None: all of them): a buffer outside
        the backend's caches (core/branch_decode.py's branches) or a slot read past the feeds'
        bookkeeping (`partial_forward`). ``only``: these layers alone, in order (the others' keys
        and values untouched).
        """
        return self.layers_with(x, rotary, self.kv.buffer_attend(buf, start, x.shape[0], mask), only)

    @torch.inference_mode()
    def partial_forward(self, cache: DecodeCache, token_ids: list[int], start: int, layers: Sequence[int]) -> torch.Tensor:
        """``token_ids`` at positions start.. through ``layers`` only, then the final norm and the LM
        head: logits [n, vocab] of a layer-skip draft. It reads the cache's keys and values of
        those layers before ``start`` and writes its rows' from ``start`` on; the other layers'
        stay as they were (services/draft/layer_skip.py shares a verifier's cache so)."""
        n = len(token_ids)
        end = start + n
        self.kv.reserve(cache, end)
        if cache.pooled:  # every layer's positions up to the end finite: the skipped ones are not written here
            cache.pool.fill_to(cache.slab, cache.slot, end)
        mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start) if n > 1 else None
        x = self.layers_forward(self.embed_rows(token_ids), self.rotary[start:end], cache.buf, start, mask, layers)
        return self.lm_head(self.norm(x, self.final_norm)).float()

    def _row_ops(self) -> tuple[Callable, Callable, Callable]:
        """This decoder's per-row ops, chosen once (llama_model.run_layers calls them): ``norm(x, weight)``
        (RMSNorm of rows [n, hidden]), ``swiglu(gate_up)`` and ``rotate(qk, rotary)`` (q and k rows
        [n, (h + kv) * d] turned by rotary [n, 1, d/2]: [n, h + kv, d]); in C in exact numerics on
        native kernels, PyTorch's otherwise."""
        eps, heads, d = self.eps, self.n_heads + self.n_kv, self.head_dim
        if self.native_ops:
            return (lambda x, weight: native_kernels.rms_norm(x, weight, eps), native_kernels.swiglu,
                    lambda qk, rotary: native_kernels.rotary(qk, heads, d, torch.view_as_real(rotary).contiguous()))
        return (lambda x, weight: llama_model.rms_norm(x, weight, eps), llama_model.swiglu,
                lambda qk, rotary: llama_model.rotate(qk, rotary, heads, d))

    def layers_with(self, x: torch.Tensor, rotary: torch.Tensor, attend: llama_model.Attend,
                    only: Sequence[int] | None = None) -> torch.Tensor:
        """`llama_model.run_layers` on this decoder's layers and ops."""
        return llama_model.run_layers(self, x, rotary, attend, only)

    @torch.inference_mode()
    def forward_batch(self, caches: list[DecodeCache], token_ids: list[list[int]], starts: list[int],
                      num_last: list[int], parents: Sequence[Sequence[int]] | None = None,
                      num_features: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Many sequences in one forward: sequence b feeds ``token_ids[b]`` at positions starts[b]..
        into ``caches[b]``; returns each one's logits of its last ``num_last[b]`` rows.

        ``parents[b]`` (empty: none) makes the last ``len(parents[b])`` rows of sequence b a token
        tree's nodes (core/tree.py): each node at its parent's position + 1, attending to the rows
        before the tree and to its own ancestors. Rows' keys and values still go to buffer positions
        ``starts[b] + row``; `keep_path` moves an accepted path's into place.

        ``num_features[b]``: the final-norm hidden states of sequence b's last rows wanted too
        (core/features.py); they are left in ``last_features`` (None for the others, or all None).

        The rows of all sequences are flattened into one [N, hidden] batch (N = the sum of their
        lengths, ragged, in the spirit of vLLM's flattened draft tokens with offsets), so every
        weight is read once per forward however many sequences share it; attention is the slab
        backend's (core/slab_backend.py: once per layer for the sequences of each pool slab, per
        sequence for private caches).
        """
        parents = parents or [()] * len(caches)
        num_features = num_features or [0] * len(caches)
        return self.forward_feeds([Feed(c, s, ids, m, tuple(p), f) for c, ids, s, m, p, f
                                   in zip(caches, token_ids, starts, num_last, parents, num_features)])

    @torch.inference_mode()
    def forward_feeds(self, feeds: Sequence[Feed], backend=None) -> list[torch.Tensor]:
        """`llama_model.forward` over ``backend`` (default: this decoder's slabs): each feed's logits
        [num_last, vocab] float32, in order; features in ``last_features``."""
        backend = backend or self.kv
        plan = backend.plan(feeds)
        logits, self.last_features = llama_model.forward(self, backend, plan, [f.num_features for f in feeds])
        backend.finish(plan)
        return list(logits.split(list(plan.num_last)))

    @torch.inference_mode()
    def forward(self, cache: DecodeCache, token_ids: list[int], start: int, num_last: int | None = None) -> torch.Tensor:
        """Feed ``token_ids`` at positions start.. into ``cache``; logits of the last ``num_last``
        (default: all) of them, ``[num_last, vocab]``."""
        n = len(token_ids)
        return self.forward_batch([cache], [list(token_ids)], [start], [n if num_last is None else num_last])[0]
