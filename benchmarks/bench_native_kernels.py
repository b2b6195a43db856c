"""specdec's native float32 linear (core/native_kernels.py) against oneDNN's packed one, on one
forward's linears of the demo target's shapes (8 layers of QKV, o, gate/up and down, and the LM
head), alternated call by call, at the row counts a verifier feeds; and the memory's own speed
(one pass summing a tensor of the forward's weight bytes) as the floor for one row.

    python benchmarks/bench_native_kernels.py [--threads 1] [--reps 15] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

SHAPES = [(1152, 384), (384, 384), (2048, 384), (384, 1024)] * 8 + [(6144, 384)]  # the demo target's linears
ROWS = (1, 2, 4, 8, 16, 64, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/native/native_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.core import native_kernels
    from specdec.core.cpu_features import describe_cpu

    if not native_kernels.available():
        sys.exit("native kernels do not build here (see the log above)")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g) for s in SHAPES]
    native = [native_kernels.NativeLinear(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    onednn = torch.ops.mkldnn._linear_pointwise
    floor_tensor = torch.randn(sum(w.numel() for w in weights), generator=g)
    results = {"cpu": describe_cpu(), "threads": args.threads, "weight_mb": floor_tensor.numel() * 4 / 1e6, "rows": {}}
    floor = []
    for _ in range(args.reps):
        t = time.perf_counter()
        floor_tensor.sum()
        floor.append(time.perf_counter() - t)
    results["memory_pass_ms"] = statistics.median(floor) * 1e3
    print(f"{describe_cpu()}, {args.threads} thread(s): one pass over {results['weight_mb']:.0f} MB "
          f"{results['memory_pass_ms']:.2f} ms")
    print("| rows | native ms | oneDNN packed ms | native / packed |\n|---|---|---|---|")
    for rows in ROWS:
        xs = [torch.randn(rows, s[1], generator=g) for s in SHAPES]
        reps = args.reps if rows <= 64 else max(3, args.reps // 4)
        times = {"native": [], "packed": []}
        for _ in range(reps):  # alternated call by call
            t = time.perf_counter()
            for x, f in zip(xs, native):
                f(x)
            times["native"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for x, p in zip(xs, packed):
                onednn(x, p, None, "none", [], "")
            times["packed"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results["rows"][rows] = med
        print(f"| {rows} | {med['native']:.2f} | {med['packed']:.2f} | {med['native'] / med['packed']:.2f} |")
    write_result(args.out, **results)


if __name__ == "__main__":
    main()
