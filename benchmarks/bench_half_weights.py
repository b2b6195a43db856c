"""Half-precision weights in specdec's native linear (core/native_kernels.py) against float32 ones and
PyTorch's ``F.linear`` in float32 and bfloat16, on a 0.45B Llama's weight shapes (hidden 1536,
intermediate 4608: the up and down projections) and the demo vocabulary's LM head, at the row counts
a verifier feeds, at 1 and 2 threads. Each repetition calls every kernel once, in turn (alternated),
each on the next of several copies of its weight (together past the last-level cache, as a forward's
layers are), so every call reads its weight from memory; the table gives medians, the JSON also what
the weight's bytes per median mean in GB/s.

    python benchmarks/bench_half_weights.py [--reps 21] [--threads 1 2] [--out FILE]
    SPECDEC_NATIVE_MARCH=haswell python benchmarks/bench_half_weights.py --out ...  # the AVX2 kernels
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

COPIES_BYTES = 128 << 20  # float32 bytes of a shape's copies: past any last-level cache of these machines
SHAPES = {"up 4608x1536": (4608, 1536), "down 1536x4608": (1536, 4608), "head 6144x1536": (6144, 1536)}  # [out, in]
ROWS = (1, 5, 9, 17)


def kernels(weight: torch.Tensor) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype, int]]:
    """name -> (call, rows' dtype, weight bytes it reads) for one copy of ``weight``."""
    from specdec.core import native_kernels

    half = weight.bfloat16()
    found = {
        "native f32": (native_kernels.NativeLinear(weight), torch.float32, weight.nbytes),
        "native bf16": (native_kernels.NativeLinear(half), torch.float32, half.nbytes),
    }
    if torch.float16 in native_kernels.weight_dtypes():
        found["native f16"] = (native_kernels.NativeLinear(weight.half()), torch.float32, half.nbytes)
    found["torch f32"] = ((lambda x: F.linear(x, weight)), torch.float32, weight.nbytes)
    found["torch bf16"] = ((lambda x: F.linear(x, half)), torch.bfloat16, half.nbytes)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="benchmarks/results/half_weights.json")
    args = ap.parse_args()
    from specdec.core import native_kernels
    from specdec.core.cpu_features import describe_cpu

    if not native_kernels.available():
        sys.exit("native kernels do not build here (see the log above)")
    g = torch.Generator().manual_seed(0)
    cpu = describe_cpu()
    march = os.environ.get("SPECDEC_NATIVE_MARCH") or "native"  # haswell: the AVX2 kernels on a wider CPU
    dtypes = ", ".join(str(d).removeprefix("torch.") for d in native_kernels.weight_dtypes())
    print(f"{cpu}; native kernels built for -march={march}, weight dtypes: {dtypes}")
    results = {"cpu": cpu, "native_march": march, "reps": args.reps, "unit": "ms per call (median)",
               "copies_bytes": COPIES_BYTES, "runs": []}
    names: list[str] = []
    for name, shape in SHAPES.items():
        copies = [kernels(torch.randn(shape, generator=g) / shape[1] ** 0.5)
                  for _ in range(-(-COPIES_BYTES // (shape[0] * shape[1] * 4)))]
        found = copies[0]
        names = list(found)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in ROWS:
                x = torch.randn(rows, shape[1], generator=g)
                inputs = {k: x.to(dtype) for k, (_, dtype, _) in found.items()}
                times: dict[str, list[float]] = {k: [] for k in found}
                for rep in range(args.reps + 2):  # the first two warm up
                    for k in found:
                        call = copies[rep % len(copies)][k][0]
                        t = time.perf_counter()
                        call(inputs[k])
                        if rep >= 2:
                            times[k].append(time.perf_counter() - t)
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                gbps = {k: found[k][2] / (ms[k] * 1e-3) / 1e9 for k in found}
                results["runs"].append({"weight": name, "shape": list(shape), "threads": threads, "rows": rows, "ms": ms,
                                        "weight_gb_per_s": gbps})
    torch.set_num_threads(1)
    header = ("| weight | threads | rows | " + " | ".join(f"{k} ms" for k in names)
              + " | bf16 / f32 native | bf16 native / torch bf16 |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for run in results["runs"]:
        ms = run["ms"]
        cells = " | ".join(f"{ms[k]:.3f}" for k in names)
        print(f"| {run['weight']} | {run['threads']} | {run['rows']} | {cells} | "
              f"{ms['native bf16'] / ms['native f32']:.2f} | {ms['native bf16'] / ms['torch bf16']:.2f} |")
    write_result(args.out, **results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
