"""specdec's own kernels (core/native/kernels.c), built on the machine that runs them: float32 math,
with linears over float32, bfloat16 or float16 weights.

Why: a oneDNN-packed linear gives a row the same bits whatever shares its call on the CPUs measured,
but it is slow at the row counts speculation lives at (1 to 16 rows; docs/performance.md 13), and
MKL's faster ones are not batch-invariant. This kernel is invariant by construction (every output is
one chain of fused multiply-adds in a fixed order, whatever the rows, their place or the threads) and
reads a single row's weights at close to the memory's speed. Where a target is bound by reading its
weights, half-precision weights halve the bytes; the kernel widens each one exactly to float32 in
registers, so it needs no bf16 arithmetic from the CPU (AVX2 with FMA does; float16 needs F16C) and
a row's result is the float32 kernel's over the widened weights, bit for bit.

The C file is compiled once per source, compiler and CPU with ``-march=native`` (the CPU's own
vector width: AVX2 with FMA or AVX-512, found by the compiler, nothing hard-coded), into
``$SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``), and loaded with ctypes: no Python headers,
no torch extension build. Where no C compiler works, or the CPU has neither AVX2 with FMA nor
AVX-512, `available()` is False and the decoders keep oneDNN's kernels. ``SPECDEC_NATIVE_KERNELS=0``
turns it off; ``SPECDEC_NATIVE_MARCH`` builds for another ``-march`` than ``native`` (``haswell``: the
AVX2 kernels, which any AVX2 machine runs, so an AVX-512 machine can test them). A call releases the
GIL; a large one is split by columns over a team of threads in C (`torch.get_num_threads()` of them,
the same team a fused layer uses); the split never changes a bit.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.core.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "kernels.c"
COMPILE_TIMEOUT_S = 120
KV_DTYPES = (torch.float32, torch.bfloat16)  # what `attention` reads keys and values in
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # a linear's weight dtype -> the C kernel's `wt`
PARALLEL_MACS = 1 << 22  # multiply-adds of a call from which it is split over threads (a hand-off costs tens of µs)


def threads_for(macs: int) -> int:
    """The threads a call of ``macs`` multiply-adds is split over: torch's count, or 1 below `PARALLEL_MACS`."""
    return torch.get_num_threads() if macs >= PARALLEL_MACS else 1


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec") / "native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _march() -> str:
    return os.environ.get("SPECDEC_NATIVE_MARCH") or "native"


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    text = "\n".join([SOURCE.read_text(), compiler, version, " ".join(sorted(cpu_flags())), _march()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be (logged once, with why)."""
    if os.environ.get("SPECDEC_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("native kernels off: no C compiler (set CC); using oneDNN's linears")
        return None
    try:
        path = cache_dir() / f"kernels-{_build_key(compiler)}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: racing processes are safe
                built = Path(tmp) / path.name
                command = [compiler, "-O3", f"-march={_march()}", "-pthread", "-shared", "-fPIC", "-o", str(built), str(SOURCE)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
                if result.returncode != 0:
                    log.warning("native kernels off: %s could not build %s on this CPU: %s", compiler, SOURCE.name,
                                (result.stderr.strip().splitlines() or ["no message"])[-1])
                    return None
                os.replace(built, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native kernels off: %s", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specdec_gemm_threads.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.specdec_gemm_threads.restype = None
    lib.specdec_panel_width.restype = ctypes.c_int
    lib.specdec_weight_types.restype = ctypes.c_int
    f32 = ctypes.c_float
    for name, types in (
        ("specdec_rms_norm", [ptr, i64, i64, i64, ptr, f32, ptr]),
        ("specdec_swiglu", [ptr, i64, i64, i64, ptr]),
        ("specdec_rotary", [ptr, i64, i64, i64, i64, ptr, ptr]),
        ("specdec_attention_threads", [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, f32, ptr, ptr,
                                       i64, ctypes.c_int]),
        ("specdec_attention_threads_bf16", [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, f32, ptr,
                                            ptr, i64, ctypes.c_int]),
    ):
        getattr(lib, name).argtypes = types
        getattr(lib, name).restype = None
    lib.specdec_decoder_layer_rows.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr,
                                               ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, f32, ptr, i64,
                                               ctypes.c_int, ctypes.c_int]
    lib.specdec_decoder_layer_rows.restype = None
    lib.specdec_decoder_layers.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr,
                                           ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, f32, ptr, i64,
                                           ctypes.c_int, ctypes.c_int]
    lib.specdec_decoder_layers.restype = None
    return lib


def available() -> bool:
    return library() is not None


def weight_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes `NativeLinear` runs here (float16 only where the CPU has F16C); () without the kernels."""
    lib = library()
    if lib is None:
        return ()
    bits = lib.specdec_weight_types()
    return tuple(dtype for dtype, wt in WEIGHT_TYPES.items() if bits >> wt & 1)


class NativeLinear:
    """``x @ weight.T`` for a ``weight`` [out, in] in float32, bfloat16 or float16 (`weight_dtypes`), held
    only as the kernel's panels in that dtype (the weight once, at its own bytes). The math is float32:
    float32 rows give float32 results; bfloat16 or float16 rows are widened exactly and the results
    rounded back to their dtype, as ``F.linear`` in that dtype returns them."""

    __slots__ = ("panels", "shape", "dtype", "_gemm")  # _gemm: the C call, its weight type bound

    def __init__(self, weight: torch.Tensor) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("native kernels are not available on this machine")
        if weight.dim() != 2 or weight.dtype not in weight_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in weight_dtypes())
            raise ValueError(f"NativeLinear takes a 2-D weight in {names} here, got {weight.dtype} {tuple(weight.shape)}")
        out, inp = weight.shape
        width = lib.specdec_panel_width()
        count = -(-out // width)
        rows = F.pad(weight.detach(), (0, 0, 0, count * width - out)).view(count, width, inp)  # zero columns past ``out``
        if weight.dtype == torch.bfloat16:
            # [panels, in, width] with each panel row's halves interleaved (column i, then i + width / 2): one
            # load gives the kernel both halves (core/native/kernels.c)
            self.panels = rows.view(count, 2, width // 2, inp).permute(0, 3, 2, 1).contiguous().view(count, inp, width)
        else:
            self.panels = rows.transpose(1, 2).contiguous()  # [panels, in, width]: each panel one contiguous stream
        self.shape, self.dtype = (out, inp), weight.dtype
        self._gemm = functools.partial(lib.specdec_gemm_threads, WEIGHT_TYPES[weight.dtype])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, inp = self.shape
        if x.dtype not in WEIGHT_TYPES or x.dim() != 2 or x.shape[1] != inp:
            raise ValueError(f"NativeLinear {self.shape} takes float32 rows [n, {inp}] (or bfloat16/float16 ones, widened), "
                             f"got {x.dtype} {tuple(x.shape)}")
        rows_dtype = x.dtype
        x = x.contiguous() if rows_dtype == torch.float32 else x.float()  # widening is exact
        rows = x.shape[0]
        y = torch.empty(rows, out, dtype=torch.float32)
        if rows == 0:
            return y.to(rows_dtype)
        self._gemm(x.data_ptr(), rows, inp, self.panels.data_ptr(), out, y.data_ptr(), threads_for(rows * out * inp))
        return y if rows_dtype == torch.float32 else y.to(rows_dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_of(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """``x`` as float32 rows whose last dimension is contiguous, checked (a kernel reads raw memory)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{what} takes float32 rows [n, {width}] with contiguous rows; got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x


def _float32_vector(w: torch.Tensor, size: int, what: str) -> None:
    """A norm's weight as the kernel reads it: ``size`` contiguous float32 values (a bfloat16 one would be misread)."""
    if w.dtype != torch.float32 or w.shape != (size,) or not w.is_contiguous():
        raise ValueError(f"{what} takes a contiguous float32 norm weight [{size}]; got {w.dtype} {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of ``x`` [n, hidden] over its root mean square, times ``weight``: [n, hidden]."""
    n, hidden = x.shape
    _rows_of(x, hidden, "rms_norm")
    _float32_vector(weight, hidden, "rms_norm")
    y = torch.empty(n, hidden)
    library().specdec_rms_norm(x.data_ptr(), n, x.stride(0), hidden, weight.data_ptr(), ctypes.c_float(eps), y.data_ptr())
    return y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows [gate | up] [n, 2 * inter]: [n, inter]."""
    n, width = gate_up.shape
    _rows_of(gate_up, width, "swiglu")
    h = torch.empty(n, width // 2)
    library().specdec_swiglu(gate_up.data_ptr(), n, gate_up.stride(0), width // 2, h.data_ptr())
    return h


def rotary(qk: torch.Tensor, heads: int, head_dim: int, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rows ``qk`` [n, heads * head_dim] (each head's pairs adjacent) turned by ``cos_sin`` [n, head_dim / 2, 2]
    (contiguous): [n, heads, head_dim]."""
    n = qk.shape[0]
    _rows_of(qk, heads * head_dim, "rotary")
    out = torch.empty(n, heads, head_dim)
    library().specdec_rotary(qk.data_ptr(), n, qk.stride(0), heads, head_dim, cos_sin.data_ptr(), out.data_ptr())
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, limits: torch.Tensor,
              allowed: torch.Tensor | None, scale: float, scratch: torch.Tensor | None = None,
              threads: int | None = None) -> torch.Tensor:
    """Rows ``q`` [n, heads, d] (each row's heads contiguous) over ``keys``/``values`` [slots, kv, positions, d]
    (one layer of a slab, same strides; float32 or bfloat16, widened exactly): row r attends to slot ``slots[r]``'s positions below ``limits[r]``,
    and of those where ``allowed`` [n, >= max limit] (uint8) is non-zero when given: [n, heads * d].
    ``slots`` and ``limits`` int64, ``scratch`` at least threads x (max(limits) + 64) floats (made when
    smaller). ``threads`` (None: `threads_for` the keys it reads): the rows split over that many threads
    in C, each row whole on one, so the same bits at any count."""
    n, heads, d = q.shape
    kv = keys.shape[1]
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError(f"attention takes float32 queries [n, heads, d] with each row's heads contiguous; got {q.dtype} {q.stride()}")
    if keys.dtype not in KV_DTYPES or values.dtype != keys.dtype or keys.stride() != values.stride() or keys.stride(3) != 1:
        raise ValueError(f"attention takes float32 or bfloat16 keys and values of one dtype and layout, head_dim contiguous; "
                         f"got {keys.dtype} {keys.stride()} and {values.dtype} {values.stride()}")
    if slots.dtype != torch.int64 or limits.dtype != torch.int64 or not (slots.is_contiguous() and limits.is_contiguous()):
        raise ValueError("attention takes contiguous int64 slots and limits")
    if allowed is not None and (allowed.dtype != torch.uint8 or not allowed.is_contiguous()):
        raise ValueError("attention takes a contiguous uint8 mask")
    stride = int(limits.max()) + 64 if n else 64
    if threads is None:
        threads = threads_for(int(limits.sum()) * heads * d * 2 if n else 0)
    threads = max(1, min(threads, n))
    if scratch is None or scratch.numel() < threads * stride:
        scratch = torch.empty(threads * stride)
    out = torch.empty(n, heads * d)
    kernel = library().specdec_attention_threads_bf16 if keys.dtype == torch.bfloat16 else library().specdec_attention_threads
    kernel(
        q.data_ptr(), n, q.stride(0), heads, kv, d, keys.data_ptr(), values.data_ptr(), slots.data_ptr(), keys.stride(0),
        keys.stride(1), keys.stride(2), limits.data_ptr(), _ptr(allowed), 0 if allowed is None else allowed.shape[1],
        ctypes.c_float(scale), out.data_ptr(), scratch.data_ptr(), stride, threads)
    return out


class LayerRows:
    """Where each row of a forward writes its key and value (``slots``, ``positions``) and which keys it
    sees (below ``limits``, and where ``allowed`` [n, >= max limit] is non-zero when given), checked
    once for every layer of the forward against ``num_slots`` sequence slots of ``capacity`` positions."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor, allowed: torch.Tensor | None,
                 num_slots: int, capacity: int, slot_stride: int | None = None) -> None:
        """``slot_stride`` given: ``slots`` are each row's offset in elements from the layer's keys (of
        several slabs of one shape, made by the caller from their tensors), not slot numbers."""
        n = len(positions)
        self.slots, self.positions, self.limits = (t.to(torch.int64).contiguous() for t in (slots, positions, limits))
        if not (len(self.slots) == len(self.limits) == n) or n == 0:
            raise ValueError(f"LayerRows takes one slot, position and limit per row; got {len(slots)}, {n}, {len(limits)}")
        top = int(self.limits.max())
        if ((slot_stride is None and (int(self.slots.min()) < 0 or int(self.slots.max()) >= num_slots))
                or int(self.positions.min()) < 0 or int(self.positions.max()) >= capacity or int(self.limits.min()) < 1
                or top > capacity):
            raise ValueError(f"LayerRows out of range: slots < {num_slots}, positions and limits within {capacity} positions")
        self.slot_stride = slot_stride
        if allowed is not None:
            allowed = allowed.to(torch.uint8).contiguous()
            if allowed.shape[0] != n or allowed.shape[1] < top:
                raise ValueError(f"LayerRows' mask must be [{n}, >= {top}], got {tuple(allowed.shape)}")
        self.allowed, self.n, self.num_slots, self.capacity = allowed, n, num_slots, capacity
        self.scratch_stride = top + 64

    def work(self, hidden: int, shape: tuple[int, int, int, int], threads: int) -> int:
        """Floats of scratch `decoder_layer` needs for these rows on ``threads`` threads."""
        heads, kv, d, inter = shape
        n = self.n
        return n * (2 * hidden + (heads + 2 * kv) * d + (heads + kv) * d + heads * d + 3 * inter) + threads * self.scratch_stride


def causal_rows(start: int, n: int, capacity: int) -> LayerRows:
    """One sequence's ``n`` causal rows from position ``start``, in slot 0."""
    positions = torch.arange(start, start + n)
    return LayerRows(torch.zeros(n, dtype=torch.int64), positions, positions + 1, None, 1, capacity)


def _check_layer(layer: tuple, hidden: int) -> None:
    """A layer as `decoder_layer` reads it: NativeLinear projections of one weight dtype, float32 norms."""
    ln1, qkv, o, ln2, gate_up, down = layer
    projections = (qkv, o, gate_up, down)
    if len({f.dtype for f in projections}) != 1:
        raise ValueError(f"decoder_layer takes projections of one weight dtype; got {[f.dtype for f in projections]}")
    for norm in (ln1, ln2):
        _float32_vector(norm, hidden, "decoder_layer")


def _check_rows(x: torch.Tensor, shape: tuple[int, int, int, int], keys: torch.Tensor, values: torch.Tensor,
                rows: LayerRows, work: torch.Tensor, threads: int) -> None:
    """The rows, one layer's keys and values and the scratch as `decoder_layer` reads them."""
    heads, kv, d, inter = shape
    n, hidden = x.shape
    if keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise ValueError(f"decoder_layer takes float32 keys and values; got {keys.dtype} and {values.dtype}")
    if (keys.dim() != 4 or keys.shape != values.shape or keys.stride() != values.stride() or keys.stride(3) != 1
            or tuple(keys.shape[1:]) != (kv, rows.capacity, d) or rows.n != n
            or (rows.slot_stride is None and keys.shape[0] != rows.num_slots)
            or not x.is_contiguous() or x.dtype != torch.float32):
        raise ValueError(f"decoder_layer takes contiguous float32 rows and keys/values [{rows.num_slots}, {kv}, "
                         f"{rows.capacity}, {d}] (head_dim contiguous) matching its LayerRows; got {tuple(keys.shape)}")
    if work.dtype != torch.float32 or not work.is_contiguous() or work.numel() < rows.work(hidden, shape, threads):
        raise ValueError(f"decoder_layer needs contiguous float32 work of rows.work(..., threads={threads}) floats")


def _rows_args(shape: tuple[int, int, int, int], keys: torch.Tensor, rows: LayerRows) -> tuple:
    """The C arguments after the keys and values that every layer of a forward shares."""
    allowed = rows.allowed
    return (keys.stride(0) if rows.slot_stride is None else rows.slot_stride, keys.stride(1), keys.stride(2),
            rows.slots.data_ptr(), rows.positions.data_ptr(), rows.limits.data_ptr(), _ptr(allowed),
            0 if allowed is None else allowed.shape[1], ctypes.c_float(1.0 / math.sqrt(shape[2])))


def decoder_layer(x: torch.Tensor, layer: tuple, shape: tuple[int, int, int, int], eps: float, cos_sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, rows: LayerRows, work: torch.Tensor, threads: int = 1) -> None:
    """One decoder layer over a batch's rows ``x`` [n, hidden] (updated in place) in one call, with the
    per-op path's kernels in its order (so the same bits): ``layer`` (ln1, qkv, o, ln2, gate_up, down) with
    NativeLinear projections of one weight dtype, ``shape`` (heads, kv_heads, head_dim, intermediate),
    ``cos_sin`` [n, d / 2, 2], float32 ``keys``/``values`` [slots, kv, positions, d] of this layer
    (head_dim contiguous, same strides), ``rows`` where each row writes and what it sees; ``work``:
    ``rows.work(...)`` floats; ``threads``: the GEMMs split by columns and attention by rows over that
    many threads in C (the same bits at any count)."""
    ln1, qkv, o, ln2, gate_up, down = layer
    heads, kv, d, inter = shape
    n, hidden = x.shape
    _check_layer(layer, hidden)
    _check_rows(x, shape, keys, values, rows, work, threads)
    library().specdec_decoder_layer_rows(
        x.data_ptr(), n, hidden, heads, kv, d, inter, ln1.data_ptr(), ln2.data_ptr(), ctypes.c_float(eps),
        qkv.panels.data_ptr(), o.panels.data_ptr(), gate_up.panels.data_ptr(), down.panels.data_ptr(), cos_sin.data_ptr(),
        keys.data_ptr(), values.data_ptr(), *_rows_args(shape, keys, rows), work.data_ptr(), rows.scratch_stride,
        WEIGHT_TYPES[qkv.dtype], threads)


class DecoderStack:
    """A model's decoder layers as `decoder_layer` reads them, checked once and held as C arrays of
    their weights' addresses, so a forward runs every layer in one call (`run`). The layers' tensors
    must not move while it is used (a decoder's weights do not after load)."""

    def __init__(self, layers: Sequence[tuple], hidden: int) -> None:
        for layer in layers:
            _check_layer(layer, hidden)
        if len({layer[1].dtype for layer in layers}) != 1:
            raise ValueError("DecoderStack takes layers of one weight dtype")
        self.layers = list(layers)  # kept: the addresses below point into them
        self.hidden = hidden
        self.weight_type = WEIGHT_TYPES[layers[0][1].dtype]

        def addresses(pick: Callable[[tuple], torch.Tensor]) -> ctypes.Array:
            return (ctypes.c_void_p * len(layers))(*(pick(layer).data_ptr() for layer in layers))

        self._ln1, self._ln2 = addresses(lambda l: l[0]), addresses(lambda l: l[3])
        self._qkv, self._o = addresses(lambda l: l[1].panels), addresses(lambda l: l[2].panels)
        self._gate_up, self._down = addresses(lambda l: l[4].panels), addresses(lambda l: l[5].panels)

    def run(self, x: torch.Tensor, shape: tuple[int, int, int, int], eps: float, cos_sin: torch.Tensor,
            keys: torch.Tensor, values: torch.Tensor, layer_stride: int, rows: LayerRows, work: torch.Tensor,
            threads: int = 1) -> None:
        """`decoder_layer` for every layer in turn: ``keys``/``values`` are layer 0's, and layer i's
        start ``i * layer_stride`` floats after them (one tensor holds every layer's)."""
        heads, kv, d, inter = shape
        n, hidden = x.shape
        if hidden != self.hidden:
            raise ValueError(f"DecoderStack holds layers of width {self.hidden}; got rows of {hidden}")
        _check_rows(x, shape, keys, values, rows, work, threads)
        library().specdec_decoder_layers(
            x.data_ptr(), n, len(self.layers), hidden, heads, kv, d, inter, self._ln1, self._ln2, ctypes.c_float(eps),
            self._qkv, self._o, self._gate_up, self._down, cos_sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
            layer_stride, *_rows_args(shape, keys, rows), work.data_ptr(), rows.scratch_stride, self.weight_type, threads)
