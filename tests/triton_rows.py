"""Triton's interpreter computes ``tl.dot`` with numpy's matmul, whose bits for a row depend on how
many rows share the call on some BLAS builds (OpenBLAS's Haswell kernels). A GPU's tensor cores give
a row of a fixed tile the same bits whatever the other rows hold, which is what core/triton_exact.py's
exact kernels rely on. ``row_invariant_dot`` makes the interpreter do the same: each row of a dot is
its own (1 x K) @ (K x N) product, so a test of the kernels checks their tiling and reduction order,
not the machine's BLAS."""
from __future__ import annotations

import numpy as np


def _per_row_matmul(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    rows = [np.matmul(a[..., i:i + 1, :], b, dtype=dtype) for i in range(a.shape[-2])]
    return np.concatenate(rows, axis=-2)


def row_invariant_dot() -> bool:
    """Patch the interpreter's dot (idempotent); False where Triton or its interpreter is missing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "row_invariant", False):
        return True
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8/int8: as Triton does
        out = _per_row_matmul(a.data, b.data, d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot.row_invariant = True
    builder.create_dot = create_dot
    return True
